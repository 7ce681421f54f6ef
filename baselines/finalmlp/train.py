"""``python -m baselines.finalmlp.train PRESET --workdir DIR [--field.sub value ...]``."""

from __future__ import annotations

import baselines.finalmlp.presets  # noqa: F401  (registers the presets)
from baselines.finalmlp.model import build_model
from recscale.train.cli import train_main


def main(argv: list[str] | None = None) -> dict:
    return train_main("finalmlp", build_model, argv, package="baselines.finalmlp")


if __name__ == "__main__":
    main()
