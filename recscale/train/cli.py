"""The bodies of every family's ``train`` and ``evaluate`` entry points (only these touch argv)."""

from __future__ import annotations

import sys

import tyro

from recscale.config import parse_preset_cli
from recscale.train.evaluation import EvalArgs, evaluate_workdir, json_line
from recscale.train.loop import BuildModel, train


def train_main(family: str, build_model: BuildModel, argv: list[str] | None = None) -> dict:
    """``python -m FAMILY.train PRESET --workdir DIR [--field.sub value ...]``; prints the result."""
    args = sys.argv[1:] if argv is None else argv
    workdir, cfg = parse_preset_cli(f"{family}/", args, prog=f"python -m {family}.train")
    result = train(cfg, build_model, workdir, argv=["-m", f"{family}.train", *args])
    print(json_line(result))
    return result


def evaluate_main(
    family: str, config_cls: type, build_model: BuildModel, argv: list[str] | None = None
) -> dict:
    """``python -m FAMILY.evaluate --workdir DIR [--step N] [--data-path F] [--output F]``.

    Prints one JSON object on the last line of stdout (the contract later tooling reads).
    """
    args = tyro.cli(EvalArgs, args=argv, prog=f"python -m {family}.evaluate")
    result = evaluate_workdir(config_cls, build_model, args)
    print(json_line(result))
    return result
