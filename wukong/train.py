"""``python -m wukong.train PRESET --workdir DIR [--field.sub value ...]``."""

from __future__ import annotations

import wukong.presets  # noqa: F401  (registers the presets)
from recscale.train.cli import train_main
from wukong.model import build_model


def main(argv: list[str] | None = None) -> dict:
    return train_main("wukong", build_model, argv)


if __name__ == "__main__":
    main()
