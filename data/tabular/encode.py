"""Rows of a tabular file -> checked values -> model inputs (the spec's rules, ``spec.py``).

Two passes use this module. The counting pass (:class:`Counts`) sees the training split's rows
and gathers what the encoding needs: each table's value counts (for vocabularies) and each
standardised numeric feature's moments. The encoding pass (:class:`Encoder`) turns rows into
the arrays of a :class:`~data.batch.Batch` with the finished :class:`Vocabulary`.

Both passes parse a chunk the same way (``data.tabular.parse``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.batch import PAD_ID, FeatureInfo, Schema
from data.criteo.hashing import fmix64, seed_offset
from data.tabular.parse import SPLITS, TRAIN, Parsed, select
from data.tabular.spec import Feature, TabularSpec

# ----------------------------------------------------------------------------- counting pass


@dataclasses.dataclass
class Counts:
    """What the counting pass gathers from training rows (mergeable over chunks and files)."""

    tables: dict[str, pa.Table] = dataclasses.field(default_factory=dict)
    """Vocabulary tables: value -> count (columns ``values``, ``counts``)."""
    moments: dict[str, tuple[float, float, float]] = dataclasses.field(default_factory=dict)
    """Standardised numeric features: (count, mean, M2) of present values."""
    rows: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0])
    positives: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0, 0.0])

    def add(self, spec: TabularSpec, parsed: Parsed) -> None:
        for code in range(3):
            sel = parsed.split == code
            self.rows[code] += int(sel.sum())
            self.positives[code] += float(parsed.label[sel].sum())
        train = select(parsed, TRAIN)
        if not train.n:
            return
        for f in spec.features:
            v = train.values[f.name]
            if f.kind == "numeric" and f.standardize and not f.boundaries:
                x, missing = v
                self._moments(f.name, x[~missing])
            elif f.kind != "numeric" and not f.hash_buckets:
                flat = v[1] if f.kind == "multi_categorical" else v
                flat = flat.drop_null()
                if pa.types.is_string(flat.type):
                    flat = flat.filter(pc.not_equal(flat, ""))
                counts = pc.value_counts(flat)
                self._merge(
                    f.table_name,
                    pa.table({"values": counts.field("values"), "counts": counts.field("counts")}),
                )

    def _moments(self, name: str, x: np.ndarray) -> None:
        if not x.size:
            return
        n2, m2, s2 = float(x.size), float(x.mean()), float(((x - x.mean()) ** 2).sum())
        n1, m1, s1 = self.moments.get(name, (0.0, 0.0, 0.0))
        n = n1 + n2
        d = m2 - m1
        self.moments[name] = (n, m1 + d * n2 / n, s1 + s2 + d * d * n1 * n2 / n)

    def _merge(self, table: str, counts: pa.Table) -> None:
        old = self.tables.get(table)
        if old is not None:
            counts = (
                pa.concat_tables([old, counts])
                .group_by("values")
                .aggregate([("counts", "sum")])
                .rename_columns(["values", "counts"])
            )
        self.tables[table] = counts

    def to_bytes(self) -> bytes:
        """The counts as an Arrow IPC file (data only: loading it never runs code, unlike a
        pickle). Each vocabulary table is one list-of-struct cell, the rest JSON metadata."""
        meta = {
            "format": COUNTS_FORMAT,
            "tables": list(self.tables),
            "moments": {k: list(v) for k, v in self.moments.items()},
            "rows": self.rows,
            "positives": self.positives,
        }
        cols = {}
        for i, t in enumerate(self.tables.values()):
            cells = pa.StructArray.from_arrays(
                [_contiguous(t.column("values")), _contiguous(t.column("counts"))],
                names=["values", "counts"],
            )
            cols[f"t{i}"] = pa.LargeListArray.from_arrays(pa.array([0, len(cells)]), cells)
        table = pa.table(cols, metadata={_COUNTS_KEY: json.dumps(meta)})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
        return sink.getvalue().to_pybytes()

    @classmethod
    def load(cls, path: str) -> Counts:
        """Counts written by :meth:`to_bytes`, checked (Arrow's full validation, the expected
        columns and metadata); anything else is a ``ValueError`` naming ``path``."""
        try:
            with open(path, "rb") as fh:
                table = pa.ipc.open_file(pa.py_buffer(fh.read())).read_all()
            table.validate(full=True)
            meta = json.loads((table.schema.metadata or {})[_COUNTS_KEY.encode()])
            if meta["format"] != COUNTS_FORMAT:
                raise ValueError(f"format {meta['format']!r}, expected {COUNTS_FORMAT!r}")
            tables = {}
            for i, name in enumerate(meta["tables"]):
                cells = table.column(f"t{i}").combine_chunks()[0].values
                tables[str(name)] = pa.table(
                    {"values": cells.field("values"), "counts": cells.field("counts")}
                )
            out = cls(
                tables=tables,
                moments={str(k): tuple(float(x) for x in v) for k, v in meta["moments"].items()},
                rows=[int(x) for x in meta["rows"]],
                positives=[float(x) for x in meta["positives"]],
            )
        except (OSError, ValueError, KeyError, IndexError, TypeError, pa.ArrowException) as e:
            raise ValueError(f"{path}: not a counts file of this version ({e})") from None
        if len(out.rows) != 3 or len(out.positives) != 3:
            raise ValueError(f"{path}: not a counts file of this version (rows, positives)")
        return out

    def merge(self, other: Counts) -> None:
        for t, c in other.tables.items():
            self._merge(t, c)
        for name, (n2, m2, s2) in other.moments.items():
            n1, m1, s1 = self.moments.get(name, (0.0, 0.0, 0.0))
            n = n1 + n2
            if n:
                d = m2 - m1
                self.moments[name] = (n, m1 + d * n2 / n, s1 + s2 + d * d * n1 * n2 / n)
        self.rows = [a + b for a, b in zip(self.rows, other.rows, strict=True)]
        self.positives = [a + b for a, b in zip(self.positives, other.positives, strict=True)]


COUNTS_FORMAT = "recscale.counts/1"
_COUNTS_KEY = "recscale.counts"


def _contiguous(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


# ----------------------------------------------------------------------------- vocabulary


@dataclasses.dataclass
class Vocabulary:
    """Everything encoding needs besides the spec: per table its sorted values (None when
    hashed or bucketised), per standardised feature its (mean, std)."""

    values: dict[str, pa.Array | None]
    scales: dict[str, tuple[float, float]]

    @classmethod
    def build(cls, spec: TabularSpec, counts: Counts) -> Vocabulary:
        values: dict[str, pa.Array | None] = {}
        for f in spec.sparse_features:
            if f.table_name in values:
                continue
            if f.hash_buckets or f.boundaries:
                values[f.table_name] = None
                continue
            c = counts.tables.get(f.table_name)
            if c is None:
                typ = {"string": pa.string(), "int": pa.int64(), "hex": pa.uint64()}[f.parse]
                values[f.table_name] = pa.array([], typ)
                continue
            kept = c.filter(pc.greater_equal(c.column("counts"), f.min_count)).column("values")
            kept = kept.combine_chunks() if isinstance(kept, pa.ChunkedArray) else kept
            values[f.table_name] = pc.take(kept, pc.sort_indices(kept))
        scales = {}
        for f in spec.dense_features:
            if f.standardize:
                n, mean, m2 = counts.moments.get(f.name, (0.0, 0.0, 0.0))
                std = float(np.sqrt(m2 / n)) if n else 1.0
                scales[f.name] = (float(mean), std if std > 0 else 1.0)
        return cls(values, scales)

    def vocab_size(self, f: Feature) -> int:
        if f.boundaries:
            return len(f.boundaries) + 2
        if f.hash_buckets:
            return f.hash_buckets
        return len(self.values[f.table_name]) + 1

    def schema(self, spec: TabularSpec) -> Schema:
        return Schema(
            dense_names=tuple(f.name for f in spec.dense_features),
            features=tuple(
                FeatureInfo(
                    name=f.name,
                    vocab_size=self.vocab_size(f),
                    max_hotness=f.max_hotness,
                    table=f.table,
                )
                for f in spec.sparse_features
            ),
        )

    def save(self, folder: str) -> None:
        import json
        import os

        import pyarrow.feather as feather

        for t, v in self.values.items():
            if v is not None:
                feather.write_feather(
                    pa.table({"values": v}), os.path.join(folder, f"vocab.{t}.arrow")
                )
        with open(os.path.join(folder, "scales.json"), "w") as fh:
            json.dump(
                {
                    "tables": sorted(self.values),
                    "hashed": sorted(t for t, v in self.values.items() if v is None),
                    "scales": self.scales,
                },
                fh,
                indent=1,
            )

    @classmethod
    def load(cls, folder: str) -> Vocabulary:
        import json
        import os

        import pyarrow.feather as feather

        with open(os.path.join(folder, "scales.json")) as fh:
            meta = json.load(fh)
        values: dict[str, pa.Array | None] = {}
        for t in meta["tables"]:
            if t in meta["hashed"]:
                values[t] = None
            else:
                col = feather.read_table(os.path.join(folder, f"vocab.{t}.arrow")).column("values")
                values[t] = col.combine_chunks()
                values[t].validate(full=True)  # offsets in bounds before any lookup reads them
        return cls(values, {k: tuple(v) for k, v in meta["scales"].items()})


# ----------------------------------------------------------------------------- encoding pass


def _hash_u64(values: pa.Array, parse: str) -> tuple[np.ndarray, np.ndarray]:
    """Each value as a uint64 hash key, and the missing mask."""
    missing = values.is_null().to_numpy(zero_copy_only=False)
    if parse == "string":
        enc = values.dictionary_encode()
        words = enc.dictionary.to_pylist()
        keys = np.array(
            [
                int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little")
                for w in words
            ],
            np.uint64,
        )
        idx = enc.indices.fill_null(0).to_numpy(zero_copy_only=False)
        out = keys[idx] if keys.size else np.zeros(len(values), np.uint64)
        missing |= pc.equal(values, "").fill_null(False).to_numpy(zero_copy_only=False)
        return out, missing
    raw = pc.fill_null(values, 0).to_numpy(zero_copy_only=False)
    return raw.astype(np.int64).view(np.uint64) if raw.dtype == np.int64 else raw.astype(
        np.uint64
    ), missing


def hash_ids(values: pa.Array, f: Feature, table_index: int) -> np.ndarray:
    """``1 + fmix64(((t << 32) + v) + s) mod (V - 1)``; 0 for missing (Criteo's hash, ``data/
    criteo/reader.py``, for uint32 values v; ``t`` the table's index, ``s`` the seed's offset)."""
    v, missing = _hash_u64(values, f.parse)
    key = (np.uint64(table_index) << np.uint64(32)) + v
    z = fmix64(key + seed_offset(f.hash_seed))
    span = np.uint64(max(f.hash_buckets - 1, 1))
    ids = (np.uint64(1) + z % span).astype(np.int64)
    return np.where(missing | (f.hash_buckets == 1), 0, ids)


class Encoder:
    """Parsed rows -> Batch arrays with a finished :class:`Vocabulary`; counts OOV per feature."""

    def __init__(self, spec: TabularSpec, vocab: Vocabulary):
        self.spec = spec
        self.vocab = vocab
        self.schema = vocab.schema(spec)
        self.table_index = {t: i for i, t in enumerate(spec.tables)}
        self.oov = {f.name: [0, 0, 0] for f in spec.sparse_features}
        self.missing = {f.name: [0, 0, 0] for f in spec.features}
        self.truncated = {f.name: 0 for f in spec.features if f.kind == "multi_categorical"}

    def _ids(self, f: Feature, values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """Ids of flat values (int64) and the mask of present values that fell out of vocab."""
        if f.hash_buckets:
            return hash_ids(values, f, self.table_index[f.table_name]), np.zeros(len(values), bool)
        vocab = self.vocab.values[f.table_name]
        if pa.types.is_string(values.type):
            values = pc.if_else(pc.equal(values, ""), pa.nulls(len(values), pa.string()), values)
        idx = pc.index_in(values, value_set=vocab)
        present = values.is_valid().to_numpy(zero_copy_only=False)
        found = idx.is_valid().to_numpy(zero_copy_only=False)
        ids = pc.fill_null(idx, -1).to_numpy(zero_copy_only=False).astype(np.int64) + 1
        return ids, present & ~found

    def encode(self, parsed: Parsed) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(dense [n, N] f32, ids [n, F, H] i32, labels [n] f32, weights [n] f32)."""
        n, split = parsed.n, parsed.split
        dense = np.zeros((n, len(self.spec.dense_features)), np.float32)
        for j, f in enumerate(self.spec.dense_features):
            x, missing = parsed.values[f.name]
            if f.standardize:
                mean, std = self.vocab.scales[f.name]
                x = (x - mean) / std
            dense[:, j] = np.where(missing, f.fill, x)
            self._count(self.missing[f.name], missing, split)
        h = self.schema.max_hotness if self.schema.features else 1
        ids = np.full((n, len(self.spec.sparse_features), h), PAD_ID, np.int32)
        for j, f in enumerate(self.spec.sparse_features):
            v = parsed.values[f.name]
            if f.boundaries:
                ids[:, j, 0] = v
                self._count(self.missing[f.name], v == 0, split)
            elif f.kind == "categorical":
                fid, oov = self._ids(f, v)
                ids[:, j, 0] = fid
                self._count(self.oov[f.name], oov, split)
                self._count(self.missing[f.name], v.is_null().to_numpy(zero_copy_only=False), split)
            else:
                tokens, flat = v
                parent = pc.list_parent_indices(tokens).to_numpy()
                fid, oov = self._ids(f, flat)
                empty = flat.is_null().to_numpy(zero_copy_only=False)
                if pa.types.is_string(flat.type):
                    empty |= pc.equal(flat, "").fill_null(True).to_numpy(zero_copy_only=False)
                self._count(self.oov[f.name], np.bincount(parent[oov], minlength=n) > 0, split)
                parent, fid = parent[~empty], fid[~empty]
                first = np.searchsorted(parent, np.arange(n))
                pos = np.arange(parent.size) - first[parent]
                fits = pos < f.max_hotness
                self.truncated[f.name] += int((~fits).sum())
                ids[parent[fits], j, pos[fits]] = fid[fits]
        return dense, ids, parsed.label, parsed.weight

    @staticmethod
    def _count(counter: list[int], mask: np.ndarray, split: np.ndarray) -> None:
        if mask.any():
            for code, c in zip(*np.unique(split[mask], return_counts=True), strict=True):
                counter[int(code)] += int(c)

    def stats(self) -> dict[str, Any]:
        per_split = lambda d: {k: dict(zip(SPLITS, v, strict=True)) for k, v in d.items() if any(v)}  # noqa: E731
        return {
            "oov": per_split(self.oov),
            "missing": per_split(self.missing),
            "truncated_tokens": {k: v for k, v in self.truncated.items() if v},
        }
