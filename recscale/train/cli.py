"""The bodies of every family's ``train`` and ``evaluate`` entry points (only these touch argv;
``export`` is ``recscale.export``'s)."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import traceback
from collections.abc import Iterator

import tyro

from recscale import config as config_lib
from recscale.config import parse_preset_cli
from recscale.families import Family
from recscale.launch import exit_at_once_on_error, initialize_from_env
from recscale.train import DIVERGED_EXIT_CODE
from recscale.train.evaluation import EvalArgs, evaluate_workdir, json_line
from recscale.train.loop import train


def input_errors() -> tuple[type[BaseException], ...]:
    """The errors of bad input (data, spec, config, a missing file) that the CLIs print as one
    line."""
    from data.tabular import SpecError, TabularFormatError  # noqa: PLC0415

    return (SpecError, TabularFormatError, config_lib.ConfigError, FileNotFoundError)


def _raised_by_a_config_check(e: BaseException) -> bool:
    """Whether ``e`` was raised by a dataclass's own ``__post_init__`` (a config refusing a
    value, e.g. one derived for evaluation), not from deeper in the code."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    return frame.f_code.co_name == "__post_init__" and dataclasses.is_dataclass(
        frame.f_locals.get("self")
    )


@contextlib.contextmanager
def one_line_errors(*, every_value_error: bool = False) -> Iterator[None]:
    """What the user's input got wrong is printed as one line, ``error: ...``, without a
    traceback: bad data or a bad spec (the message names file, line and column), a config that
    contradicts itself or the data (``ConfigError``, naming the flag that fixes it; the model
    families raise it when their network cannot read the data), a missing file, and a
    ``ValueError`` from a config's own checks (``every_value_error``: any ``ValueError``, as
    the exporter raises for what it refuses). Anything else keeps its traceback."""
    try:
        yield
    except ValueError as e:
        if not (every_value_error or isinstance(e, input_errors()) or _raised_by_a_config_check(e)):
            raise
        raise SystemExit(f"error: {e}") from None
    except input_errors() as e:
        raise SystemExit(f"error: {e}") from None


def _start_distributed() -> None:
    """``initialize_from_env``, with a malformed setting printed as one line."""
    try:
        initialize_from_env()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def print_result(result: dict) -> None:
    """The result's JSON line, from process 0 only (every process computes the same result;
    the last line of stdout is the contract sweeps read)."""
    import jax  # noqa: PLC0415

    if jax.process_index() == 0:
        print(json_line(result))


def train_main(family: Family, argv: list[str] | None = None) -> dict:
    """``python -m PACKAGE.train PRESET --workdir DIR [--field.sub value ...]``; prints the result.

    ``family`` (``recscale.families``) names the presets (``dcnv2/...``) and the package whose
    ``train`` module the run's ``command.txt`` records (``baselines.dcnv2.train``).
    """
    module = family.module("train")
    args = sys.argv[1:] if argv is None else argv
    workdir, cfg = parse_preset_cli(f"{family.name}/", args, prog=f"python -m {module}")
    _start_distributed()
    with exit_at_once_on_error():
        try:
            with one_line_errors():
                result = train(cfg, family.build_model, workdir, argv=["-m", module, *args])
        except FloatingPointError:
            traceback.print_exc()
            raise SystemExit(DIVERGED_EXIT_CODE) from None
        print_result(result)
    return result


def evaluate_main(family: Family, argv: list[str] | None = None) -> dict:
    """``python -m PACKAGE.evaluate --workdir DIR [--step N] [--data-path F] [--output F]``.

    Prints one JSON object (auc, logloss, ne, calibration, num_examples, step, ...) on the last
    line of stdout (the contract later tooling reads).
    """
    args = tyro.cli(EvalArgs, args=argv, prog=f"python -m {family.module('evaluate')}")
    _start_distributed()
    with exit_at_once_on_error():
        with one_line_errors():
            result = evaluate_workdir(family.config_cls, family.build_model, args)
        print_result(result)
    return result


@dataclasses.dataclass(frozen=True, kw_only=True)
class PopulationArgs:
    package: str
    """The members' model family, by its package (``dlrm``, ``wukong``, ``baselines.dcnv2``;
    ``recscale.families``)."""
    configs: tuple[str, ...]
    """Each member's config file (``config.json`` as a run or a sweep writes it)."""
    workdirs: tuple[str, ...]
    """Each member's run folder, in the order of ``--configs``."""


def population_main(argv: list[str] | None = None) -> list[dict]:
    """``python -m recscale.population --package P --configs C... --workdirs W...``: trains the
    members as one vmapped population (``recscale.train.population``) and prints
    ``{"population": [each member's result], "preempted": ...}`` as the last line."""
    from recscale import families  # noqa: PLC0415
    from recscale.train.population import train_population  # noqa: PLC0415

    args = sys.argv[1:] if argv is None else argv
    a = tyro.cli(PopulationArgs, args=args, prog="python -m recscale.population")
    with exit_at_once_on_error(), one_line_errors():
        try:
            family = families.by_package(a.package)
        except families.UnknownFamilyError as e:
            raise SystemExit(f"error: --package: {e}") from None
        cfgs = [config_lib.load_json(family.config_cls, c) for c in a.configs]
        results = train_population(
            cfgs, family.build_model, list(a.workdirs), argv=["-m", "recscale.population", *args]
        )
    print_result({"population": results, "preempted": any(r.get("preempted") for r in results)})
    return results
