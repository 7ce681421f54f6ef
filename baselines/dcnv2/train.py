"""``python -m baselines.dcnv2.train PRESET --workdir DIR [--field.sub value ...]``."""

from __future__ import annotations

import baselines.dcnv2.presets  # noqa: F401  (registers the presets)
from baselines.dcnv2.model import build_model
from recscale.train.cli import train_main


def main(argv: list[str] | None = None) -> dict:
    return train_main("dcnv2", build_model, argv, package="baselines.dcnv2")


if __name__ == "__main__":
    main()
