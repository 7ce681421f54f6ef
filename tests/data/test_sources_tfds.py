"""make_source over prepared tfds array_record datasets equals the in-memory route, bitwise.

Every test runs on generated files (``frappe_files`` / ``criteo_files`` in ``conftest.py``, so
in CI too) and again on heads of the real files when ``../shared/data`` is present.
"""

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets  # noqa: E402,F401  (a hard dependency: fail, never skip)

from data.batch import Batch
from data.builders import make_source
from data.config import CriteoConfig, DataConfig
from data.criteo.reader import read_criteo
from data.frappe.reader import build_frappe_vocab, read_frappe
from data.sources import InMemorySource, RandomAccessSource


def _assert_same(got: Batch, want: Batch) -> None:
    for name, a, b in zip(Batch._fields, got, want, strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name
        np.testing.assert_array_equal(a, b, err_msg=name)
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), name


def _assert_sources_equal(got, want, steps=(0, 1, 2)) -> None:
    assert isinstance(got, RandomAccessSource) and isinstance(want, InMemorySource)
    assert got.schema == want.schema
    for step in steps:
        _assert_same(got.train_batch(step), want.train_batch(step))
    assert got.num_eval_examples == want.num_eval_examples
    g, w = list(got.eval_batches()), list(want.eval_batches())
    assert len(g) == len(w) > 0
    for a, b in zip(g, w, strict=True):
        _assert_same(a, b)


def _head(src: Path, dst: Path, lines: slice) -> Path:
    dst.write_text("".join(src.read_text().splitlines(keepends=True)[lines]))
    return dst


# ------------------------------------------------------------------------------------ frappe


@pytest.fixture(scope="module")
def frappe_cfg(frappe_files, tmp_path_factory):
    """Train/valid CSVs of 400/150 rows (in tmp only) and a config reading them."""
    root = tmp_path_factory.mktemp("frappe")
    manual = root / "raw"
    manual.mkdir()
    src = frappe_files.path
    _head(src / "train.csv", manual / "train.csv", slice(0, 401))  # header + 400 rows
    _head(src / "valid.csv", manual / "valid.csv", slice(0, 151))
    return DataConfig(
        kind="frappe",
        train_path=str(manual / "train.csv"),
        eval_path=str(manual / "valid.csv"),
        batch_size=160,
        eval_batch_size=64,
        shuffle_seed=3,
    ), root


def test_frappe_tfds_equals_in_memory(frappe_cfg):
    cfg, root = frappe_cfg
    tfds_cfg = dataclasses.replace(cfg, tfds_data_dir=str(root / "tfds"))
    # 400 rows / 160: step 2 straddles the epoch boundary; two hosts split each batch.
    for host, hosts in ((0, 1), (1, 2)):
        kw = dict(process_index=host, process_count=hosts)
        got = make_source(tfds_cfg, **kw)
        _assert_sources_equal(got, make_source(cfg, **kw))
    assert (root / "tfds" / "frappe_bars" / "1.0.0").is_dir()
    assert got.stats["tfds"]["eval"] == "split validation"
    assert got.stats["vocab_sizes"] == list(build_frappe_vocab(cfg.train_path).vocab_sizes)
    # OOV counts of the validation split are those of the in-memory reader (some are unseen).
    oov = make_source(cfg).stats["eval"]["oov"]
    assert got.stats["eval"]["oov"] == oov and oov["user"] > 0
    # No eval_path: the validation split.
    _assert_sources_equal(
        make_source(dataclasses.replace(tfds_cfg, eval_path="")), make_source(cfg)
    )


def test_frappe_tfds_prepared_in_several_shards(frappe_cfg, tmp_path):
    # Full Criteo is written in many shards; records must map to the right shard and position.
    import tensorflow_datasets as tfds

    from data.tfds_builders.frappe import FrappeBars

    cfg, _ = frappe_cfg
    builder = FrappeBars(data_dir=str(tmp_path), file_format="array_record")
    builder.download_and_prepare(
        file_format="array_record",
        download_config=tfds.download.DownloadConfig(
            manual_dir=str(Path(cfg.train_path).parent), num_shards=3
        ),
    )
    assert len(list(tmp_path.glob("frappe_bars/1.0.0/frappe_bars-train.array_record-*"))) == 3
    tfds_cfg = dataclasses.replace(cfg, tfds_data_dir=str(tmp_path))  # reuses it as prepared
    _assert_sources_equal(make_source(tfds_cfg), make_source(cfg), steps=range(6))


def test_frappe_tfds_eval_override_reads_raw_file(frappe_cfg, frappe_files, tmp_path):
    cfg, root = frappe_cfg
    tfds_cfg = dataclasses.replace(cfg, tfds_data_dir=str(root / "tfds"))
    other = _head(frappe_files.path / "valid.csv", tmp_path / "other.csv", slice(0, 101))
    got = make_source(tfds_cfg, eval_path=str(other))
    _assert_sources_equal(got, make_source(cfg, eval_path=str(other)))
    assert got.stats["tfds"]["eval"] == f"raw file {other} (in memory)"
    want, _ = read_frappe(other, build_frappe_vocab(cfg.train_path))
    assert got.num_eval_examples == want.batch_size == 100
    # The training file itself is the prepared train split.
    train_eval = make_source(tfds_cfg, eval_path=cfg.train_path)
    assert train_eval.stats["tfds"]["eval"] == "split train"
    _assert_sources_equal(train_eval, make_source(cfg, eval_path=cfg.train_path))


def test_frappe_tfds_needs_train_csv(frappe_cfg, tmp_path):
    cfg, _ = frappe_cfg
    bad = dataclasses.replace(
        cfg, train_path=str(tmp_path / "frappe_train.csv"), tfds_data_dir=str(tmp_path / "t")
    )
    with pytest.raises(ValueError, match="must be named train.csv"):
        make_source(bad)


# ------------------------------------------------------------------------------------ criteo

VOCAB = (1000,) * 26  # small tables, so hashing with another seed changes many ids


@pytest.fixture(scope="module")
def criteo_cfg(criteo_files, tmp_path_factory):
    """train.tsv = sample rows 0..1199, valid.tsv = rows 1200..1998 (in tmp only)."""
    root = tmp_path_factory.mktemp("criteo")
    manual = root / "raw"
    manual.mkdir()
    _head(criteo_files.path, manual / "train.tsv", slice(0, 1200))
    _head(criteo_files.path, manual / "valid.tsv", slice(1200, None))
    return DataConfig(
        kind="criteo",
        train_path=str(manual / "train.tsv"),
        eval_path=str(manual / "valid.tsv"),
        batch_size=128,
        eval_batch_size=256,
        shuffle_seed=1,
        criteo=CriteoConfig(vocab_sizes=VOCAB, hash_seed=5),
    ), root


def test_criteo_tfds_equals_in_memory(criteo_cfg):
    cfg, root = criteo_cfg
    tfds_cfg = dataclasses.replace(cfg, tfds_data_dir=str(root / "tfds"))
    for host, hosts in ((0, 1), (1, 2)):
        kw = dict(process_index=host, process_count=hosts)
        got = make_source(tfds_cfg, **kw)  # prepares on the first call, reuses it after
        _assert_sources_equal(got, make_source(cfg, **kw))
    assert got.num_train_examples == 1200 and got.num_eval_examples == 799
    assert got.stats["tfds"]["eval"] == "split validation"
    # Evaluating on the training file reads the prepared train split.
    train_eval = make_source(dataclasses.replace(tfds_cfg, eval_path=cfg.train_path))
    assert train_eval.stats["tfds"]["eval"] == "split train"
    _assert_sources_equal(
        train_eval, make_source(dataclasses.replace(cfg, eval_path=cfg.train_path))
    )


def test_criteo_tfds_without_eval_path_holds_out_last_seventh(criteo_cfg):
    cfg, root = criteo_cfg
    src = make_source(dataclasses.replace(cfg, eval_path="", tfds_data_dir=str(root / "tfds")))
    rows, _ = read_criteo(cfg.train_path, cfg.criteo)
    cut = 1200 - 1200 // 7
    assert (src.num_train_examples, src.num_eval_examples) == (cut, 1200 // 7)
    got = list(src.eval_batches())
    _assert_same(Batch(*(np.concatenate(f) for f in zip(*got, strict=True))), _pad(rows, cut))
    # Training batches draw only from the first `cut` rows (rows told apart by their dense part).
    seen = {r.tobytes() for step in range(3) for r in src.train_batch(step).dense_bn}
    held_out = {r.tobytes() for r in rows.dense_bn[cut:]} - {
        r.tobytes() for r in rows.dense_bn[:cut]
    }
    assert held_out and seen and not seen & held_out


def _pad(rows: Batch, cut: int) -> Batch:
    """Rows ``[cut:]`` padded to whole 256-example batches with repeats of weight 0."""
    from data.pipeline import eval_index_batches, gather, pad_weights

    tail = Batch(*(f[cut:] for f in rows))
    parts = [
        pad_weights(gather(tail, idx), n)
        for idx, n in eval_index_batches(tail.batch_size, batch_size=256)
    ]
    return Batch(*(np.concatenate(f) for f in zip(*parts, strict=True)))


def test_criteo_tfds_eval_override_reads_raw_file(criteo_cfg, criteo_files, tmp_path):
    cfg, root = criteo_cfg
    other = _head(criteo_files.path, tmp_path / "test.tsv", slice(1500, None))
    got = make_source(
        dataclasses.replace(cfg, tfds_data_dir=str(root / "tfds")), eval_path=str(other)
    )
    assert got.stats["tfds"]["eval"] == f"raw file {other} (in memory)"
    assert got.stats["eval"]["rows_kept"] == 499
    _assert_sources_equal(got, make_source(cfg, eval_path=str(other)))


def test_criteo_tfds_missing_eval_file_is_named(criteo_cfg, tmp_path):
    cfg, _ = criteo_cfg
    missing = str(Path(cfg.train_path).with_name("missing.tsv"))
    bad = dataclasses.replace(cfg, eval_path=missing, tfds_data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=re.escape(f"validation file {missing} not")):
        make_source(bad)


@pytest.mark.parametrize(
    "criteo, message",
    [
        (CriteoConfig(vocab_sizes=VOCAB, hash_seed=6), "hash_seed: prepared 5, config 6"),
        (
            CriteoConfig(vocab_sizes=(999,) + VOCAB[1:], hash_seed=5),
            f"vocab_sizes: prepared {list(VOCAB)}, config {[999, *VOCAB[1:]]}",
        ),
        (CriteoConfig(vocab_sizes=VOCAB, hash_seed=5, max_rows=100), "max_rows: prepared 0"),
    ],
)
def test_criteo_tfds_other_hashing_is_a_clear_error(criteo_cfg, criteo, message, tmp_path):
    cfg, root = criteo_cfg
    tfds_cfg = dataclasses.replace(cfg, tfds_data_dir=str(root / "tfds"))
    make_source(tfds_cfg)  # prepared with hash_seed 5
    with pytest.raises(ValueError, match="other Criteo hashing parameters") as err:
        make_source(dataclasses.replace(tfds_cfg, criteo=criteo))
    assert message in str(err.value) and "tfds_data_dir" in str(err.value)
    # In a fresh data_dir the other parameters prepare their own copy, equal to in-memory.
    fresh = dataclasses.replace(tfds_cfg, tfds_data_dir=str(tmp_path), criteo=criteo)
    _assert_sources_equal(make_source(fresh), make_source(dataclasses.replace(cfg, criteo=criteo)))


def test_tfds_data_dir_is_rejected_for_synthetic():
    with pytest.raises(ValueError, match="tfds_data_dir applies to kinds frappe and criteo"):
        DataConfig(kind="synthetic", tfds_data_dir="/tmp/x")
