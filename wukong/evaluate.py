"""``python -m wukong.evaluate --workdir DIR [--step N] [--data-path FILE] [--output FILE]``.

Prints one JSON object (auc, logloss, ne, calibration, num_examples, step, ...) on the last line
of stdout.
"""

from __future__ import annotations

import json

import tyro

from recscale.train.evaluation import EvalArgs, evaluate_workdir
from wukong.config import WukongConfig
from wukong.model import build_model


def main(argv: list[str] | None = None) -> dict:
    args = tyro.cli(EvalArgs, args=argv, prog="python -m wukong.evaluate")
    result = evaluate_workdir(WukongConfig, build_model, args)
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
