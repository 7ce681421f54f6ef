"""``python -m wukong.evaluate --workdir DIR [--step N] [--data-path FILE] [--output FILE]``."""

from __future__ import annotations

from recscale.train.cli import evaluate_main
from wukong import FAMILY


def main(argv: list[str] | None = None) -> dict:
    return evaluate_main(FAMILY, argv)


if __name__ == "__main__":
    main()
