"""Tiered tables (``recscale.embeddings.tiers``): the undo-logged store goes back to any kept
checkpoint (also after a kill in the middle of a write-back), the cache's directory and LRU /
LFU eviction, and training through the cache equals the all-in-memory engine on 8 devices."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

import dlrm.presets  # noqa: F401
from data.batch import PAD_ID, Batch, FeatureInfo, Schema
from data.config import DataConfig
from dlrm import evaluate as dlrm_evaluate
from dlrm.config import DLRMConfig, DLRMModelConfig
from dlrm.model import build_model
from recscale import sharding
from recscale.config import (
    ConfigError,
    DenseOptimConfig,
    EmbeddingOptimConfig,
    EmbeddingShardingConfig,
    MeshConfig,
    get_preset,
)
from recscale.embeddings import engine, tier_store, tier_view
from recscale.embeddings import tiers as tiers_lib
from recscale.serving.export import ExportArgs, export_workdir
from recscale.serving.runtime import Model
from recscale.train.evaluation import restored
from recscale.train.loop import make_optimizer, train
from recscale.train.steps import TrainState, initial_rng, make_train_step

# -- the store ------------------------------------------------------------------------------------


def _store(tmp_path, tier, rows=300, width=5):
    s = tier_store.RowStore(tmp_path / "t", rows, width, tier)
    s.create(lambda a, b: np.arange(a * width, b * width, dtype=np.float32).reshape(-1, width))
    return s


def _all(s):
    return s.read(np.arange(s.num_rows))


@pytest.mark.parametrize("tier", tiers_lib.TIERS)
def test_the_store_goes_back_to_every_kept_checkpoint(tmp_path, tier):
    rng = np.random.default_rng(0)
    s = _store(tmp_path, tier)
    snaps = {0: _all(s).copy()}
    for step in (3, 7, 9):
        for _ in range(4):  # rows written several times between checkpoints
            rows = np.unique(rng.integers(0, s.num_rows, 40))
            s.write(rows, rng.standard_normal((len(rows), s.width)).astype(np.float32))
        s.sync(step)
        snaps[step] = _all(s).copy()
    # a read-only view of the store as of step 9, taken before the rows below are written and
    # read again after: the values of step 9 (the later writes' undo records found)
    view = tier_view.StoreView(s.dir, s.num_rows, s.width, 9)
    np.testing.assert_array_equal(view.read(0, 150), snaps[9][:150])
    rows = np.arange(0, 300, 7)
    s.write(rows, np.full((len(rows), s.width), -1, np.float32))  # after the last checkpoint
    s.sync(11) if tier == "dram" else None  # dram: reaches the file only at a sync
    np.testing.assert_array_equal(view.read(0, 300), snaps[9])
    before = {p.name: p.read_bytes() for p in s.dir.iterdir()}
    for step in (0, 3, 7, 9):  # every kept checkpoint, the file and its logs left as they are
        view = tier_view.StoreView(s.dir, s.num_rows, s.width, step)
        np.testing.assert_array_equal(view.read(0, 300), snaps[step])
        np.testing.assert_array_equal(view.read(100, 130), snaps[step][100:130])
    assert {p.name: p.read_bytes() for p in s.dir.iterdir()} == before
    assert not np.array_equal(
        tier_view.StoreView(s.dir, s.num_rows, s.width, 3).read(0, 300), _all(s)
    )
    with pytest.raises(FileNotFoundError, match="no undo log for step 5"):
        tier_view.StoreView(s.dir, s.num_rows, s.width, 5)
    with pytest.raises(FileNotFoundError, match="not 300 rows x 6 float32"):
        tier_view.StoreView(s.dir, s.num_rows, 6, 3)
    for step in (9, 7, 3):
        s.restore(step)
        np.testing.assert_array_equal(_all(s), snaps[step])
        assert s.logs()[-1] == step  # the later logs are consumed
    s.prune(3)
    with pytest.raises(FileNotFoundError, match="no undo log for step 0"):
        s.prune(4)
        s.restore(0)
    s.close()
    # a torn last record (a write that never happened) is dropped, the rest applies
    s = _store(tmp_path, "ssd")
    s.write(np.array([1, 2]), np.zeros((2, 5), np.float32))
    with open(tmp_path / "t" / "undo.0.log", "ab") as f:
        f.write(tier_store._HEADER.pack(tier_store._MAGIC, 3) + b"\0" * 10)
    s.restore(0)
    np.testing.assert_array_equal(_all(s)[1], np.arange(5, 10))


def test_a_kill_in_the_middle_of_write_backs_loses_nothing(tmp_path):
    """A child writes back rows as fast as it can after a checkpoint and is SIGKILLed; the
    store restored to that checkpoint equals it exactly."""
    child = textwrap.dedent(f"""
        import sys, numpy as np
        sys.path.insert(0, {os.getcwd()!r})
        from recscale.embeddings.tier_store import RowStore
        s = RowStore(__import__("pathlib").Path({str(tmp_path / "t")!r}), 20000, 8, "ssd")
        s.create(lambda a, b: np.full((b - a, 8), 1.0, np.float32))
        rng = np.random.default_rng(0)
        s.write(np.arange(0, 20000, 3), np.full((6667, 8), 2.0, np.float32))
        s.sync(5)
        np.save({str(tmp_path / "at5.npy")!r}, s.read(np.arange(20000)))
        print("ready", flush=True)
        while True:
            rows = np.unique(rng.integers(0, 20000, 500))
            s.write(rows, rng.standard_normal((len(rows), 8)).astype(np.float32))
    """)
    with subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True) as p:
        assert p.stdout.readline().strip() == "ready"
        log = tmp_path / "t" / "undo.5.log"
        while log.stat().st_size < 200_000 and p.poll() is None:  # well into the write-backs
            pass
        assert p.poll() is None, "the child stopped by itself"
        os.kill(p.pid, signal.SIGKILL)
    s = tier_store.RowStore(tmp_path / "t", 20000, 8, "ssd")
    s.restore(5)
    np.testing.assert_array_equal(_all(s), np.load(tmp_path / "at5.npy"))
    s.close()


# -- the cache --------------------------------------------------------------------------------------


def test_lru_and_lfu_evict_as_specified():
    c = tier_store.RowCache(100, 4, "lru", "t")
    p = c.plan(np.array([[5, 6], [5, PAD_ID]]), train=True)
    np.testing.assert_array_equal(p.load_rows, [5, 6])
    np.testing.assert_array_equal(p.slot_ids, [[0, 1], [0, PAD_ID]])
    c.plan(np.array([7, 8]), train=False)  # cache full: 5 6 7 8 (7, 8 clean)
    c.plan(np.array([5]), train=False)
    p = c.plan(np.array([9, 10, 5]), train=True)  # LRU: 6 (dirty) and 7 (clean) go
    np.testing.assert_array_equal(np.sort(p.load_rows), [9, 10])
    np.testing.assert_array_equal(p.evict_rows, [6])  # only dirty rows are written back
    assert c.slot_of[7] == -1 and c.slot_of[8] >= 0 and c.hits == 2 and c.requests == 8
    np.testing.assert_array_equal(c.row_of[p.slot_ids], [9, 10, 5])
    with pytest.raises(ValueError, match="'t': a batch reads 5 distinct rows, more than"):
        c.plan(np.arange(20, 25), train=False)
    with pytest.raises(ValueError, match="'t': id 100 outside"):
        c.plan(np.array([1, 100]), train=False)
    # a batch that fills the last free slots and evicts: its new rows are not the victims
    c = tier_store.RowCache(100, 4)
    c.plan(np.array([1, 2, 3]), train=False)
    p = c.plan(np.array([4, 5, 6]), train=False)
    assert sorted(c.row_of[p.slot_ids]) == [4, 5, 6] and sorted(c.row_of) == [3, 4, 5, 6]
    # LRU over many steps: every victim was used no later than every slot kept (the use queue
    # equals a scan of the stamps), and the state round-trips mid-way
    rng = np.random.default_rng(0)
    c, d = tier_store.RowCache(500, 64), None
    for step in range(200):
        before = c.stamp.copy()
        ids = rng.integers(0, 500, 40) // (1 + rng.integers(0, 4, 40))
        p = c.plan(ids, train=True)
        if d is not None:  # the reloaded directory makes the same choices
            np.testing.assert_array_equal(d.plan(ids, train=True).slot_ids, p.slot_ids)
        evicted = np.setdiff1d(p.load_slots, np.arange(c.used)[before[: c.used] < 0])
        kept = np.setdiff1d(np.flatnonzero(c.stamp < step), evicted)
        if len(evicted) and len(kept):
            assert before[evicted].max() <= before[kept].min(), step
        if step == 100:
            d = tier_store.RowCache(500, 64)
            d.load(c.state())
    assert c.evictions > 500
    f = tier_store.RowCache(100, 3, "lfu")
    for b in ([1, 2], [1, 2], [1, 3], [4]):  # 3 is least frequent: LFU evicts it, LRU 2
        f.plan(np.array(b), train=False)
    assert f.slot_of[3] == -1 and f.slot_of[2] >= 0
    # the directory round-trips
    g = tier_store.RowCache(100, 3, "lfu")
    g.load(f.state())
    np.testing.assert_array_equal(g.slot_of, f.slot_of)


def test_tier_pins_parse_with_clear_errors():
    got = tiers_lib.parse_tiers(("C1=ssd:64", "C2=dram:8"))
    assert got["C1"] == tiers_lib.TierSpec(table="C1", tier="ssd", cache_rows=64)
    for bad in ("C1=disk:8", "C1=ssd", "C1=ssd:0", "=ssd:8"):
        with pytest.raises(ValueError, match="TABLE=TIER:CACHE_ROWS"):
            tiers_lib.parse_tiers((bad,))
    schema = Schema(dense_names=(), features=(FeatureInfo(name="a", vocab_size=10),))
    with pytest.raises(ValueError, match=r"unknown tables \['b'\]"):
        tiers_lib.model_schema(schema, tiers_lib.parse_tiers(("b=ssd:4",)))


# -- training through the cache ----------------------------------------------------------------------

F, H, B = 4, 3, 16
VOCAB = (100, 110, 120, 130)
SCHEMA = Schema(
    dense_names=("a", "b"),
    features=tuple(
        FeatureInfo(name=f"f{i}", vocab_size=v, max_hotness=H) for i, v in enumerate(VOCAB)
    ),
)
PINS = ("f0=dram:56", "f2=ssd:64")  # a batch reads at most 48 distinct rows of a table


def _cfg(kind, opt):
    return DLRMConfig(
        model=DLRMModelConfig(embed_dim=8, bottom_mlp=(8, 8), top_mlp=(8, 1)),
        data=DataConfig(batch_size=B, eval_batch_size=B),
        dense_optim=DenseOptimConfig(name="sgd", learning_rate=0.1, b1=0.0),
        embedding_optim=EmbeddingOptimConfig(name=opt, learning_rate=0.1, initial_accumulator=0.1),
        mesh=MeshConfig(data_parallel=8),
        embeddings=EmbeddingShardingConfig(sharding=kind),
    )


def _batches(steps):
    rng = np.random.default_rng(0)
    return [
        Batch(
            dense_bn=rng.standard_normal((B, 2)).astype(np.float32),
            # half Zipf-like (some rows come back often), half uniform: the caches fill up
            ids_bfh=np.where(
                rng.random((B, F, H)) < 0.5,
                np.minimum(rng.zipf(1.3, (B, F, H)) - 1, 99),
                rng.integers(0, 100, (B, F, H)),
            ).astype(np.int32),
            labels_b=rng.integers(0, 2, B).astype(np.float32),
            weights_b=np.ones(B, np.float32),
        )
        for _ in range(steps)
    ]


def _state(cfg, schema):
    model = build_model(cfg, schema, nnx.Rngs(params=0))
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    tx = make_optimizer(cfg, params)
    state = TrainState(
        step=jax.numpy.zeros((), "int32"),
        params=params,
        opt_state=tx.init(params),
        batch_stats=stats,
        rng=initial_rng(0),
    )
    return model, state, jax.jit(make_train_step(graphdef, tx), donate_argnums=0)


def _tables(model, state):
    """The tables, each row with its row-wise Adagrad accumulator as the last column."""
    coll = model.embeddings
    bufs = {k: v[...] for k, v in state.params["embeddings"]["buffers"].items()}
    out = engine.export_tables(coll.layout, bufs, coll.table_specs, coll.feature_specs)
    accs = {
        path.split("/")[-1]: np.asarray(per["acc"][...])[:, None].repeat(8, 1)
        for path, per in state.opt_state["embedding"].items()
    }
    acc = engine.export_tables(coll.layout, accs, coll.table_specs, coll.feature_specs)
    return {t: np.concatenate([out[t], acc[t][:, :1]], axis=1) for t in out}


@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_training_through_the_cache_equals_the_engine(tmp_path, kind):
    cfg, steps = _cfg(kind, "rowwise_adagrad"), _batches(8)
    specs = tiers_lib.parse_tiers(PINS)
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.activate(mesh, cfg.mesh):
        ref_model, ref, ref_step = _state(cfg, SCHEMA)
        initial = _tables(ref_model, ref)
        ref_losses = []
        for b in steps:
            ref, m = ref_step(ref, b)
            ref_losses.append(float(m["loss"]))
        want = _tables(ref_model, ref)

        model, state, step = _state(cfg, tiers_lib.model_schema(SCHEMA, specs))
        tiers = tiers_lib.TieredTables(
            model,
            SCHEMA,
            specs,
            tmp_path,
            optimizer="rowwise_adagrad",
            initial_accumulator=0.1,
            seed=0,
            mesh=mesh,
        )
        tiers.create({t: initial[t] for t in ("f0", "f2")})
        losses, saved = [], None
        for i, b in enumerate(steps):
            state, tb = tiers.prepare(state, b, train=True)
            state, m = step(state, tb)
            losses.append(float(m["loss"]))
            if i == 3:
                state = tiers.checkpoint(state, 4)
                saved = jax.device_get(state)
        state = tiers.checkpoint(state, 8)
        got = _tables(model, state)
        first = {t: tiers.stores[t].read(np.arange(v)) for t, v in (("f0", 100), ("f2", 120))}
        stats = tiers.stats()
        # again from the checkpoint of step 4: the stores go back, the same steps follow
        tiers.restore(4)
        state = jax.device_put(saved, jax.tree.map(lambda x: x.sharding, state))
        for b in steps[4:]:
            state, tb = tiers.prepare(state, b, train=True)
            state, m = step(state, tb)
        state = tiers.checkpoint(state, 8)
        again = {t: tiers.stores[t].read(np.arange(v)) for t, v in (("f0", 100), ("f2", 120))}
        tiers.close()

    # table-wise: the same sums in the same order, bitwise; row-wise: a bag's rows sit in other
    # row shards when cached, so its partial sums add up in another order (float32 rounding)
    check = (
        np.testing.assert_array_equal
        if kind == "table_wise"
        else lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    )
    check(losses, ref_losses)
    for t in ("f1", "f3"):  # in memory
        check(got[t], want[t])
    for t in ("f0", "f2"):  # tiered: the store holds every row and its accumulator
        check(first[t], want[t])
        np.testing.assert_array_equal(again[t], first[t])  # resumed from step 4: bitwise
    assert 0 < stats["tier/f0/hit_rate_total"] < 1 and stats["tier/f2/ssd_read_mib"] > 0
    assert stats["tier/f0/dram_written_mib"] > 0  # rows were evicted and written back
    assert all(tiers.caches[t].evictions > 50 for t in ("f0", "f2"))


def test_tiers_refuse_column_split_caches(tmp_path):
    cfg = dataclasses.replace(_cfg("column_wise", "sgd"))
    specs = tiers_lib.parse_tiers(PINS)
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.activate(mesh, cfg.mesh):
        model, _, _ = _state(cfg, tiers_lib.model_schema(SCHEMA, specs))
        with pytest.raises(ValueError, match="'f0': its cache must be placed whole rows"):
            tiers_lib.TieredTables(
                model,
                SCHEMA,
                specs,
                tmp_path,
                optimizer="sgd",
                initial_accumulator=0.0,
                seed=0,
                mesh=mesh,
            )


def test_a_fresh_run_refuses_a_tier_dir_holding_another_runs_stores(tmp_path):
    """Two runs given one ``embeddings.tier_dir``: the second's fresh start would truncate the
    first's table files and delete its undo logs. It is refused, every file kept; the run that
    owns the folder may start afresh in it, and stores no run claims are refused too."""
    cfg, specs = _cfg("row_wise", "rowwise_adagrad"), tiers_lib.parse_tiers(PINS)
    shared = tmp_path / "shared"
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.activate(mesh, cfg.mesh):
        model, _, _ = _state(cfg, tiers_lib.model_schema(SCHEMA, specs))

        def fresh(owner):
            tables = tiers_lib.TieredTables(
                model,
                SCHEMA,
                specs,
                shared,
                optimizer="rowwise_adagrad",
                initial_accumulator=0.1,
                seed=0,
                mesh=mesh,
                owner=str(tmp_path / owner),
            )
            try:
                tables.create()
            finally:
                tables.close()

        fresh("a")
        files = {p: p.read_bytes() for p in sorted(shared.rglob("*")) if p.is_file()}
        assert shared / "f2" / "rows.f32" in files
        with pytest.raises(ConfigError, match=r"shared: holds the table stores of .*/a, not of"):
            fresh("b")
        assert {p: p.read_bytes() for p in sorted(shared.rglob("*")) if p.is_file()} == files
        fresh("a")
        (shared / tiers_lib.OWNER_FILE).unlink()  # stores of an older version, say
        with pytest.raises(ConfigError, match="holds the table stores of no run named"):
            fresh("a")


def test_the_trainer_trains_resumes_and_reports_with_tiered_tables(tmp_path, capsys):
    """dlrm/tiny with two tables tiered: hit rates and tier bytes in the train rows; a run
    killed after its step-40 checkpoint of the stores but before the trainer's (the stores are
    ahead of the checkpoint it resumes from) ends bitwise like the uninterrupted run."""
    cfg = get_preset("dlrm/tiny")
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(
            cfg.train,
            num_steps=60,
            checkpoint_every=20,
            log_every=20,
            max_checkpoints=3,
            eval_every=0,
            progress=False,
        ),
        mesh=dataclasses.replace(cfg.mesh, data_parallel=8),
        embeddings=EmbeddingShardingConfig(sharding="row_wise", tiers=("f0=dram:90", "f2=ssd:150")),
    )
    full = train(cfg, build_model, tmp_path / "full")
    rows = [json.loads(r) for r in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["split"] == "train"][-1]
    assert 0.5 < last["tier/f2/hit_rate"] <= 1 and last["tier/f0/dram_read_mib"] > 0
    assert last["tier/f2/ssd_written_mib"] > 0  # evicted rows went back
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    for step in (40, 60):
        shutil.rmtree(tmp_path / "resumed" / "checkpoints" / str(step))
    (tmp_path / "resumed" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 20)
    )
    capsys.readouterr()
    resumed = train(cfg, build_model, tmp_path / "resumed")
    assert "restored checkpoint step 20" in capsys.readouterr().err
    assert resumed == full
    # without tiers the same config trains too (the tables in the engine): comparable quality
    plain = train(
        dataclasses.replace(cfg, embeddings=EmbeddingShardingConfig(sharding="row_wise")),
        build_model,
        tmp_path / "plain",
    )
    assert abs(plain["auc"] - full["auc"]) < 0.05, (plain["auc"], full["auc"])
    # checkpoint evaluation of the row-wise tiered run: its tables whole, as its stores hold
    # them (test_a_tiered_run_evaluates_exports_and_serves_whole_tables); row-wise bags may add
    # their rows' partial sums in another order than through the caches (float32 rounding)
    got = dlrm_evaluate.main(["--workdir", str(tmp_path / "full")])
    assert got["step"] == 60 and got["num_examples"] == full["num_examples"]
    for key in ("auc", "logloss"):
        np.testing.assert_allclose(got[key], full[key], rtol=1e-6, err_msg=key)


def test_a_tiered_run_evaluates_exports_and_serves_whole_tables(tmp_path):
    """Checkpoint evaluation, export and the exported model of a tiered run: its tables whole
    (the stores' rows as of the checkpoint, laid out in device memory). Each kept checkpoint
    evaluates to the metrics the trainer measured through the caches at that step (table-wise:
    the same sums in the same order, bitwise), the stores are left as they were, and the
    artifact holds every row and scores as the evaluation does. The run also resumes on
    another device count."""
    cfg = get_preset("dlrm/tiny")
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(
            cfg.train,
            num_steps=30,
            checkpoint_every=10,
            log_every=10,
            eval_every=10,
            max_checkpoints=3,
            progress=False,
        ),
        mesh=dataclasses.replace(cfg.mesh, data_parallel=8),
        embeddings=EmbeddingShardingConfig(
            sharding="table_wise", tiers=("f0=dram:90", "f2=ssd:150")
        ),
    )
    wd = tmp_path / "run"
    train(cfg, build_model, wd)
    rows = [json.loads(r) for r in (wd / "metrics.jsonl").read_text().splitlines()]
    trained = {r["step"]: r for r in rows if r["split"] == "eval"}
    assert sorted(trained) == [10, 20, 30]
    stores = {p: p.read_bytes() for p in sorted((wd / "tiers").rglob("*.*"))}
    assert (wd / "tiers" / "f2" / "undo.10.log").stat().st_size > 0  # step 10 is in the logs
    for step in (10, 30, 20):
        got = dlrm_evaluate.main(["--workdir", str(wd), "--step", str(step)])
        assert got["step"] == step
        for key in ("auc", "logloss", "num_examples"):
            assert got[key] == trained[step][key], (step, key)
    assert {p: p.read_bytes() for p in sorted((wd / "tiers").rglob("*.*"))} == stores

    # The checkpoint's scores per example (on the training run's 8 devices), against the
    # artifact's: the exported tables are whole (every row of the stores' file, the latest
    # checkpoint's), the scores the evaluation's up to float32 rounding.
    with restored(DLRMConfig, build_model, wd, num_devices=8) as r:
        dense, ids, want = [], [], []
        for b in r.exp.source.eval_batches():
            logits = r.exp._eval_step(r.params, r.batch_stats, r.exp.device_batch(b))
            want.append(np.asarray(jax.nn.sigmoid(logits)))
            dense.append(b.dense_bn)
            ids.append(b.ids_bfh)
    dense, ids, want = np.concatenate(dense), np.concatenate(ids), np.concatenate(want)
    assert (ids[:, 2] >= 150).any()  # the batches read rows beyond the cache's 150
    out = tmp_path / "model"
    man = export_workdir(
        DLRMConfig, build_model, ExportArgs(workdir=str(wd), out=str(out)), family="dlrm"
    )
    assert man["source"]["step"] == 30
    vocab = {f["table"]: f["vocab_size"] for f in man["inputs"]["features"]}
    with np.load(out / "weights.npz") as z:
        for t in ("f0", "f2"):
            table = z[f"embeddings/tables/{t}/w"]  # float32 [V, D]
            whole = np.fromfile(wd / "tiers" / t / "rows.f32", np.float32)
            np.testing.assert_array_equal(table, whole.reshape(vocab[t], -1)[:, : table.shape[1]])
    got = Model.load(out).predict(dense, ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)

    # Resumed from the step-10 checkpoint on 4 devices (the caches re-laid out for them), the
    # run ends as it did on 8, up to the rounding of the dense gradients' all-reduce over
    # another device count (measured: logloss within 1e-9 relative, the same AUC).
    on4 = tmp_path / "on4"
    shutil.copytree(wd, on4)
    for step in (20, 30):
        shutil.rmtree(on4 / "checkpoints" / str(step))
    (on4 / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 10)
    )
    four = train(
        dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data_parallel=4)),
        build_model,
        on4,
    )
    for key in ("auc", "logloss"):
        np.testing.assert_allclose(four[key], trained[30][key], rtol=1e-6, err_msg=key)


def test_row_sharded_reads_return_exact_bits_including_negative_zero():
    """The row-sharded read sums every device's (mostly empty) share: as bit patterns, so a
    row holding -0.0 comes back as -0.0 (a float sum would make it +0.0)."""
    mesh = sharding.make_mesh(MeshConfig(data_parallel=8))
    spec = tiers_lib.TierSpec(table="t", tier="dram", cache_rows=32)
    p = tiers_lib._Placed(
        spec=spec,
        feature=0,
        hotness=1,
        num_rows=100,
        dim=2,
        opt_path="",
        opt_names=(),
        pos=np.arange(32),
        buffer_rows=32,
        block_rows=4,
    )
    buf = np.arange(64, dtype=np.float32).reshape(32, 2)
    buf[5] = -0.0
    x = jax.device_put(buf, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    rows = np.array([5, 31, 0, 32], np.int32)  # 32: padding, reads zeros
    (got,) = jax.jit(lambda a, r: tiers_lib._gather_rows(p, mesh, [a], r))(x, rows)
    got = np.asarray(got)
    np.testing.assert_array_equal(got[:3], buf[[5, 31, 0]])
    assert np.signbit(got[0]).all() and not got[3].any()
