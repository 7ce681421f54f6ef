"""Frappe reader (real BARS files when present, tiny hand-written files) and the tfds builder
(on generated files, and on real ones when present)."""

from pathlib import Path

import numpy as np
import pytest

from data.frappe import (
    FRAPPE_FIELDS,
    FRAPPE_HEADER,
    FrappeFormatError,
    FrappeVocab,
    build_frappe_vocab,
    frappe_schema,
    read_frappe,
)

# Distinct training values per field of the BARS Frappe_x1 train.csv (+1 for the OOV row).
FRAPPE_VOCAB_SIZES = (955, 4083, 8, 8, 3, 4, 3, 10, 81, 234)


def _write(path: Path, rows: list[str], header: str = FRAPPE_HEADER, newline: str = "\n") -> Path:
    path.write_text(newline.join([header, *rows]) + newline)
    return path


ROW = "1,26,3569,5042,5047,5053,5057,5058,5060,5080,5149"


# ---------------------------------------------------------------------------------- real data


@pytest.fixture(scope="module")
def frappe_real(frappe_dir):
    vocab = build_frappe_vocab(frappe_dir / "train.csv")
    train, train_stats = read_frappe(frappe_dir / "train.csv", vocab)
    valid, valid_stats = read_frappe(frappe_dir / "valid.csv", vocab)
    return vocab, train, train_stats, valid, valid_stats


def test_real_counts_and_schema(frappe_real):
    vocab, train, train_stats, valid, valid_stats = frappe_real
    assert train.batch_size == train_stats.rows_read == train_stats.rows_kept == 202_027
    assert valid.batch_size == valid_stats.rows_read == valid_stats.rows_kept == 57_722
    assert int(train.labels_b.sum()) == train_stats.positives == 67_604
    assert vocab.vocab_sizes == FRAPPE_VOCAB_SIZES
    schema = frappe_schema(vocab)
    assert schema.num_dense == 0 and schema.dense_names == ()
    assert [f.name for f in schema.features] == list(FRAPPE_FIELDS)
    assert [f.vocab_size for f in schema.features] == list(FRAPPE_VOCAB_SIZES)
    assert schema.max_hotness == 1
    schema.validate(train, where="train")
    schema.validate(valid, where="valid")
    assert train.ids_bfh.shape == (202_027, 10, 1) and train.dense_bn.shape == (202_027, 0)
    assert (train.weights_b == 1).all() and set(np.unique(train.labels_b)) == {0.0, 1.0}


def test_real_oov(frappe_real):
    _, train, train_stats, valid, valid_stats = frappe_real
    # The vocabulary comes from train.csv, so training rows never map to OOV (index 0) ...
    assert sum(train_stats.oov.values()) == 0 and (train.ids_bfh > 0).all()
    # ... while validation users unseen in training do, and each is counted.
    assert valid_stats.oov == {f: (6 if f == "user" else 0) for f in FRAPPE_FIELDS}
    zeros = (valid.ids_bfh[:, :, 0] == 0).sum(axis=0)
    assert dict(zip(FRAPPE_FIELDS, zeros.tolist(), strict=True)) == valid_stats.oov


def test_real_ids_follow_sorted_raw_values(frappe_dir, frappe_real):
    vocab, train, *_ = frappe_real
    raw = np.loadtxt(frappe_dir / "train.csv", delimiter=",", skiprows=1, dtype=np.int64)
    np.testing.assert_array_equal(train.labels_b, raw[:, 0].astype(np.float32))
    for f in range(len(FRAPPE_FIELDS)):
        known = np.asarray(vocab.values[f])
        np.testing.assert_array_equal(known[train.ids_bfh[:, f, 0] - 1], raw[:, 1 + f])


# --------------------------------------------------------------------------------- tiny files


def test_vocab_oov_and_json_round_trip(tmp_path):
    train = _write(
        tmp_path / "train.csv", [ROW, "0,7,3569,5041,5047,5053,5057,5058,5060,5080,5149"]
    )
    vocab = build_frappe_vocab(train)
    assert vocab.values[0] == (7, 26) and vocab.values[2] == (5041, 5042)
    assert vocab.vocab_sizes == (3, 2, 3, 2, 2, 2, 2, 2, 2, 2)
    vocab.save(tmp_path / "vocab.json")
    assert FrappeVocab.load(tmp_path / "vocab.json") == vocab

    valid = _write(tmp_path / "valid.csv", ["0,26,999,5042,5047,5053,5057,5058,5060,5080,1"])
    rows, stats = read_frappe(valid, vocab)
    np.testing.assert_array_equal(rows.ids_bfh[0, :, 0], [2, 0, 2, 1, 1, 1, 1, 1, 1, 0])
    assert stats.oov == {f: int(f in ("item", "city")) for f in FRAPPE_FIELDS}
    assert rows.labels_b.dtype == np.float32 and rows.labels_b.tolist() == [0.0]


def test_crlf_missing_final_newline_and_empty_file(tmp_path):
    ref = _write(tmp_path / "a.csv", [ROW, ROW])
    crlf = _write(tmp_path / "b.csv", [ROW, ROW], newline="\r\n")
    bare = tmp_path / "c.csv"
    bare.write_text(f"{FRAPPE_HEADER}\n{ROW}\n{ROW}")
    vocab = build_frappe_vocab(ref)
    want, _ = read_frappe(ref, vocab)
    for path in (crlf, bare):
        got, _ = read_frappe(path, vocab)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    empty, stats = read_frappe(_write(tmp_path / "d.csv", []), vocab)
    assert empty.batch_size == 0 and stats.rows_read == 0


@pytest.mark.parametrize(
    ("lines", "where", "what"),
    [
        (["label,user,item", ROW], ":1:", "expected header"),
        ([FRAPPE_HEADER, ROW, "1,2,3"], ":3:", "expected 11 columns, got 3"),
        ([FRAPPE_HEADER, ROW + ",7"], ":2:", "expected 11 columns, got 12"),
        ([FRAPPE_HEADER, ROW, ROW.replace("3569", "35x9")], ":3: column 3 (item)", "'35x9'"),
        ([FRAPPE_HEADER, ROW.replace("5149", "5149.0")], ":2: column 11 (city)", "'5149.0'"),
        ([FRAPPE_HEADER, ROW.replace(",26,", ",-26,")], ":2: column 2 (user)", "'-26'"),
        ([FRAPPE_HEADER, ROW.replace(",26,", ",,")], ":2: column 2 (user)", "is empty"),
        ([FRAPPE_HEADER, ROW, "2" + ROW[1:]], ":3: column 1 (label)", "must be 0 or 1, got 2"),
        ([FRAPPE_HEADER, ROW, "", ROW], ":3:", "expected 11 columns, got 1"),
    ],
)
def test_bad_input_names_file_line_column(tmp_path, lines, where, what):
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(FrappeFormatError) as err:
        build_frappe_vocab(path)
    msg = str(err.value)
    assert f"{path}{where}" in msg and what in msg, msg
    assert isinstance(err.value, ValueError)


# --------------------------------------------------------------------------------------- tfds


@pytest.fixture(scope="module")
def tfds_frappe(frappe_files, tmp_path_factory):
    """A tiny manual dir (first rows of the generated or real files) prepared as array_record."""
    import tensorflow_datasets as tfds  # a hard dependency: fail, never skip

    from data.tfds_builders.frappe import FrappeBars

    root = tmp_path_factory.mktemp("frappe_tfds")
    manual = root / "manual"
    manual.mkdir()
    for name, n in (("train.csv", 400), ("valid.csv", 150)):
        with open(frappe_files.path / name) as src:
            (manual / name).write_text("".join(next(src) for _ in range(n + 1)))
    builder = FrappeBars(data_dir=str(root / "data"), file_format="array_record")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=str(manual))
    )
    return builder, manual, root / "data"


def test_tfds_builder_round_trip_equals_reader(tfds_frappe):
    import tensorflow_datasets as tfds

    from data.tfds_builders.frappe import frappe_bars_vocab, frappe_records_to_batch

    builder, manual, data_dir = tfds_frappe
    vocab = build_frappe_vocab(manual / "train.csv")
    assert frappe_bars_vocab(builder) == vocab
    assert set(builder.info.splits) == {"train", "validation"}
    for split, name in (("train", "train.csv"), ("validation", "valid.csv")):
        want, stats = read_frappe(manual / name, vocab)
        ds = builder.as_data_source(split)
        assert len(ds) == want.batch_size
        got = frappe_records_to_batch(ds.__getitems__(list(range(len(ds)))))
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
        assert builder.info.metadata["oov"][split] == stats.oov
    # A fresh builder / tfds.data_source reads the prepared files back (vocab from metadata).
    ds = tfds.data_source("frappe_bars", split="validation", data_dir=str(data_dir), download=False)
    assert len(ds) == 150
    from data.tfds_builders.frappe import FrappeBars

    assert frappe_bars_vocab(FrappeBars(data_dir=str(data_dir))) == vocab


def test_tfds_random_access_source_equals_in_memory(tfds_frappe):
    from data.sources import InMemorySource, RandomAccessSource
    from data.tfds_builders.frappe import frappe_bars_vocab, frappe_records_to_batch

    builder, manual, _ = tfds_frappe
    vocab = frappe_bars_vocab(builder)
    schema = frappe_schema(vocab)
    train, _ = read_frappe(manual / "train.csv", vocab)
    valid, _ = read_frappe(manual / "valid.csv", vocab)
    kw = dict(batch_size=64, eval_batch_size=64, seed=3, process_index=1, process_count=2)
    mem = InMemorySource(schema, train, valid, **kw)
    ras = RandomAccessSource(
        schema,
        builder.as_data_source("train"),
        builder.as_data_source("validation"),
        to_batch=frappe_records_to_batch,
        **kw,
    )
    for step in (0, 6, 7, 13):  # 400 rows / 64: steps 6 and 12 straddle epochs
        for a, b in zip(ras.train_batch(step), mem.train_batch(step), strict=True):
            np.testing.assert_array_equal(a, b)
    got, want = list(ras.eval_batches()), list(mem.eval_batches())
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        schema.validate(g)
        for a, b in zip(g, w, strict=True):
            np.testing.assert_array_equal(a, b)
