"""``python -m sequential.bag.train PRESET --workdir DIR [--field.sub value ...]``."""

from __future__ import annotations

from recscale.train.cli import train_main
from sequential.bag import FAMILY


def main(argv: list[str] | None = None) -> dict:
    return train_main(FAMILY, argv)


if __name__ == "__main__":
    main()
