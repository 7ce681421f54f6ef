"""The preset registry, the JSON round trip and the preset CLI of ``recscale.config``, which
re-exports every name here (``recscale.config`` is the documented home of all of them).

No jax import (tyro is imported by the CLI only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from data import strict
from data.config import DataConfig
from data.strict import FieldError, to_dict

T = TypeVar("T")


class ConfigError(ValueError):
    """A config whose fields contradict each other across sections (found when a run is set
    up, not by one section's checks); the CLIs print it as one line."""


# ------------------------------------------------------------------------------------------------
# Preset registry.

_PRESETS: dict[str, Callable[[], Any]] = {}


def register(name: str) -> Callable[[Callable[[], T]], Callable[[], T]]:
    """Decorator registering a zero-argument preset function under ``name`` (e.g. ``dlrm/tiny``)."""

    def deco(fn: Callable[[], T]) -> Callable[[], T]:
        if name in _PRESETS:
            raise ValueError(f"preset {name!r} registered twice")
        _PRESETS[name] = fn
        return fn

    return deco


def preset_names(prefix: str = "") -> list[str]:
    return sorted(n for n in _PRESETS if n.startswith(prefix))


def get_preset(name: str) -> Any:
    if name not in _PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(preset_names())}")
    return _PRESETS[name]()


# ------------------------------------------------------------------------------------------------
# JSON round trip.


def from_dict(cls: type[T], data: Any, *, path: str = "config") -> T:
    """Inverse of ``to_dict``; raises ``FieldError`` (a ``TypeError`` and a ``ValueError``)
    naming the field path on an unknown, missing or ill-typed field, and ``ConfigError`` naming
    the section on a value its own checks refuse."""
    return strict.build(cls, data, path=path, error=FieldError, checks=ConfigError)


def absolute_paths(cfg: T) -> T:
    """``cfg`` with every non-empty ``*_path``/``*_dir``/``init_from``/``spec`` (a tabular feature
    spec file) field made absolute.

    Runs store absolute paths in ``config.json``, so evaluation works from any directory.
    """
    if not dataclasses.is_dataclass(cfg):
        return cfg
    changes = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            changes[f.name] = absolute_paths(v)
        elif (
            isinstance(v, str)
            and v
            and (f.name.endswith(("_path", "_dir")) or f.name in ("init_from", "spec"))
        ):
            changes[f.name] = str(Path(v).expanduser().absolute())
    return dataclasses.replace(cfg, **changes)


def save_json(cfg: Any, path: str | Path) -> None:
    """Writes ``cfg`` atomically (a temporary file renamed over ``path``): the other processes
    of a multi-process run read the file while process 0 rewrites it on a resume."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(to_dict(cfg), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def load_json(cls: type[T], path: str | Path) -> T:
    """The config ``save_json`` wrote to ``path``; errors name the file (see ``from_dict``)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not a JSON config ({e})") from None
    return from_dict(cls, data, path=str(path))


# ------------------------------------------------------------------------------------------------
# CLI: ``python -m dlrm.train PRESET --workdir DIR [--train.num-steps 100 ...]``.


def parse_preset_cli(
    prefix: str, argv: list[str] | None = None, *, prog: str = ""
) -> tuple[str, Any]:
    """Parses ``PRESET --workdir DIR [overrides]``; returns ``(workdir, config)``.

    ``PRESET`` is a registered name or a ``*.json`` config file (as ``save_json`` writes it).
    The preset is looked up in the registry (``prefix`` is prepended when the name has no ``/``);
    every config field can then be overridden with tyro's typed flags, e.g. ``--train.num-steps``.
    """
    import tyro  # noqa: PLC0415  (entry points only)

    argv = list(sys.argv[1:] if argv is None else argv)
    names = preset_names(prefix)
    if not argv or argv[0].startswith("-"):
        usage = f"usage: {prog or 'python -m ' + prefix.rstrip('/') + '.train'} PRESET --workdir DIR [--field.sub value ...]"
        if argv and argv[0] in ("-h", "--help"):
            print(usage + "\npresets: " + ", ".join(names))
            raise SystemExit(0)
        raise SystemExit(usage + "\npresets: " + ", ".join(names))
    if argv[0].endswith(".json"):
        # A resolved config file (what sweeps write per trial); the class is the family's.
        if not names:
            raise SystemExit(f"no presets registered under {prefix!r}")
        name = argv[0]
        try:
            default = load_json(type(get_preset(names[0])), argv[0])
        except (OSError, TypeError, ValueError) as e:  # messages name the file and the field
            raise SystemExit(f"error: {e}") from None
    else:
        name = argv[0] if "/" in argv[0] else prefix + argv[0]
        if name not in names:
            raise SystemExit(f"unknown preset {argv[0]!r}; known: {', '.join(names)}")
        default = get_preset(name)

    # Built with make_dataclass because the field type (the preset's class) is only known here.
    args_cls = dataclasses.make_dataclass(
        "Args",
        [
            ("workdir", str),
            (
                "config",
                typing.Annotated[type(default), tyro.conf.arg(name="")],
                dataclasses.field(default=default),
            ),
        ],
        frozen=True,
        kw_only=True,
    )
    args = tyro.cli(args_cls, args=argv[1:], prog=f"{prog} {name}".strip())
    return args.workdir, _drop_other_kinds_files(default, args.config, argv[1:])


def _flags_given(argv: list[str]) -> set[str]:
    """Field paths set on a command line: ``--data.train-path x`` and ``--data.train_path=x``
    both give ``data.train_path``."""
    return {
        a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--") and len(a) > 2
    }


def _drop_other_kinds_files(default: Any, cfg: Any, argv: list[str]) -> Any:
    """``cfg`` without the preset's data files when the command line switched ``data.kind``.

    A preset's paths belong to its kind (``dlrm/frappe``'s ``valid.csv``): kept under another
    kind, ``--data.kind tabular`` would evaluate on Frappe's file. The ``DataConfig`` fields
    marked ``kind_file`` are emptied unless the command line sets them as well.
    """
    before, after = getattr(default, "data", None), getattr(cfg, "data", None)
    if not isinstance(after, DataConfig) or before.kind == after.kind:
        return cfg
    given = _flags_given(argv)
    cleared = {
        f.name: ""
        for f in dataclasses.fields(DataConfig)
        if f.metadata.get("kind_file") and f"data.{f.name}" not in given
    }
    try:
        data = dataclasses.replace(after, **cleared)
    except ValueError as e:
        raise SystemExit(
            f"error: {e} (the preset's {before.kind} files are not kept under "
            f"--data.kind {after.kind})"
        ) from None
    return dataclasses.replace(cfg, data=data)
