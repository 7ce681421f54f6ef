"""A serving artifact's raw-row encoder (``recscale/serving/runtime.py``, numpy only) gives the ids
and dense values ``data.tabular`` gave the same rows: every feature kind, parse mode, hash,
transform, side table and edge value of a spec, read from its files or sent as JSON values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data.tabular import TabularFormatError, prepare
from data.tabular.spec import spec_from_dict
from recscale.serving.runtime import ArtifactError, RowEncoder, read_rows

HEADER = ["label", "uid", "city", "age", "item", "tags", "htags", "price", "n", "src", "dst", "hx"]
# Planted: whitespace around values, "NA" (a null value), a value seen once (min_count 2), ints
# with "+" and leading zeros, an empty token and a blank one, negative hashed ints, hex with a
# 0x prefix and upper case, exponents, prices beyond the clip, a shared table.
TRAIN = [
    ("1", "u1", "paris", "5", "apple", "a|b", "1;2", "3.5", "4", "x", "y", "0a1b2c3d"),
    ("0", "u2", " rome", "12", "pear", "b", "-3", "-3.5", "7", "y", "x", "deadbeef"),
    ("1", "u3", "paris", "+100", "", "a|b|c", "", "80", "NA", "z", "w", "0x0A1B2C3D"),
    ("0", "u1", "oslo", "", "apple", "", "5;;6", "NA", "2", "x", "z", ""),
    ("0", "u2", "rome ", "007", "fig", "c|d|a|b", "9", "0", "11", "y", "y", "12345678"),
    ("1", "u4", "lima", "40", "pear", " d ", "1;2;3;4", "12.25", "-5", "x", "w", "ffffffff"),
    ("0", "u3", "", "75", "apple", "a", " 2 ", "7", "0", "z", "x", "00000000"),
    ("1", "u4", "oslo", " 12", "kiwi", "b|c", "", "", "3", "w", "x", "DEADBEEF"),
    ("0", "u1", "paris", "5", "fig", "a||b", "-1", "1e1", "8", "x", "y", "deadbeef"),
    ("1", "u2", "rome", "100", "", "c| |a", "4", " 49.9 ", "1", "y", "z", "0a1b2c3d"),
]
VALID = [  # unseen values: tokyo, age 300, tokens e/f, src q, item mango, user u9's side row
    ("1", "u3", "tokyo", "5", "apple", "a|e", "8;1", "3", "6", "x", "y", "0a1b2c3d"),
    ("0", "u9", "lima", "300", "mango", "b", "", "", "NA", "q", "w", "DeadBeef"),
    ("1", "u1", "paris", "", "", "", "1;1;1;1", "60", "4", "", "x", ""),
    ("0", "u2", "rome", "-12", "fig", "e|f|a", "-3", "-2", "2", "y", "y", "ffffffff"),
]
USERS = "uid,gender,score,unused\nu1,f,0.5,z\nu2,m,,z\nu3,NA,2.5,z\nu4,f,1,z\nu9,x,7,z\n"
FEATURES = [
    {"name": "city", "kind": "categorical", "min_count": 2},
    {"name": "age", "kind": "categorical", "parse": "int"},
    {"name": "item", "kind": "categorical", "hash_buckets": 11, "hash_seed": 3},
    {"name": "tags", "kind": "multi_categorical", "separator": "|", "max_hotness": 2},
    {
        "name": "htags",
        "kind": "multi_categorical",
        "separator": ";",
        "max_hotness": 3,
        "parse": "int",
        "hash_buckets": 50,
        "hash_seed": 1,
    },
    {
        "name": "price",
        "kind": "numeric",
        "clip": [0, 50],
        "log": True,
        "standardize": True,
        "fill": -1.0,
    },
    {"name": "age_b", "column": "age", "kind": "numeric", "boundaries": [10, 50]},
    {"name": "n", "kind": "numeric", "dtype": "int", "standardize": True},
    {"name": "src", "kind": "categorical", "table": "place"},
    {"name": "dst", "kind": "categorical", "table": "place"},
    {"name": "hx", "kind": "categorical", "parse": "hex", "hash_buckets": 1000, "hash_seed": 5},
    {"name": "gender", "kind": "categorical"},
    {"name": "score", "kind": "numeric", "log": True},
    {"name": "hx_vocab", "column": "hx", "kind": "categorical", "parse": "hex"},
]


def _write(path: Path, rows) -> Path:
    path.write_text("\n".join(",".join(r) for r in [HEADER, *rows]) + "\n")
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_tabular")
    _write(d / "train.csv", TRAIN)
    _write(d / "valid.csv", VALID)
    (d / "users.csv").write_text(USERS)
    spec = spec_from_dict(
        {
            "name": "kinds",
            "train": ["train.csv"],
            "valid": ["valid.csv"],
            "split": {"kind": "files"},
            "label": {"column": "label"},
            "format": {"null_values": ["", "NA"]},
            "joins": [{"path": ["users.csv"], "key": "uid", "columns": ["gender", "score"]}],
            "features": FEATURES,
        },
        where="test",
        base_dir=str(d),
    )
    p = prepare(spec, str(d / "prep"), workers=1, progress=False)
    desc, arrays = p.serving_encoding()
    return d, p, desc, RowEncoder(desc, arrays, p.schema.max_hotness)


@pytest.mark.parametrize("name", ["train.csv", "valid.csv"])
def test_raw_rows_encode_as_prepare_encoded_them(prepared, name):
    d, p, desc, rows_enc = prepared
    want, stats = p.encode_file(str(d / name))
    rows = list(read_rows(d / name, desc["format"]))
    dense, ids, counts = rows_enc.encode(rows)
    np.testing.assert_array_equal(dense, want.dense_bn)  # bitwise: the same float64 steps
    np.testing.assert_array_equal(ids, want.ids_bfh)
    again = rows_enc.encode(rows[::-1])  # every string now from the encoder's cache
    np.testing.assert_array_equal(again[0], dense[::-1])
    np.testing.assert_array_equal(again[1], ids[::-1])
    assert again[2] == counts
    assert counts["truncated_tokens"] == sum(stats["truncated_tokens"].values())
    if name == "valid.csv":
        # unseen values, counted per value (prepare counts rows with one): city tokyo and lima
        # (rare), age 300 and -12, tokens e, e, f, src q, gender x (user u9's side row)
        assert counts["unseen_values"] == 9
        assert stats["oov"] == {"city": 2, "age": 2, "tags": 2, "src": 1, "gender": 1}
    # every kind is exercised: a hashed bag, a bucket, a side-table column
    f = [x["name"] for x in desc["sparse"]]
    assert (ids[:, f.index("htags")] > 0).any() and (ids[:, f.index("age_b")] == 3).any()
    assert (ids[:, f.index("gender"), 0] > 0).any()


def test_json_values_encode_as_their_text(prepared):
    """A client sends numbers as numbers, bags as lists, missing values as null or not at all."""
    d, p, desc, rows_enc = prepared
    text = list(read_rows(d / "valid.csv", desc["format"]))
    typed = []
    for row in text:
        t = {k: (None if v in ("", "NA") else v) for k, v in row.items()}
        t["age"] = None if t["age"] is None else int(t["age"])
        t["price"] = None if t["price"] is None else float(t["price"])
        t["n"] = None if t["n"] is None else int(t["n"])
        t["tags"] = [] if t["tags"] is None else t["tags"].split("|")
        t["htags"] = [] if t["htags"] is None else [int(x) for x in t["htags"].split(";")]
        typed.append({k: v for k, v in t.items() if v is not None})  # left out: missing
    a, b = rows_enc.encode(text), rows_enc.encode(typed)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize(
    "column, value, match",
    [
        ("price", "abc", "column 'price': not a number: 'abc'"),
        ("n", "1.5", "column 'n': not an integer"),
        ("age", "12x", "column 'age': not an integer"),
        ("hx", "xyz", "column 'hx': bad hex"),
        ("htags", "1;b", "column 'htags': token not an integer"),
        ("uid", "u77", "column 'uid': key not in side table .*users.csv: 'u77'"),
    ],
)
def test_a_bad_value_is_an_error_in_both(prepared, tmp_path, column, value, match):
    d, p, desc, rows_enc = prepared
    row = list(VALID[0])
    row[HEADER.index(column)] = value
    bad = _write(tmp_path / "bad.csv", [VALID[1], tuple(row)])
    with pytest.raises(TabularFormatError):
        p.encode_file(str(bad), strict=True)
    with pytest.raises(ArtifactError, match=f"example 1: {match}"):
        rows_enc.encode(list(read_rows(bad, desc["format"])))


def test_request_errors_name_the_column(prepared):
    _, _, _, rows_enc = prepared
    with pytest.raises(ArtifactError, match="example 0: unknown column 'cty'"):
        rows_enc.encode([{"cty": "paris", "uid": "u1"}])
    with pytest.raises(ArtifactError, match="column 'gender' comes from side table"):
        rows_enc.encode([{"gender": "f", "uid": "u1"}])
    with pytest.raises(ArtifactError, match="column 'uid': missing key"):
        rows_enc.encode([{"city": "paris"}])
    with pytest.raises(ArtifactError, match="column 'price': expected a number, got list"):
        rows_enc.encode([{"uid": "u1", "price": [1]}])
    # the label is part of a training row: accepted and not read; a column left out is a
    # missing value (the OOV id, an empty bag, the fill)
    dense, ids, counts = rows_enc.encode([{"uid": "u1", "label": "1"}])
    assert counts["missing_features"] == 12  # all but the side table's two
    np.testing.assert_array_equal(ids[0, :, 0], [0, 0, 0, -1, -1, 0, 0, 0, 0, 2, 0])  # f: id 2
    assert dense[0, 0] == -1.0  # price's fill


def test_read_rows_names_a_short_line(tmp_path):
    f = tmp_path / "x.csv"
    f.write_text("a,b\n1,2\n3\n")
    fmt = {"delimiter": "", "header": True, "column_names": [], "quote_char": '"'}
    with pytest.raises(ArtifactError, match=r"x.csv: line 3: 1 fields, expected 2"):
        list(read_rows(f, fmt))


def test_criteo_raw_rows_encode_as_the_criteo_reader(criteo_files):
    """A model trained with the Criteo reader (``data.kind=criteo``) exports the reader's
    hashing: raw TSV lines of the generated and the real sample give the reader's batches."""
    from data.builders import make_source
    from data.config import CRITEO_KAGGLE_VOCAB_SIZES, CriteoConfig, DataConfig

    path = str(criteo_files.path)
    cfg = DataConfig(
        kind="criteo",
        train_path=path,
        eval_path=path,
        batch_size=256,
        eval_batch_size=4096,
        criteo=CriteoConfig(vocab_sizes=CRITEO_KAGGLE_VOCAB_SIZES, hash_seed=7),
    )
    source = make_source(cfg)
    (want,) = list(source.eval_batches())
    n = int(want.weights_b.sum())  # the padding of the batch weighs 0
    desc, arrays = source.serving_encoding()
    rows = list(read_rows(path, desc["format"]))
    assert len(rows) == n == 1999
    dense, ids, counts = RowEncoder(desc, arrays, 1).encode(rows)
    np.testing.assert_array_equal(dense, want.dense_bn[:n])
    np.testing.assert_array_equal(ids, want.ids_bfh[:n])
    assert counts["unseen_values"] == 0 and counts["missing_features"] > 0


def test_frappe_raw_rows_encode_as_the_frappe_reader(frappe_files):
    """A Frappe model exports the reader's training vocabulary: raw validation rows (generated
    and real) give the reader's ids, unseen values counted as the reader counts them."""
    import dataclasses

    from data.builders import make_source
    from data.presets import frappe as frappe_preset

    cfg = dataclasses.replace(frappe_preset(str(frappe_files.path)), eval_batch_size=8192)
    source = make_source(cfg)
    batches = list(source.eval_batches())
    ids_want = np.concatenate([b.ids_bfh for b in batches])
    n = int(sum(b.weights_b.sum() for b in batches))  # the last batch's padding weighs 0
    desc, arrays = source.serving_encoding()
    rows = list(read_rows(frappe_files.path / "valid.csv", desc["format"]))
    assert len(rows) == n
    dense, ids, counts = RowEncoder(desc, arrays, 1).encode(rows)
    assert dense.shape == (n, 0)
    np.testing.assert_array_equal(ids, ids_want[:n])
    assert counts["unseen_values"] == sum(source.stats["eval"]["oov"].values())


def test_read_rows_takes_a_bom_and_names_bad_bytes(prepared, tmp_path):
    d, p, desc, rows_enc = prepared
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + (d / "valid.csv").read_bytes())
    want, _ = p.encode_file(str(bom))
    dense, ids, _ = rows_enc.encode(list(read_rows(bom, desc["format"])))
    np.testing.assert_array_equal(ids, want.ids_bfh)
    bad = tmp_path / "bad.csv"
    bad.write_bytes((d / "valid.csv").read_bytes() + b"1,u1,caf\xe9,5,,,,,,,,\n")
    with pytest.raises(ArtifactError, match=r"bad.csv: line 6: not UTF-8 text \(b'\\xe9'\)"):
        list(read_rows(bad, desc["format"]))
    with pytest.raises(ArtifactError, match="column 'city': not a valid Unicode string"):
        rows_enc.encode([{"uid": "u1", "city": "\ud800"}])
    with pytest.raises(ArtifactError, match="column 'age': out of the int64 range"):
        rows_enc.encode([{"uid": "u1", "age": 2**63}])


def test_a_typed_side_table_encodes_as_prepare_read_it(tmp_path):
    """A Parquet side table's float32 column feeds a numeric feature (float32(0.1) widened, not
    the text "0.1" parsed) and a categorical one (its text), and the rows carry unread columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    pq.write_table(
        pa.table(
            {
                "item": [f"i{k}" for k in range(20)],
                "price": pa.array(
                    [None, *rng.uniform(0, 3, 19).round(1)], pa.float32()
                ),  # a null: missing in both
                "stock": pa.array(rng.integers(0, 4, 20), pa.int64()),
            }
        ),
        tmp_path / "items.parquet",
    )
    lines = ["label,item,when"] + [f"{k % 2},i{k % 20},{k}" for k in range(60)]
    (tmp_path / "x.csv").write_text("\n".join(lines) + "\n")
    spec = spec_from_dict(
        {
            "name": "typed",
            "train": ["x.csv"],
            "split": {"kind": "random", "valid_fraction": 0.3},
            "label": {"column": "label"},
            "joins": [{"path": ["items.parquet"], "key": "item"}],
            "features": [
                {"name": "item", "kind": "categorical"},
                {"name": "price", "kind": "numeric", "standardize": True},
                {"name": "price_cat", "column": "price", "kind": "categorical"},
                {"name": "stock", "kind": "numeric", "log": True},
            ],
        },
        where="test",
        base_dir=str(tmp_path),
    )
    p = prepare(spec, str(tmp_path / "prep"), workers=1, progress=False)
    desc, arrays = p.serving_encoding()
    assert "when" in desc["ignored_columns"]  # a column of the file no feature reads
    want, _ = p.encode_file(str(tmp_path / "x.csv"))
    rows = list(read_rows(tmp_path / "x.csv", desc["format"]))
    dense, ids, _ = RowEncoder(desc, arrays, 1).encode(rows)
    np.testing.assert_array_equal(dense, want.dense_bn)
    np.testing.assert_array_equal(ids, want.ids_bfh)
    assert (ids[:, 1, 0] > 0).any()  # price's text found in its vocabulary
    assert ids[0, 1, 0] == 0 and dense[0, 0] == 0.0  # row 0 is item i0: its null price is missing
