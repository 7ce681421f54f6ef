"""``python -m baselines.masknet.evaluate --workdir DIR [--step N] [--data-path FILE] [--output FILE]``.

Prints one JSON object (auc, logloss, ne, calibration, num_examples, step, ...) on the last line
of stdout.
"""

from __future__ import annotations

from baselines.masknet.config import MaskNetConfig
from baselines.masknet.model import build_model
from recscale.train.cli import evaluate_main


def main(argv: list[str] | None = None) -> dict:
    return evaluate_main("masknet", MaskNetConfig, build_model, argv, package="baselines.masknet")


if __name__ == "__main__":
    main()
