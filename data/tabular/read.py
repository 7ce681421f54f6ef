"""Reading tabular files with pyarrow: CSV/TSV (header or not, quoting, compressed) and Parquet.

:func:`iter_chunks` streams one file (or one byte-range piece of a large uncompressed CSV, cut at
a line end by :func:`pieces`) as :class:`Chunk`\\ s of the columns a spec needs, each remembering
where its rows came from, so every later error can name the file and the line (CSV) or row group
and row (Parquet). CSV is parsed single-threaded (pyarrow gives the line number of a malformed
row only then) on a background thread, so parsing overlaps the caller's encoding; pieces and
files are read by several processes (``data/tabular/prepare.py``).

Line numbers count physical lines from 1 (the header is line 1; a blank line is a malformed row,
never skipped). Every value must be valid UTF-8, and a quoted value may not hold a line break
(``\n`` or ``\r``): one row per line, as interaction logs are written, so a large file can be cut
into pieces at any line end and every line number is found by counting them. Such a row is bad
input like a malformed one: strict, an error naming its file and line; lenient, a reject (reasons
``invalid UTF-8`` and ``line break in a quoted value``), the lines after it numbered as the file's
(a value with line breaks: convert the file to Parquet, whose values may hold anything).
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from data.tabular import values
from data.tabular.spec import FileFormat


class TabularFormatError(ValueError):
    """Bad input; the message names the file, the line (or row group) and the column."""


@dataclasses.dataclass
class Reject:
    """One rejected row: where, why, and its text (a malformed CSV line verbatim; a row with a
    bad value as its needed columns' values joined by tabs)."""

    file: str
    line: str | Callable[[], str]
    """``"line 12"`` (or a function giving it: a piece's line numbers are resolved lazily)."""
    reason: str
    column: str
    text: str
    row: int = -1
    """Kept rows of the piece before it (files a malformed line under its part)."""

    def where(self) -> str:
        return self.line() if callable(self.line) else self.line


@dataclasses.dataclass
class Chunk:
    """Consecutive kept rows of one file."""

    table: pa.Table
    """The needed columns (CSV: all strings; Parquet: the file's types)."""
    file: str
    first_row: int
    """Index of the chunk's first row among the file's kept rows."""
    locate: Callable[[int], str]
    """Row index within the file (kept rows) -> ``"line 12"`` or ``"row group 3, row 7"``."""


def is_parquet(path: str, fmt: FileFormat) -> bool:
    if fmt.kind != "auto":
        return fmt.kind == "parquet"
    return path.lower().endswith((".parquet", ".pq"))


def _delimiter(path: str, fmt: FileFormat) -> str:
    return fmt.delimiter or ("\t" if ".tsv" in os.path.basename(path).lower() else ",")


def file_columns(path: str, fmt: FileFormat) -> list[str]:
    """The file's column names (reads the header / the Parquet footer only)."""
    if is_parquet(path, fmt):
        try:
            return list(pq.ParquetFile(path).schema_arrow.names)
        except (pa.ArrowInvalid, OSError) as e:
            raise TabularFormatError(f"{path}: not a readable Parquet file ({e})") from None
    if not fmt.header:
        return list(fmt.column_names)
    head = b""
    try:
        with pa.input_stream(path, compression="detect") as f:
            while b"\n" not in head and len(head) <= _BLOCK_BYTES:
                block = f.read(1 << 16)
                if not block:
                    break
                head += block
    except OSError as e:
        raise TabularFormatError(f"{path}: cannot read the header line ({e})") from None
    line = head.split(b"\n", 1)[0]
    if len(line) > _BLOCK_BYTES:  # the CSV reader parses a block at a time: a row must fit
        raise TabularFormatError(
            f"{path}: line 1: the header line is longer than {_BLOCK_BYTES >> 20} MiB"
        )
    try:
        first = line.decode("utf-8").rstrip("\r\n").lstrip("\ufeff")
    except UnicodeDecodeError as e:
        raise TabularFormatError(
            f"{path}: line 1: the header is not valid UTF-8 (byte {e.start}: {line[e.start : e.start + 4]!r})"
        ) from None
    if not first:
        raise TabularFormatError(f"{path}: empty file (no header line)")
    # pyarrow parses the one line, so quoted names are read as the data will be.
    tbl = pacsv.read_csv(
        pa.py_buffer((first + "\n").encode()),
        read_options=pacsv.ReadOptions(autogenerate_column_names=True),
        parse_options=pacsv.ParseOptions(
            delimiter=_delimiter(path, fmt), quote_char=fmt.quote_char or False
        ),
        convert_options=pacsv.ConvertOptions(
            column_types={
                f"f{i}": pa.string() for i in range(first.count(_delimiter(path, fmt)) + 1)
            }
        ),
    )
    return [str(tbl.column(i)[0]) for i in range(tbl.num_columns)]


def _parse_options(path: str, fmt: FileFormat, handler) -> pacsv.ParseOptions:
    return pacsv.ParseOptions(
        delimiter=_delimiter(path, fmt),
        quote_char=fmt.quote_char or False,
        invalid_row_handler=handler,
        # A blank line is a row (a malformed one unless the file has one column), so line
        # numbers stay physical and nothing is skipped without a count.
        ignore_empty_lines=False,
    )


def check_columns(path: str, have: Sequence[str], need: Sequence[str], what: str) -> None:
    missing = [c for c in need if c not in have]
    if missing:
        shown = ", ".join(have[:20]) + (f" and {len(have) - 20} more" if len(have) > 20 else "")
        raise TabularFormatError(
            f"{path}: column {missing[0]!r} named by the spec ({what}) is not in the file "
            f"(its columns: {shown or 'none'})"
        )


def _nth_kept(want: int, *excluded: list[int]) -> int:
    """The smallest n with ``n - (excluded values <= n) == want``: the number of the record
    ``want`` counts, records in the sorted lists ``excluded`` left out (bisection, so a file
    with many bad rows stays linear)."""
    lo, hi = want, want + sum(len(e) for e in excluded)
    while lo < hi:
        mid = (lo + hi) // 2
        if mid - sum(bisect.bisect_right(e, mid) for e in excluded) < want:
            lo = mid + 1
        else:
            hi = mid
    return lo


class _Lines:
    """Line numbers of a CSV piece's rows. pyarrow numbers a piece's records from 1 (the header,
    if any, is record 1); kept row k is the k-th record neither skipped (malformed: pyarrow's
    handler, on the reader thread) nor dropped (invalid UTF-8 or a line break in a value: the
    consumer); a record's line is its number plus the line breaks inside the records before it
    (only dropped records hold any). Resolved lazily, as the reader runs ahead of the consumer
    (it only appends records beyond those the consumer asks about).
    """

    def __init__(self, first_rel: int, base: Callable[[], int]):
        self.first_rel = first_rel  # record of the first data row
        self.base = base  # lines of the file before the piece
        self.skipped: list[int] = []  # records, appended in order by the reader thread
        self.dropped: list[int] = []  # records, appended in order by the consumer
        self.broken: list[int] = []  # records holding line breaks, in order (the consumer)
        self.breaks_before: list[int] = [0]  # line breaks inside broken[:i]

    def record(self, row: int) -> int:
        return _nth_kept(self.first_rel + row, self.skipped, self.dropped)

    def add_breaks(self, record: int, breaks: int) -> None:
        self.broken.append(record)
        self.breaks_before.append(self.breaks_before[-1] + breaks)

    def line(self, record: int) -> int:
        return self.base() + record + self.breaks_before[bisect.bisect_left(self.broken, record)]

    def locate(self, row: int) -> str:
        return f"line {self.line(self.record(row))}"


_BLOCK_BYTES = 4 << 20
"""CSV bytes per chunk: larger chunks spread the encoder's per-column Python overhead over more
rows (1 MB -> 4 MB: Criteo-format preparation 315k -> 437k rows/s, 1.4x), and stay far below
the memory bound."""

_COMPRESSED = (".gz", ".bz2", ".zst", ".zstd", ".lz4", ".xz", ".br", ".snappy")


def pieces(path: str, fmt: FileFormat, piece_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` that cut a large uncompressed CSV file at line ends into
    pieces of about ``piece_bytes`` (read by separate processes); one range for anything else.
    A quoted field may not hold a newline (pyarrow's CSV reader does not allow it either)."""
    size = os.path.getsize(path)
    if is_parquet(path, fmt) or path.lower().endswith(_COMPRESSED) or size <= piece_bytes:
        return [(0, size)]
    cuts = [0]
    with open(path, "rb") as fh:
        for k in range(1, -(-size // piece_bytes)):
            at = max(k * piece_bytes, cuts[-1] + 1)
            if at >= size:
                break
            fh.seek(at - 1)
            while True:  # the first line end at or after at - 1
                block = fh.read(1 << 20)
                i = block.find(b"\n")
                if i >= 0 or not block:
                    break
            end = fh.tell() - len(block) + i + 1 if block else size
            if end >= size:
                break
            if end > cuts[-1]:
                cuts.append(end)
    cuts.append(size)
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def lines_before(path: str, offset: int) -> int:
    """Line ends in the file's first ``offset`` bytes (a piece's line-number offset): counted
    from the nearest offset counted before in this process."""
    done = [o for o in _COUNTED.get(path, {}) if o <= offset]
    start = max(done) if done else 0
    count = _COUNTED[path][start] if done else 0
    with open(path, "rb") as fh:
        fh.seek(start)
        left = offset - start
        while left > 0:
            block = fh.read(min(left, 1 << 24))
            if not block:
                break
            count += int(np.count_nonzero(np.frombuffer(block, np.uint8) == 10))
            left -= len(block)
    _COUNTED.setdefault(path, {})[offset] = count
    return count


_COUNTED: dict[str, dict[int, int]] = {}


class _Range(io.RawIOBase):
    """Bytes ``[start, end)`` of a file as a readable stream (one CSV piece for pyarrow)."""

    def __init__(self, path: str, start: int, end: int):
        self._fh = open(path, "rb")  # noqa: SIM115 (closed with the stream)
        self._fh.seek(start)
        self._left = end - start

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._fh.readinto(memoryview(b)[: min(len(b), self._left)]) if self._left else 0
        self._left -= n
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


def iter_chunks(
    path: str,
    fmt: FileFormat,
    columns: Sequence[str],
    *,
    strict: bool,
    on_reject: Callable[[Reject], None],
    piece: tuple[int, int] | None = None,
) -> Iterator[Chunk]:
    """Streams ``columns`` of one file (or of one CSV ``piece``, a byte range from
    :func:`pieces`) in chunks of about 4 MB of CSV, CSV columns as strings (the encoder parses
    and checks them).

    Args:
      strict: a bad CSV row (wrong column count, invalid UTF-8, a line break in a quoted value)
        or a truncated compressed stream raises :class:`TabularFormatError` (the first in the
        file's order); lenient, it is passed to ``on_reject`` and reading goes on (after a
        truncated stream, with the next file).

    Raises:
      TabularFormatError: an empty file, a missing column, a bad row (strict).
    """
    if not os.path.isfile(path):
        raise TabularFormatError(f"{path}: no such file")
    have = file_columns(path, fmt)
    check_columns(path, have, columns, "needed column")
    if is_parquet(path, fmt):
        yield from _iter_parquet(path, columns, strict=strict, on_reject=on_reject)
        return
    start, end = piece if piece is not None else (0, os.path.getsize(path))
    header = fmt.header and start == 0
    # pyarrow numbers a piece's records from 1; the file's line of piece line n is base() + n.
    base = (lambda: lines_before(path, start)) if start else (lambda: 0)
    lines = _Lines(2 if header else 1, base)
    pending: list[tuple[int, str]] = []  # strict: malformed records not yet raised, in order

    def handler(row) -> str:
        n = int(row.number)
        # Kept rows before it, as pyarrow counts them (rows the consumer drops later count as
        # kept here): which part a lenient reject is filed under, the same in every run.
        kept_before = n - lines.first_rel - len(lines.skipped)
        lines.skipped.append(n)
        if strict:  # raised by the consumer, in the file's order with its other errors
            reason = f"wrong column count (expected {row.expected_columns}, got "
            pending.append((n, f"{reason}{row.actual_columns}): {row.text[:200]!r}"))
        else:
            where = lambda: f"line {lines.line(n)}"  # noqa: E731
            on_reject(Reject(path, where, "wrong column count", "", row.text, row=kept_before))
        return "skip"

    # Every column is read (as bytes) when values may be quoted, to find line breaks in any of
    # them; the needed ones are checked as UTF-8 and passed on as strings.
    every = bool(fmt.quote_char)
    whole = start == 0 and end >= os.path.getsize(path)  # a whole file may be compressed
    source = path if whole else io.BufferedReader(_Range(path, start, end), 1 << 20)
    try:
        reader = pacsv.open_csv(
            source,
            read_options=pacsv.ReadOptions(
                use_threads=False,
                block_size=_BLOCK_BYTES,
                column_names=None if header else have,
            ),
            parse_options=_parse_options(path, fmt, handler),
            convert_options=pacsv.ConvertOptions(
                include_columns=None if every else list(columns),
                column_types={c: pa.binary() for c in (have if every else columns)},
                null_values=list(fmt.null_values),
                strings_can_be_null=True,
                quoted_strings_can_be_null=False,
            ),
        )
    except (pa.ArrowInvalid, OSError) as e:
        if "Empty CSV file" in str(e):
            raise TabularFormatError(f"{path}: empty file") from None
        raise TabularFormatError(f"{path}: {e}") from None
    row = 0

    def check(batch: pa.RecordBatch):
        names = batch.schema.names
        need = [names.index(c) for c in columns]  # the first of repeated names, as pyarrow's
        return need, *values.bad_rows(batch, need, every)

    for item in _background(reader, path, check):
        if isinstance(item, BaseException):
            batch = item
            if pending:
                n, msg = pending[0]
                raise TabularFormatError(f"{path}: line {lines.line(n)}: {msg}") from None
            where = lines.locate(row - 1) if row else f"line {base() + lines.first_rel - 1}"
            msg = str(batch)
            if "ompressed" in msg or isinstance(batch, OSError):
                if strict:
                    raise TabularFormatError(
                        f"{path}: truncated or corrupt compressed stream after {where} ({msg})"
                    ) from None
                on_reject(Reject(path, f"after {where}", "truncated stream", "", "", row=row))
                break
            raise TabularFormatError(f"{path}: after {where}: {msg}") from None
        batch, (need, bad, strings) = item
        if strict:
            _raise_first(path, lines, row, batch.num_rows, bad, pending)
        elif bad:
            keep = np.ones(batch.num_rows, bool)
            for j, (i, (column, reason, _, breaks)) in enumerate(sorted(bad.items())):
                k = row + i - j  # its index among kept rows, the bad ones before it dropped
                n = lines.record(k)
                where = f"line {lines.line(n)}"
                lines.dropped.append(n)
                if breaks:
                    lines.add_breaks(n, breaks)
                text = "\t".join(values.show(batch.column(c)[i].as_py(), 10**6) for c in need)
                on_reject(Reject(path, where, reason, column, text, row=k))
                keep[i] = False
            kept = batch.filter(pa.array(keep))
            strings = [kept.column(c).cast(pa.string()) for c in need]
        if strings and len(strings[0]):
            table = pa.Table.from_arrays(strings, names=list(columns))
            yield Chunk(table, path, row, lines.locate)
            row += table.num_rows
    if pending:  # malformed records after the last kept row
        n, msg = pending[0]
        raise TabularFormatError(f"{path}: line {lines.line(n)}: {msg}")
    if row == 0 and not lines.skipped and not lines.dropped and start == 0:
        raise TabularFormatError(f"{path}: empty file (no data rows)")


def _raise_first(
    path: str,
    lines: _Lines,
    row: int,
    rows: int,
    bad: dict[int, tuple[str, str, bytes, int]],
    pending: list[tuple[int, str]],
) -> None:
    """Strict: raises the first bad row up to the end of this batch (its ``rows`` kept rows
    follow ``row`` kept rows): a row of it, or a malformed record pyarrow skipped before it."""
    first: tuple[int, str] | None = None
    if bad:
        i = min(bad)
        column, reason, value, _ = bad[i]
        if reason == values.BREAK:
            reason += " (one row per line: convert the file to Parquet)"
        n = lines.record(row + i)
        first = (n, f"column {column!r}: {reason}: {values.show(value, 200)!r}")
    last = lines.record(row + rows - 1) if rows else None
    if pending and (last is None or pending[0][0] <= last):
        if first is None or pending[0][0] < first[0]:
            first = pending[0]
    if first is not None:
        raise TabularFormatError(f"{path}: line {lines.line(first[0])}: {first[1]}")


def _background(reader, path: str, check: Callable, depth: int = 4) -> Iterator:
    """Reads batches on a thread (pyarrow releases the GIL while parsing), each yielded with
    ``check(batch)`` (computed on that thread too); an exception is yielded in place."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def run():
        try:
            while not stop.is_set():
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                q.put((batch, check(batch)))
        except BaseException as e:  # handed to the consumer
            q.put(e)
        q.put(None)

    t = threading.Thread(target=run, name=f"csv-read:{os.path.basename(path)}", daemon=True)
    t.start()
    try:
        while (item := q.get()) is not None:
            yield item
            if isinstance(item, BaseException):
                break
    finally:
        stop.set()
        while t.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                t.join(0.01)


def _iter_parquet(
    path: str, columns: Sequence[str], *, strict: bool, on_reject: Callable[[Reject], None]
) -> Iterator[Chunk]:
    """A Parquet file's row groups; a row with invalid UTF-8 in a string column (Parquet's
    reader does not check) is bad input, as in a CSV file."""
    f = pq.ParquetFile(path)
    if f.metadata.num_rows == 0:
        raise TabularFormatError(f"{path}: empty file (no rows)")
    starts = np.cumsum([0] + [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)])
    dropped: list[int] = []  # the file's rows dropped (lenient), in order

    def where(n: int) -> str:
        g = int(np.searchsorted(starts, n, side="right") - 1)
        return f"row group {g}, row {n - int(starts[g])}"

    def locate(row: int) -> str:  # kept row -> the file's row
        return where(_nth_kept(row, dropped))

    row = 0
    for g in range(f.num_row_groups):
        table = f.read_row_group(g, columns=list(columns))
        bad = _bad_utf8(path, table)
        if bad and strict:
            i = min(bad)
            raise TabularFormatError(
                f"{path}: {where(int(starts[g]) + i)}: column {bad[i][0]!r}: invalid UTF-8: "
                f"{values.show(bad[i][1], 200)!r}"
            )
        if bad:
            raw = [_as_bytes(table.column(c)) for c in columns]
            for j, i in enumerate(sorted(bad)):
                dropped.append(int(starts[g]) + i)
                text = "\t".join(values.show(v[i], 10**6) for v in raw)
                reject = Reject(path, where(dropped[-1]), "invalid UTF-8", bad[i][0], text)
                reject.row = row + i - j
                on_reject(reject)
            table = table.filter(pa.array([i not in bad for i in range(table.num_rows)]))
        yield Chunk(table, path, row, locate)
        row += table.num_rows


def _as_bytes(col: pa.ChunkedArray) -> list[bytes | None]:
    """A column's values as bytes (a string's unchecked bytes; other types as text)."""
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return col.cast(
            pa.binary() if pa.types.is_string(col.type) else pa.large_binary()
        ).to_pylist()
    return [None if v is None else str(v).encode() for v in col.to_pylist()]


def _bad_utf8(path: str, table: pa.Table) -> dict[int, tuple[str, bytes]]:
    """Rows with invalid UTF-8 in a string column: row -> (first such column, its value)."""
    bad: dict[int, tuple[str, bytes]] = {}
    for name, col in zip(table.column_names, table.columns, strict=True):
        try:
            col.validate(full=True)
            continue
        except pa.ArrowInvalid:
            if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
                raise TabularFormatError(f"{path}: column {name!r}: not valid Arrow data") from None
        for i, v in enumerate(_as_bytes(col)):
            if v is not None and i not in bad and not values.utf8(v):
                bad[i] = (name, v)
    return bad


def read_whole(path: str, fmt: FileFormat, columns: Sequence[str] | None = None) -> pa.Table:
    """A small file (a side table) read whole, CSV columns as strings."""
    have = file_columns(path, fmt)
    cols = list(columns) if columns is not None else have
    check_columns(path, have, cols, "side-table column")
    chunks = list(iter_chunks(path, fmt, cols, strict=True, on_reject=lambda r: None))
    return pa.concat_tables([c.table for c in chunks])
