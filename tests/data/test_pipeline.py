"""Index pipeline (order, determinism, resume, host sharding, eval padding) and data sources."""

import dataclasses

import numpy as np
import pytest

from data.batch import Batch, FeatureInfo, Schema
from data.builders import make_source
from data.config import CriteoConfig, DataConfig, SyntheticConfig
from data.pipeline import eval_index_batches, gather, num_eval_batches, train_dataset
from data.sources import DataSource, InMemorySource, RandomAccessSource


def _stream(ds, num_steps: int) -> np.ndarray:
    return np.concatenate([ds[s] for s in range(num_steps)])


def test_train_indices_shape_dtype_and_determinism():
    a = train_dataset(1000, batch_size=64, seed=7)
    b = train_dataset(1000, batch_size=64, seed=7)
    c = train_dataset(1000, batch_size=64, seed=8)
    assert a[0].dtype == np.int64 and a[0].shape == (64,)
    np.testing.assert_array_equal(_stream(a, 40), _stream(b, 40))
    assert not np.array_equal(a[0], c[0])


def test_resume_is_exact_at_any_step():
    full = train_dataset(1000, batch_size=64, seed=1)
    want = [full[s] for s in range(120)]
    for k in (0, 15, 16, 57, 119):  # 1000/64: step 15 straddles epochs 0 and 1
        rebuilt = train_dataset(1000, batch_size=64, seed=1)
        np.testing.assert_array_equal(rebuilt[k], want[k])
        np.testing.assert_array_equal(rebuilt[k:][0], want[k])  # grain slicing


@pytest.mark.parametrize(("n", "batch"), [(1000, 64), (1000, 1000), (10, 32)])
def test_each_epoch_is_a_fresh_permutation(n, batch):
    ds = train_dataset(n, batch_size=batch, seed=0)
    epochs = 4
    stream = _stream(ds, -(-epochs * n // batch))[: epochs * n].reshape(epochs, n)
    for e in range(epochs):
        np.testing.assert_array_equal(np.sort(stream[e]), np.arange(n))
    assert len({tuple(row) for row in stream}) == epochs  # every epoch in a new order
    assert not np.array_equal(stream[0], np.arange(n))


def test_seeds_do_not_alias_epochs():
    # grain's shuffle(seed).repeat() uses seed+epoch, so seed 1 epoch 0 == seed 0 epoch 1.
    s0 = _stream(train_dataset(100, batch_size=100, seed=0), 2)
    s1 = _stream(train_dataset(100, batch_size=100, seed=1), 1)
    assert not np.array_equal(s0[100:], s1)


@pytest.mark.parametrize("process_count", [2, 4, 8])
def test_host_shards_partition_the_global_batch(process_count):
    one = train_dataset(1000, batch_size=64, seed=5)
    hosts = [
        train_dataset(1000, batch_size=64, seed=5, process_index=h, process_count=process_count)
        for h in range(process_count)
    ]
    for step in (0, 15, 31):
        parts = [h[step] for h in hosts]
        assert all(p.shape == (64 // process_count,) for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), one[step])
        if step != 15:  # step 15 straddles an epoch boundary, where repeats are legitimate
            assert len(np.unique(np.concatenate(parts))) == 64


def test_bad_host_arguments_raise():
    with pytest.raises(ValueError, match="not divisible by process_count 3"):
        train_dataset(100, batch_size=64, seed=0, process_count=3)
    with pytest.raises(ValueError, match="process_index 2 is outside"):
        train_dataset(100, batch_size=64, seed=0, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="at least one example"):
        train_dataset(0, batch_size=64, seed=0)
    with pytest.raises(ValueError, match="not divisible"):
        list(eval_index_batches(100, batch_size=10, process_count=4))


@pytest.mark.parametrize(
    ("n", "batch", "hosts"), [(100, 32, 1), (100, 32, 4), (64, 32, 2), (5, 32, 4)]
)
def test_eval_index_batches_cover_once_with_padding(n, batch, hosts):
    per_host = [
        list(eval_index_batches(n, batch_size=batch, process_index=h, process_count=hosts))
        for h in range(hosts)
    ]
    assert all(len(p) == num_eval_batches(n, batch) == -(-n // batch) for p in per_host)
    seen = []
    for j in range(num_eval_batches(n, batch)):
        for h in range(hosts):
            idx, valid = per_host[h][j]
            assert idx.shape == (batch // hosts,) and idx.dtype == np.int64
            seen.extend(idx[:valid].tolist())
            assert (idx[valid:] == 0).all()
    assert seen == list(range(n))


def _toy(n: int, offset: int = 0) -> tuple[Schema, Batch]:
    schema = Schema(
        dense_names=("x",),
        features=(
            FeatureInfo(name="a", vocab_size=10),
            FeatureInfo(name="b", vocab_size=3, max_hotness=2),
        ),
    )
    i = np.arange(n)
    ids = np.full((n, 2, 2), -1, np.int32)
    ids[:, 0, 0] = i % 10
    ids[:, 1, 0] = i % 3
    ids[:, 1, 1] = np.where(i % 2 == 0, (i + 1) % 3, -1)
    rows = Batch(
        dense_bn=(i + offset).astype(np.float32)[:, None],
        ids_bfh=ids,
        labels_b=(i % 2).astype(np.float32),
        weights_b=np.ones(n, np.float32),
    )
    return schema, rows


def test_gather_indexes_every_field():
    _, rows = _toy(20)
    got = gather(rows, np.array([3, 3, 19]))
    assert got.dense_bn[:, 0].tolist() == [3, 3, 19]
    np.testing.assert_array_equal(got.ids_bfh, rows.ids_bfh[[3, 3, 19]])
    assert got.labels_b.tolist() == [1, 1, 1] and got.weights_b.shape == (3,)


@pytest.mark.parametrize("hosts", [1, 2])
def test_in_memory_source(hosts):
    schema, train = _toy(50)
    _, evals = _toy(37, offset=1000)
    srcs = [
        InMemorySource(
            schema,
            train,
            evals,
            batch_size=8,
            eval_batch_size=16,
            seed=2,
            process_index=h,
            process_count=hosts,
        )
        for h in range(hosts)
    ]
    assert isinstance(srcs[0], DataSource)
    batch = srcs[0].train_batch(3)
    schema.validate(batch)
    assert batch.batch_size == 8 // hosts
    np.testing.assert_array_equal(
        np.concatenate([s.train_batch(3).dense_bn[:, 0] for s in srcs]),
        train.dense_bn[train_dataset(50, batch_size=8, seed=2)[3], 0],
    )
    seen, total_weight = [], 0.0
    for s in srcs:
        batches = list(s.eval_batches())
        assert len(batches) == 3 and all(b.batch_size == 16 // hosts for b in batches)
        for b in batches:
            schema.validate(b)
            seen.extend(b.dense_bn[b.weights_b == 1, 0].tolist())
            total_weight += float(b.weights_b.sum())
            assert set(np.unique(b.weights_b)) <= {0.0, 1.0}
    assert total_weight == 37 == srcs[0].num_eval_examples
    assert sorted(seen) == list(range(1000, 1037))


def test_in_memory_source_rejects_rows_breaking_schema():
    schema, train = _toy(10)
    bad = train._replace(ids_bfh=np.where(train.ids_bfh == 9, 10, train.ids_bfh))
    with pytest.raises(ValueError, match="training rows: feature 'a'"):
        InMemorySource(schema, bad, train, batch_size=4, eval_batch_size=4, seed=0)


def _check_sources(srcs, *, batch: int, eval_batch: int, num_eval: int) -> Batch:
    """``srcs``: the sources of all hosts of one run. Returns the eval set's real rows in order."""
    weight = 0.0
    for src in srcs:
        assert isinstance(src, DataSource)
        for step in (0, 1, 1000):
            b = src.train_batch(step)
            src.schema.validate(b, where=f"train step {step}")
            assert b.batch_size == batch // len(srcs) and (b.weights_b == 1).all()
        np.testing.assert_array_equal(src.train_batch(5).ids_bfh, src.train_batch(5).ids_bfh)
        for b in src.eval_batches():
            src.schema.validate(b, where="eval")
            assert b.batch_size == eval_batch // len(srcs)
            weight += float(b.weights_b.sum())
        assert src.num_eval_examples == num_eval
    assert weight == num_eval
    return _eval_rows(srcs)


def _eval_rows(srcs) -> Batch:
    """The weight-1 eval rows of all hosts, in global order (batch by batch, host by host)."""
    parts = []
    for per_host in zip(*(s.eval_batches() for s in srcs), strict=True):
        for b in per_host:
            assert set(np.unique(b.weights_b)) <= {0.0, 1.0}
            keep = b.weights_b == 1
            assert keep.all() or not keep[np.argmin(keep) :].any()  # padding only at the end
            parts.append(Batch(*(f[keep] for f in b)))
    return Batch(*(np.concatenate(f) for f in zip(*parts, strict=True)))


def _assert_same(got: Batch, want: Batch) -> None:
    for name, a, b in zip(Batch._fields, got, want, strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_make_source_synthetic():
    import data.synthetic  # noqa: F401  (a required module: fail, never skip)

    cfg = DataConfig(
        kind="synthetic",
        batch_size=32,
        eval_batch_size=64,
        synthetic=SyntheticConfig(num_eval_examples=150),
    )
    _check_sources([make_source(cfg)], batch=32, eval_batch=64, num_eval=150)
    hosts = [make_source(cfg, process_index=h, process_count=2) for h in range(2)]
    _check_sources(hosts, batch=32, eval_batch=64, num_eval=150)
    with pytest.raises(ValueError, match="eval_path '/x.csv' given for synthetic data"):
        make_source(cfg, eval_path="/x.csv")


def _frappe_truth(folder):
    """What the Frappe sources must give, computed from the CSVs with plain numpy: training
    vocabulary sizes, per-field OOV counts of valid.csv, and its rows as ids (0 = OOV)."""
    from data.frappe import FRAPPE_FIELDS

    train, valid = (
        np.loadtxt(folder / name, delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
        for name in ("train.csv", "valid.csv")
    )
    known = [np.unique(train[:, 1 + f]) for f in range(10)]
    seen = np.stack([np.isin(valid[:, 1 + f], known[f]) for f in range(10)], axis=1)
    ids = np.stack([np.searchsorted(known[f], valid[:, 1 + f]) + 1 for f in range(10)], axis=1)
    rows = Batch(
        dense_bn=np.zeros((len(valid), 0), np.float32),
        ids_bfh=np.where(seen, ids, 0).astype(np.int32)[:, :, None],
        labels_b=valid[:, 0].astype(np.float32),
        weights_b=np.ones(len(valid), np.float32),
    )
    oov = dict(zip(FRAPPE_FIELDS, (~seen).sum(axis=0).tolist(), strict=True))
    return [len(k) + 1 for k in known], len(train), oov, rows


def test_make_source_frappe(frappe_files):
    folder = frappe_files.path
    real = frappe_files.kind == "real"
    batch, eval_batch = (4096, 8192) if real else (64, 32)  # generated: 150 eval rows, 5 batches
    cfg = DataConfig(
        kind="frappe",
        train_path=str(folder / "train.csv"),
        eval_path=str(folder / "valid.csv"),
        batch_size=batch,
        eval_batch_size=eval_batch,
    )
    vocab_sizes, num_train, oov, valid = _frappe_truth(folder)
    src = make_source(cfg)
    got = _check_sources([src], batch=batch, eval_batch=eval_batch, num_eval=valid.batch_size)
    _assert_same(got, valid)  # every eval example once, in file order
    assert [f.vocab_size for f in src.schema.features] == vocab_sizes
    assert src.stats["train"]["rows_read"] == num_train and src.stats["eval"]["oov"] == oov
    assert sum(oov.values()) > 0 and src.stats["train"]["oov"] == dict.fromkeys(oov, 0)
    if real:
        assert vocab_sizes == [955, 4083, 8, 8, 3, 4, 3, 10, 81, 234]
        assert num_train == 202_027 and valid.batch_size == 57_722 and oov["user"] == 6
    hosts = [make_source(cfg, process_index=h, process_count=2) for h in range(2)]
    got = _check_sources(hosts, batch=batch, eval_batch=eval_batch, num_eval=valid.batch_size)
    _assert_same(got, valid)
    with pytest.raises(ValueError, match="needs an eval file"):
        make_source(dataclasses.replace(cfg, eval_path=""))


def test_make_source_criteo(criteo_files, tmp_path):
    import data.criteo.reader  # noqa: F401  (a required module: fail, never skip)
    from data.criteo.reader import read_criteo

    vocab = (1000,) * 26
    path = str(criteo_files.path)
    cfg = DataConfig(
        kind="criteo",
        train_path=path,
        eval_path=path,
        batch_size=128,
        eval_batch_size=256,
        criteo=CriteoConfig(vocab_sizes=vocab),
    )
    hosts = [make_source(cfg, process_index=h, process_count=2) for h in range(2)]
    got = _check_sources(hosts, batch=128, eval_batch=256, num_eval=1999)
    _assert_same(got, read_criteo(path, cfg.criteo)[0])  # every eval example once, in order
    assert hosts[0].stats["train"]["rows_kept"] == 1999
    assert "1999 kept + 0 rejected" in hosts[0].stats["report"]
    assert [f.vocab_size for f in hosts[0].schema.features] == list(vocab)
    assert hosts[0].schema.dense_names == tuple(f"I{i}" for i in range(1, 14))

    lenient = dataclasses.replace(cfg, criteo=CriteoConfig(vocab_sizes=vocab, strict=False))
    src = make_source(lenient, rejects_dir=str(tmp_path))
    assert src.stats["train"]["rejects_path"] == str(tmp_path / "criteo_rejects.tsv")
    assert src.stats["eval"]["rejects_path"] == str(tmp_path / "criteo_rejects.eval.tsv")
    assert (tmp_path / "criteo_rejects.tsv").is_file()


# ----------------------------------------------------------------------------- eval_only


def _assert_same_eval(got, want) -> None:
    assert got.schema == want.schema and got.num_eval_examples == want.num_eval_examples
    g, w = list(got.eval_batches()), list(want.eval_batches())
    assert len(g) == len(w) > 0
    for a, b in zip(g, w, strict=True):
        _assert_same(a, b)


def test_make_source_frappe_eval_only_reads_no_training_rows(frappe_files, monkeypatch):
    import data.frappe.reader as reader

    folder = frappe_files.path
    cfg = DataConfig(
        kind="frappe",
        train_path=str(folder / "train.csv"),
        eval_path=str(folder / "valid.csv"),
        batch_size=64,
        eval_batch_size=64,
    )
    read, real_read = [], reader.read_frappe
    monkeypatch.setattr(reader, "read_frappe", lambda p, v: read.append(str(p)) or real_read(p, v))
    for h, hosts in ((0, 1), (1, 2)):
        kw = dict(process_index=h, process_count=hosts)
        read.clear()
        src = make_source(cfg, eval_only=True, **kw)
        assert read == [cfg.eval_path]  # the vocabulary is still built from train.csv
        assert src.stats["train"] is None
        with pytest.raises(RuntimeError, match="eval-only"):
            src.train_batch(0)
        full = make_source(cfg, **kw)
        assert read == [cfg.eval_path, cfg.train_path, cfg.eval_path]
        _assert_same_eval(src, full)
        assert src.stats["eval"] == full.stats["eval"]
        assert src.stats["vocab_sizes"] == full.stats["vocab_sizes"]


def test_make_source_criteo_eval_only_reads_no_training_rows(criteo_files, tmp_path):
    path = str(criteo_files.path)
    cfg = DataConfig(
        kind="criteo",
        train_path=path,
        eval_path=path,
        batch_size=128,
        eval_batch_size=256,
        criteo=CriteoConfig(vocab_sizes=(1000,) * 26),
    )
    # The training file is never opened: a missing one is fine.
    no_train = dataclasses.replace(cfg, train_path=str(tmp_path / "missing.tsv"))
    for h, hosts in ((0, 1), (1, 2)):
        kw = dict(process_index=h, process_count=hosts)
        src = make_source(no_train, eval_only=True, **kw)
        assert src.stats["train"] is None and src.stats["report"].startswith("eval ")
        with pytest.raises(RuntimeError, match="eval-only"):
            src.train_batch(0)
        _assert_same_eval(src, make_source(cfg, **kw))
    with pytest.raises(FileNotFoundError):
        make_source(no_train)


def test_random_access_source_names_the_record_with_an_out_of_range_id():
    schema = Schema(dense_names=(), features=(FeatureInfo(name="f", vocab_size=5),))
    ids = [0, 1, 2, 3, 4, 5, 6, 7]  # records 5..7 hold ids outside [0, 5)

    def to_batch(recs):
        n = len(recs)
        return Batch(
            dense_bn=np.zeros((n, 0), np.float32),
            ids_bfh=np.asarray(recs, np.int32).reshape(n, 1, 1),
            labels_b=np.zeros(n, np.float32),
            weights_b=np.ones(n, np.float32),
        )

    src = RandomAccessSource(
        schema, ids, ids[:5], to_batch=to_batch, batch_size=8, eval_batch_size=4, seed=0
    )
    with pytest.raises(ValueError, match=r"train records: feature 'f' .* at record [567] "):
        src.train_batch(0)
    assert sum(int(b.weights_b.sum()) for b in src.eval_batches()) == 5  # valid records pass
