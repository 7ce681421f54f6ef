"""``python -m baselines.dcnv2.train PRESET --workdir DIR [--field.sub value ...]``.

Calls the pieces of ``recscale.train.cli.train_main`` itself because that helper assumes the
module path is the family name (``dcnv2.train``), while this one is ``baselines.dcnv2.train``.
"""

from __future__ import annotations

import sys

import baselines.dcnv2.presets  # noqa: F401  (registers the presets)
from baselines.dcnv2.model import build_model
from recscale.config import parse_preset_cli
from recscale.train.evaluation import json_line
from recscale.train.loop import train

MODULE = "baselines.dcnv2.train"


def main(argv: list[str] | None = None) -> dict:
    args = sys.argv[1:] if argv is None else argv
    workdir, cfg = parse_preset_cli("dcnv2/", args, prog=f"python -m {MODULE}")
    result = train(cfg, build_model, workdir, argv=["-m", MODULE, *args])
    print(json_line(result))
    return result


if __name__ == "__main__":
    main()
