"""``python -m baselines.finalmlp.evaluate --workdir DIR [--step N] [--data-path FILE] [--output FILE]``."""

from __future__ import annotations

from baselines.finalmlp import FAMILY
from recscale.train.cli import evaluate_main


def main(argv: list[str] | None = None) -> dict:
    return evaluate_main(FAMILY, argv)


if __name__ == "__main__":
    main()
