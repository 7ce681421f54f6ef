"""The value checks of tabular reading (``data/tabular/read.py``): invalid UTF-8 and line
breaks in the byte columns a CSV is read as, found in one pass over a column's buffer and
looked at value by value only in a column that holds a bad one."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

BREAK = "line break in a quoted value"


def show(value: bytes | None, limit: int) -> str:
    """A value for a message or a rejects file: bad bytes as ``\\xNN``, line breaks as
    ``\\n``, cut to ``limit`` characters."""
    if value is None:
        return ""
    text = value.decode("utf-8", "backslashreplace")
    return text.replace("\r", "\\r").replace("\n", "\\n")[:limit]


def bytes_of(col: pa.Array) -> np.ndarray:
    """The value bytes of a binary column (its data buffer between its first and last offset)."""
    _, offsets, data = col.buffers()
    if data is None or not len(col):
        return np.zeros(0, np.uint8)
    off = np.frombuffer(offsets, np.int32)[col.offset : col.offset + len(col) + 1]
    return np.frombuffer(data, np.uint8)[off[0] : off[-1]]


def has_break(b: np.ndarray) -> bool:
    """Whether value bytes ``b`` hold ``\n`` or ``\r``: the minimum first, one pass without a
    temporary (8x faster than the comparisons), as a byte below 14 is rare in values."""
    return bool(b.size and b.min() < 14 and np.any((b == 10) | (b == 13)))


def strings_of(col: pa.Array, b: np.ndarray) -> pa.Array:
    """A binary column as strings: ASCII bytes (one pass for their maximum) need no check;
    otherwise the cast checks UTF-8 (``ArrowInvalid`` if a value is not)."""
    if not b.size or b.max() < 128:
        return col.view(pa.string())
    return col.cast(pa.string())


def bad_rows(
    batch: pa.RecordBatch, need: list[int], every: bool
) -> tuple[dict[int, tuple[str, str, bytes, int]], list[pa.Array]]:
    """The batch's rows with invalid UTF-8 in a needed column or a line break in any value:
    row -> (column, reason, value, "\n" in the row), the first bad column in the file's order;
    and the needed columns as strings when no row is bad. Values are looked at one by one only
    in a column that holds a bad one."""
    found: dict[int, tuple[int, str, bytes]] = {}  # row -> (column index, reason, value)
    breaks: dict[int, int] = {}

    def note(i: int, j: int, reason: str, value: bytes) -> None:
        if i not in found or j < found[i][0]:
            found[i] = (j, reason, value)

    strings: dict[int, pa.Array] = {}
    for j in range(batch.num_columns) if every else sorted(set(need)):
        col = batch.column(j)
        if not pa.types.is_binary(col.type):  # not read as bytes (cannot be, kept as a guard)
            if j in need:
                strings[j] = col.cast(pa.string())
            continue
        b = bytes_of(col)
        if j in need:
            try:
                strings[j] = strings_of(col, b)
            except pa.ArrowInvalid:
                for i, v in enumerate(col.to_pylist()):
                    if v is not None and not utf8(v):
                        note(i, j, "invalid UTF-8", v)
        if every and has_break(b):
            for i, v in enumerate(col.to_pylist()):
                if v is not None and (b"\n" in v or b"\r" in v):
                    note(i, j, BREAK, v)
                    breaks[i] = breaks.get(i, 0) + v.count(b"\n")
    if found:
        names = batch.schema.names
        return {i: (names[j], r, v, breaks.get(i, 0)) for i, (j, r, v) in found.items()}, []
    return {}, [strings[j] for j in need]


def utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
