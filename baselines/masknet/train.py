"""``python -m baselines.masknet.train PRESET --workdir DIR [--field.sub value ...]``."""

from __future__ import annotations

import baselines.masknet.presets  # noqa: F401  (registers the presets)
from baselines.masknet.model import build_model
from recscale.train.cli import train_main


def main(argv: list[str] | None = None) -> dict:
    return train_main("masknet", build_model, argv, package="baselines.masknet")


if __name__ == "__main__":
    main()
