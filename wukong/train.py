"""``python -m wukong.train PRESET --workdir DIR [--field.sub value ...]``."""

from __future__ import annotations

import json

import wukong.presets  # noqa: F401  (registers the presets)
from recscale.config import parse_preset_cli
from recscale.train.loop import train
from wukong.model import build_model


def main(argv: list[str] | None = None) -> dict:
    workdir, cfg = parse_preset_cli("wukong/", argv, prog="python -m wukong.train")
    result = train(cfg, build_model, workdir)
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
