"""Bring-your-own tabular data (``data/tabular``) on small generated files.

Every encoding rule of the spec's docstring is checked against a plain-Python reference computed
here from the rows written: vocabularies, hashing, bags, numeric transforms, bucketising, label,
weight, shared tables, joins, the three split kinds, every input format, strict errors (file,
line, column), lenient rejects, spec loading, fingerprints and multi-process preparation.
"""

from __future__ import annotations

import gzip
import importlib
import json
import math
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from data.batch import PAD_ID, Batch, FeatureInfo
from data.criteo.hashing import hash_categorical
from data.tabular import Prepared, SpecError, TabularFormatError, load_spec, prepare
from data.tabular.passes import REJECTS_HEADER
from data.tabular.spec import TabularSpec, spec_from_dict

# ``data.tabular.prepare`` the attribute is the function; the module is reached by name.
prepare_module = importlib.import_module("data.tabular.prepare")

SPLITS = ("train", "valid", "test")

# ----------------------------------------------------------------------------- helpers


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _csv(header: list[str] | None, rows: list[tuple], sep: str = ",") -> str:
    lines = [sep.join(header)] if header else []
    lines += [sep.join("" if v is None else str(v) for v in row) for row in rows]
    return "\n".join(lines) + "\n"


def _spec(base: Path, **fields) -> TabularSpec:
    return spec_from_dict(fields, where="test-spec", base_dir=str(base))


def _prepare(spec: TabularSpec, base: Path, root: str = "prep", workers: int = 1) -> Prepared:
    return prepare(spec, str(base / root), workers=workers, progress=False)


def _batch(p: Prepared, split: str) -> Batch | None:
    """Every record of a split, in order (None when the split is empty)."""
    if not p.stats["rows"][split]:
        return None
    src = p.records(split)
    return p.to_batch([src[i] for i in range(len(src))])


def _assert_batches_equal(a: Batch | None, b: Batch | None) -> None:
    assert (a is None) == (b is None)
    if a is not None:
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)


def _assert_same_prepared(a: Prepared, b: Prepared) -> None:
    assert a.schema == b.schema
    for split in SPLITS:
        _assert_batches_equal(_batch(a, split), _batch(b, split))


def _ids_of(vocab: dict, values: list) -> list[int]:
    return [0 if v is None else vocab.get(v, 0) for v in values]


def _vocab(values, *, min_count: int = 1, key=None) -> dict:
    """The reference vocabulary: present values seen >= min_count times, sorted, ids 1..n."""
    counts = Counter(v for v in values if v is not None and v != "")
    kept = sorted((v for v, c in counts.items() if c >= min_count), key=key)
    return {v: i + 1 for i, v in enumerate(kept)}


def _float(s: str | None) -> float | None:
    return None if s in (None, "") else float(s)


# ----------------------------------------------------------------------------- every kind

HEADER = ["label", "w", "city", "age", "item", "tags", "price", "src", "dst", "hx"]
# Edge cases planted: "lima" seen once in training (min_count 2 -> OOV), ages whose string
# order differs from their numeric order, an empty token ("a||b"), an exponent ("1e1"), prices
# beyond the clip, an upper-case hex value, "w" only ever a dst (shared table), missing values.
TRAIN_ROWS = [
    ("1", "1.0", "paris", "5", "apple", "a|b", "3.5", "x", "y", "0a1b2c3d"),
    ("0", "0.5", "rome", "12", "pear", "b", "-3.5", "y", "x", "deadbeef"),
    ("1", "2", "paris", "100", "", "a|b|c", "80", "z", "w", "0a1b2c3d"),
    ("0", "1", "oslo", "", "apple", "", "", "x", "z", ""),
    ("0", "1", "rome", "7", "fig", "c|d|a|b", "0", "y", "y", "12345678"),
    ("1", "1", "lima", "40", "pear", "d", "12.25", "x", "w", "ffffffff"),
    ("0", "1", "", "75", "apple", "a", "7", "z", "x", "00000000"),
    ("1", "3", "oslo", "12", "kiwi", "b|c", "", "w", "x", "DEADBEEF"),
    ("0", "1", "paris", "5", "fig", "a||b", "1e1", "x", "y", "deadbeef"),
    ("1", "1", "rome", "100", "", "c", "49.9", "y", "z", "0a1b2c3d"),
    ("0", "1", "oslo", "7", "apple", "b|a", "-1", "z", "z", "12345678"),
    ("1", "0.25", "paris", "40", "pear", "d|c|b", "25", "x", "x", "abcdef01"),
]
# Unseen values: city "tokyo", age 300, tokens "e"/"f", src "q"; "lima" is rare in training.
VALID_ROWS = [
    ("1", "1", "tokyo", "5", "apple", "a|e", "3", "x", "y", "0a1b2c3d"),
    ("0", "1", "lima", "300", "mango", "b", "", "q", "w", "deadbeef"),
    ("1", "1", "paris", "", "", "", "60", "", "x", ""),
    ("0", "1", "rome", "12", "fig", "e|f|a", "-2", "y", "y", "ffffffff"),
]
TEST_ROWS = [
    ("0", "2", "oslo", "9", "kiwi", "d|d|d", "5", "w", "w", "11111111"),
    ("1", "1", "lima", "12", "apple", "b", "-100", "z", "q", "deadbeef"),
]
FEATURES = [
    {"name": "city", "kind": "categorical", "min_count": 2},
    {"name": "age", "kind": "categorical", "parse": "int"},
    {"name": "item", "kind": "categorical", "hash_buckets": 11, "hash_seed": 3},
    {"name": "tags", "kind": "multi_categorical", "separator": "|", "max_hotness": 2},
    {
        "name": "price",
        "kind": "numeric",
        "clip": [0, 50],
        "log": True,
        "standardize": True,
        "fill": -1.0,
    },
    {"name": "age_b", "column": "age", "kind": "numeric", "boundaries": [10, 50]},
    {"name": "src", "kind": "categorical", "table": "place"},
    {"name": "dst", "kind": "categorical", "table": "place"},
    {"name": "hx", "kind": "categorical", "parse": "hex", "hash_buckets": 1000, "hash_seed": 5},
    {"name": "age_raw", "column": "age", "kind": "numeric"},
]


def _every_kind_spec(tmp_path: Path) -> TabularSpec:
    _write(tmp_path / "train.csv", _csv(HEADER, TRAIN_ROWS))
    _write(tmp_path / "valid.csv", _csv(HEADER, VALID_ROWS))
    _write(tmp_path / "test.csv", _csv(HEADER, TEST_ROWS))
    return _spec(
        tmp_path,
        name="kinds",
        train=["train.csv"],
        valid=["valid.csv"],
        test=["test.csv"],
        split={"kind": "files"},
        label={"column": "label"},
        weight="w",
        features=FEATURES,
    )


def _col(rows, name: str) -> list[str | None]:
    j = HEADER.index(name)
    return [r[j] or None for r in rows]


def _reference(train, rows) -> dict:
    """The spec docstring's encoding of ``rows`` with vocabularies/moments from ``train``."""
    city_v = _vocab(_col(train, "city"), min_count=2)
    age_v = _vocab([None if a is None else int(a) for a in _col(train, "age")])
    tok = lambda s: [t for t in (s or "").split("|") if t]  # noqa: E731
    tags_v = _vocab([t for s in _col(train, "tags") for t in tok(s)])
    place_v = _vocab(_col(train, "src") + _col(train, "dst"))

    def price_t(s):
        x = min(max(float(s), 0.0), 50.0)
        return math.copysign(math.log1p(abs(x)), x)

    present = [price_t(s) for s in _col(train, "price") if s is not None]
    mean, std = np.mean(present), np.std(present)  # population std
    n = len(rows)
    ages = [None if a is None else int(a) for a in _col(rows, "age")]
    dense = np.zeros((n, 2))
    dense[:, 0] = [-1.0 if s is None else (price_t(s) - mean) / std for s in _col(rows, "price")]
    dense[:, 1] = [0.0 if a is None else a for a in ages]
    ids = np.full((n, 8, 2), PAD_ID, np.int64)
    ids[:, 0, 0] = _ids_of(city_v, _col(rows, "city"))
    ids[:, 1, 0] = _ids_of(age_v, ages)
    # ids[:, 2] (string hashing) is checked by its properties
    truncated = 0
    for i, s in enumerate(_col(rows, "tags")):
        bag = [tags_v.get(t, 0) for t in tok(s)]
        ids[i, 3, : len(bag[:2])] = bag[:2]
        truncated += max(len(bag) - 2, 0)
    ids[:, 4, 0] = [
        0 if a is None else 1 + int(np.searchsorted([10, 50], a, "right")) for a in ages
    ]
    ids[:, 5, 0] = _ids_of(place_v, _col(rows, "src"))
    ids[:, 6, 0] = _ids_of(place_v, _col(rows, "dst"))
    hexes = [r[HEADER.index("hx")] for r in rows]
    ids[:, 7, 0] = hash_categorical(hexes, feature_index=6, vocab_size=1000, seed=5)

    def oov(vocab, values):
        return sum(v is not None and v not in vocab for v in values)

    return {
        "dense": dense,
        "ids": ids,
        "labels": np.array([float(r[0]) for r in rows]),
        "weights": np.array([float(r[1]) for r in rows]),
        "vocab": {"city": city_v, "age": age_v, "tags": tags_v, "place": place_v},
        "truncated": truncated,
        "oov": {
            "city": oov(city_v, _col(rows, "city")),
            "age": oov(age_v, ages),
            "tags": sum(any(t not in tags_v for t in tok(s)) for s in _col(rows, "tags")),
            "src": oov(place_v, _col(rows, "src")),
            "dst": oov(place_v, _col(rows, "dst")),
        },
        "missing": {
            "city": _col(rows, "city").count(None),
            "age": ages.count(None),
            "item": _col(rows, "item").count(None),
            "price": _col(rows, "price").count(None),
            "age_b": ages.count(None),
            "src": _col(rows, "src").count(None),
            "dst": _col(rows, "dst").count(None),
            "hx": _col(rows, "hx").count(None),
            "age_raw": ages.count(None),
        },
    }


def test_every_column_kind_matches_the_reference_encoding(tmp_path):
    spec = _every_kind_spec(tmp_path)
    p = _prepare(spec, tmp_path)
    assert spec.tables.index("hx") == 6  # src and dst share one table
    refs = {
        s: _reference(TRAIN_ROWS, rows)
        for s, rows in zip(SPLITS, (TRAIN_ROWS, VALID_ROWS, TEST_ROWS), strict=True)
    }
    vocab = refs["train"]["vocab"]
    assert list(vocab["city"]) == ["oslo", "paris", "rome"]  # "lima" once: below min_count
    assert list(vocab["age"]) == [5, 7, 12, 40, 75, 100]  # numeric, not string, order
    assert list(vocab["place"]) == ["w", "x", "y", "z"]  # "w" only ever a dst
    assert p.vocab.values["city"].to_pylist() == list(vocab["city"])
    assert p.vocab.values["age"].to_pylist() == list(vocab["age"])
    assert p.vocab.values["place"].to_pylist() == list(vocab["place"])
    assert p.vocab.values["tags"].to_pylist() == ["a", "b", "c", "d"]

    assert p.schema.dense_names == ("price", "age_raw")
    assert p.schema.features == (
        FeatureInfo(name="city", vocab_size=4, max_hotness=1),
        FeatureInfo(name="age", vocab_size=7, max_hotness=1),
        FeatureInfo(name="item", vocab_size=11, max_hotness=1),
        FeatureInfo(name="tags", vocab_size=5, max_hotness=2),
        FeatureInfo(name="age_b", vocab_size=4, max_hotness=1),
        FeatureInfo(name="src", vocab_size=5, max_hotness=1, table="place"),
        FeatureInfo(name="dst", vocab_size=5, max_hotness=1, table="place"),
        FeatureInfo(name="hx", vocab_size=1000, max_hotness=1),
    )
    assert p.stats["rows"] == {"train": 12, "valid": 4, "test": 2}

    batches = {s: _batch(p, s) for s in SPLITS}
    for split, b in batches.items():
        ref = refs[split]
        assert b.ids_bfh.dtype == np.int32 and b.dense_bn.dtype == np.float32
        np.testing.assert_allclose(b.dense_bn, ref["dense"], rtol=1e-6, atol=1e-6)
        exact = np.delete(np.arange(8), 2)  # all but the hashed strings
        np.testing.assert_array_equal(b.ids_bfh[:, exact], ref["ids"][:, exact], err_msg=split)
        np.testing.assert_array_equal(b.labels_b, ref["labels"])
        np.testing.assert_array_equal(b.weights_b, ref["weights"])
        assert p.schema.ids_in_format(b.ids_bfh)

    train = batches["train"]
    # Shared table: one value, one id, whichever feature reads it.
    src = dict(zip(_col(TRAIN_ROWS, "src"), train.ids_bfh[:, 5, 0].tolist(), strict=True))
    dst = dict(zip(_col(TRAIN_ROWS, "dst"), train.ids_bfh[:, 6, 0].tolist(), strict=True))
    assert src.keys() & dst.keys() == {"w", "x", "y", "z"}
    assert all(src[v] == dst[v] == vocab["place"][v] for v in src.keys() & dst.keys())
    np.testing.assert_array_equal(train.ids_bfh[3, 3], [PAD_ID, PAD_ID])  # empty list: all pad
    np.testing.assert_array_equal(train.ids_bfh[4, 3], [3, 4])  # "c|d|a|b" cut to 2 slots
    assert train.dense_bn[3, 0] == -1.0  # missing price: fill, not standardised

    # String hashing: ids in [1, V), 0 for a missing value, one id per value in every split.
    item_id: dict[str, int] = {}
    for split, rows in zip(SPLITS, (TRAIN_ROWS, VALID_ROWS, TEST_ROWS), strict=True):
        got = batches[split].ids_bfh[:, 2, :]
        assert (got[:, 1] == PAD_ID).all()
        for value, i in zip(_col(rows, "item"), got[:, 0].tolist(), strict=True):
            if value is None:
                assert i == 0
            else:
                assert 1 <= i < 11
                assert item_id.setdefault(value, i) == i
    assert len(set(item_id.values())) > 1

    # Stats: per split, over every split's rows; the bag cut counted in all splits.
    for feat in ("city", "age", "tags", "src", "dst"):
        want = {s: refs[s]["oov"][feat] for s in SPLITS}
        assert p.stats["oov"].get(feat, dict.fromkeys(SPLITS, 0)) == want, feat
    assert p.stats["oov"]["city"] == {"train": 1, "valid": 2, "test": 1}
    for feat in refs["train"]["missing"]:
        want = {s: refs[s]["missing"][feat] for s in SPLITS}
        assert p.stats["missing"].get(feat, dict.fromkeys(SPLITS, 0)) == want, feat
    truncated = sum(refs[s]["truncated"] for s in SPLITS)
    assert truncated == 6
    assert p.stats["truncated_tokens"] == {"tags": truncated}
    assert p.stats["rejected"] == {}


def test_hashing_is_seeded_and_deterministic(tmp_path):
    spec = _every_kind_spec(tmp_path)
    a = _batch(_prepare(spec, tmp_path, "prep-a"), "train")
    b = _batch(_prepare(spec, tmp_path, "prep-b"), "train")
    np.testing.assert_array_equal(a.ids_bfh, b.ids_bfh)
    feats = [dict(f, hash_seed=4) if f["name"] == "item" else f for f in FEATURES]
    reseeded = _spec(tmp_path, **{**spec.to_dict(), "features": feats})
    c = _batch(_prepare(reseeded, tmp_path, "prep-c"), "train")
    present = a.ids_bfh[:, 2, 0] > 0
    assert (c.ids_bfh[:, 2, 0] > 0).tolist() == present.tolist()
    assert (a.ids_bfh[present, 2, 0] != c.ids_bfh[present, 2, 0]).any()
    np.testing.assert_array_equal(np.delete(a.ids_bfh, 2, 1), np.delete(c.ids_bfh, 2, 1))


def test_encode_file_uses_the_prepared_vocabulary(tmp_path):
    p = _prepare(_every_kind_spec(tmp_path), tmp_path)
    new = _write(tmp_path / "new.csv", _csv(HEADER, VALID_ROWS + TEST_ROWS))
    batch, stats = p.encode_file(str(new))
    ref = _reference(TRAIN_ROWS, VALID_ROWS + TEST_ROWS)
    keep = np.delete(np.arange(8), 2)
    np.testing.assert_array_equal(batch.ids_bfh[:, keep], ref["ids"][:, keep])
    np.testing.assert_allclose(batch.dense_bn, ref["dense"], rtol=1e-6, atol=1e-6)
    assert stats["rows"] == 6
    assert stats["oov"]["city"] == ref["oov"]["city"] == 3


# ----------------------------------------------------------------------------- label, joins

RATINGS = [  # user_id, movie_id, rating, ts
    ("u1", "m1", "5", "10"),
    ("u2", "m1", "3.5", "11"),
    ("u1", "m2", "4", "12"),
    ("u3", "m3", "1", "13"),
    ("u2", "m2", "4.5", "14"),
    ("u3", "m1", "2", "15"),
]
USERS = [("u1", "F", "23"), ("u2", "M", "41"), ("u3", "F", ""), ("u4", "M", "30")]
MOVIES = [("m1", "Drama|Comedy", "1999"), ("m2", "Action", "2004"), ("m3", "", "1950")]


def _movielens(tmp_path: Path, ratings=RATINGS, users=USERS) -> TabularSpec:
    _write(tmp_path / "ratings.csv", _csv(["user_id", "movie_id", "rating", "ts"], ratings))
    _write(tmp_path / "users.csv", _csv(["uid", "gender", "age"], users))
    _write(tmp_path / "movies.csv", _csv(["movie_id", "genres", "year"], MOVIES))
    return _spec(
        tmp_path,
        train=["ratings.csv"],
        joins=[
            {"path": ["users.csv"], "key": "user_id", "right_key": "uid"},
            {"path": "movies.csv", "key": "movie_id", "columns": ["genres"]},
        ],
        split={"kind": "random", "valid_fraction": 0.0},
        label={"column": "rating", "threshold": 4},
        features=[
            {"name": "user_id", "kind": "categorical"},
            {"name": "gender", "kind": "categorical"},
            {"name": "genres", "kind": "multi_categorical", "max_hotness": 2},
            {"name": "age", "kind": "numeric", "fill": -5.0},
        ],
    )


def test_label_threshold_and_side_table_joins(tmp_path):
    p = _prepare(_movielens(tmp_path), tmp_path)
    b = _batch(p, "train")
    users = {u: (g, a) for u, g, a in USERS}
    genres = {m: g for m, g, _ in MOVIES}
    np.testing.assert_array_equal(b.labels_b, [float(r[2]) >= 4 for r in RATINGS])
    np.testing.assert_array_equal(b.labels_b, [1, 0, 1, 0, 1, 0])
    np.testing.assert_array_equal(b.weights_b, np.ones(6))
    gender_v = _vocab(users[r[0]][0] for r in RATINGS)  # u4 never rated: not in the vocab
    genre_v = _vocab(t for r in RATINGS for t in genres[r[1]].split("|") if t)
    assert list(genre_v) == ["Action", "Comedy", "Drama"]
    np.testing.assert_array_equal(b.ids_bfh[:, 0, 0], [1, 2, 1, 3, 2, 3])
    np.testing.assert_array_equal(b.ids_bfh[:, 1, 0], [gender_v[users[r[0]][0]] for r in RATINGS])
    want_genres = np.full((6, 2), PAD_ID)
    for i, r in enumerate(RATINGS):
        bag = [genre_v[t] for t in genres[r[1]].split("|") if t]
        want_genres[i, : len(bag)] = bag
    np.testing.assert_array_equal(b.ids_bfh[:, 2, :], want_genres)
    ages = [float(users[r[0]][1]) if users[r[0]][1] else -5.0 for r in RATINGS]
    np.testing.assert_array_equal(b.dense_bn[:, 0], ages)
    assert p.stats["missing"]["age"] == {"train": 2, "valid": 0, "test": 0}


def test_join_key_missing_from_side_table_is_an_error(tmp_path):
    ratings = [*RATINGS[:3], ("u9", "m1", "5", "16"), *RATINGS[3:]]
    spec = _movielens(tmp_path, ratings=ratings)
    with pytest.raises(
        TabularFormatError,
        match=r"ratings\.csv: line 5: column 'user_id': key not "
        r"in side table .*users\.csv: 'u9'",
    ):
        _prepare(spec, tmp_path)


def test_duplicate_side_table_keys_are_an_error(tmp_path):
    spec = _movielens(tmp_path, users=[*USERS, ("u2", "F", "50")])
    with pytest.raises(
        TabularFormatError, match=r"users\.csv: key column 'uid' repeats value 'u2'"
    ):
        _prepare(spec, tmp_path)


# ----------------------------------------------------------------------------- splits


def _rows_file(tmp_path: Path, name: str, n: int, *, flip: bool = False) -> None:
    rows = [((i + flip) % 2, i, f"v{(i * 7 + flip) % 13}", i * 10) for i in range(n)]
    _write(tmp_path / name, _csv(["label", "rid", "cat", "ts"], rows))


def _rid_spec(tmp_path: Path, files, split: dict, **extra) -> TabularSpec:
    return _spec(
        tmp_path,
        train=files,
        split=split,
        label={"column": "label"},
        features=[
            {"name": "rid", "kind": "categorical", "parse": "int"},
            {"name": "cat", "kind": "categorical"},
            {"name": "row", "column": "rid", "kind": "numeric", "dtype": "int"},
        ],
        **extra,
    )


def _rows_by_split(p: Prepared) -> dict[str, list[int]]:
    return {
        s: [] if (b := _batch(p, s)) is None else b.dense_bn[:, 0].astype(int).tolist()
        for s in SPLITS
    }


def test_random_split_fractions_determinism_and_train_only_vocabulary(tmp_path):
    n = 3000
    _rows_file(tmp_path / "a", "data.csv", n)
    _rows_file(tmp_path / "b", "data.csv", n, flip=True)  # other values, same row count
    split = {"kind": "random", "valid_fraction": 0.2, "test_fraction": 0.1, "seed": 7}
    p = _prepare(_rid_spec(tmp_path / "a", ["data.csv"], split), tmp_path, "prep-1")
    rows = _rows_by_split(p)
    assert sorted(rows["train"] + rows["valid"] + rows["test"]) == list(range(n))
    for s, frac in (("train", 0.7), ("valid", 0.2), ("test", 0.1)):
        assert rows[s] == sorted(rows[s])  # file order within a split
        assert abs(len(rows[s]) / n - frac) < 0.04, (s, len(rows[s]))
        assert p.stats["rows"][s] == len(rows[s])
    # The vocabulary holds training rows only: train ids are 1..n_train, others OOV.
    n_train = len(rows["train"])
    assert p.schema.features[0].vocab_size == n_train + 1
    np.testing.assert_array_equal(_batch(p, "train").ids_bfh[:, 0, 0], np.arange(1, n_train + 1))
    for s in ("valid", "test"):
        assert (_batch(p, s).ids_bfh[:, 0, 0] == 0).all()
        assert p.stats["oov"]["rid"][s] == len(rows[s])
    assert p.stats["oov"]["rid"]["train"] == 0
    # Another root: the same bytes. Other contents, same row count: the same rows per split.
    _assert_same_prepared(p, _prepare(p.spec, tmp_path, "prep-2"))
    other = _prepare(_rid_spec(tmp_path / "b", ["data.csv"], split), tmp_path, "prep-3")
    assert _rows_by_split(other) == rows
    reseeded = _rid_spec(tmp_path / "a", ["data.csv"], {**split, "seed": 8})
    assert _rows_by_split(_prepare(reseeded, tmp_path, "prep-4")) != rows


def test_time_split(tmp_path):
    _rows_file(tmp_path, "data.csv", 30)  # ts = 10 * row
    split = {"kind": "time", "column": "ts", "valid_from": 150, "test_from": 245}
    p = _prepare(_rid_spec(tmp_path, ["data.csv"], split), tmp_path)
    assert _rows_by_split(p) == {
        "train": list(range(15)),
        "valid": list(range(15, 25)),
        "test": list(range(25, 30)),
    }
    assert p.schema.features[0].vocab_size == 16  # rid: training rows only
    cat_train = {f"v{(i * 7) % 13}" for i in range(15)}
    assert p.vocab.values["cat"].to_pylist() == sorted(cat_train)
    no_test = _rid_spec(tmp_path, ["data.csv"], {"kind": "time", "column": "ts", "valid_from": 280})
    assert _rows_by_split(_prepare(no_test, tmp_path))["valid"] == [28, 29]


def test_files_split(tmp_path):
    for name, n in (("tr-1.csv", 5), ("tr-2.csv", 4), ("va.csv", 3), ("te.csv", 2)):
        _rows_file(tmp_path, name, n)
    spec = _rid_spec(tmp_path, ["tr-*.csv"], {"kind": "files"}, valid=["va.csv"], test=["te.csv"])
    p = _prepare(spec, tmp_path)
    assert _rows_by_split(p) == {
        "train": [0, 1, 2, 3, 4, 0, 1, 2, 3],
        "valid": [0, 1, 2],
        "test": [0, 1],
    }
    assert p.stats["rows"] == {"train": 9, "valid": 3, "test": 2}
    assert p.vocab.values["rid"].to_pylist() == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(_batch(p, "train").ids_bfh[:, 0, 0], [1, 2, 3, 4, 5, 1, 2, 3, 4])


# ----------------------------------------------------------------------------- input formats

IN_HEADER = ["label", "w", "city", "age", "tags", "price"]
IN_ROWS = [
    (1, 1.0, "paris", 5, "a|b", 3.5),
    (0, 0.5, "rome", 12, "b", None),
    (1, 2.0, None, 100, "a|b|c", 80.0),
    (0, 1.0, "oslo", None, None, -2.0),
    (0, 1.0, "rome", 7, "c|d", 0.0),
    (1, 1.0, "lima", 40, "d", 12.25),
    (0, 1.0, "paris", 75, "a", 7.0),
    (1, 3.0, "oslo", 12, "b|c", 1.5),
    (0, 1.0, "paris", 5, "a|b", 10.0),
    (1, 1.0, "rome", 100, "c", 49.9),
    (0, 1.0, "oslo", 7, "b|a", -1.0),
    (1, 0.25, "paris", 40, "d|c|b", 25.0),
    (1, 1.0, "kyiv", 9, "e", 4.0),
    (0, 2.0, "rome", 12, "a", 6.0),
]
IN_TYPES = {
    "label": pa.int64(),
    "w": pa.float64(),
    "city": pa.string(),
    "age": pa.int64(),
    "tags": pa.string(),
    "price": pa.float64(),
}


def _inputs_spec(tmp_path: Path, files, *, fmt=None, valid_fraction=0.3) -> TabularSpec:
    return _spec(
        tmp_path,
        train=files,
        **({"format": fmt} if fmt else {}),
        split={"kind": "random", "valid_fraction": valid_fraction, "seed": 1},
        label={"column": "label"},
        weight="w",
        features=[
            {"name": "city", "kind": "categorical"},
            {"name": "age", "kind": "categorical", "parse": "int"},
            {"name": "age_b", "column": "age", "kind": "numeric", "boundaries": [10, 50]},
            {"name": "tags", "kind": "multi_categorical", "max_hotness": 2},
            {"name": "price", "kind": "numeric", "log": True, "standardize": True},
        ],
    )


def _write_variant(tmp_path: Path, kind: str) -> tuple[list[str], dict | None]:
    text = _csv(IN_HEADER, IN_ROWS)
    tmp_path.mkdir()
    if kind == "tsv_no_header":
        _write(tmp_path / "data.tsv", _csv(None, IN_ROWS, sep="\t"))
        return ["data.tsv"], {"header": False, "column_names": IN_HEADER}
    if kind == "gzip":
        (tmp_path / "data.csv.gz").write_bytes(gzip.compress(text.encode()))
        return ["data.csv.gz"], None
    if kind == "parquet":
        _write(tmp_path / "tmp.csv", text)
        table = pacsv.read_csv(
            tmp_path / "tmp.csv",
            convert_options=pacsv.ConvertOptions(column_types=IN_TYPES, strings_can_be_null=True),
        )
        assert table.column("city").null_count == 1
        pq.write_table(table, tmp_path / "data.parquet", row_group_size=5)  # 3 row groups
        return ["data.parquet"], None
    assert kind == "glob"
    for i, lo, hi in ((0, 0, 5), (1, 5, 6), (2, 6, len(IN_ROWS))):
        _write(tmp_path / f"part-{i}.csv", _csv(IN_HEADER, IN_ROWS[lo:hi]))
    _write(tmp_path / "other.csv", "not,the,same\n1,2,3\n")  # not matched
    return ["part-*.csv"], None


@pytest.mark.parametrize("kind", ["tsv_no_header", "gzip", "parquet", "glob"])
def test_input_formats_give_the_csv_batches(tmp_path, kind):
    base_dir, var_dir = tmp_path / "csv", tmp_path / kind
    _write(base_dir / "data.csv", _csv(IN_HEADER, IN_ROWS))
    files, fmt = _write_variant(var_dir, kind)
    # A glob's files have their own indices, so the random split differs: compare all-train.
    vf = 0.0 if kind == "glob" else 0.3
    base = _prepare(_inputs_spec(base_dir, ["data.csv"], valid_fraction=vf), tmp_path, "prep-csv")
    if vf:
        assert base.stats["rows"]["train"] and base.stats["rows"]["valid"]
    got = _prepare(_inputs_spec(var_dir, files, fmt=fmt, valid_fraction=vf), tmp_path, "prep-var")
    _assert_same_prepared(base, got)
    assert sum(got.stats["rows"].values()) == len(IN_ROWS)


def test_csv_header_row_values_and_quoted_delimiters(tmp_path):
    text = (
        "label,city,tags,x\n"
        '1,"paris, france","a,b|c",1\n'
        '0,"say ""hi""",a,2\n'
        '1,rome,"c|a,b|d",3\n'
        '0,"paris, france",,4\n'
        '1,"",d,5\n'
    )
    _write(tmp_path / "q.csv", text)
    spec = _spec(
        tmp_path,
        train=["q.csv"],
        split={"kind": "random", "valid_fraction": 0.0},
        label={"column": "label"},
        features=[
            {"name": "city", "kind": "categorical"},
            {"name": "tags", "kind": "multi_categorical", "max_hotness": 3},
            {"name": "x", "kind": "numeric"},
        ],
    )
    p = _prepare(spec, tmp_path)
    assert p.vocab.values["city"].to_pylist() == ["paris, france", "rome", 'say "hi"']
    assert p.vocab.values["tags"].to_pylist() == ["a", "a,b", "c", "d"]
    b = _batch(p, "train")
    np.testing.assert_array_equal(b.ids_bfh[:, 0, 0], [1, 3, 2, 1, 0])
    np.testing.assert_array_equal(
        b.ids_bfh[:, 1, :],
        [[2, 3, -1], [1, -1, -1], [3, 2, 4], [-1, -1, -1], [4, -1, -1]],
    )
    np.testing.assert_array_equal(b.dense_bn[:, 0], [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(b.labels_b, [1, 0, 1, 0, 1])


# ----------------------------------------------------------------------------- bad input

BASE_HEADER = "label,u,x\n"
GOOD = "1,a,1\n0,b,2.5\n1,c,3\n"  # lines 2-4


def _bad_spec(tmp_path: Path, files, **extra) -> TabularSpec:
    fields = {
        "train": files,
        "split": {"kind": "random", "valid_fraction": 0.0},
        "label": {"column": "label"},
        "features": [{"name": "u", "kind": "categorical"}, {"name": "x", "kind": "numeric"}],
    }
    return _spec(tmp_path, **{**fields, **extra})


U_INT = [{"name": "u", "kind": "categorical", "parse": "int"}]
U_HEX = [{"name": "u", "kind": "categorical", "parse": "hex", "hash_buckets": 9}]
X_INT = [{"name": "u", "kind": "categorical"}, {"name": "x", "kind": "numeric", "dtype": "int"}]
BAD_CASES = {
    # name: (file name, text, spec extras, message)
    "not_a_number": (
        "bad.csv",
        BASE_HEADER + GOOD + "0,d,abc\n",
        {},
        r"bad\.csv: line 5: column 'x': not a number: 'abc'",
    ),
    "ragged_short": (
        "bad.csv",
        BASE_HEADER + "1,a,1\n0,b\n" + GOOD,
        {},
        r"bad\.csv: line 3: wrong column count \(expected 3, got 2\)",
    ),
    "ragged_long": (
        "bad.csv",
        BASE_HEADER + GOOD + GOOD + "0,b,2,9\n",
        {},
        r"bad\.csv: line 8: wrong column count \(expected 3, got 4\)",
    ),
    "label_outside": (
        "bad.csv",
        BASE_HEADER + "1,a,1\n2,b,2\n",
        {},
        r"bad\.csv: line 3: column 'label': label outside \{0, 1\}: '2'",
    ),
    "missing_label": (
        "bad.csv",
        BASE_HEADER + GOOD + ",b,2\n",
        {},
        r"bad\.csv: line 5: column 'label': missing label",
    ),
    "empty_file": ("bad.csv", "", {}, r"bad\.csv: empty file"),
    "header_only": ("bad.csv", BASE_HEADER, {}, r"bad\.csv: empty file \(no data rows\)"),
    "missing_column": (
        "bad.csv",
        BASE_HEADER + GOOD,
        {"features": [{"name": "u", "kind": "categorical"}, {"name": "nope", "kind": "numeric"}]},
        r"bad\.csv: column 'nope' named by the spec .* not in the file",
    ),
    "bad_int": (
        "bad.csv",
        BASE_HEADER + "1,7,1\n0,x7,2\n",
        {"features": U_INT},
        r"bad\.csv: line 3: column 'u': .*'x7'",
    ),
    "bad_hex": (
        "bad.csv",
        BASE_HEADER + "1,0a0b,1\n0,zz,2\n",
        {"features": U_HEX},
        r"bad\.csv: line 3: column 'u': bad hex: 'zz'",
    ),
    # pyarrow's int cast takes these when the whole chunk is clean; the rule does not
    "hex_int": (
        "bad.csv",
        BASE_HEADER + "1,7,1\n0,0x10,2\n",
        {"features": U_INT},
        r"bad\.csv: line 3: column 'u': .*'0x10'",
    ),
    "int_19_digits": (
        "bad.csv",
        BASE_HEADER + "1,a,1\n0,b,1234567890123456789\n",
        {"features": X_INT},
        r"bad\.csv: line 3: column 'x': not an integer: '1234567890123456789'",
    ),
    "not_an_integer": (
        "bad.csv",
        BASE_HEADER + "1,a,1\n0,b,-2\n1,c,3\n1,d,1.5\n",
        {"features": X_INT},
        r"bad\.csv: line 5: column 'x': not an integer: '1\.5'",
    ),
    "negative_weight": (
        "bad.csv",
        "label,u,x,w\n1,a,1,1\n0,b,2,-1\n",
        {"weight": "w"},
        r"bad\.csv: line 3: column 'w': weight is not a number >= 0: '-1'",
    ),
    "tsv_no_header_ragged": (
        "bad.tsv",
        "1\ta\t1\n0\tb\t2\n1\tc\n",
        {"format": {"header": False, "column_names": ["label", "u", "x"]}},
        r"bad\.tsv: line 3: wrong column count \(expected 3, got 2\)",
    ),
    "tsv_no_header_value": (
        "bad.tsv",
        "1\ta\t1\n0\tb\tnan?\n",
        {"format": {"header": False, "column_names": ["label", "u", "x"]}},
        r"bad\.tsv: line 2: column 'x': not a number",
    ),
    "gzip_value": (
        "bad.csv.gz",
        BASE_HEADER + GOOD + GOOD + "1,a,inf\n",
        {},
        r"bad\.csv\.gz: line 8: column 'x': not a number: 'inf'",
    ),
    "missing_time": (
        "bad.csv",
        "label,u,x,t\n1,a,1,5\n0,b,2,\n",
        {"split": {"kind": "time", "column": "t", "valid_from": 3}},
        r"bad\.csv: line 3: column 't': missing time",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_strict_names_file_line_and_column(tmp_path, case):
    name, text, extra, message = BAD_CASES[case]
    path = tmp_path / name
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        _write(path, text)
    spec = _bad_spec(tmp_path, [name], **extra)
    with pytest.raises(TabularFormatError, match=message):
        _prepare(spec, tmp_path)


def test_a_hex_column_of_empty_strings_is_missing(tmp_path):
    """A quoted "" is an empty string, not a null: in a hex column (alone in its chunk) it is
    a missing value, and an empty bag of a hex multi-categorical."""
    _write(tmp_path / "e.csv", 'label,u,x,m\n1,"",1,""\n0,"",2,|\n')
    spec = _bad_spec(
        tmp_path,
        ["e.csv"],
        features=[
            *U_HEX,
            {
                "name": "m",
                "kind": "multi_categorical",
                "parse": "hex",
                "hash_buckets": 5,
                "max_hotness": 2,
            },
        ],
    )
    b = _batch(_prepare(spec, tmp_path), "train")
    np.testing.assert_array_equal(b.ids_bfh[:, 0, 0], [0, 0])
    np.testing.assert_array_equal(b.ids_bfh[:, 1], [[PAD_ID, PAD_ID], [PAD_ID, PAD_ID]])


def test_bad_parquet_row_names_row_group_and_row(tmp_path):
    table = pa.table({"label": [1, 0, 1, 0, 3, 1], "u": list("abcdef"), "x": [1.0] * 6})
    pq.write_table(table, tmp_path / "bad.parquet", row_group_size=3)
    with pytest.raises(
        TabularFormatError, match=r"bad\.parquet: row group 1, row 1: column 'label': label outside"
    ):
        _prepare(_bad_spec(tmp_path, ["bad.parquet"]), tmp_path)


def test_bad_rows_in_a_valid_file_are_found_by_the_encoding_pass(tmp_path):
    _write(tmp_path / "tr.csv", BASE_HEADER + GOOD)
    _write(tmp_path / "va.csv", BASE_HEADER + GOOD + "1,q,x\n")
    spec = _spec(
        tmp_path,
        train=["tr.csv"],
        valid=["va.csv"],
        split={"kind": "files"},
        label={"column": "label"},
        features=[{"name": "u", "kind": "categorical"}, {"name": "x", "kind": "numeric"}],
    )
    with pytest.raises(TabularFormatError, match=r"va\.csv: line 5: column 'x': not a number"):
        _prepare(spec, tmp_path)


# ----------------------------------------------------------------------------- lenient

LENIENT_LINES = [  # lines 2.., (text, reject reason or None, column)
    ("1,a,1.5,k1", None, ""),
    ("0,b,abc,k1", "not a number", "x"),
    ("1,c", "wrong column count", ""),
    ("2,a,2,k2", "label outside {0, 1}", "label"),
    ("0,b,3,k9", "key not in side table", "k"),
    ("1,c,4,k2", None, ""),
    ("0,a,,k1", None, ""),
    ("1,b,5,k1,extra", "wrong column count", ""),
    ("0,,6,k2", None, ""),
    ("1,c,7.5,k1", None, ""),
]


def _lenient_spec(tmp_path: Path, data: str, strict: bool) -> TabularSpec:
    _write(tmp_path / "side.csv", "k,color\nk1,red\nk2,blue\n")
    return _spec(
        tmp_path,
        train=[data],
        joins=[{"path": ["side.csv"], "key": "k"}],
        split={"kind": "random", "valid_fraction": 0.0},
        label={"column": "label"},
        strict=strict,
        features=[
            {"name": "u", "kind": "categorical"},
            {"name": "color", "kind": "categorical"},
            {"name": "x", "kind": "numeric", "standardize": True},
        ],
    )


def test_lenient_mode_rejects_bad_rows_and_keeps_the_rest(tmp_path):
    header = "label,u,x,k\n"
    _write(tmp_path / "data.csv", header + "".join(t + "\n" for t, _, _ in LENIENT_LINES))
    p = _prepare(_lenient_spec(tmp_path, "data.csv", strict=False), tmp_path)
    side = str(tmp_path / "side.csv")
    reasons = Counter(
        r if r != "key not in side table" else f"{r} {side}" for _, r, _ in LENIENT_LINES if r
    )
    assert p.stats["rejected"] == dict(reasons)
    kept = sum(r is None for _, r, _ in LENIENT_LINES)
    assert p.stats["rows"]["train"] == kept == 5
    assert kept + sum(p.stats["rejected"].values()) == len(LENIENT_LINES)

    rejects = sorted((Path(p.folder) / "rejects").glob("*.tsv"))
    assert [f.parent for f in rejects] == [Path(p.stats["rejects_dir"])]
    text = "".join(f.read_text() for f in rejects)
    assert text.startswith(REJECTS_HEADER) and REJECTS_HEADER == "file\tline\treason\tcolumn\trow\n"
    records = [line.split("\t", 4) for line in text.splitlines()[1:]]
    file = str(tmp_path / "data.csv")
    want = {
        (file, f"line {i + 2}", r if r != "key not in side table" else f"{r} {side}", c)
        for i, (_, r, c) in enumerate(LENIENT_LINES)
        if r
    }
    assert {tuple(r[:4]) for r in records} == want
    rows = {r[1]: r[4] for r in records}
    assert rows["line 4"] == "1,c"  # a malformed row: its line
    assert rows["line 3"] == "0\tb\tabc\tk1"  # a bad value: the row's values

    # The kept rows encode as the same rows without the bad ones, in strict mode.
    good = header + "".join(t + "\n" for t, r, _ in LENIENT_LINES if r is None)
    _write(tmp_path / "clean" / "data.csv", good)
    clean = _prepare(_lenient_spec(tmp_path / "clean", "data.csv", strict=True), tmp_path)
    assert clean.stats["rejected"] == {}
    _assert_same_prepared(p, clean)
    b = _batch(p, "train")
    np.testing.assert_array_equal(
        b.ids_bfh[:, 0, 0], [1, 2, 1, 0, 2]
    )  # u: a, c, a, -, c ("b" rejected)
    np.testing.assert_array_equal(b.ids_bfh[:, 1, 0], [2, 1, 2, 1, 2])  # blue, red
    x = np.array([1.5, 4.0, 6.0, 7.5])  # bad rows' values are not in the moments
    want_x = (
        [(v - x.mean()) / x.std() for v in (1.5, 4.0)]
        + [0.0]
        + [(v - x.mean()) / x.std() for v in (6.0, 7.5)]
    )
    np.testing.assert_allclose(b.dense_bn[:, 0], want_x, rtol=1e-6)


# ----------------------------------------------------------------------------- spec loading

SPEC_YAML = """\
name: movies
train: [ratings.csv]
format: {delimiter: ",", header: true}
joins:
  - {path: [users.csv], key: user_id, right_key: uid}
split: {kind: random, valid_fraction: 0.25, seed: 3}
label: {column: rating, threshold: 4}
features:
  - {name: user_id, kind: categorical, min_count: 2}
  - {name: genres, kind: multi_categorical, separator: "|", max_hotness: 6}
  - {name: age, kind: numeric, clip: [0, 90], standardize: true}
  - {name: age_b, column: age, kind: numeric, boundaries: [18, 25, 35]}
"""
SPEC_TOML = """\
name = "movies"
train = ["ratings.csv"]
format = {delimiter = ",", header = true}
joins = [{path = ["users.csv"], key = "user_id", right_key = "uid"}]
split = {kind = "random", valid_fraction = 0.25, seed = 3}
label = {column = "rating", threshold = 4}

[[features]]
name = "user_id"
kind = "categorical"
min_count = 2

[[features]]
name = "genres"
kind = "multi_categorical"
separator = "|"
max_hotness = 6

[[features]]
name = "age"
kind = "numeric"
clip = [0, 90]
standardize = true

[[features]]
name = "age_b"
column = "age"
kind = "numeric"
boundaries = [18, 25, 35]
"""


def test_yaml_json_and_toml_specs_are_equal(tmp_path):
    import yaml

    data = yaml.safe_load(SPEC_YAML)
    paths = {
        "yaml": _write(tmp_path / "spec.yaml", SPEC_YAML),
        "json": _write(tmp_path / "spec.json", json.dumps(data)),
        "toml": _write(tmp_path / "spec.toml", SPEC_TOML),
    }
    specs = {k: load_spec(v) for k, v in paths.items()}
    assert specs["yaml"] == specs["json"] == specs["toml"]
    s = specs["yaml"]
    assert s.base_dir == str(tmp_path)
    assert s.label.threshold == 4.0 and s.features[2].clip == (0.0, 90.0)
    assert s.joins[0].right_key == "uid" and s.split.valid_fraction == 0.25
    assert s.resolve("ratings.csv") == str(tmp_path / "ratings.csv")
    assert [f.name for f in s.dense_features] == ["age"]
    assert s.tables == ("user_id", "genres", "age_b")


def test_prepare_from_a_spec_file_resolves_paths_against_its_folder(tmp_path, monkeypatch):
    _write(tmp_path / "cfg" / "data" / "d.csv", BASE_HEADER + GOOD)
    spec_text = (
        "train: [data/d.csv]\nsplit: {kind: random, valid_fraction: 0.0}\n"
        "label: {column: label}\nfeatures:\n  - {name: u, kind: categorical}\n"
    )
    path = _write(tmp_path / "cfg" / "spec.yaml", spec_text)
    monkeypatch.chdir(tmp_path)
    p = prepare(str(path), str(tmp_path / "prep"), workers=1, progress=False)
    np.testing.assert_array_equal(_batch(p, "train").ids_bfh[:, 0, 0], [1, 2, 3])


SPEC_ERRORS = {
    # name: (YAML, message)
    "typo_in_feature": (
        "features:\n  - {name: a, kind: categorical}\n  - {name: b, kind: multi_categorical, "
        "seperator: ';'}\n",
        r"features\[1\]: unknown field 'seperator'",
    ),
    "typo_in_format": ("format: {delimter: ','}\n", r"format: unknown field 'delimter'"),
    "typo_top_level": ("lable: {column: y}\n", r"unknown field 'lable'"),
    "int_as_string": (
        "features:\n  - {name: a, kind: multi_categorical, max_hotness: '3'}\n",
        r"features\[0\]\.max_hotness: expected an integer, got '3'",
    ),
    "bool_as_string": ("strict: 'no'\n", r"strict: expected true or false"),
    "unknown_kind": (
        "features:\n  - {name: a, kind: categorial}\n",
        r"features\[0\]\.kind: 'categorial' is not one of",
    ),
    "clip_not_a_pair": (
        "features:\n  - {name: a, kind: numeric, clip: [1, 2, 3]}\n",
        r"features\[0\]\.clip: expected 2 values, got 3",
    ),
    "number_as_string": (
        "split: {valid_fraction: 'a lot'}\n",
        r"split\.valid_fraction: expected a number, got 'a lot'",
    ),
    "not_a_mapping": ("- 1\n- 2\n", r"expected a mapping at the top level"),
    "invariant": (
        "features:\n  - {name: a, kind: categorical, max_hotness: 2}\n",
        r"features\[0\]: feature 'a': max_hotness applies to multi_categorical",
    ),
    "shared_table_mismatch": (
        "features:\n  - {name: a, kind: categorical, table: t}\n"
        "  - {name: b, kind: categorical, table: t, hash_buckets: 10}\n",
        r"features 'a' and 'b' share table 't'",
    ),
}


@pytest.mark.parametrize("case", list(SPEC_ERRORS))
def test_spec_errors_name_the_file_and_field(tmp_path, case):
    text, message = SPEC_ERRORS[case]
    base = "train: [d.csv]\nlabel: {column: y}\n"
    if not text.startswith("features") and not text.startswith("-"):
        base += "features:\n  - {name: a, kind: categorical}\n"
    body = text if text.startswith("-") else base + text
    if case == "typo_top_level":
        body = body.replace("label: {column: y}\n", "")
    path = _write(tmp_path / "spec.yaml", body)
    # "<file>: <field path>: <what is wrong>", the field path without the file glued on.
    with pytest.raises(SpecError, match="^" + re.escape(f"{path}: ") + message):
        load_spec(path)


def test_spec_missing_field_and_bad_syntax(tmp_path):
    path = _write(tmp_path / "spec.yaml", "train: [d.csv]\nfeatures: [{name: a, kind: numeric}]\n")
    with pytest.raises(SpecError, match="^" + re.escape(f"{path}: missing field 'label'")):
        load_spec(path)
    with pytest.raises(SpecError, match=r"^where: joins\[0\]: missing field 'key'"):
        spec_from_dict(
            {
                "train": "d.csv",
                "label": {"column": "y"},
                "joins": [{"path": "s.csv"}],
                "features": [{"name": "a", "kind": "numeric"}],
            },
            where="where",
        )
    with pytest.raises(SpecError, match=r"spec\.json: not valid json"):
        load_spec(_write(tmp_path / "spec.json", "{train: }"))
    with pytest.raises(SpecError, match=r"end in \.yaml"):
        load_spec(_write(tmp_path / "spec.txt", "{}"))


# ----------------------------------------------------------------------------- fingerprint


def test_fingerprint_reuses_or_renews_the_prepared_folder(tmp_path, monkeypatch):
    data = _write(tmp_path / "data.csv", BASE_HEADER + GOOD)
    spec = _bad_spec(tmp_path, ["data.csv"])
    root = tmp_path / "prep"
    first = _prepare(spec, tmp_path)
    manifest = Path(first.folder) / "manifest.json"
    assert manifest.is_file() and Path(first.folder).parent == root
    stamp = manifest.stat().st_mtime_ns

    def no_work(*args, **kwargs):
        raise AssertionError("prepared again")

    with monkeypatch.context() as m:
        m.setattr(prepare_module, "_run", no_work)
        again = _prepare(spec, tmp_path)
    assert again.folder == first.folder and manifest.stat().st_mtime_ns == stamp
    _assert_same_prepared(first, again)

    changed = _bad_spec(tmp_path, ["data.csv"], rows_per_shard=2)
    folders = {first.folder, _prepare(changed, tmp_path).folder}
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, same bytes
    folders.add(_prepare(spec, tmp_path).folder)
    st = data.stat()
    data.write_text(BASE_HEADER + GOOD + "0,d,4\n")  # modified, same time stamps
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    modified = _prepare(spec, tmp_path)
    folders.add(modified.folder)
    assert len(folders) == 4
    assert sorted(str(d) for d in root.iterdir()) == sorted(folders)
    assert all(Path(f).name.startswith("tabular-") for f in folders)
    assert modified.stats["rows"]["train"] == 4


def test_small_parts_give_the_same_batches(tmp_path):
    _rows_file(tmp_path, "data.csv", 50)
    split = {"kind": "random", "valid_fraction": 0.3}
    whole = _prepare(_rid_spec(tmp_path, ["data.csv"], split), tmp_path, "prep-1")
    parts = _prepare(_rid_spec(tmp_path, ["data.csv"], split, rows_per_shard=7), tmp_path, "prep-2")
    assert len(list((Path(parts.folder) / "parts").glob("*.json"))) == 8  # ceil(50 / 7)
    assert len(whole.shards["train"]) == 1 and len(parts.shards["train"]) > 1
    for t in ("rid", "cat"):
        assert whole.vocab.values[t].to_pylist() == parts.vocab.values[t].to_pylist()
    _assert_same_prepared(whole, parts)


# ----------------------------------------------------------------------------- workers


def test_two_workers_write_the_same_records_as_one(tmp_path):
    _rows_file(tmp_path, "a.csv", 300)
    _rows_file(tmp_path, "b.csv", 200, flip=True)
    spec = _rid_spec(tmp_path, ["a.csv", "b.csv"], {"kind": "random", "valid_fraction": 0.25})
    z = {"name": "z", "column": "ts", "kind": "numeric", "log": True, "standardize": True}
    spec = _spec(tmp_path, **{**spec.to_dict(), "features": [*spec.to_dict()["features"], z]})
    one = _prepare(spec, tmp_path, "prep-1", workers=1)
    two = _prepare(spec, tmp_path, "prep-2", workers=2)
    assert Path(one.folder).name == Path(two.folder).name
    assert one.schema == two.schema
    for s in ("train", "valid"):
        ra, rb = one.records(s), two.records(s)
        assert [ra[i] for i in range(len(ra))] == [rb[i] for i in range(len(rb))]
        assert len(ra) == one.stats["rows"][s] > 0
    for key in ("rows", "rejected", "oov", "missing", "truncated_tokens"):
        assert one.stats[key] == two.stats[key]
    assert one.stats["rows"]["train"] + one.stats["rows"]["valid"] == 500
    assert one.vocab.scales == two.vocab.scales
    # A bad row in a worker is the parent's TabularFormatError, naming file, line and column.
    _write(tmp_path / "c.csv", "label,rid,cat,ts\n1,1,a,5\n0,2,b,6\n1,abc,c,7\n")
    bad = _rid_spec(tmp_path, ["a.csv", "c.csv"], {"kind": "random", "valid_fraction": 0.25})
    with pytest.raises(TabularFormatError, match=r"c\.csv: line 4: column 'rid': .*'abc'"):
        _prepare(bad, tmp_path, "prep-3", workers=2)
