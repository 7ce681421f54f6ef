"""The learned sharding cost model and its planner (issue 39): the measuring harness does the
engine's work, the model learns a device's cost as a set, the search keeps plans valid and finds
the cheaper ones the model knows of, and the config and ``recscale.plan`` reach it."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from recscale.config_io import ConfigError
from recscale.embeddings import learned_cost, learned_planner, planner, shard_cost
from recscale.embeddings.learned_cost import CostPredictor, Sample
from recscale.embeddings.shard_cost import ShardWork
from recscale.kernels.embedding_bag import reference as bag_ref
from tpu_gpu_configs.profiles import get_profile

CPU = get_profile("cpu-2core")


def test_zipf_ids_put_the_hottest_row_first_at_its_share():
    rng = np.random.default_rng(0)
    ids = shard_cost.zipf_ids(10_000, 1.1, (200_000,), rng)
    assert ids.min() >= 0 and ids.max() < 10_000
    share = np.mean(ids == 0)
    assert share == pytest.approx(planner.hot_fraction(10_000, 1.1), rel=0.1)
    assert np.mean(shard_cost.zipf_ids(10_000, 0.0, (200_000,), rng) == 0) < 5e-4


def test_device_inputs_pool_each_shard_as_its_own_table():
    """The harness's stacked buffers and keys give each slot the pooled rows of its own shard
    (a row-wise shard: only the ids in its rows), as the engine's lookup forms them."""
    rw = dict(table_rows=90, rows=30, row_start=30, kind="row_wise")
    shards = [
        ShardWork(table_rows=50, rows=50, width=8, bags=16, hotness=3, zipf=1.0),
        ShardWork(width=8, bags=16, hotness=2, **rw),
        ShardWork(table_rows=40, rows=40, width=4, bags=16, hotness=1),
    ]
    parts = shard_cost.device_inputs(shards, pad_hotness=5, seed=3)
    assert [(r, k.shape, w) for r, k, w in parts] == [(40, (16, 5), 4), (80, (32, 5), 8)]
    rows8, keys8, _ = parts[1]
    buf = jnp.arange(rows8 * 8, dtype=jnp.float32).reshape(rows8, 8)
    pooled = np.asarray(bag_ref.pool(buf, jnp.asarray(keys8)))
    # the row-wise slot (second in the buffer, after the 50-row table) reads only its own rows
    rw = keys8[16:]
    assert ((rw == rows8) | ((rw >= 50) & (rw < 80))).all() and (rw[:, 2:] == rows8).all()
    assert (rw < rows8).any() and (rw == rows8).any()
    np.testing.assert_allclose(pooled[16:], np.asarray(bag_ref.pool(buf, jnp.asarray(rw))))


def test_measure_times_the_engine_kernels_of_a_set():
    shards = [
        ShardWork(table_rows=2000, rows=2000, width=16, bags=256, hotness=4, zipf=1.0),
        ShardWork(table_rows=500, rows=500, width=32, bags=64, hotness=1, kind="data_parallel"),
    ]
    t = shard_cost.measure(shards, repeats=2)
    assert 0 < t < 1.0


def test_device_work_covers_every_shard_of_a_plan():
    tables = [
        planner.PlannerTable(name=f"t{i}", num_rows=1000 * (i + 1), dim=16, pooling_factor=2.0)
        for i in range(6)
    ]
    pins = ("row_wise", "data_parallel", "column_wise", "table_wise", "table_wise", "table_wise")
    tables = [dataclasses.replace(t, allowed=(k,)) for t, k in zip(tables, pins, strict=True)]
    p = planner.plan(tables, CPU, 4, batch_size=512)
    work = shard_cost.device_work(p, tables, 4, 512)
    kinds = sorted(s.kind for d in work for s in d)
    cw = len(p.by_table()["t2"].shards)
    assert kinds.count("row_wise") == 4 and kinds.count("data_parallel") == 4
    assert kinds.count("column_wise") == cw and kinds.count("table_wise") == 3
    assert all(s.bags == 128 for d in work for s in d if s.kind == "data_parallel")
    rw = sorted((s.row_start, s.rows) for d in work for s in d if s.kind == "row_wise")
    assert rw[0][0] == 0 and sum(r for _, r in rw) == 1000


# ------------------------------------------------------------------------------------------------
# The model, on a known cost: each slot scans all its padded keys, lookups cost by bytes, and
# every buffer (distinct width) of a device costs a fixed call: not a sum of per-table costs.


def truth(shards: list[ShardWork], pad: int) -> float:
    scan = sum(s.bags * max(pad, s.hotness) for s in shards) * 2e-9
    looks = sum(s.bags * s.hotness * shard_cost.valid_share(s) * s.width for s in shards) * 4e-10
    calls = len({(s.width, s.replicated) for s in shards}) * 2e-4
    return 1e-4 + scan + looks + calls


def random_set(rng) -> tuple[list[ShardWork], int]:
    pad = int(rng.choice([1, 4, 16]))
    out = []
    for _ in range(int(rng.integers(1, 9))):
        v = int(10 ** rng.uniform(3, 6))
        kind = str(rng.choice(shard_cost.KINDS))
        m = int(rng.choice([2, 4, 8]))
        rows = -(-v // m) if kind == "row_wise" else v
        start = int(rng.integers(0, m)) * rows if kind == "row_wise" else 0
        start = min(start, v - 1)
        w = int(rng.choice([8, 16, 32, 64]))
        out.append(
            ShardWork(
                table_rows=v,
                rows=max(1, min(rows, v - start)),
                row_start=start,
                width=w // 2 if kind == "column_wise" else w,
                bags=1024 // m if kind == "data_parallel" else 1024,
                hotness=int(rng.integers(1, pad + 1)),
                zipf=float(rng.choice([0.0, 1.0])),
                kind=kind,
            )
        )
    return out, pad


@pytest.fixture(scope="module")
def trained():
    rng = np.random.default_rng(0)
    samples = []
    for i in range(700):
        shards, pad = random_set(rng)
        samples.append(Sample(f"task{i // 7}", pad, tuple(shards), truth(shards, pad)))
    tr, te = learned_cost.split_by_task(samples)
    model = learned_cost.train(tr, steps=1000, seed=0, members=2)
    return model, tr, te


def test_the_model_learns_a_set_cost_the_analytic_formula_cannot(trained):
    model, tr, te = trained
    assert not {s.task for s in tr} & {s.task for s in te}  # held out by task
    factor = learned_cost.fit_analytic(tr, CPU)
    report = learned_cost.evaluate(model, factor, te, CPU)
    assert report["learned_mape"] < 0.10, report
    assert report["learned_mape"] < report["analytic_mape"] / 3, report
    assert report["learned_spearman"] > 0.95 > report["analytic_spearman"], report


def test_the_ensemble_predicts_its_members_geometric_mean(trained):
    model, _, te = trained
    stacked = {k for k in model.weights if k.endswith(("_w", "_b"))}  # [members, ...]
    members = [
        CostPredictor(
            {k: v[i : i + 1] if k in stacked else v for k, v in model.weights.items()}, {}
        )
        for i in range(2)
    ]
    for s in te[:10]:
        one = [m.seconds(list(s.shards), s.pad) for m in members]
        assert model.seconds(list(s.shards), s.pad) == pytest.approx(np.sqrt(one[0] * one[1]))
    assert one[0] != one[1]


def test_a_saved_model_predicts_the_same_and_bad_files_say_which(trained, tmp_path):
    model, _, te = trained
    model.save(tmp_path / "m.npz")
    again = CostPredictor.load(tmp_path / "m.npz")
    for s in te[:20]:
        assert again.seconds(list(s.shards), s.pad) == model.seconds(list(s.shards), s.pad)
    (tmp_path / "bad.npz").write_bytes(b"not a model")
    with pytest.raises(ConfigError, match=r"bad\.npz: not a learned cost model"):
        CostPredictor.load(tmp_path / "bad.npz")
    digest = learned_cost.file_digest(tmp_path / "m.npz")
    assert CostPredictor.for_profile("x", tmp_path / "m.npz", digest=digest) is not None
    with pytest.raises(ConfigError, match="changed since this run planned"):
        CostPredictor.for_profile("x", tmp_path / "m.npz", digest="0" * 16)
    with pytest.raises(ConfigError, match="no learned cost model for profile 'tpu-v9'"):
        CostPredictor.for_profile("tpu-v9")
    table = tmp_path / "t.jsonl"
    table.write_text('{"version": 1}\n{"task": "a", "pad": 1, "seconds": 1, "shards": [[1]]}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:2: bad cost-table sample"):
        learned_cost.load_table(table)


def _tables(rng, n: int) -> list[planner.PlannerTable]:
    return [
        planner.PlannerTable(
            name=f"t{i}",
            num_rows=int(10 ** rng.uniform(3, 5.5)),
            dim=int(rng.choice([16, 32, 64])),
            pooling_factor=float(rng.integers(1, 9)),
            zipf_exponent=1.0,
        )
        for i in range(n)
    ]


def _truth_of(plan, tables, n, batch) -> float:
    sets = shard_cost.device_work(plan, tables, n, batch)
    pad = max(int(np.ceil(t.pooling_factor)) for t in tables)
    comm = np.zeros(n)
    for tp in plan.tables:
        for sh in tp.shards:
            comm[sh.device] += sh.comm_s
    return max(truth(s, pad) + c for s, c in zip(sets, comm, strict=True))


def test_learned_plans_are_valid_and_cheaper_under_the_cost_it_learned(trained):
    model, tr, _ = trained
    rng = np.random.default_rng(1)
    factor = learned_cost.fit_analytic(tr, CPU)
    cm = dataclasses.replace(planner.CostModel(), lookup=factor)
    wins = 0
    for _ in range(3):
        tables = _tables(rng, 24)
        total = sum(t.num_rows * (t.dim * 4 + 4) for t in tables)
        prof = dataclasses.replace(CPU, memory_bytes=1.5 * total / 4 / planner.MEMORY_FRACTION)
        lp = learned_planner.plan(tables, prof, 4, batch_size=1024, predictor=model, cost_model=cm)
        ap = planner.plan(tables, prof, 4, batch_size=1024, cost_model=cm)
        mem = np.zeros(4)  # recomputed from the shards, not the planner's own count
        for tp in lp.tables:
            for sh in tp.shards:
                mem[sh.device] += sh.memory_bytes
        assert (mem <= lp.memory_limit_bytes).all() and np.allclose(mem, lp.device_memory_bytes)
        # its predicted devices are the model's prediction of the sets the engine would run
        sets = shard_cost.device_work(lp, tables, 4, 1024)
        kernel = [
            model.seconds(s, max(int(np.ceil(t.pooling_factor)) for t in tables)) for s in sets
        ]
        np.testing.assert_allclose(lp.device_terms_s[:, 0], kernel, rtol=1e-9)
        for t, tp in zip(tables, lp.tables, strict=True):  # every row and column placed once
            cells = sum((s.rows[1] - s.rows[0]) * (s.cols[1] - s.cols[0]) for s in tp.shards)
            want = t.num_rows * t.dim * (4 if tp.sharding == "data_parallel" else 1)
            assert tp.table == t.name and cells == want, tp
        wins += _truth_of(lp, tables, 4, 1024) < _truth_of(ap, tables, 4, 1024)
    assert wins == 3


def test_empty_row_shards_cost_nothing_and_a_finer_split_is_tried_when_one_cannot_fit(trained):
    model = trained[0]
    few = planner.PlannerTable(name="few", num_rows=5, dim=16, allowed=("row_wise",))
    other = planner.PlannerTable(name="o", num_rows=3000, dim=16, pooling_factor=4.0)
    p = learned_planner.plan([few, other], CPU, 8, batch_size=256, predictor=model)
    (rw,) = [tp for tp in p.tables if tp.table == "few"]
    assert sum(s.rows[1] > s.rows[0] for s in rw.shards) == 5  # 5 rows on 8 devices: 3 empty
    sets = shard_cost.device_work(p, [few, other], 8, 256)
    np.testing.assert_allclose(
        p.device_terms_s[:, 0], [model.seconds(s, 4) for s in sets], rtol=1e-9
    )
    # a column-only table whose halves exceed a device but whose quarters fit
    wide = planner.PlannerTable(name="w", num_rows=10_000, dim=64, allowed=("column_wise",))
    half = 10_000 * (32 * 4 + 4)
    prof = dataclasses.replace(CPU, memory_bytes=0.8 * half / planner.MEMORY_FRACTION)
    p = learned_planner.plan([wide], prof, 4, batch_size=256, predictor=model)
    assert len(p.tables[0].shards) == 4


def test_the_learned_planner_keeps_pins_and_names_a_table_that_cannot_fit(trained):
    model = trained[0]
    tables = _tables(np.random.default_rng(2), 6)
    tables[0] = dataclasses.replace(tables[0], allowed=("column_wise",))
    tables[1] = dataclasses.replace(tables[1], allowed=("row_wise",))
    p = learned_planner.plan(tables, CPU, 4, batch_size=512, predictor=model)
    assert p.tables[0].sharding == "column_wise" and p.tables[1].sharding == "row_wise"
    tiny = dataclasses.replace(CPU, memory_bytes=1000)
    with pytest.raises(ValueError, match="table 't.*does not fit"):
        learned_planner.plan(tables, tiny, 4, batch_size=512, predictor=model)


def test_the_engine_plans_with_the_learned_model_and_records_its_digest(trained, tmp_path):
    """``--embeddings.planner learned``: the layout comes from the learned planner and trains
    as the analytic layout does (the engine is exact under any plan); ``resolve`` records the
    model's digest, and a changed file is refused."""
    from dlrm.model import build_model  # noqa: PLC0415
    from recscale.config import get_preset  # noqa: PLC0415
    from recscale.embeddings import plan_inputs  # noqa: PLC0415
    from recscale.train.loop import train  # noqa: PLC0415

    trained[0].save(tmp_path / "m.npz")
    base = get_preset("dlrm/tiny")
    e = dataclasses.replace(
        base.embeddings,
        planner="learned",
        cost_model_path=str(tmp_path / "m.npz"),
        profile="cpu-2core",
    )
    cfg = dataclasses.replace(
        base, embeddings=e, train=dataclasses.replace(base.train, num_steps=3)
    )
    resolved = plan_inputs.resolve(cfg)
    assert resolved.embeddings.cost_model_digest == learned_cost.file_digest(tmp_path / "m.npz")
    final = train(resolved, build_model, tmp_path / "run")
    assert final["step"] == 3 and np.isfinite(final["logloss"])
    text = (tmp_path / "run" / "embedding_plan.txt").read_text()
    assert "embedding plan (learned): 4 tables on 8 devices" in text
    other = CostPredictor(dict(trained[0].weights), trained[0].meta)
    other.weights["out_b"] = other.weights["out_b"] + 1  # another model at the same path
    other.save(tmp_path / "m.npz")
    with pytest.raises(ConfigError, match="changed since this run planned"):
        train(resolved, build_model, tmp_path / "run2")


def test_the_shipped_model_is_loadable_and_describes_its_training():
    model = CostPredictor.for_profile("cpu-2core")
    meta = model.meta
    assert meta["held_out"]["learned_mape"] < meta["held_out"]["analytic_mape"]
    assert meta["machine"]["backend"] == "cpu" and meta["train_samples"] > 500
    assert meta["members"] == model.encoding_shape[0] == 5
