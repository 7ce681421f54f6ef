"""``python -m dlrm.train PRESET --workdir DIR [--field.sub value ...]``."""

from __future__ import annotations

import json
import sys

import dlrm.presets  # noqa: F401  (registers the presets)
from dlrm.model import build_model
from recscale.config import parse_preset_cli
from recscale.train.loop import train


def main(argv: list[str] | None = None) -> dict:
    args = sys.argv[1:] if argv is None else argv
    workdir, cfg = parse_preset_cli("dlrm/", args, prog="python -m dlrm.train")
    result = train(cfg, build_model, workdir, argv=["-m", "dlrm.train", *args])
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
