"""``python -m sequential.bag.evaluate --workdir DIR [--step N] [--output FILE]``: next-item loss
and ranking metrics of a checkpoint on the run's held-out users (``sequential.task``)."""

from __future__ import annotations

from recscale.train.cli import evaluate_main
from sequential.bag import FAMILY


def main(argv: list[str] | None = None) -> dict:
    return evaluate_main(FAMILY, argv)


if __name__ == "__main__":
    main()
