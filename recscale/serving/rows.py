"""Raw rows of a data file or a request, encoded as training encoded them (issue 20).

Part of the jax-free half of the serving loader: ``recscale/serving/runtime.py`` (the model) uses
it, and export copies it into every artifact beside ``recscale_model.py`` as ``recscale_rows.py``,
so it imports only numpy and the standard library. :class:`RowEncoder` applies a feature spec's
rules (``data.tabular``; Frappe's and Criteo's readers as their specs state them) with the
vocabularies and side tables ``prepare`` built; :func:`read_rows` reads a CSV/TSV/Parquet file.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import re
import reprlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


class ArtifactError(ValueError):
    """A malformed artifact or input, with a message naming the file, field or feature; for a
    bad row, its index in the batch (``example``) and the message without it (``detail``)."""

    def __init__(self, msg: str, example: int | None = None, detail: str = ""):
        super().__init__(msg)
        self.example, self.detail = example, detail or msg


class Malformed(ArtifactError):
    """A manifest field that is missing or of the wrong type (``Model.load`` names the file)."""

    def __init__(self, where: str, e: Exception):
        what = (
            f"key {e.args[0]!r} is missing"
            if isinstance(e, KeyError)
            else f"{type(e).__name__}: {e}"
        )
        super().__init__(f"malformed {where}: {what}")


def _row_error(r: int, detail: str) -> ArtifactError:
    return ArtifactError(f"example {r}: {detail}", r, detail)


_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = _SHOW.maxlong = 80
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxdict = 2, 6, 4


def show(v: Any) -> str:
    """``repr(v)`` cut to about 80 characters (and two levels of nesting), for error messages
    that echo a value a client sent: a 7 MB value or a list nested 900 deep is named, not sent
    back whole."""
    try:
        return _SHOW.repr(v)
    except (ValueError, RecursionError):  # an int past 4,300 digits; a value nested too deep
        return f"<{type(v).__name__}>"


# ------------------------------------------------------------------------------------------------
# Raw rows, encoded as training encoded them (a feature spec's rules: ``data.tabular``; Frappe's
# and Criteo's readers as their specs state them).

_WS = "[ \t\n\f\r]"  # RE2's \s: the class of the regexes prepare's pyarrow kernels ran
_INT = re.compile(rf"{_WS}*[+-]?[0-9]{{1,18}}{_WS}*")
_FLOAT = re.compile(
    rf"{_WS}*[+-]?(?:[0-9]+\.?[0-9]*(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?){_WS}*"
)
_HEX = re.compile(r"\s*(?:0[xX])?[0-9a-fA-F]{1,16}\s*")  # Python's \s, as prepare's hex check
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _fmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's output mix (``data.criteo.hashing.fmix64``), wrapping uint64 arithmetic."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _words(arrays: dict, name: str) -> list[str | None]:
    """A string column stored as UTF-8 bytes and offsets (``data/tabular/serving.py``)."""
    data, offs = arrays[f"{name}.utf8"].tobytes(), arrays[f"{name}.offsets"].tolist()
    out: list[str | None] = [data[a:b].decode() for a, b in zip(offs[:-1], offs[1:], strict=True)]
    null = arrays.get(f"{name}.null")
    if null is not None:
        out = [None if n else w for w, n in zip(out, null.tolist(), strict=True)]
    return out


def _name(file: str) -> str:
    """A side table's file name, without the training machine's folders."""
    return Path(file).name


def _absent(v: Any, nulls: set[str]) -> bool:
    return v is None or (isinstance(v, str) and v in nulls)


class _Bad(ValueError):
    """A value that breaks its feature's rule (the message says which rule)."""


CACHE_BYTES = 64 << 20
"""The raw-row encoder's default memory for remembered values (:class:`RowEncoder`)."""
MAX_CACHED_CHARS = 256
"""Longer values are parsed at every sight, never remembered."""


ENTRY_KEYS = {
    "dense": ("name", "column", "dtype", "clip", "log", "standardize", "fill"),
    "sparse": (
        *("name", "column", "kind", "dtype", "parse", "vocab", "hash_buckets", "hash_key"),
        *("separator", "max_hotness", "boundaries"),
    ),
    "joins": ("key", "file", "columns"),
}
"""The keys :class:`RowEncoder` reads of each entry of a spec's lists (``data.tabular.serving``
writes them all): checked at load, where a missing one would fail every request instead."""


def _check_entries(spec: dict) -> None:
    """Raises :class:`Malformed` naming the entry (``vocab.sparse.city``) and the key."""
    for part, keys in ENTRY_KEYS.items():
        if not isinstance(spec[part], list):
            raise Malformed(
                f"vocab.{part}", TypeError(f"a list expected, got {type(spec[part]).__name__}")
            )
        for i, f in enumerate(spec[part]):
            if not isinstance(f, dict):
                raise Malformed(
                    f"vocab.{part}[{i}]", TypeError(f"an object expected, got {type(f).__name__}")
                )
            name = f.get("name")
            where = f"vocab.{part}.{name}" if isinstance(name, str) else f"vocab.{part}[{i}]"
            for k in keys:
                if k not in f:
                    raise Malformed(where, KeyError(k))


class RowEncoder:
    """Raw rows -> ``(dense [B, N], ids [B, F, H])`` by a feature spec's rules, with the
    vocabularies, numeric moments and side tables ``prepare`` built from the training split:
    the ids and dense values ``data.tabular`` gave the same rows (tested against its encoder).

    A row is a mapping of column to value: a string as read from a CSV file (the spec's
    ``null_values`` are missing), or a JSON number, ``null``, or (multi-categorical features)
    a list of tokens. Rows carry the join keys; the artifact supplies the side tables' columns.
    Missing values, unseen values (the out-of-vocabulary id) and tokens beyond a bag's size
    are counted; an unknown column, a value that does not parse, a key absent from its side
    table raise :class:`ArtifactError` naming the example and column.

    Work is column by column: each distinct string of a column is parsed and looked up once,
    the ids of a batch's new values are hashed or searched in one numpy call
    (``benchmarks/row_encoding.py``). A parsed string is remembered for later batches only if
    it is known: in its feature's vocabulary (an unseen value gets the out-of-vocabulary id and
    is forgotten), of a hashed feature, or a number; and at most ``MAX_CACHED_CHARS`` long.
    What is remembered, all columns together, stays within ``cache_bytes`` (its strings'
    ``sys.getsizeof`` plus ``_ENTRY_BYTES`` a value, an estimate of the entry's dict slot and
    ids): a value that would pass it empties the whole cache first, so a client sending unique
    values costs the others a re-parse, never memory.
    """

    def __init__(
        self,
        spec: dict,
        arrays: dict[str, np.ndarray],
        max_hotness: int,
        cache_bytes: int = CACHE_BYTES,
    ):
        _check_entries(spec)
        self.dense, self.sparse = spec["dense"], spec["sparse"]
        self.nulls = set(spec["null_values"])
        self.max_hotness = max_hotness
        self.vocab: dict[str, Any] = {}
        for t, kind in spec["tables"].items():
            if kind == "string":
                self.vocab[t] = {w: i + 1 for i, w in enumerate(_words(arrays, f"vocab.{t}"))}
            else:
                self.vocab[t] = np.asarray(arrays[f"vocab.{t}"], np.dtype(kind))
        self.joins = []
        for j, join in enumerate(spec["joins"]):
            keys = {k: i for i, k in enumerate(_words(arrays, f"join{j}.key"))}
            cols = {c: _words(arrays, f"join{j}.{c}") for c in join["columns"]}
            self.joins.append((join, keys, cols))
        self.side = {c: j for j, (join, _, _) in enumerate(self.joins) for c in join["columns"]}
        # a floating side column's float64 values, for numeric features (its text may differ;
        # a NaN stays one, a bad value as in prepare)
        self.side_numbers = {}
        for c, j in self.side.items():
            if f"join{j}.{c}.f64" in arrays:
                x = arrays[f"join{j}.{c}.f64"].tolist()
                null = arrays.get(f"join{j}.{c}.null")
                null = null.tolist() if null is not None else [False] * len(x)
                self.side_numbers[c] = [None if n else v for v, n in zip(x, null, strict=True)]
        read = {f["column"] for f in (*self.dense, *self.sparse)}
        read |= {join["key"] for join, _, _ in self.joins}
        self.columns = sorted(read - set(self.side))
        self.ignored = set(spec["ignored_columns"])
        self.allowed = set(self.columns) | self.ignored
        self.cache_bytes = cache_bytes
        self._entry_bytes = 160 + 40 * max_hotness  # dict slot, tuples, ints (measured ~0.9x)
        self._caches: dict[str, dict] = {}
        self.cached_bytes = 0  # of what ``_caches`` holds, by the estimate above
        self._lock = threading.Lock()

    # -------------------------------------------------------------------- one value

    def _nulls(self, column: str) -> set[str]:
        """The strings that mean a missing value in a column: the spec's ``null_values``, none
        for a side table's column (its file's were applied when ``prepare`` read it)."""
        return set() if column in self.side else self.nulls

    def _number(self, v: Any, dtype: str, nulls: set[str]) -> float | None:
        if _absent(v, nulls):
            return None
        if isinstance(v, str):
            if not v.strip():
                return None
            if not (_INT if dtype == "int" else _FLOAT).fullmatch(v):
                raise _Bad("not an integer" if dtype == "int" else "not a number")
            x = float(int(v)) if dtype == "int" else float(v)
        elif isinstance(v, bool) or not isinstance(v, int | float):
            raise _Bad(f"expected a number, got {type(v).__name__}")
        else:
            try:
                x = float(v)
            except OverflowError:
                raise _Bad("out of range") from None
            if dtype == "int" and x != round(x):
                raise _Bad("not an integer")
        if not np.isfinite(x):
            raise _Bad("not a number")
        return x

    def _key(self, v: Any, parse: str, nulls: set[str]) -> str | int | None:
        """A categorical value as its vocabulary's type (None: missing)."""
        if _absent(v, nulls):
            return None
        if isinstance(v, bool) or not isinstance(v, int | str):
            raise _Bad(f"expected a string or integer, got {type(v).__name__}")
        if isinstance(v, int):
            if parse == "int":
                if not -(2**63) <= v < 2**63:
                    raise _Bad("out of the int64 range")
                return v
            v = str(v)
        if parse == "string":
            v = v.strip()
            try:
                v.encode()  # hashed as UTF-8; a lone surrogate (from JSON) has none
            except UnicodeEncodeError:
                raise _Bad("not a valid Unicode string") from None
            return v or None
        if parse == "int":
            if not v.strip():
                return None
            if not _INT.fullmatch(v):
                raise _Bad("not an integer")
            return int(v)
        if v == "":
            return None
        if not _HEX.fullmatch(v):
            raise _Bad("bad hex")
        return int(v, 16)

    def _tokens(self, v: Any, f: dict, nulls: set[str]) -> list[str | int]:
        if _absent(v, nulls):
            return []
        if isinstance(v, str):
            tokens: list = v.split(f["separator"])
        elif isinstance(v, list):
            tokens = v
        else:
            raise _Bad(f"expected a string or a list of tokens, got {type(v).__name__}")
        out = []
        for t in tokens:
            t = t.strip() if isinstance(t, str) else t
            try:
                k = self._key(t, f["parse"], set())
            except _Bad as e:
                raise _Bad(f"token {e}") from None
            if k is not None:
                out.append(k)
        return out

    def _ids(self, f: dict, keys: list) -> np.ndarray:
        """Ids of present keys (``prepare``'s vocabulary or hash; 0 for an unseen value)."""
        if not keys:
            return np.zeros(0, np.int64)
        if f["hash_buckets"]:
            if f["parse"] == "string":
                u = [
                    int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little")
                    for k in keys
                ]
            else:
                u = [k % 2**64 for k in keys]  # an int64 as its two's-complement bits
            z = _fmix64(np.array(u, np.uint64) + np.uint64(int(f["hash_key"])))
            span = np.uint64(max(f["hash_buckets"] - 1, 1))
            ids = (np.uint64(1) + z % span).astype(np.int64)
            return ids if f["hash_buckets"] > 1 else np.zeros_like(ids)
        vocab = self.vocab[f["vocab"]]
        if isinstance(vocab, dict):
            return np.array([vocab.get(k, 0) for k in keys], np.int64)
        k = np.array(keys, vocab.dtype)
        pos = np.searchsorted(vocab, k)
        found = pos < vocab.size
        found[found] &= vocab[pos[found]] == k[found]
        return np.where(found, pos + 1, 0).astype(np.int64)

    # -------------------------------------------------------------------- columns

    def _remember(self, name: str, entries: dict, known: Any) -> None:
        """Adds the ``known(entry)`` entries of short strings to column ``name``'s cache,
        within ``cache_bytes`` (thread-safe; a full cache is replaced by empty ones, so other
        threads keep the dicts they hold)."""
        with self._lock:
            for v, e in entries.items():
                if len(v) > MAX_CACHED_CHARS or not known(e):
                    continue
                size = sys.getsizeof(v) + self._entry_bytes
                if self.cached_bytes + size > self.cache_bytes:
                    self._caches, self.cached_bytes = {}, 0
                    if size > self.cache_bytes:
                        return
                self._caches.setdefault(name, {})[v] = e
                self.cached_bytes += size

    def clear(self) -> None:
        """Forgets every remembered value."""
        with self._lock:
            self._caches, self.cached_bytes = {}, 0

    def remembered(self) -> int:
        """How many values the cache holds, all columns."""
        return sum(len(c) for c in list(self._caches.values()))

    def _entries(self, vals: list, parse: Any) -> list:
        """Each value through ``parse`` (a ``_Bad`` names the value's position ``i`` as
        ``e.args[1]``), for a column's values not in its cache."""
        out = []
        for i, v in enumerate(vals):
            try:
                out.append(parse(v))
            except _Bad as e:
                raise _Bad(str(e), i) from None
        return out

    def _column(self, vals: list, f: dict, parse: Any, finish: Any = None) -> list:
        """Per row the entry of its value: ``parse`` each distinct string once (then
        ``finish`` the new entries of the batch together), and every other value. Of a
        vocabulary's feature, a string with unseen values (``entry[1]``) is not remembered."""
        cache = self._caches.get(f["name"], {})  # this call's dict: others are swapped in whole
        new = list({v: None for v in vals if type(v) is str and v not in cache})
        others = [r for r, v in enumerate(vals) if type(v) is not str]
        todo = new + [vals[r] for r in others]
        try:
            parsed = self._entries(todo, parse)
        except _Bad as e:
            i = e.args[1]
            r = vals.index(todo[i]) if i < len(new) else others[i - len(new)]
            raise _row_error(r, f"column {f['column']!r}: {e.args[0]}: {show(vals[r])}") from None
        if finish is not None:
            parsed = finish(parsed)
        fresh = dict(zip(new, parsed[: len(new)], strict=True))
        if fresh:
            vocab = finish is not None and not f.get("hash_buckets")
            self._remember(f["name"], fresh, (lambda e: not e[1]) if vocab else (lambda e: True))
            out = [(fresh[v] if v in fresh else cache[v]) if type(v) is str else None for v in vals]
        else:  # every string remembered (a warm server's usual batch)
            out = [cache[v] if type(v) is str else None for v in vals]
        for r, e in zip(others, parsed[len(new) :], strict=True):
            out[r] = e
        return out

    def _bags(self, f: dict, keys: list) -> list[tuple[tuple, int, int]]:
        """``(ids padded to H, unseen, keys)`` per row of its keys (lists of present keys): a
        missing categorical is id 0, a bag is cut at the feature's size and padded with -1;
        the ids of all rows in one call."""
        h, cut = self.max_hotness, f["max_hotness"]
        ids = self._ids(f, [k for ks in keys for k in ks]).tolist()
        out, start = [], 0
        for ks in keys:
            bag = ids[start : start + len(ks)]
            start += len(ks)
            unseen = 0 if f["hash_buckets"] else bag.count(0)
            if f["kind"] == "categorical" and not bag:
                bag = [0]
            out.append((tuple(bag[:cut] + [-1] * (h - min(len(bag), cut))), unseen, len(ks)))
        return out

    # -------------------------------------------------------------------- rows

    def _check(self, rows: list) -> None:
        for r, row in enumerate(rows):
            if not isinstance(row, dict):
                raise _row_error(r, "expected an object of column: value")
            if row.keys() <= self.allowed:
                continue
            for c in row:
                if c in self.side:
                    file = _name(self.joins[self.side[c]][0]["file"])
                    raise _row_error(r, f"column {c!r} comes from side table {file} (send its key)")
                if c not in self.allowed:
                    raise _row_error(
                        r, f"unknown column {show(c)} (the model reads {', '.join(self.columns)})"
                    )

    def _values(
        self, rows: list[dict], column: str, side: dict[int, list[int]], numeric: bool = False
    ) -> list:
        """A column's values, from the rows or their side tables' rows (``numeric``: a
        floating side column's numbers rather than its text)."""
        j = self.side.get(column)
        if j is None:
            return [row.get(column) for row in rows]
        col = (self.side_numbers if numeric else {}).get(column) or self.joins[j][2][column]
        return [col[i] for i in side[j]]

    def encode(self, rows: list) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
        """``(dense float32 [B, N], ids int64 [B, F, H], counts)`` of raw rows."""
        n = len(rows)
        self._check(rows)
        side: dict[int, list[int]] = {}  # per join, the side table's row of each example
        for j, (join, keys, _) in enumerate(self.joins):
            col, nulls = join["key"], self._nulls(join["key"])
            side[j] = []
            for r, k in enumerate(self._values(rows, col, side)):
                if _absent(k, nulls):
                    raise _row_error(
                        r, f"column {col!r}: missing key of side table {_name(join['file'])}"
                    )
                if isinstance(k, bool) or not isinstance(k, int | str):
                    raise _row_error(
                        r, f"column {col!r}: a key is a string or integer, got {type(k).__name__}"
                    )
                i = keys.get(str(k))
                if i is None:
                    raise _row_error(
                        r,
                        f"column {col!r}: key not in side table {_name(join['file'])}: {show(str(k))}",
                    )
                side[j].append(i)
        counts = {"unseen_values": 0, "missing_features": 0, "truncated_tokens": 0}
        dense = np.zeros((n, len(self.dense)), np.float32)
        for j, f in enumerate(self.dense):
            x, missing = self._numbers(rows, f, side, counts)
            if f["clip"] is not None:
                x = np.clip(x, f["clip"][0], f["clip"][1])
            if f["log"]:
                x = np.sign(x) * np.log1p(np.abs(x))
            if f["standardize"] is not None:
                mean, std = f["standardize"]
                x = (x - mean) / std
            dense[:, j] = np.where(missing, f["fill"], x)
        h = self.max_hotness
        ids = np.full((n, len(self.sparse), h), -1, np.int64)
        for j, f in enumerate(self.sparse):
            if f["kind"] == "bucketized":
                x, missing = self._numbers(rows, f, side, counts)
                b = 1 + np.searchsorted(np.asarray(f["boundaries"], np.float64), x, side="right")
                ids[:, j, 0] = np.where(missing, 0, b)
                continue
            nulls = self._nulls(f["column"])
            if f["kind"] == "categorical":
                parse = lambda v, f=f, nulls=nulls: self._key(v, f["parse"], nulls)  # noqa: E731
                keys = lambda k: [] if k is None else [k]  # noqa: E731
            else:
                parse = lambda v, f=f, nulls=nulls: self._tokens(v, f, nulls)  # noqa: E731
                keys = list
            entries = self._column(
                self._values(rows, f["column"], side),
                f,
                parse,
                lambda ks, f=f, keys=keys: self._bags(f, [keys(k) for k in ks]),
            )
            flat = itertools.chain.from_iterable(e[0] for e in entries)
            ids[:, j, :] = np.fromiter(flat, np.int64, n * h).reshape(n, h)
            counts["unseen_values"] += sum(e[1] for e in entries)
            counts["missing_features"] += sum(not e[2] for e in entries)
            counts["truncated_tokens"] += sum(max(e[2] - f["max_hotness"], 0) for e in entries)
        return dense, ids, counts

    def _numbers(
        self, rows: list[dict], f: dict, side: dict, counts: dict
    ) -> tuple[np.ndarray, np.ndarray]:
        nulls = self._nulls(f["column"])
        vals = self._column(
            self._values(rows, f["column"], side, numeric=True),
            f,
            lambda v: self._number(v, f["dtype"], nulls),
        )
        missing = np.array([v is None for v in vals], bool)
        x = np.array([0.0 if v is None else v for v in vals], np.float64)
        counts["missing_features"] += int(missing.sum())
        return x, missing


def read_rows(
    path: str | Path, fmt: dict, columns: list[str] | None = None, *, lines: bool = False
) -> Iterator[Any]:
    """Rows of a CSV/TSV file (``.gz``/``.bz2`` too) as column: string, read with the spec's
    ``format`` (stdlib ``csv``; a Parquet file needs pyarrow); only ``columns`` where given
    (as ``prepare`` reads a file: each must be in it); ``lines``: ``(line, row)`` pairs (a
    Parquet row's line is its 1-based index). A row with the wrong number of fields, bytes that
    are not UTF-8 or a malformed field raise :class:`ArtifactError` naming the file and line.

    One difference from ``prepare``'s reader: ``csv`` does not say which fields were quoted, so
    a quoted null string (``"NA"`` with ``NA`` among ``null_values``) is missing here, where
    ``prepare`` keeps it as the string ``NA``."""
    path = Path(path)
    pairs = _numbered_rows(path, fmt)
    if columns is not None:
        first = next(pairs, None)
        if first is None:
            return
        absent = [c for c in columns if c not in first[1]]
        if absent:
            raise ArtifactError(
                f"{path}: column {absent[0]!r} named by the spec is not in the "
                f"file (its columns: {', '.join(first[1])})"
            )
        pairs = ((n, {c: row[c] for c in columns}) for n, row in itertools.chain([first], pairs))
    yield from pairs if lines else (row for _, row in pairs)


def _numbered_rows(path: Path, fmt: dict) -> Iterator[tuple[int, dict[str, Any]]]:
    name = path.name.lower()
    if name.endswith((".parquet", ".pq")):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ArtifactError(f"{path}: reading Parquet needs pyarrow") from None
        yield from enumerate(pq.read_table(path).to_pylist(), start=1)
        return
    if name.endswith(".zst"):
        raise ArtifactError(
            f"{path}: decompress .zst files first (this loader reads plain, .gz and .bz2 files)"
        )
    import bz2  # here: a Python built without them still loads models
    import gzip

    opener = {".gz": gzip.open, ".bz2": bz2.open}.get(path.suffix.lower(), open)
    delimiter = fmt["delimiter"] or ("\t" if ".tsv" in name else ",")
    quote = fmt["quote_char"]
    # undecodable bytes are kept as surrogates, to be named with their line below
    with opener(path, "rt", newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
        reader = csv.reader(
            fh,
            delimiter=delimiter,
            quotechar=quote or None,
            quoting=csv.QUOTE_MINIMAL if quote else csv.QUOTE_NONE,
        )
        names = list(fmt["column_names"]) if not fmt["header"] else None
        while True:
            try:
                row = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                raise ArtifactError(f"{path}: line {reader.line_num}: {e}") from None
            try:
                "".join(row).encode()
            except UnicodeEncodeError as e:
                raise ArtifactError(
                    f"{path}: line {reader.line_num}: not UTF-8 text "
                    f"({e.object[e.start : e.end].encode(errors='surrogateescape')!r})"
                ) from None
            if names is None:
                names = row
                continue
            if len(row) != len(names):
                raise ArtifactError(
                    f"{path}: line {reader.line_num}: {len(row)} fields, expected {len(names)}"
                )
            yield reader.line_num, dict(zip(names, row, strict=True))
        if names is None:
            raise ArtifactError(f"{path}: empty file")
