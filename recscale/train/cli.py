"""The bodies of every family's ``train`` and ``evaluate`` entry points (only these touch argv)."""

from __future__ import annotations

import sys

import tyro

from recscale.config import parse_preset_cli
from recscale.train.evaluation import EvalArgs, evaluate_workdir, json_line
from recscale.train.loop import BuildModel, train


def train_main(
    family: str, build_model: BuildModel, argv: list[str] | None = None, *, package: str = ""
) -> dict:
    """``python -m PACKAGE.train PRESET --workdir DIR [--field.sub value ...]``; prints the result.

    ``family`` is the preset prefix (``dcnv2`` for ``dcnv2/tiny``); ``package`` the module path
    of the family's package when it differs (``baselines.dcnv2``).
    """
    module = f"{package or family}.train"
    args = sys.argv[1:] if argv is None else argv
    workdir, cfg = parse_preset_cli(f"{family}/", args, prog=f"python -m {module}")
    result = train(cfg, build_model, workdir, argv=["-m", module, *args])
    print(json_line(result))
    return result


def evaluate_main(
    family: str,
    config_cls: type,
    build_model: BuildModel,
    argv: list[str] | None = None,
    *,
    package: str = "",
) -> dict:
    """``python -m PACKAGE.evaluate --workdir DIR [--step N] [--data-path F] [--output F]``.

    Prints one JSON object on the last line of stdout (the contract later tooling reads).
    """
    args = tyro.cli(EvalArgs, args=argv, prog=f"python -m {package or family}.evaluate")
    result = evaluate_workdir(config_cls, build_model, args)
    print(json_line(result))
    return result
