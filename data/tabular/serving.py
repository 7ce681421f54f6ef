"""A prepared feature spec as a serving artifact stores it (``recscale.serving``, issue 20).

An exported model scores raw rows (a CSV line, a JSON object of columns) with only numpy and
jax: ``recscale/serving/rows.py`` (the artifact's ``recscale_rows.py``) re-implements the
encoding of ``encode.py`` for one row at a time, and needs from here what ``prepare`` learned
and the spec says:

* every feature's rule (column, kind, parse mode, hash seed and buckets, separator, bag size,
  clip, log, the training split's mean and standard deviation, fill, bucket boundaries);
* each vocabulary table's values in id order (``id = position + 1``, 0 out of vocabulary);
* each side table's keys and the columns the features read from it (rows carry the join key,
  the artifact supplies the joined columns, as ``prepare`` joined them);
* the training files' other columns, which a row as in the data files may carry unread.

Arrays go to the artifact's ``vocab.npz``: integer vocabularies as int64 / uint64 (hex), string
columns as UTF-8 bytes and offsets (``<name>.utf8``, ``<name>.offsets``, and ``<name>.null``
where a side column has missing values). A typed side column (Parquet) is stored as the text
``prepare`` cast it to for categorical features, and, floating, also as the float64 values its
numeric features read (``<name>.f64``: ``float32(0.1)`` is not the text ``"0.1"`` parsed).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.criteo.hashing import seed_offset
from data.tabular import encode as enc
from data.tabular import parse
from data.tabular.spec import TabularSpec

KIND = "tabular/1"


def _strings(values: pa.Array, name: str, arrays: dict[str, np.ndarray]) -> None:
    """A string array as UTF-8 bytes and offsets (nulls as empty strings, flagged)."""
    values = pc.cast(values, pa.string())
    nulls = values.is_null().to_numpy(zero_copy_only=False)
    words = [w.encode() for w in pc.fill_null(values, "").to_pylist()]
    arrays[f"{name}.offsets"] = np.cumsum([0, *map(len, words)], dtype=np.int64)
    arrays[f"{name}.utf8"] = np.frombuffer(b"".join(words), np.uint8).copy()
    if nulls.any():
        arrays[f"{name}.null"] = nulls


def _hash_key(table_index: int, seed: int) -> str:
    """The offset ``hash_ids`` adds to a value before its mix, ``(table index << 32) + the
    seed's offset`` mod 2^64, as a decimal string (JSON numbers lose uint64 precision in many
    readers)."""
    return str(((table_index << 32) + int(seed_offset(seed))) % 2**64)


def serving_encoding(
    spec: TabularSpec,
    vocab: enc.Vocabulary,
    sides: list[parse.SideTable],
    file_columns: tuple[str, ...] = (),
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(description for the manifest, arrays for vocab.npz)`` of a prepared dataset;
    ``file_columns``: the training files' columns (those no feature reads are accepted in a
    request and ignored)."""
    arrays: dict[str, np.ndarray] = {}
    tables = {}
    for t, values in vocab.values.items():
        if values is None:
            continue
        if pa.types.is_string(values.type):
            _strings(values, f"vocab.{t}", arrays)
            tables[t] = "string"
        else:
            typ = np.uint64 if pa.types.is_unsigned_integer(values.type) else np.int64
            arrays[f"vocab.{t}"] = values.to_numpy(zero_copy_only=False).astype(typ)
            tables[t] = typ.__name__
    index = {t: i for i, t in enumerate(spec.tables)}
    needed = set(spec.needed_columns())
    joins = []
    for j, (join, side) in enumerate(zip(spec.joins, sides, strict=True)):
        cols = [c for c in side.columns.column_names if c in needed]
        _strings(side.keys, f"join{j}.key", arrays)
        for c in cols:
            col = side.columns.column(c)
            col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
            _strings(col, f"join{j}.{c}", arrays)
            if pa.types.is_floating(col.type):  # nulls: the text's ``.null`` flags
                x = pc.fill_null(pc.cast(col, pa.float64()), 0.0)
                arrays[f"join{j}.{c}.f64"] = x.to_numpy(zero_copy_only=False)
        joins.append({"key": join.key, "file": side.file, "columns": cols})
    dense = [
        {
            "name": f.name,
            "column": f.source,
            "dtype": f.dtype,
            "clip": list(f.clip) if f.clip is not None else None,
            "log": f.log,
            "standardize": list(vocab.scales[f.name]) if f.standardize else None,
            "fill": f.fill,
        }
        for f in spec.dense_features
    ]
    sparse = [
        {
            "name": f.name,
            "column": f.source,
            "kind": "bucketized" if f.boundaries else f.kind,
            "dtype": f.dtype,
            "parse": f.parse,
            "table": f.table_name,
            "vocab": f.table_name if vocab.values.get(f.table_name) is not None else None,
            "hash_buckets": f.hash_buckets,
            "hash_key": _hash_key(index[f.table_name], f.hash_seed) if f.hash_buckets else None,
            "separator": f.separator,
            "max_hotness": f.max_hotness,
            "boundaries": list(f.boundaries),
        }
        for f in spec.sparse_features
    ]
    # columns of a training row the model does not read: accepted in a request, and ignored
    ignored = {
        spec.label.column,
        spec.weight,
        spec.split.column if spec.split.kind == "time" else "",
        *file_columns,
    }
    read = {f.source for f in spec.features} | {j.key for j in spec.joins}
    return {
        "kind": KIND,
        "null_values": list(spec.format.null_values),
        "format": {
            "delimiter": spec.format.delimiter,
            "header": spec.format.header,
            "column_names": list(spec.format.column_names),
            "quote_char": spec.format.quote_char,
        },
        "dense": dense,
        "sparse": sparse,
        "tables": tables,
        "joins": joins,
        "ignored_columns": sorted({c for c in ignored if c} - read),
    }, arrays


def criteo_encoding(
    vocab_sizes: tuple[int, ...], hash_seed: int
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The Criteo reader's encoding (``data/criteo``), as its feature spec states it
    (``presets.criteo_spec``: the same batches, tested): raw TSV rows of an exported Criteo
    model are hashed as in training."""
    from data.tabular.presets import criteo_spec

    spec = criteo_spec(("<criteo>",), vocab_sizes=tuple(vocab_sizes), hash_seed=hash_seed)
    return serving_encoding(spec, enc.Vocabulary(dict.fromkeys(spec.tables), {}), [])


def frappe_encoding(
    values: tuple[tuple[int, ...], ...],
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The Frappe reader's encoding (``data/frappe``: per field its sorted training values,
    ``FrappeVocab.values``), as its feature spec states it (``presets.frappe_spec``: the same
    batches, tested): raw CSV rows of an exported Frappe model map as in training."""
    from data.tabular.presets import FRAPPE_FIELDS, frappe_spec

    spec = frappe_spec("<frappe>")
    tables = {f: pa.array(v, pa.int64()) for f, v in zip(FRAPPE_FIELDS, values, strict=True)}
    return serving_encoding(spec, enc.Vocabulary(tables, {}), [])
