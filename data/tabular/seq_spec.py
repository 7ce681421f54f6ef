"""The sequence spec: an event log's columns and how they become per-user histories.

A spec of the CTR path (``spec.py``) with a ``sequence`` section in place of ``label`` and
``features``, read by the sequential families (``sequential.sasrec``, ``sequential.hstu``) with
``--data.kind tabular --data.tabular.spec SPEC``. Loaded from YAML, JSON or TOML with
:func:`load_sequence_spec` (paths relative to the file's folder). Example (YAML)::

    name: shop_events
    train: [events.csv]                 # files or globs (a glob's matches in sorted order)
    format: {delimiter: ",", header: true}
    sequence:
      user: user_id                     # whose history an event belongs to
      item: item_id                     # what was interacted with
      item_parse: int                   # string (default) or int: how item values are read
      time: timestamp                   # orders each history; '' = the order of the file
      time_parse: int                   # int, float or datetime (ISO 8601, to microseconds)
      max_len: 50                       # keep each user's most recent 50 events
      side:                             # per-event columns carried beside the items
        - {name: action, kind: categorical}
        - {name: hour_band, column: hour, kind: numeric, boundaries: [6, 12, 18]}
    split: {kind: leave_one_out}        # or {kind: time, valid_from: ..., test_from: ...}

How an event log becomes histories (``data/tabular/seq_prepare.py`` implements it, on
``data.sequences.build_histories``):

* Every event of the ``train`` files is read (the whole log is held in memory: histories need
  a global sort). A user's events are ordered by ``time``, stably: events with equal times keep
  the files' order (``train``'s order) and are counted as ``ties``; events earlier than the
  user's previous one in the files are counted as ``out_of_order`` (the sort puts them right).
* Each user keeps the most recent ``max_len`` events (the others counted as truncated).
* Items are mapped to dense ids ``1..V`` by their sorted raw values (numerically with
  ``item_parse: int``); 0 is the padding id. The vocabulary is saved beside the prepared data.
* A missing or unparsable user, item or time is bad input: strict, an error naming the file,
  the line and the column; lenient (``strict: false``), the event is rejected and counted by
  reason in the prepared data's stats.
* Side columns become int32 ids aligned with the items: ``categorical`` a vocabulary of the
  values ``1..n`` (0: missing, counted); ``numeric`` with ``boundaries``
  ``1 + searchsorted(boundaries, x, side="right")`` (0: missing). A numeric side of the time
  column reads the parsed time (microseconds since the epoch for datetimes).
* Split ``leave_one_out`` (SASRec's and HSTU's): a user's last event is their test target, the
  one before it their validation target, the rest train (users with fewer than 3 events train
  only). Split ``time``: events before ``valid_from`` train; a user's first event at or after
  ``valid_from`` is their validation target (context: their events before it), their first at
  or after ``test_from`` their test target (context: their events before ``test_from``). For
  ``time_parse: datetime`` the cutoffs are datetime strings, else numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Literal

import numpy as np

from data import strict
from data.tabular.spec import FileFormat, SpecError, _check_name, read_spec_file

SEQUENCE_FORMAT_VERSION = 1
"""Bumped when a prepared sequence folder's layout changes (part of every fingerprint)."""


def parse_datetimes(arr) -> tuple[np.ndarray, np.ndarray]:
    """int64 microseconds since the epoch (UTC) of a pyarrow string, timestamp or date array,
    and a bad mask (a string that is no ISO 8601 datetime); nulls are 0 and not bad. A value
    without a zone is taken as UTC; one with ``Z`` or an offset is converted to UTC."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(arr)
    if pa.types.is_timestamp(arr.type) or pa.types.is_date(arr.type):
        us = pc.cast(arr, pa.timestamp("us", tz=getattr(arr.type, "tz", None)), safe=False)
        return pc.fill_null(us.cast(pa.int64()), 0).to_numpy(zero_copy_only=False), np.zeros(
            n, bool
        )
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        return np.zeros(n, np.int64), arr.is_valid().to_numpy(zero_copy_only=False)
    text = pc.utf8_trim_whitespace(arr)
    zoned = pc.fill_null(pc.match_substring_regex(text, _ZONE), False).to_numpy(
        zero_copy_only=False
    )
    out, bad = np.zeros(n, np.int64), np.zeros(n, bool)
    for mask, typ in ((~zoned, pa.timestamp("us")), (zoned, pa.timestamp("us", tz="UTC"))):
        if mask.any():
            out[mask], bad[mask] = _cast_micros(text.filter(pa.array(mask)), typ)
    return out, bad


def _cast_micros(text, typ) -> tuple[np.ndarray, np.ndarray]:
    """pyarrow's cast of strings to timestamps, as int64 microseconds and a bad mask: a part
    that fails is halved until the values that do not parse are found (a few bad values cost
    a few casts per value, not one per row)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        us = pc.fill_null(pc.cast(text, typ).cast(pa.int64()), 0)
        return us.to_numpy(zero_copy_only=False), np.zeros(len(text), bool)
    except pa.ArrowInvalid:
        if len(text) == 1:
            return np.zeros(1, np.int64), np.ones(1, bool)
    half = len(text) // 2
    (a, bad_a), (b, bad_b) = (_cast_micros(p, typ) for p in (text[:half], text[half:]))
    return np.concatenate([a, b]), np.concatenate([bad_a, bad_b])


def datetime_micros(text: str) -> int | None:
    """One ISO 8601 datetime as int64 microseconds since the epoch (None: not one)."""
    import pyarrow as pa

    values, bad = parse_datetimes(pa.array([text], pa.string()))
    return None if bad[0] else int(values[0])


_ZONE = r"(Z|[+-]\d\d:?\d\d)$"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SideColumn:
    """A per-event column carried as int32 ids beside the items (module docstring)."""

    name: str
    """Side column name (unique; names the batch's ``side`` entry)."""
    kind: Literal["categorical", "numeric"]
    """``categorical``: a vocabulary of its values; ``numeric``: bucketised by ``boundaries``."""
    column: str = ""
    """Source column ('' = ``name``)."""
    parse: Literal["string", "int"] = "string"
    """``categorical``: values as strings or base-10 integers (sorted numerically)."""
    boundaries: tuple[float, ...] = ()
    """``numeric``: strictly increasing bucket boundaries (required)."""

    def __post_init__(self):
        where = f"side column {self.name!r}"
        if not self.name:
            raise SpecError("a side column has an empty name")
        if self.name == "time":  # the packs' side entry ``time`` is the event times
            raise SpecError(f"{where}: the name 'time' is reserved for the event times")
        if self.kind not in ("categorical", "numeric"):
            raise SpecError(f"{where}: unknown kind {self.kind!r}")
        if self.kind == "numeric" and not self.boundaries:
            raise SpecError(f"{where}: numeric side columns need boundaries (carried as ids)")
        if self.kind == "categorical" and self.boundaries:
            raise SpecError(f"{where}: boundaries apply to numeric side columns")
        if list(self.boundaries) != sorted(set(self.boundaries)):
            raise SpecError(f"{where}: boundaries must be strictly increasing")

    @property
    def source(self) -> str:
        return self.column or self.name


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceColumns:
    """Which columns make the histories (module docstring)."""

    user: str
    """User id column (values read as strings)."""
    item: str
    """Item id column."""
    item_parse: Literal["string", "int"] = "string"
    """Item values as strings or base-10 integers (the vocabulary sorted numerically)."""
    time: str = ""
    """Time column ordering each user's events ('' = the order of the files)."""
    time_parse: Literal["int", "float", "datetime"] = "int"
    """Times as base-10 integers (e.g. epoch seconds), decimal numbers, or ISO 8601 datetimes
    (``2024-01-02``, ``2024-01-02 03:04:05.5``, with ``Z`` or ``+02:00`` converted to UTC; a
    Parquet timestamp or date column), kept as int64 microseconds since the epoch."""
    max_len: int = 200
    """Most recent events kept per user (>= 3, so leave-one-out leaves one to train on)."""
    side: tuple[SideColumn, ...] = ()
    """Per-event side columns."""

    def __post_init__(self):
        if not self.user or not self.item:
            raise SpecError("user and item must name columns")
        if self.max_len < 3:
            raise SpecError(f"max_len must be >= 3, got {self.max_len}")
        names = [s.name for s in self.side]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise SpecError(f"side column names must be unique, repeated: {dup}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceSplit:
    """Which events are validation and test targets (module docstring)."""

    kind: Literal["leave_one_out", "time"] = "leave_one_out"
    """``leave_one_out``: each user's last event test, second to last validation; ``time``: by
    the time column against ``valid_from`` and ``test_from``."""
    valid_from: float | str | None = None
    """``time``: events at or after this are held out (the first one a validation target)."""
    test_from: float | str | None = None
    """``time``: a user's first event at or after this is their test target (None: no test)."""

    def __post_init__(self):
        if self.kind == "time" and self.valid_from is None:
            raise SpecError("kind time needs valid_from")
        if self.kind == "leave_one_out" and (self.valid_from, self.test_from) != (None, None):
            raise SpecError("valid_from and test_from apply to kind time")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceSpec:
    """An event log: files, the sequence section and the split."""

    name: str = "events"
    """Dataset name (names the prepared folder ``<root>/<name>-<fingerprint>``)."""
    train: tuple[str, ...]
    """Event files or globs (every event; the split holds targets out)."""
    format: FileFormat = FileFormat()
    """How to read the files."""
    sequence: SequenceColumns
    """Which columns make the histories."""
    split: SequenceSplit = SequenceSplit()
    """Validation and test targets."""
    strict: bool = True
    """Strict: the first bad event raises naming file, line and column. Lenient: bad events are
    rejected and counted by reason; nothing is dropped silently."""
    base_dir: str = ""
    """Folder relative paths are resolved against (set by :func:`load_sequence_spec`)."""

    def __post_init__(self):
        _check_name(self.name)
        if not self.train:
            raise SpecError("train lists no file")
        s, seq = self.split, self.sequence
        if s.kind == "time":
            if not seq.time:
                raise SpecError("split kind time needs sequence.time (a time column)")
            want = str if seq.time_parse == "datetime" else (int, float)
            for key in ("valid_from", "test_from"):
                v = getattr(s, key)
                if v is not None and not isinstance(v, want):
                    raise SpecError(
                        f"split.{key}: {v!r} must be a "
                        + ("datetime string" if want is str else "number")
                        + f" (sequence.time_parse is {seq.time_parse})"
                    )
            if seq.time_parse == "datetime":
                for key in ("valid_from", "test_from"):
                    v = getattr(s, key)
                    if v is not None and datetime_micros(v) is None:
                        raise SpecError(f"split.{key}: {v!r} is not an ISO 8601 datetime")
            if s.test_from is not None and self.cutoff("test_from") < self.cutoff("valid_from"):
                raise SpecError("split: test_from must be >= valid_from")

    def cutoff(self, key: str) -> float | int | None:
        """``split.valid_from`` or ``split.test_from`` on the prepared times' scale."""
        v = getattr(self.split, key)
        return datetime_micros(v) if isinstance(v, str) else v

    def resolve(self, path: str) -> str:
        p = os.path.expanduser(path)
        return p if os.path.isabs(p) else os.path.join(self.base_dir or ".", p)

    def needed_columns(self) -> tuple[str, ...]:
        """Every column the sequence section reads."""
        seq = self.sequence
        need = [seq.user, seq.item, *([seq.time] if seq.time else [])]
        return tuple(dict.fromkeys(need + [s.source for s in seq.side]))

    def to_dict(self) -> dict[str, Any]:
        d = strict.to_dict(self)
        d.pop("base_dir")
        return d


def sequence_spec_from_dict(data: Any, *, where: str = "spec", base_dir: str = "") -> SequenceSpec:
    """A :class:`SequenceSpec` from plain data (parsed YAML/JSON/TOML).

    Raises:
      SpecError: an unknown or missing field, or a value of the wrong type, naming ``where``
        and the field's path (e.g. ``spec.yaml: sequence.side[0].kind``).
    """
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    if "sequence" not in data:
        raise SpecError(
            f"{where}: no sequence section: a CTR spec (label and features) is for the CTR "
            "families; the sequential families need sequence: {user, item, time}"
        )
    data = {**data, "base_dir": base_dir}
    try:
        return strict.build(SequenceSpec, data, error=SpecError, str_as_list=True)
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None


def load_sequence_spec(path: str | os.PathLike) -> SequenceSpec:
    """Loads a sequence spec from a ``.yaml``/``.yml``, ``.json`` or ``.toml`` file."""
    path = os.fspath(path)
    data, base_dir = read_spec_file(path)
    return sequence_spec_from_dict(data, where=path, base_dir=base_dir)


def is_sequence_spec(path: str | os.PathLike) -> bool:
    """Whether the spec file has a ``sequence`` section (errors reading it are the loaders')."""
    try:
        data, _ = read_spec_file(path)
    except SpecError:
        return False
    return isinstance(data, dict) and "sequence" in data


def sequence_digest(spec: SequenceSpec) -> str:
    """SHA-256 of the spec's canonical JSON and the format version (files are hashed apart)."""
    text = json.dumps(
        {"v": SEQUENCE_FORMAT_VERSION, "sequence_spec": spec.to_dict()}, sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()
