"""Frozen dataclasses to and from plain data (JSON, YAML, TOML), strictly.

One loader for run configs (``recscale.config.from_dict``) and feature specs
(``data.tabular.spec.spec_from_dict``). It lives on the bottom floor because ``data`` may not
import ``recscale``. A misspelt, missing or ill-typed field is an error naming the field's path
(``config.train: unknown field 'num_stepz' (known: ...)``, ``features[2].separator: expected a
string, got 3``), never a silent default. ``dataclasses.asdict`` only goes one way, and
dacite/pydantic are not dependencies; the types handled are the ones configs and specs use:
nested dataclasses, ``bool``/``int``/``float``/``str``, ``Literal``, ``tuple[X, ...]``, fixed
tuples and ``X | None``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, TypeVar

T = TypeVar("T")


class FieldError(TypeError, ValueError):
    """Plain data that does not fit its dataclass: the message names the field's path. Both a
    ``TypeError`` (an unknown field or a value of the wrong type) and a ``ValueError`` (a value
    outside a ``Literal``), as run configs raised them before this loader was shared."""


def to_dict(obj: Any) -> Any:
    """Dataclass -> JSON-able nested dict (tuples become lists); the inverse of :func:`build`."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def build(
    cls: type[T],
    data: Any,
    *,
    path: str = "",
    error: type[Exception] = FieldError,
    str_as_list: bool = False,
    checks: type[Exception] | None = None,
) -> T:
    """``cls`` built from plain data, checked field by field.

    Args:
      cls: a dataclass; fields that are dataclasses are built from nested mappings.
      data: a mapping of field names to values (lists for tuples).
      path: the field path of ``data`` itself, prefixed to the nested ones (``config`` gives
        ``config.train.seed``); '' names nested fields from the top (``train.seed``).
      error: the exception raised; an ``error`` raised by a ``__post_init__`` is raised again
        with the path of the dataclass that raised it prefixed (other exceptions pass as they
        are, since their messages name their fields already).
      str_as_list: a string where a ``tuple[X, ...]`` is expected is a list of that one string
        (a spec may give one file as ``train: d.csv``).
      checks: a ``ValueError`` a class's own checks (``__post_init__``) raise is raised again as
        this, with the path of the dataclass that raised it prefixed (None: it passes as is).

    Raises:
      error: an unknown or missing field, a value of the wrong type, a value outside its
        ``Literal``, or a fixed-length tuple of the wrong length, naming the field's path.
    """
    return _Loader(error, str_as_list, checks).dataclass(cls, data, path)


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type of dataclass ``cls`` (annotations may be strings)."""
    return typing.get_type_hints(cls)


@dataclasses.dataclass(frozen=True)
class _Loader:
    error: type[Exception]
    str_as_list: bool
    checks: type[Exception] | None = None

    def dataclass(self, cls: type, data: Any, path: str) -> Any:
        at = f"{path}: " if path else ""  # path '' is the top level
        if not isinstance(data, dict):
            raise self.error(f"{at}expected a mapping for {cls.__name__}, got {data!r}")
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        # fields a class no longer has (``data.roles.RETIRED``): older files still name them
        data = {k: v for k, v in data.items() if k not in getattr(cls, "RETIRED", {})}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise self.error(f"{at}unknown field {unknown[0]!r} (known: {', '.join(fields)})")
        hints = field_types(cls)
        kwargs = {k: self.value(hints[k], v, f"{path}.{k}" if path else k) for k, v in data.items()}
        missing = [
            n
            for n, f in fields.items()
            if n not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise self.error(f"{at}missing field {missing[0]!r}")
        try:
            return cls(**kwargs)
        except self.error as e:
            raise self.error(f"{at}{e}") from None
        except ValueError as e:
            if self.checks is None:
                raise
            raise self.checks(f"{at}{e}") from None

    def value(self, tp: Any, value: Any, path: str) -> Any:
        origin = typing.get_origin(tp)
        if dataclasses.is_dataclass(tp):
            return self.dataclass(tp, value, path)
        if origin in (typing.Union, types.UnionType):
            args = typing.get_args(tp)
            if value is None and type(None) in args:
                return None
            errors = []
            for a in args:
                if a is type(None):
                    continue
                try:
                    return self.value(a, value, path)
                except self.error as e:
                    errors.append(str(e))
            raise self.error(errors[0])  # the first alternative's complaint
        if origin is Literal:
            if value not in typing.get_args(tp):
                raise self.error(f"{path}: {value!r} is not one of {list(typing.get_args(tp))}")
            return value
        if origin is tuple:
            return self.sequence(typing.get_args(tp), value, path)
        if tp is bool:
            if not isinstance(value, bool):
                raise self.error(f"{path}: expected true or false, got {value!r}")
            return value
        if tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.error(f"{path}: expected an integer, got {value!r}")
            return value
        if tp is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise self.error(f"{path}: expected a number, got {value!r}")
            return float(value)
        if tp is str:
            if not isinstance(value, str):
                raise self.error(f"{path}: expected a string, got {value!r}")
            return value
        raise TypeError(f"{path}: unsupported field type {tp}")

    def sequence(self, args: tuple, value: Any, path: str) -> tuple:
        variadic = args[-1] is Ellipsis
        if variadic and self.str_as_list and isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            raise self.error(f"{path}: expected a list, got {value!r}")
        if variadic:
            return tuple(self.value(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise self.error(f"{path}: expected {len(args)} values, got {len(value)}")
        return tuple(
            self.value(a, v, f"{path}[{i}]")
            for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
