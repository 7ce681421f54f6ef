"""``python -m dlrm.evaluate --workdir DIR [--step N] [--data-path FILE] [--output FILE]``.

Prints one JSON object (auc, logloss, ne, calibration, num_examples, step, ...) on the last line
of stdout.
"""

from __future__ import annotations

import tyro

from dlrm.config import DLRMConfig
from dlrm.model import build_model
from recscale.train.evaluation import EvalArgs, evaluate_workdir, json_line


def main(argv: list[str] | None = None) -> dict:
    args = tyro.cli(EvalArgs, args=argv, prog="python -m dlrm.evaluate")
    result = evaluate_workdir(DLRMConfig, build_model, args)
    print(json_line(result))
    return result


if __name__ == "__main__":
    main()
