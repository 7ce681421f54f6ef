"""What each config field is for, declared once on the field, and the sets derived from it.

A run config's fields differ in more than their values: some change what a run computes, some
only how often it logs, some only how its tables are laid out. Each field says which with
:func:`field` (``dataclasses.field`` metadata, as flax's ``struct.field(pytree_node=False)``
does), and every consumer derives its set from the classes:

* resuming (``recscale.train.loop``): a run may resume with a ``resume_free`` field changed;
* trial identity (``sweeps.identity.trial_id``): fields outside ``identity``, and fields at their
  ``identity_default``, are left out of the hash;
* compiled programs (``recscale.train.loop``): fields outside ``program`` are no part of the
  key under which a jitted program is reused;
* the embedding plan (``recscale.embeddings.relayout``): ``plan_input`` fields are what a
  checkpoint's layout records and a re-layout restores.

This lives in ``data`` (the bottom floor) because ``DataConfig``'s fields carry roles too and
``data`` may not import ``recscale``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

from data.strict import field_types, to_dict


@dataclasses.dataclass(frozen=True)
class Role:
    """What a field is for, as three yes/no questions."""

    name: str
    identity: bool
    """Part of a sweep trial's identity (two trials differing in it are two trials)."""
    resume_free: bool
    """A run may resume from its checkpoints with this field changed."""
    program: bool
    """Reaches the compiled programs as a constant, so it is part of their cache key."""


SEMANTIC = Role("semantic", identity=True, resume_free=False, program=True)
"""What the run computes (the default)."""
ARGUMENT = Role("argument", identity=True, resume_free=False, program=False)
"""What the run computes, passed to its compiled programs as an argument (steps, seed,
learning rates, warmup), so runs that differ only in these share programs."""
CADENCE = Role("cadence", identity=False, resume_free=True, program=False)
"""When and how the run logs, evaluates, measures and checkpoints; reaches no program."""
RUNTIME = Role("runtime", identity=False, resume_free=True, program=True)
"""How and where the run executes, not what it computes: the device count, evaluation batch
size, folders of its files and workers, which file evaluation reads."""
LAYOUT = Role("layout", identity=True, resume_free=True, program=True)
"""How the same computation is laid out over devices (the embedding plan, the dense
sharding): a resume re-lays the checkpoint out; trials keep it, as a sweep may compare
layouts."""
LOCATION = Role("location", identity=False, resume_free=False, program=True)
"""Where the training data is: a resume must keep it; identities use the data's fingerprint
(its content) instead."""

_NO_DEFAULT = object()


def field(
    default: Any,
    *,
    role: Role = SEMANTIC,
    identity_default: Any = _NO_DEFAULT,
    plan_input: str = "",
    kind_file: bool = False,
) -> Any:
    """A config field with a default and what it is for.

    Args:
      default: the field's default (an immutable value).
      role: see :class:`Role`.
      identity_default: the field is left out of trial identities while it has this value: the
        value that keeps the behaviour from before the field existed, so trials recorded then
        keep their ids. Stated apart from ``default`` on purpose: changing a default must never
        move an identity.
      plan_input: the field is an input of the embedding plan, named so in
        ``recscale.embeddings.layout.EngineSpec`` and in checkpoints' layout records.
      kind_file: a file of one data kind (``DataConfig.kind``): a command line switching the
        kind empties it unless it sets it too (``recscale.config.parse_preset_cli``).
    """
    meta = {"role": role, "plan_input": plan_input, "kind_file": kind_file}
    if identity_default is not _NO_DEFAULT:
        meta["identity_default"] = to_dict(identity_default)
    return dataclasses.field(default=default, metadata=meta)


def role_of(f: dataclasses.Field) -> Role:
    return f.metadata.get("role", SEMANTIC)


def _sections(cls: type) -> dict[str, type]:
    """Field name -> dataclass type of ``cls``'s fields that hold a dataclass."""
    return {k: tp for k, tp in field_types(cls).items() if dataclasses.is_dataclass(tp)}


@functools.cache
def roles(cls: type) -> dict[str, Role]:
    """Dotted path -> role of every field of ``cls``, nested dataclasses' fields included (a
    field holding a dataclass is listed too, with its own role)."""
    out = {}
    sections = _sections(cls)
    for f in dataclasses.fields(cls):
        out[f.name] = role_of(f)
        if f.name in sections:
            out.update({f"{f.name}.{k}": r for k, r in roles(sections[f.name]).items()})
    return out


def paths(cls: type, **want: bool) -> frozenset[str]:
    """Dotted paths of ``cls``'s fields whose role has the given answers, e.g.
    ``paths(cfg_cls, resume_free=True)``."""
    return frozenset(
        p for p, r in roles(cls).items() if all(getattr(r, k) == v for k, v in want.items())
    )


@functools.cache
def plan_inputs(cls: type) -> dict[str, str]:
    """Plan input name -> dotted path of the field that sets it."""
    out = {}
    sections = _sections(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("plan_input"):
            out[f.metadata["plan_input"]] = f.name
        if f.name in sections:
            out.update({k: f"{f.name}.{p}" for k, p in plan_inputs(sections[f.name]).items()})
    return out


def identity_view(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (``to_dict`` of a ``cls``) without the fields outside trial identity and those at
    their ``identity_default``. Keys that are no field of ``cls`` (written by an older version)
    stay, and missing fields are skipped, so a config recorded before a field existed gives the
    identity it gave then."""
    out = copy.deepcopy(data)
    _prune(cls, out)
    return out


RETIRED = "RETIRED"
"""A config class's ``RETIRED: ClassVar[dict[str, Any]]``: fields it no longer has, each with
the value every recorded run had or that computes what they did. The loader
(``data.strict.build``) accepts and drops them, so files written before still load; trial
identity puts the value back where it is absent, so trials recorded before keep their ids."""


def _prune(cls: type, data: dict[str, Any]) -> None:
    sections = _sections(cls)
    for name, value in getattr(cls, RETIRED, {}).items():
        data.setdefault(name, to_dict(value))
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        at_default = data[f.name] == f.metadata.get("identity_default", _NO_DEFAULT)
        if at_default or not role_of(f).identity:
            del data[f.name]
        elif f.name in sections and isinstance(data[f.name], dict):
            _prune(sections[f.name], data[f.name])


def config_diffs(old: Any, new: Any, free: frozenset[str], path: str = "") -> list[str]:
    """What differs between two config dicts, but for the fields in ``free``."""
    if path in free:
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            out += config_diffs(old.get(k), new.get(k), free, f"{path}.{k}" if path else k)
        return out
    if old == new:
        return []
    return [f"{path}: saved {old!r}, now {new!r}"]
