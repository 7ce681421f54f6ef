"""``python -m dlrm.train PRESET --workdir DIR [--field.sub value ...]``."""

from __future__ import annotations

from dlrm import FAMILY
from recscale.train.cli import train_main


def main(argv: list[str] | None = None) -> dict:
    return train_main(FAMILY, argv)


if __name__ == "__main__":
    main()
