"""``python -m dlrm.evaluate --workdir DIR [--step N] [--data-path FILE] [--output FILE]``.

Prints one JSON object (auc, logloss, ne, calibration, num_examples, step, ...) on the last line
of stdout.
"""

from __future__ import annotations

from dlrm import FAMILY
from recscale.train.cli import evaluate_main


def main(argv: list[str] | None = None) -> dict:
    return evaluate_main(FAMILY, argv)


if __name__ == "__main__":
    main()
