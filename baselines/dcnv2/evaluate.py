"""``python -m baselines.dcnv2.evaluate --workdir DIR [--step N] [--data-path FILE] [--output FILE]``.

Prints one JSON object (auc, logloss, ne, calibration, num_examples, step, ...) on the last line
of stdout.
"""

from __future__ import annotations

import tyro

from baselines.dcnv2.config import DCNv2Config
from baselines.dcnv2.model import build_model
from recscale.train.evaluation import EvalArgs, evaluate_workdir, json_line


def main(argv: list[str] | None = None) -> dict:
    # recscale.train.cli.evaluate_main would name the program ``python -m dcnv2.evaluate``.
    args = tyro.cli(EvalArgs, args=argv, prog="python -m baselines.dcnv2.evaluate")
    result = evaluate_workdir(DCNv2Config, build_model, args)
    print(json_line(result))
    return result


if __name__ == "__main__":
    main()
