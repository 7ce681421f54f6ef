"""``python -m dlrm.train PRESET --workdir DIR [--field.sub value ...]``."""

from __future__ import annotations

import dlrm.presets  # noqa: F401  (registers the presets)
from dlrm.model import build_model
from recscale.train.cli import train_main


def main(argv: list[str] | None = None) -> dict:
    return train_main("dlrm", build_model, argv)


if __name__ == "__main__":
    main()
