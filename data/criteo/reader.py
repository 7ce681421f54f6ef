"""Streaming, validating reader of the raw Criteo TSV (Kaggle Display Advertising / Terabyte).

Format: one example per line, 40 tab-separated columns ``label, I1..I13, C1..C26``; lines end in
``\\n`` (``\\r\\n`` is accepted and stripped). A UTF-8 byte-order mark before line 1 is stripped.
Files whose name ends in ``.gz`` are read as gzip (multi-member streams included). Lines are
numbered from 1 per file; an empty line is a row, and a malformed one (wrong column count), but
the end of the last line needs no newline.

Validation, per column (anything else is a malformed row):
  * ``label``: exactly ``0`` or ``1``.
  * ``I1..I13``: empty (missing) or a base-10 integer ``-?[0-9]+`` in int32 range
    ``[-2**31, 2**31 - 1]``. Reasons ``non-integer`` / ``out-of-range integer``.
  * ``C1..C26``: empty (missing) or exactly 8 hex digits, either case. Reason ``bad hex``.
  * exactly 40 columns. Reason ``wrong column count``.
  * a gzip stream that ends early or is corrupt. Reason ``truncated gzip``.

Strict mode (``CriteoConfig.strict``) raises :class:`CriteoFormatError` at the first malformed
row, naming file, 1-based line, column and value (for a truncated gzip: the last good line).
Lenient mode writes every rejected row to a rejects file and counts it by reason in
:class:`ReadStats`; nothing is dropped silently, and ``rows_read == rows_kept + rows_rejected``.
A truncated gzip is one counted reject (its partial last line, possibly empty, is the row), and
reading of that file stops there; later files are still read.

Rejects file: a TSV with the header ``file, line, reason, column, row``; ``row`` is the
original line verbatim (without its line ending), so split each record with ``maxsplit=4``.

Categorical hashing and the integer transform: ``data.criteo.hashing``.

Speed: each chunk of lines is parsed by a vectorised numpy byte scanner; only rare fields
(integers longer than 11 characters) are checked per value in Python.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from typing import IO

import numpy as np

from data.batch import Batch, FeatureInfo, Schema
from data.config import CriteoConfig
from data.criteo.hashing import HEX_LUT, hash_u32, show_value, transform_dense

CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
"""Names of the 13 integer columns, in file order (axis N of ``dense_bn``)."""
CRITEO_SPARSE = tuple(f"C{i}" for i in range(1, 27))
"""Names of the 26 categorical columns, in file order (axis F of ``ids_bfh``)."""
CRITEO_COLUMNS = ("label", *CRITEO_DENSE, *CRITEO_SPARSE)
"""All 40 columns of a raw line, in order."""

REJECTS_HEADER = "file\tline\treason\tcolumn\trow\n"
"""First line of a rejects file."""

# Reasons, in the order used by the parser's reason codes (code = index + 1).
_REASONS = (
    "wrong column count",
    "bad label",
    "non-integer",
    "out-of-range integer",
    "bad hex",
    "truncated gzip",
)
_COUNT, _LABEL, _NONINT, _RANGE, _HEX, _TRUNC = range(1, 7)

_NCOL = 40
_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1
_INT_FAST_WIDTH = 11  # "-2147483648" is 11 characters; longer fields take the slow path.
_INT_RE = re.compile(rb"-?[0-9]+")
_BOM = b"\xef\xbb\xbf"
_BLOCK_BYTES = 1 << 22
_TAB, _NL, _MINUS, _ZERO = 9, 10, ord("-"), ord("0")

# Two ASCII bytes read as a little-endian uint16 -> their byte value, -1 if not both hex.
_lo, _hi = HEX_LUT[np.arange(65536) & 0xFF], HEX_LUT[np.arange(65536) >> 8]
_HEX_PAIR_LUT = np.where((_lo >= 0) & (_hi >= 0), _lo * 16 + _hi, -1).astype(np.int16)
del _lo, _hi


class CriteoFormatError(ValueError):
    """A raw Criteo file breaks the format; the message names file, line, column and value."""

    def __init__(self, path: str, line: int, column: str, reason: str, value: bytes, detail: str):
        self.path = path
        self.line = line
        self.column = column
        self.reason = reason
        self.value = value
        super().__init__(f"{path}:{line}: column {column}: {reason} {show_value(value)} ({detail})")


@dataclasses.dataclass
class ReadStats:
    """Counts of one read (accumulated over all files and chunks)."""

    rows_read: int = 0
    """Rows (lines) read, including rejected ones and a truncated gzip's partial line."""
    rows_kept: int = 0
    """Rows that passed validation and were returned."""
    rows_rejected: int = 0
    """Rows rejected in lenient mode (written to the rejects file)."""
    rejects_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    """Rejected rows per reason (``wrong column count``, ``bad hex``, ...)."""
    files: list[str] = dataclasses.field(default_factory=list)
    """Files opened, in order."""
    rejects_path: str = ""
    """Where rejected rows were written ('' in strict mode)."""

    def check(self) -> None:
        """Raises AssertionError unless ``rows_read == rows_kept + rows_rejected`` (and per reason)."""
        if self.rows_read != self.rows_kept + self.rows_rejected:
            raise AssertionError(
                f"rows_read {self.rows_read} != rows_kept {self.rows_kept} + rows_rejected "
                f"{self.rows_rejected}"
            )
        if sum(self.rejects_by_reason.values()) != self.rows_rejected:
            raise AssertionError(
                f"rejects_by_reason {self.rejects_by_reason} does not sum to {self.rows_rejected}"
            )

    def report(self) -> str:
        """One line for logs, e.g. ``criteo: 1999 rows read = 1990 kept + 9 rejected (...)``."""
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.rejects_by_reason.items()))
        where = f" -> {self.rejects_path}" if self.rejects_path else ""
        return (
            f"criteo: {self.rows_read} rows read = {self.rows_kept} kept + {self.rows_rejected} "
            f"rejected ({reasons or 'none'}){where} from {len(self.files)} file(s)"
        )

    __str__ = report

    def _reject(self, reason: str) -> None:
        self.rows_rejected += 1
        self.rejects_by_reason[reason] = self.rejects_by_reason.get(reason, 0) + 1


def criteo_schema(vocab_sizes: Sequence[int]) -> Schema:
    """The schema of Criteo batches: 13 dense features, 26 one-hot features of these sizes."""
    if len(vocab_sizes) != len(CRITEO_SPARSE):
        raise ValueError(f"Criteo has 26 categorical features, got {len(vocab_sizes)} vocab sizes")
    return Schema(
        dense_names=CRITEO_DENSE,
        features=tuple(
            FeatureInfo(name=n, vocab_size=int(v), max_hotness=1)
            for n, v in zip(CRITEO_SPARSE, vocab_sizes, strict=True)
        ),
    )


# ----------------------------------------------------------------------------- line reading


@dataclasses.dataclass
class _Lines:
    first_line: int  # 1-based number of lines[0] in its file
    lines: list[bytes]


@dataclasses.dataclass
class _Truncated:
    line: int  # 1-based number of the partial (lost) line: last good line + 1
    fragment: bytes
    error: str


def _open(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")  # noqa: SIM115


def _iter_lines(path: str, chunk_rows: int, max_rows: int) -> Iterator[_Lines | _Truncated]:
    """Lines of ``path`` (BOM and line endings stripped) in blocks of at most ``chunk_rows``."""
    pending: list[bytes] = []
    emitted = 0  # lines already yielded
    rest = b""
    at_start = True
    with _open(path) as f:
        while True:
            try:
                block = f.read1(_BLOCK_BYTES)
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                if pending:
                    yield _Lines(emitted + 1, pending)
                    emitted += len(pending)
                yield _Truncated(emitted + 1, rest, f"{type(e).__name__}: {e}")
                return
            data = rest + block
            if at_start:
                if block and len(data) < len(_BOM):
                    rest = data
                    continue
                if data.startswith(_BOM):
                    data = data[len(_BOM) :]
                at_start = False
            if block:
                parts = data.split(b"\n")
                rest = parts.pop()
            else:
                parts = [data] if data else []
                rest = b""
            if b"\r" in data:
                parts = [p[:-1] if p.endswith(b"\r") else p for p in parts]
            done = not block
            if max_rows > 0 and emitted + len(pending) + len(parts) >= max_rows:
                parts = parts[: max_rows - emitted - len(pending)]
                done = True
            pending.extend(parts)
            while len(pending) >= chunk_rows or (done and pending):
                out, pending = pending[:chunk_rows], pending[chunk_rows:]
                yield _Lines(emitted + 1, out)
                emitted += len(out)
            if done:
                return


# ----------------------------------------------------------------------------- parsing


@dataclasses.dataclass
class _Parsed:
    kept: np.ndarray  # int64 [m] indices (into the chunk's lines) of valid rows
    labels: np.ndarray  # uint8 [m]
    ints: np.ndarray  # int64 [m, 13]
    int_missing: np.ndarray  # bool [m, 13]
    cats: np.ndarray  # uint32 [m, 26]
    cat_missing: np.ndarray  # bool [m, 26]
    errors: list[tuple[int, int, int, bytes]]  # (line index, column or -1, reason code, value)


def _separators(arr: np.ndarray) -> np.ndarray:
    """Positions of tabs and newlines (uint8 ``b - 9`` wraps below 9, so only 9, 10 are < 2)."""
    return np.flatnonzero((arr - np.uint8(_TAB)) < 2)


def _gather(windows: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """``[..., width]`` bytes from each start (one index per field, not per byte)."""
    return windows[starts][..., :width]


def _parse_lines(lines: list[bytes]) -> _Parsed:
    """Validates and converts a block of lines (no line endings) with vectorised numpy."""
    n = len(lines)
    errors: list[tuple[int, int, int, bytes]] = []
    buf = b"\n".join(lines) + b"\n"
    arr = np.frombuffer(buf, np.uint8)
    seps = _separators(arr)
    fields_per_line = np.diff(np.flatnonzero(arr[seps] == _NL), prepend=-1)
    kept = np.arange(n)
    if (fields_per_line != _NCOL).any():
        good = fields_per_line == _NCOL
        for i in np.flatnonzero(~good):
            errors.append((int(i), -1, _COUNT, b"%d columns" % fields_per_line[i]))
        kept = np.flatnonzero(good)
        buf = b"".join(lines[i] + b"\n" for i in kept)
        arr = np.frombuffer(buf, np.uint8)
        seps = _separators(arr)
    m = kept.size
    # Every field is followed by a separator, so a window of _INT_FAST_WIDTH bytes from any
    # field start stays inside ``padded``; windows past a field's end are masked by its length.
    padded = np.concatenate([arr, np.zeros(_INT_FAST_WIDTH, np.uint8)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, _INT_FAST_WIDTH)
    ends = seps.reshape(m, _NCOL)
    starts = np.empty_like(ends)
    starts.reshape(-1)[1:] = seps[:-1] + 1
    if m:
        starts[0, 0] = 0
    lens = ends - starts
    code = np.zeros((m, _NCOL), np.int8)

    # label
    first = padded[starts[:, 0]]
    code[:, 0] = np.where((lens[:, 0] == 1) & ((first == _ZERO) | (first == _ZERO + 1)), 0, _LABEL)
    labels = (first - _ZERO).astype(np.uint8)

    # integers: optional '-', then >= 1 digits; Horner over the first 11 characters.
    s_i, l_i = starts[:, 1:14], lens[:, 1:14]
    g = _gather(windows, s_i, _INT_FAST_WIDTH)
    pos = np.arange(_INT_FAST_WIDTH)
    neg = (l_i > 0) & (g[..., 0] == _MINUS)
    digit_zone = (pos >= neg[..., None]) & (pos < l_i[..., None])
    digit = g - np.uint8(_ZERO)  # wraps: a non-digit byte gives a value >= 10
    chars_ok = (~digit_zone | (digit < 10)).all(-1) & (l_i - neg >= 1)
    val = np.zeros(l_i.shape, np.int64)
    for k in range(_INT_FAST_WIDTH):
        val = np.where(digit_zone[..., k], val * 10 + digit[..., k], val)
    val = np.where(neg, -val, val)
    in_range = (val >= _INT_MIN) & (val <= _INT_MAX)
    int_code = np.where(chars_ok, np.where(in_range, 0, _RANGE), _NONINT)
    int_code = np.where(l_i == 0, 0, int_code)
    for r, c in np.argwhere(l_i > _INT_FAST_WIDTH):  # rare: leading zeros or huge numbers
        s = buf[starts[r, c + 1] : ends[r, c + 1]]
        if not _INT_RE.fullmatch(s):
            int_code[r, c] = _NONINT
        elif _INT_MIN <= int(s) <= _INT_MAX:
            int_code[r, c], val[r, c] = 0, int(s)
        else:
            int_code[r, c] = _RANGE
    code[:, 1:14] = int_code
    ints = np.where(l_i == 0, 0, val)

    # categoricals: empty or exactly 8 hex digits
    s_c, l_c = starts[:, 14:], lens[:, 14:]
    # 8 bytes per field as one uint64 (an unaligned strided view), decoded 2 bytes at a time.
    u64 = np.ndarray((padded.size - 7,), dtype="<u8", buffer=padded, strides=(1,))
    pairs = u64[s_c].view("<u2").reshape(*s_c.shape, 4)
    byte_vals = _HEX_PAIR_LUT[pairs]  # int16 [m, 26, 4], -1 = not two hex digits
    present = l_c > 0
    hex_ok = ~present | ((l_c == 8) & (byte_vals >= 0).all(-1))
    code[:, 14:] = np.where(hex_ok, 0, _HEX)
    bv = np.where(hex_ok[..., None] & present[..., None], byte_vals, 0).astype(np.uint32)
    cats = (bv[..., 0] << 24) | (bv[..., 1] << 16) | (bv[..., 2] << 8) | bv[..., 3]

    bad = (code != 0).any(1)
    if bad.any():
        for r in np.flatnonzero(bad):
            c = int(np.argmax(code[r] != 0))
            errors.append((int(kept[r]), c, int(code[r, c]), buf[starts[r, c] : ends[r, c]]))
        errors.sort()
        ok = ~bad
        kept, labels, ints = kept[ok], labels[ok], ints[ok]
        l_i, cats, present = l_i[ok], cats[ok], present[ok]
    return _Parsed(kept, labels, ints, l_i == 0, cats, ~present, errors)


# ----------------------------------------------------------------------------- public readers


_DETAIL = {
    _COUNT: "expected 40 tab-separated columns: label, I1..I13, C1..C26",
    _LABEL: "expected exactly '0' or '1'",
    _NONINT: "expected empty or a base-10 integer",
    _RANGE: f"expected an integer in int32 range [{_INT_MIN}, {_INT_MAX}]",
    _HEX: "expected empty or exactly 8 hex digits",
}


def _column_name(c: int) -> str:
    return "(row)" if c < 0 else CRITEO_COLUMNS[c]


def _as_paths(paths) -> list[str]:
    return [os.fspath(p) for p in ([paths] if isinstance(paths, str | os.PathLike) else paths)]


def _rejects_target(cfg: CriteoConfig, rejects_path: str | None) -> str:
    path = rejects_path if rejects_path is not None else cfg.rejects_path
    if not cfg.strict and not path:
        raise ValueError(
            "lenient Criteo reading (strict=False) needs a rejects file: pass rejects_path= or "
            "set CriteoConfig.rejects_path"
        )
    return path if not cfg.strict else ""


def iter_criteo_chunks(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    cfg: CriteoConfig,
    *,
    chunk_rows: int = 65536,
    stats: ReadStats | None = None,
    rejects_path: str | None = None,
) -> Iterator[Batch]:
    """Streams raw Criteo TSV file(s) as Batches of at most ``chunk_rows`` kept rows.

    Batches never span files; a chunk whose rows were all rejected yields nothing. Labels are
    0/1, ``dense_bn`` is :func:`transform_dense` of I1..I13, ``ids_bfh`` is
    :func:`hash_categorical` of C1..C26 with ``cfg.vocab_sizes`` and ``cfg.hash_seed`` (shape
    ``[B, 26, 1]``), weights are 1.

    Args:
      paths: a file or a list of files (``.gz`` = gzip).
      cfg: reader options (strict/lenient, hashing, ``max_rows`` per file).
      chunk_rows: lines parsed per step.
      stats: if given, counts are accumulated into it as reading proceeds.
      rejects_path: lenient mode's rejects file; overrides ``cfg.rejects_path``.

    Raises:
      CriteoFormatError: strict mode, at the first malformed row.
      ValueError: lenient mode without a rejects file.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    files = _as_paths(paths)
    stats = stats if stats is not None else ReadStats()
    rej_path = _rejects_target(cfg, rejects_path)
    stats.rejects_path = rej_path
    vocab = np.asarray(cfg.vocab_sizes, np.int64)
    feat = np.arange(len(CRITEO_SPARSE), dtype=np.uint64)
    rej = open(rej_path, "wb") if rej_path else None  # noqa: SIM115
    try:
        if rej is not None:
            rej.write(REJECTS_HEADER.encode())
            rej.flush()
        for path in files:
            stats.files.append(path)
            for block in _iter_lines(path, chunk_rows, cfg.max_rows):
                if isinstance(block, _Truncated):
                    stats.rows_read += 1
                    if rej is None:
                        raise CriteoFormatError(
                            path,
                            block.line,
                            "(file)",
                            "truncated gzip",
                            block.fragment,
                            f"the gzip stream ends early or is corrupt after line "
                            f"{block.line - 1}, the last good line: {block.error}",
                        )
                    _write_reject(rej, path, block.line, _TRUNC, "(file)", block.fragment)
                    stats._reject(_REASONS[_TRUNC - 1])
                    break
                p = _parse_lines(block.lines)
                if p.errors and rej is None:
                    i, c, r, value = p.errors[0]
                    raise CriteoFormatError(
                        path,
                        block.first_line + i,
                        _column_name(c),
                        _REASONS[r - 1],
                        value,
                        _DETAIL[r],
                    )
                stats.rows_read += len(block.lines)
                for i, c, r, _ in p.errors:
                    _write_reject(
                        rej, path, block.first_line + i, r, _column_name(c), block.lines[i]
                    )
                    stats._reject(_REASONS[r - 1])
                stats.rows_kept += p.kept.size
                if p.kept.size == 0:
                    continue
                ids = hash_u32(p.cats, p.cat_missing, feat, vocab, cfg.hash_seed)
                yield Batch(
                    dense_bn=transform_dense(p.ints, p.int_missing),
                    ids_bfh=ids[:, :, None],
                    labels_b=p.labels.astype(np.float32),
                    weights_b=np.ones(p.kept.size, np.float32),
                )
            if rej is not None:
                rej.flush()
    finally:
        if rej is not None:
            rej.close()


def _write_reject(
    rej: IO[bytes], path: str, line: int, reason: int, column: str, row: bytes
) -> None:
    head = f"{path}\t{line}\t{_REASONS[reason - 1]}\t{column}\t"
    rej.write(head.encode("utf-8", "surrogateescape") + row + b"\n")  # the row byte for byte


def count_criteo_rows(
    paths: str | os.PathLike | Sequence[str | os.PathLike], cfg: CriteoConfig
) -> int:
    """Rows (lines) the reader would read from ``paths`` under ``cfg.max_rows``, unparsed.

    A truncated gzip counts its partial line as one row, as the reader does.
    """
    total = 0
    for path in _as_paths(paths):
        for block in _iter_lines(path, 65536, cfg.max_rows):
            total += 1 if isinstance(block, _Truncated) else len(block.lines)
    return total


def read_criteo(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    cfg: CriteoConfig,
    *,
    rejects_path: str | None = None,
    chunk_rows: int = 65536,
) -> tuple[Batch, ReadStats]:
    """Reads whole raw Criteo file(s) into one Batch (see :func:`iter_criteo_chunks`).

    Returns:
      The batch of all kept rows (in file order) and the read's stats (already checked).
    """
    stats = ReadStats()
    chunks = list(
        iter_criteo_chunks(
            paths, cfg, chunk_rows=chunk_rows, stats=stats, rejects_path=rejects_path
        )
    )
    stats.check()
    if not chunks:
        return criteo_schema(cfg.vocab_sizes).empty_batch(0), stats
    return Batch(*(np.concatenate(parts) for parts in zip(*chunks, strict=True))), stats
