"""Reading tabular files with pyarrow: CSV/TSV (header or not, quoting, compressed) and Parquet.

:func:`iter_chunks` streams one file as :class:`Chunk`\\ s of the columns a spec needs, each
remembering where its rows came from, so every later error can name the file and the line (CSV)
or row group and row (Parquet). CSV is parsed single-threaded (pyarrow gives the line number of a
malformed row only then) on a background thread, so parsing overlaps the caller's encoding;
several files are read by several processes (``data/tabular/prepare.py``).

Line numbers count physical lines from 1 (the header is line 1). A quoted field holding a newline
makes the lines after it in the same file one later than reported.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from data.tabular.spec import FileFormat


class TabularFormatError(ValueError):
    """Bad input; the message names the file, the line (or row group) and the column."""


@dataclasses.dataclass
class Reject:
    """One rejected row: where, why, and its text (CSV: the line; else the row's values)."""

    file: str
    line: str
    reason: str
    column: str
    text: str


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
    try:
        with pa.input_stream(path, compression="detect") as f:
            head = f.read(1 << 16)
    except OSError as e:
        raise TabularFormatError(f"{path}: cannot read the header line ({e})") from None
    first = head.split(b"\n", 1)[0].decode("utf-8", "replace").rstrip("\r\n").lstrip("\ufeff")
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
    )


def check_columns(path: str, have: Sequence[str], need: Sequence[str], what: str) -> None:
    missing = [c for c in need if c not in have]
    if missing:
        raise TabularFormatError(
            f"{path}: column {missing[0]!r} named by the spec ({what}) is not in the file "
            f"(its columns: {', '.join(have) or 'none'})"
        )


def _csv_locator(first_line: int, skipped: list[int]) -> Callable[[int], str]:
    def locate(row: int) -> str:
        line = first_line + row
        for s in sorted(skipped):  # physical lines pyarrow skipped as malformed
            if s <= line:
                line += 1
        return f"line {line}"

    return locate


def iter_chunks(
    path: str,
    fmt: FileFormat,
    columns: Sequence[str],
    *,
    strict: bool,
    on_reject: Callable[[Reject], None],
    string_columns: bool = True,
) -> Iterator[Chunk]:
    """Streams ``columns`` of one file in chunks (about 1 MB of CSV each).

    Args:
      strict: a malformed CSV row (wrong column count) or a truncated compressed stream raises
        :class:`TabularFormatError`; lenient, it is passed to ``on_reject`` and reading goes on
        (after a truncated stream, with the next file).
      string_columns: CSV columns are read as strings (the encoder parses and checks them).

    Raises:
      TabularFormatError: an empty file, a missing column, a malformed row (strict).
    """
    if not os.path.isfile(path):
        raise TabularFormatError(f"{path}: no such file")
    have = file_columns(path, fmt)
    check_columns(path, have, columns, "needed column")
    if is_parquet(path, fmt):
        yield from _iter_parquet(path, columns)
        return
    first_line = 2 if fmt.header else 1
    skipped: list[int] = []
    first_error: list[TabularFormatError] = []

    def handler(row) -> str:
        reason = f"wrong column count (expected {row.expected_columns}, got {row.actual_columns})"
        if strict:  # an exception raised here would be swallowed by pyarrow: keep it
            first_error.append(
                TabularFormatError(f"{path}: line {row.number}: {reason}: {row.text[:200]!r}")
            )
            return "error"
        skipped.append(int(row.number))
        on_reject(Reject(path, f"line {row.number}", "wrong column count", "", row.text))
        return "skip"

    try:
        reader = pacsv.open_csv(
            path,
            read_options=pacsv.ReadOptions(
                use_threads=False,
                block_size=1 << 20,
                column_names=list(fmt.column_names) if not fmt.header else None,
            ),
            parse_options=_parse_options(path, fmt, handler),
            convert_options=pacsv.ConvertOptions(
                include_columns=list(columns),
                column_types={c: pa.string() for c in columns} if string_columns else None,
                null_values=list(fmt.null_values),
                strings_can_be_null=True,
                quoted_strings_can_be_null=False,
            ),
        )
    except (pa.ArrowInvalid, OSError) as e:
        if first_error:
            raise first_error[0] from None
        if "Empty CSV file" in str(e):
            raise TabularFormatError(f"{path}: empty file") from None
        raise TabularFormatError(f"{path}: {e}") from None
    locate = _csv_locator(first_line, skipped)
    row = 0
    for batch in _background(reader, path):
        if isinstance(batch, BaseException):
            if first_error:
                raise first_error[0]
            where = locate(row - 1) if row else f"line {first_line - 1}"
            msg = str(batch)
            if "ompressed" in msg or isinstance(batch, OSError):
                if strict:
                    raise TabularFormatError(
                        f"{path}: truncated or corrupt compressed stream after {where} ({msg})"
                    ) from None
                on_reject(Reject(path, f"after {where}", "truncated stream", "", ""))
                break
            raise TabularFormatError(f"{path}: after {where}: {msg}") from None
        if batch.num_rows:
            yield Chunk(pa.Table.from_batches([batch]), path, row, locate)
            row += batch.num_rows
    if row == 0 and not skipped:
        raise TabularFormatError(f"{path}: empty file (no data rows)")


def _background(reader, path: str, depth: int = 4) -> Iterator:
    """Reads batches on a thread (pyarrow releases the GIL while parsing); an exception is
    yielded in place of a batch."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def run():
        try:
            while not stop.is_set():
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                q.put(batch)
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


def _iter_parquet(path: str, columns: Sequence[str]) -> Iterator[Chunk]:
    f = pq.ParquetFile(path)
    if f.metadata.num_rows == 0:
        raise TabularFormatError(f"{path}: empty file (no rows)")
    starts = np.cumsum([0] + [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)])

    def locate(row: int) -> str:
        g = int(np.searchsorted(starts, row, side="right") - 1)
        return f"row group {g}, row {row - int(starts[g])}"

    row = 0
    for g in range(f.num_row_groups):
        table = f.read_row_group(g, columns=list(columns))
        yield Chunk(table, path, row, locate)
        row += table.num_rows


def read_whole(path: str, fmt: FileFormat, columns: Sequence[str] | None = None) -> pa.Table:
    """A small file (a side table) read whole, CSV columns as strings."""
    have = file_columns(path, fmt)
    cols = list(columns) if columns is not None else have
    check_columns(path, have, cols, "side-table column")
    chunks = list(iter_chunks(path, fmt, cols, strict=True, on_reject=lambda r: None))
    return pa.concat_tables([c.table for c in chunks])
