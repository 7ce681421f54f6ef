"""Parsing a chunk of a tabular file into checked values (the spec's rules, ``spec.py``), for
both passes of ``data.tabular.encode``.

Both passes parse a chunk the same way (:func:`parse_chunk`): side tables joined, split
assigned, label, weight and every feature's column parsed and checked. A row that breaks a rule
(a value that does not parse, a label outside the declared values, a key missing from a side
table, ...) is a bad row: strict mode raises naming the file, the line and the column; lenient
mode rejects the row (written out and counted by reason) and goes on. Every array operation is
a pyarrow compute kernel or numpy; Python loops run only over a chunk's distinct values (hashing
strings, parsing hex) and over bad rows.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.criteo.hashing import fmix64, seed_offset
from data.tabular.read import Chunk, Reject, TabularFormatError
from data.tabular.spec import TabularSpec

TRAIN, VALID, TEST = 0, 1, 2
SPLITS = ("train", "valid", "test")

_FLOAT_RE = r"^\s*[+-]?(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)\s*$"
_INT_RE = r"^\s*[+-]?\d{1,18}\s*$"
_HEX_FULL = re.compile(r"\s*(?:0[xX])?[0-9a-fA-F]{1,16}\s*")


@dataclasses.dataclass
class SideTable:
    """A joined side table: its key values (unique, as strings) and the columns it adds."""

    file: str
    key: str
    keys: pa.Array
    columns: pa.Table


def side_table(table: pa.Table, *, file: str, key: str, columns: tuple[str, ...]) -> SideTable:
    """Checks a side table (unique, present keys) and keeps ``columns`` (empty = all others)."""
    keys = pc.cast(table.column(key), pa.string()).combine_chunks()
    if keys.null_count:
        raise TabularFormatError(f"{file}: key column {key!r} has an empty value")
    counts = pc.value_counts(keys)
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(dup):
        raise TabularFormatError(
            f"{file}: key column {key!r} repeats value {dup.field('values')[0].as_py()!r} "
            f"({dup.field('counts')[0].as_py()} rows); side-table keys must be unique"
        )
    cols = columns or tuple(c for c in table.column_names if c != key)
    return SideTable(file, key, keys, table.select(list(cols)))


# ----------------------------------------------------------------------------- parsing


@dataclasses.dataclass
class Parsed:
    """One chunk's kept rows, parsed."""

    n: int
    split: np.ndarray
    """int8 split code per row (TRAIN, VALID, TEST)."""
    label: np.ndarray
    weight: np.ndarray
    values: dict[str, Any]
    """Per feature: categorical -> pa.Array (nulls missing); multi -> pa.ListArray of tokens;
    numeric -> (float64 values after clip/log, missing mask); bucketised -> int32 ids."""


class _Bad:
    """Bad rows of a chunk: the first reason per row, in check order."""

    def __init__(self, n: int):
        self.mask = np.zeros(n, bool)
        self.info: dict[int, tuple[str, str, str]] = {}

    def add(self, bad: np.ndarray, column: str, reason: str, values) -> None:
        new = bad & ~self.mask
        if not new.any():
            return
        for r in np.flatnonzero(new)[:100_000].tolist():
            v = values[r] if values is not None else None
            v = v.as_py() if hasattr(v, "as_py") else v
            self.info[r] = (column, reason, "" if v is None else str(v))
        self.mask |= new


def _mask(arr) -> np.ndarray:
    """A pyarrow boolean array (nulls false) as numpy."""
    return pc.fill_null(arr, False).to_numpy(zero_copy_only=False).astype(bool)


def _column(table: pa.Table, name: str) -> pa.Array:
    col = table.column(name)
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def parse_numbers(
    arr: pa.Array, *, integer: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Numbers of a column: (float64 values, missing mask, bad mask). Strings must be decimal
    numbers (``integer``: base-10 integers of at most 18 digits); non-finite values are bad."""
    missing = arr.is_null().to_numpy(zero_copy_only=False)
    fast = (
        _cast_or_none(arr, pa.int64())
        if integer and _plain_ints(arr)
        else (None if integer else _cast_or_none(arr, pa.float64()))
    )
    if fast is not None and (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        # Clean data: pyarrow's own strict cast (no whitespace, no junk) does all the work.
        values = fast.to_numpy(zero_copy_only=False).astype(np.float64)
        values = np.where(missing, 0.0, values)
        bad = ~np.isfinite(values)
        return np.where(bad, 0.0, values), missing, bad
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        # Some value does not cast: the regex names which (spaces around a number are allowed).
        arr = blank_is_null(arr)
        missing = arr.is_null().to_numpy(zero_copy_only=False)
        ok = _mask(pc.match_substring_regex(arr, _INT_RE if integer else _FLOAT_RE))
        bad = ~ok & ~missing
        clean = _plain(pc.if_else(pa.array(ok), arr, pa.nulls(len(arr), arr.type)))
        values = pc.cast(clean, pa.float64()).to_numpy(zero_copy_only=False)
    elif (
        pa.types.is_integer(arr.type)
        or pa.types.is_floating(arr.type)
        or pa.types.is_boolean(arr.type)
    ):
        values = pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)
        bad = np.zeros(len(arr), bool)
        if integer and pa.types.is_floating(arr.type):
            bad = ~missing & (np.nan_to_num(values) != np.round(np.nan_to_num(values)))
    else:
        raise TabularFormatError(f"column of type {arr.type} is not numeric")
    values = np.where(missing | bad, 0.0, values)
    bad |= ~np.isfinite(values)
    return np.where(bad, 0.0, values), missing, bad


def _plain_ints(arr: pa.Array) -> bool:
    """Whether pyarrow's string-to-int64 cast may decide a string column: it also takes hex
    (``0x10``, wrapping past 2^63) and 19 digits, which the rule (``_INT_RE``: at most 18
    digits) rejects, so such columns go the regex's way. Read off the string buffers (a
    pyarrow substring search took 5x the cast)."""
    large = pa.types.is_large_string(arr.type)
    if not (pa.types.is_string(arr.type) or large) or not len(arr):
        return True
    offs = np.frombuffer(arr.buffers()[1], np.int64 if large else np.int32)
    offs = offs[arr.offset : arr.offset + len(arr) + 1]
    if (np.diff(offs) > 18).any():
        return False
    data = arr.buffers()[2]
    chars = np.frombuffer(data, np.uint8)[offs[0] : offs[-1]] if data is not None else ()
    return not ((np.asarray(chars, np.uint8) | 0x20) == ord("x")).any()  # x or X


def _cast_or_none(arr: pa.Array, typ: pa.DataType) -> pa.Array | None:
    try:
        return pc.cast(arr, typ)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None


_NIBBLE = np.full(256, -1, np.int8)
_NIBBLE[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_NIBBLE[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_NIBBLE[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)
_SHIFTS = (4 * np.arange(15, -1, -1)).astype(np.uint64)


def _parse_hex_words(words: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """uint64 values and bad flags of distinct hex strings (1-16 digits, optional 0x, spaces
    around). Plain digits are parsed in numpy from the string buffers; only the rest (a prefix,
    spaces, or bad text) one by one in Python."""
    n = len(words)
    offs = np.frombuffer(words.buffers()[1], np.int32)[words.offset : words.offset + n + 1]
    data = np.frombuffer(words.buffers()[2] or b"", np.uint8) if n else np.zeros(0, np.uint8)
    if not data.size:  # no word has a character (all empty): nothing to index
        data = np.zeros(1, np.uint8)
    start, length = offs[:-1].astype(np.int64), np.diff(offs).astype(np.int64)
    k = np.arange(16)
    use = k >= (16 - length)[:, None]  # right-aligned digits
    pos = np.clip(start[:, None] + length[:, None] - 16 + k, 0, max(data.size - 1, 0))
    nib = np.where(use, _NIBBLE[data[pos]], 0)
    ok = (length >= 1) & (length <= 16) & (nib >= 0).all(1)
    out = np.bitwise_or.reduce(nib.clip(0).astype(np.uint64) << _SHIFTS, axis=1)
    out = np.where(ok, out, np.uint64(0))
    bad = ~ok
    for i in np.flatnonzero(~ok).tolist():  # the slow, rare forms
        w = words[i].as_py()
        if _HEX_FULL.fullmatch(w):
            out[i], bad[i] = int(w, 16), False
    return out, bad


def parse_categorical(arr: pa.Array, parse: str) -> tuple[pa.Array, np.ndarray]:
    """Categorical values as their vocabulary type (string, int64 or uint64), and a bad mask."""
    n = len(arr)
    if parse == "string":
        out = arr if pa.types.is_string(arr.type) else pc.cast(arr, pa.string())
        return pc.utf8_trim_whitespace(out), np.zeros(n, bool)
    if pa.types.is_integer(arr.type):
        if parse == "int":
            return pc.cast(arr, pa.int64()), np.zeros(n, bool)
        arr = pc.cast(arr, pa.string())
    if not pa.types.is_string(arr.type):
        arr = pc.cast(arr, pa.string())
    if parse == "hex":  # parsed per distinct value: a chunk has far fewer than rows
        enc = arr.dictionary_encode()
        nums, bad_words = _parse_hex_words(enc.dictionary)
        idx = enc.indices.fill_null(0).to_numpy(zero_copy_only=False)
        valid = enc.indices.is_valid().to_numpy(zero_copy_only=False)
        if len(nums):  # an empty string (e.g. in Parquet) is a missing value, not a bad one
            empty = (
                np.diff(
                    np.frombuffer(enc.dictionary.buffers()[1], np.int32)[
                        enc.dictionary.offset : enc.dictionary.offset + len(nums) + 1
                    ]
                )
                == 0
            )
            bad_words &= ~empty
            valid &= ~empty[idx]
        bad = valid & bad_words[idx] if len(nums) else np.zeros(n, bool)
        values = np.where(bad, 0, nums[idx]) if len(nums) else np.zeros(n, np.uint64)
        return pa.array(values, pa.uint64(), mask=~valid | bad), bad
    fast = _cast_or_none(arr, pa.int64()) if _plain_ints(arr) else None
    if fast is not None:
        return fast, np.zeros(n, bool)
    arr = blank_is_null(arr)  # only here: an empty string fails the cast above
    ok = _mask(pc.match_substring_regex(arr, _INT_RE))
    missing = arr.is_null().to_numpy(zero_copy_only=False)
    bad = ~ok & ~missing
    clean = _plain(pc.if_else(pa.array(ok), arr, pa.nulls(n, pa.string())))
    return pc.cast(clean, pa.int64()), bad


def blank_is_null(arr: pa.Array) -> pa.Array:
    """Empty or all-blank strings (a quoted "" in CSV, "" in Parquet, an empty list token) as
    missing values, as an unquoted empty CSV field already is."""
    blank = pc.equal(pc.utf8_trim_whitespace(arr), "")
    if not pc.any(blank).as_py():
        return arr
    return pc.if_else(blank, pa.nulls(len(arr), arr.type), arr)


def _plain(arr: pa.Array) -> pa.Array:
    """Checked number text ready for pyarrow's strict cast: spaces and a leading '+' removed
    (the float cast takes '+', the integer cast does not)."""
    return pc.replace_substring_regex(pc.utf8_trim_whitespace(arr), r"^\+", "")


def _split_codes(
    spec: TabularSpec,
    table: pa.Table,
    chunk: Chunk,
    file_split: int | None,
    file_index: int,
    piece_index: int,
    bad: _Bad,
) -> np.ndarray:
    n = table.num_rows
    if file_split is not None:
        return np.full(n, file_split, np.int8)
    s = spec.split
    if s.kind == "random":
        rows = np.arange(chunk.first_row, chunk.first_row + n, dtype=np.uint64)
        # (file, piece, row) -> a uniform draw: fixed for the file whatever the worker count.
        key = (
            (np.uint64(file_index) << np.uint64(48))
            + (np.uint64(piece_index) << np.uint64(32))
            + rows
        )
        u = (fmix64(key + seed_offset(s.seed)) >> np.uint64(11)).astype(np.float64) / 2.0**53
        return np.where(
            u < s.valid_fraction,
            VALID,
            np.where(u < s.valid_fraction + s.test_fraction, TEST, TRAIN),
        ).astype(np.int8)
    arr = _column(table, s.column)
    t, missing, badt = parse_numbers(arr)
    bad.add(badt, s.column, "not a number", arr)
    bad.add(missing, s.column, "missing time", arr)
    code = np.where(t >= s.valid_from, VALID, TRAIN)
    if s.test_from is not None:
        code = np.where(t >= s.test_from, TEST, code)
    return code.astype(np.int8)


def parse_chunk(
    spec: TabularSpec,
    chunk: Chunk,
    sides: list[SideTable],
    *,
    file_split: int | None,
    file_index: int,
    piece_index: int = 0,
    strict: bool,
    rejects: list[Reject],
) -> Parsed:
    """Joins, splits and parses one chunk; bad rows raise (strict) or go to ``rejects``."""
    table = chunk.table
    n = table.num_rows
    bad = _Bad(n)
    for side, join in zip(sides, spec.joins, strict=True):
        key = pc.cast(_column(table, join.key), pa.string())
        idx = pc.index_in(key, value_set=side.keys)
        absent = idx.is_null().to_numpy(zero_copy_only=False)
        bad.add(absent, join.key, f"key not in side table {side.file}", key)
        taken = side.columns.take(pc.fill_null(idx, 0))
        for name in taken.column_names:
            table = table.append_column(name, taken.column(name))
    split = _split_codes(spec, table, chunk, file_split, file_index, piece_index, bad)

    arr = _column(table, spec.label.column)
    y, missing, bady = parse_numbers(arr)
    bad.add(bady, spec.label.column, "label is not a number", arr)
    bad.add(missing, spec.label.column, "missing label", arr)
    if spec.label.threshold is None:
        bad.add((y != 0) & (y != 1), spec.label.column, "label outside {0, 1}", arr)
        label = y.astype(np.float32)
    else:
        label = (y >= spec.label.threshold).astype(np.float32)
    if spec.weight:
        arr = _column(table, spec.weight)
        w, missing, badw = parse_numbers(arr)
        bad.add(badw | (w < 0), spec.weight, "weight is not a number >= 0", arr)
        bad.add(missing, spec.weight, "missing weight", arr)
        weight = w.astype(np.float32)
    else:
        weight = np.ones(n, np.float32)

    values: dict[str, Any] = {}
    for f in spec.features:
        arr = _column(table, f.source)
        if f.kind == "numeric":
            x, missing, badx = parse_numbers(arr, integer=f.dtype == "int")
            bad.add(badx, f.source, "not an integer" if f.dtype == "int" else "not a number", arr)
            if f.boundaries:
                ids = 1 + np.searchsorted(np.asarray(f.boundaries), x, side="right")
                values[f.name] = np.where(missing, 0, ids).astype(np.int32)
                continue
            if f.clip is not None:
                x = np.clip(x, f.clip[0], f.clip[1])
            if f.log:
                x = np.sign(x) * np.log1p(np.abs(x))
            values[f.name] = (x, missing)
        elif f.kind == "categorical":
            vals, badc = parse_categorical(arr, f.parse)
            bad.add(
                badc, f.source, f"not a {f.parse} value" if f.parse != "hex" else "bad hex", arr
            )
            values[f.name] = vals
        else:
            tokens = pc.split_pattern(pc.cast(arr, pa.string()), f.separator)
            flat = pc.utf8_trim_whitespace(pc.list_flatten(tokens))
            vals, badt = parse_categorical(flat, f.parse)
            if badt.any():
                row_of = pc.list_parent_indices(tokens).to_numpy()
                rows = np.zeros(n, bool)
                rows[row_of[badt]] = True
                bad.add(rows, f.source, f"token not a {f.parse} value", arr)
            values[f.name] = (tokens, vals)

    if bad.mask.any():
        first = int(np.flatnonzero(bad.mask)[0])
        if strict:
            column, reason, value = bad.info[first]
            raise TabularFormatError(
                f"{chunk.file}: {chunk.locate(chunk.first_row + first)}: column {column!r}: "
                f"{reason}: {value!r}"
            )
        for r in np.flatnonzero(bad.mask).tolist():
            column, reason, value = bad.info.get(r, ("", "bad row", ""))
            row = {c: chunk.table.column(c)[r].as_py() for c in chunk.table.column_names}
            rejects.append(
                Reject(
                    chunk.file,
                    chunk.locate(chunk.first_row + r),
                    reason,
                    column,
                    "\t".join("" if v is None else str(v) for v in row.values()),
                )
            )
        keep = ~bad.mask
        kept = pa.array(keep)
        split, label, weight = split[keep], label[keep], weight[keep]
        for k, v in values.items():
            values[k] = _filter_value(v, keep, kept)
        n = int(keep.sum())
    return Parsed(n, split, label, weight, values)


def _filter_value(v, keep: np.ndarray, kept: pa.Array):
    if isinstance(v, np.ndarray):
        return v[keep]
    if isinstance(v, tuple) and isinstance(v[0], np.ndarray):
        return v[0][keep], v[1][keep]
    if isinstance(v, tuple):  # (tokens per row, parsed flat tokens)
        tokens, flat = v
        parent = pc.list_parent_indices(tokens).to_numpy()
        return tokens.filter(kept), flat.filter(pa.array(keep[parent]))
    return v.filter(kept)


def select(parsed: Parsed, code: int) -> Parsed:
    """The rows of one split."""
    keep = parsed.split == code
    if keep.all():
        return parsed
    kept = pa.array(keep)
    return Parsed(
        int(keep.sum()),
        parsed.split[keep],
        parsed.label[keep],
        parsed.weight[keep],
        {k: _filter_value(v, keep, kept) for k, v in parsed.values.items()},
    )
