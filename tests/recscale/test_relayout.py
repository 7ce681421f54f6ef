"""Restoring a training state onto another mesh and embedding sharding (``recscale.train
.relayout``): outputs equal, the tables and their optimizer state move bitwise, training goes
on with the same loss, round trips are exact, and what cannot be re-laid out exactly is refused.

Time: one trained run (row-wise on 8 devices); the other states are fabricated with the
layout's invariants (zero padding rows, initial accumulators), so no other init or train step
is compiled."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlrm.presets  # noqa: F401
from dlrm.config import DLRMConfig
from dlrm.model import build_model
from recscale import config as config_lib
from recscale import sharding
from recscale.config import EmbeddingShardingConfig, KernelConfig, get_preset
from recscale.embeddings import engine, relayout
from recscale.train import checkpoint
from recscale.train.checkpoint import Checkpointer
from recscale.train.evaluation import EvalArgs, evaluate_workdir
from recscale.train.experiment import Experiment
from recscale.train.steps import TrainState, make_train_step

STEPS = 3
PINS = ("f0=column_wise", "f1=data_parallel", "f2=table_row_wise", "f3=table_column_wise")

# Logits of row-wise tables differ from table-wise ones in float32 rounding only: a bag's rows
# (up to 3 here) sit on different devices, whose partial sums are added device by device, where
# one table-wise shard adds them in bag order. The re-associated sum moves a pooled value by
# about an ulp, and the two small MLPs carry that to the logits (seen: 4e-8). Table-wise on 2
# and on 1 device are bitwise equal (asserted), so nothing else differs.
LOGITS_ATOL = 1e-6
# The batch mean of the loss sums per-device partial sums in another order on 1 device (seen:
# 1 ulp); 8 and 2 devices give the same bits.
LOSS_RTOL = 1e-6


def _cfg(kind, n, opt="rowwise_adagrad", **emb):
    cfg = get_preset("dlrm/tiny")
    return dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cfg.mesh, data_parallel=n),
        # a non-zero initial accumulator: rows a layout leaves unused must get it, not zero
        embedding_optim=dataclasses.replace(cfg.embedding_optim, name=opt, initial_accumulator=0.1),
        embeddings=EmbeddingShardingConfig(sharding=kind, **emb),
    )


@contextlib.contextmanager
def _active(cfg):
    """The experiment of ``cfg`` inside its mesh and engine."""
    with sharding.activate(sharding.make_mesh(cfg.mesh), cfg.mesh):
        yield Experiment.build(cfg, build_model)


def _save(ckpt, state, cfg):
    items = {
        "params": state.params,
        "opt_state": state.opt_state,
        "batch_stats": state.batch_stats,
        "rng": {"key_data": state.rng},
    }
    step = int(state.step)
    ckpt.save(step, items, {"step": step, "layout": relayout.layout_meta(cfg)})
    ckpt.wait()


def _restore(ckpt, step, exp, cfg) -> TrainState:
    """The resume the trainer does: the layout from the meta, ``restore_relaid`` when needed."""
    saved = ckpt.read_meta(step)["layout"]
    rng = {"key_data": exp.abstract_state.rng}
    trees = relayout.restore_relaid(ckpt, step, exp, cfg, build_model, saved, extra={"rng": rng})
    step_arr = jax.device_put(jnp.asarray(step, jnp.int32), sharding.replicated())
    return TrainState(step=step_arr, rng=trees.pop("rng")["key_data"], **trees)


def _logits(exp, state) -> np.ndarray:
    batch = exp.device_batch(next(iter(exp.source.eval_batches())))
    return np.asarray(exp._eval_step(state.params, state.batch_stats, batch))


def _next_loss(exp, state) -> float:
    step = jax.jit(make_train_step(exp.graphdef, exp.tx), donate_argnums=0)
    _, metrics = step(state, exp.device_batch(exp.source.train_batch(int(state.step))))
    return float(metrics["loss"])


def _flat(state) -> dict[str, np.ndarray]:
    """Every array of the state's params / opt_state / batch_stats on the host, by path."""
    trees = {"params": state.params, "opt_state": state.opt_state, "batch_stats": state.batch_stats}
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(trees))[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def _assert_bitwise(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    assert got.tobytes() == want.tobytes(), f"{what} differs"


def _tables(exp, state) -> dict[str, dict[str, np.ndarray]]:
    """Per table: its rows (``engine.export_tables``) and its optimizer state (``acc`` per row,
    read back from every shard holding the row; ``m``/``v`` per element)."""
    coll = nnx.merge(exp.graphdef, state.params, state.batch_stats).embeddings
    keys = {bl.key: f"embeddings/buffers/{bl.key}" for bl in coll.layout.buffers}
    specs = (coll.table_specs, coll.feature_specs)
    bufs = {k: state.params["embeddings"]["buffers"][k][...] for k in keys}
    out = {n: {"table": t} for n, t in engine.export_tables(coll.layout, bufs, *specs).items()}
    emb = state.opt_state["embedding"]
    for name in emb[next(iter(keys.values()))]:
        arrays = {k: np.asarray(emb[p][name][...]) for k, p in keys.items()}
        if name == "acc":
            per = _read_rows(coll, arrays)
        else:
            per = engine.export_tables(coll.layout, arrays, *specs)
        for n, v in per.items():
            out[n][name] = v
    return out


def _slots(coll):
    """``(buffer layout, table, buffer row, table row, rows)`` of every non-padding slot."""
    for bl in coll.layout.buffers:
        for d in range(1 if bl.replicated else coll.layout.num_devices):
            for s, f in enumerate(bl.feature[d]):
                if bl.row_count[d][s]:
                    table = coll.feature_specs[f].table
                    row = d * bl.rows + bl.offset[d][s]
                    yield bl, table, row, bl.row_start[d][s], bl.row_count[d][s]


def _read_rows(coll, arrays) -> dict[str, np.ndarray]:
    """Per-row state ``{table: [V]}`` from per-buffer-row arrays; every shard of a row (the
    column shards of a column-split table) must hold the same value."""
    out = {t.name: np.full(t.num_rows, np.nan, np.float32) for t in coll.table_specs}
    for bl, table, row, r0, count in _slots(coll):
        got, seen = arrays[bl.key][row : row + count], out[table][r0 : r0 + count]
        ok = np.isnan(seen) | (seen.view(np.uint32) == got.view(np.uint32))
        assert ok.all(), f"{table}: column shards disagree on their rows' accumulators"
        out[table][r0 : r0 + count] = got
    return out


def _place_rows(coll, per_table, fill) -> dict[str, np.ndarray]:
    """The inverse of ``_read_rows``: every shard of a row gets its value; other rows ``fill``."""
    out = {}
    for bl in coll.layout.buffers:
        n = 1 if bl.replicated else coll.layout.num_devices
        out[bl.key] = np.full(n * bl.rows, fill, np.float32)
    for bl, table, row, r0, count in _slots(coll):
        out[bl.key][row : row + count] = per_table[table][r0 : r0 + count]
    return out


def _fabricated(exp, seed) -> TrainState:
    """A random state of ``exp``'s layout that keeps the layout's invariants (zero padding rows
    and moments, ``initial_accumulator`` in unused accumulator rows), without compiling an init."""
    rng = np.random.default_rng(seed)
    abstract = exp.abstract_state
    coll = nnx.merge(exp.graphdef, abstract.params, abstract.batch_stats).embeddings
    tables = coll.table_specs
    index = [next(i for i, t in enumerate(tables) if t.name == f.table) for f in coll.feature_specs]

    def place(scale):
        values = [scale * rng.standard_normal((t.num_rows, t.dim), np.float32) for t in tables]
        return engine.init_buffers(coll.layout, lambda i: values[i], index, len(tables))

    def fake(sds):
        if jnp.issubdtype(sds.dtype, jnp.floating):
            value = rng.standard_normal(sds.shape).astype(sds.dtype)
        else:
            value = np.full(sds.shape, STEPS, sds.dtype)  # e.g. Adam's count
        return jax.device_put(value, sds.sharding)

    bufs = place(0.1)
    leaves = []
    for path, var in nnx.to_flat_state(abstract.params):
        v = var.get_value()
        value = bufs[path[-1]] if path[:2] == ("embeddings", "buffers") else fake(v)
        leaves.append((path, var.replace(jax.device_put(value, v.sharding))))
    states = {"m": place(0.01), "v": {k: x * x for k, x in place(0.01).items()}}
    acc = {t.name: rng.random(t.num_rows).astype(np.float32) for t in tables}
    states["acc"] = _place_rows(coll, acc, exp.cfg.embedding_optim.initial_accumulator)
    emb = {
        p: {
            k: var.replace(jax.device_put(states[k][p.split("/")[-1]], var.get_value().sharding))
            for k, var in per.items()
        }
        for p, per in abstract.opt_state["embedding"].items()
    }
    opt = {"dense": jax.tree.map(fake, abstract.opt_state["dense"]), "embedding": emb}
    return TrainState(
        step=jnp.asarray(STEPS, jnp.int32),
        params=nnx.from_flat_state(leaves),
        opt_state=opt,
        batch_stats=jax.tree.map(fake, abstract.batch_stats),
        rng=fake(abstract.rng),
    )


@pytest.fixture
def no_fingerprints(monkeypatch):
    """Checkpoints without their integrity fingerprints (tested in test_fault_tolerance): each
    saved or restored layout compiles a fingerprint program, about a second here. The resume
    test keeps them, so they are checked across a re-layout there."""
    monkeypatch.setattr(checkpoint, "fingerprints", lambda trees: {})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Row-wise on 8 devices, trained ``STEPS`` steps and checkpointed; what it computes next."""
    cfg = _cfg("row_wise", 8)
    workdir = tmp_path_factory.mktemp("row_wise_8")
    ckpt = Checkpointer(workdir / "checkpoints", async_save=False)
    with _active(cfg) as exp:
        state = exp.init_state()
        step = jax.jit(make_train_step(exp.graphdef, exp.tx), donate_argnums=0)
        for s in range(STEPS):
            state, _ = step(state, exp.device_batch(exp.source.train_batch(s)))
        _save(ckpt, state, cfg)
        out = dict(
            cfg=cfg,
            ckpt=ckpt,
            workdir=workdir,
            logits=_logits(exp, state),
            tables=_tables(exp, state),
            flat=_flat(state),
            eval=exp.evaluate(state.params, state.batch_stats),
        )
        _, metrics = step(state, exp.device_batch(exp.source.train_batch(STEPS)))
        out["loss"] = float(metrics["loss"])
    yield out
    ckpt.close()


def test_row_wise_on_8_devices_resumes_table_wise_on_2_and_on_1_device(trained):
    logits = {}
    for kind, n in (("table_wise", 2), ("row_wise", 1)):  # on 1 device every table is whole
        cfg = _cfg(kind, n)
        with _active(cfg) as exp:
            assert relayout.needs_relayout(trained["ckpt"].read_meta(STEPS)["layout"], cfg)
            state = _restore(trained["ckpt"], STEPS, exp, cfg)
            a = exp.abstract_state
            for got, want in zip(
                jax.tree.leaves((state.params, state.opt_state)),
                jax.tree.leaves((a.params, a.opt_state)),
                strict=True,
            ):
                assert got.sharding == want.sharding  # laid out for this mesh
            tables = _tables(exp, state)
            assert tables.keys() == trained["tables"].keys()
            for name, per in trained["tables"].items():
                assert per.keys() == {"table", "acc"}
                for k, want in per.items():
                    _assert_bitwise(tables[name][k], want, f"{name} {k} on {n} devices")
            assert np.any(trained["tables"]["f0"]["acc"] > 0), "training must have moved them"
            flat = _flat(state)
            for path, want in trained["flat"].items():
                if "embedding" not in path:  # dense parameters and their optax state
                    _assert_bitwise(flat[path], want, path)
            logits[n] = _logits(exp, state)
            np.testing.assert_allclose(logits[n], trained["logits"], rtol=0, atol=LOGITS_ATOL)
            loss = _next_loss(exp, state)
            np.testing.assert_allclose(loss, trained["loss"], rtol=LOSS_RTOL)
    _assert_bitwise(logits[2], logits[1], "table-wise logits on 2 and on 1 device")


def _round_trip(ckpt, cfg_a, cfg_b, tmp_path, *, with_logits=False):
    """A (saved in ``ckpt``) -> B -> A. Asserts B holds A's tables and optimizer state; returns
    the state back on A (host arrays by path) and (``with_logits``) its logits."""
    ckpt_b = Checkpointer(tmp_path / "b", async_save=False)
    with _active(cfg_b) as exp:
        state = _restore(ckpt, STEPS, exp, cfg_b)
        tables_b = _tables(exp, state)
        _save(ckpt_b, state, cfg_b)
    with _active(cfg_a) as exp:
        back = _restore(ckpt_b, STEPS, exp, cfg_a)
        tables_a = _tables(exp, back)
        logits = _logits(exp, back) if with_logits else None
    ckpt_b.close()
    for name, per in tables_a.items():
        for k, want in per.items():
            _assert_bitwise(tables_b[name][k], want, f"{name} {k} on B")
    return _flat(back), logits


def test_evaluation_restores_the_layout_the_checkpoint_records(trained, no_fingerprints):
    """The run's config.json says table-wise (as after a resume that changed it), the checkpoint
    was saved row-wise on 8 devices: evaluation follows the checkpoint's layout."""
    later = dataclasses.replace(
        trained["cfg"], embeddings=EmbeddingShardingConfig(sharding="table_wise")
    )
    config_lib.save_json(later, trained["workdir"] / "config.json")
    got = evaluate_workdir(DLRMConfig, build_model, EvalArgs(workdir=str(trained["workdir"])))
    assert got["step"] == STEPS and got["num_examples"] == trained["eval"]["num_examples"]
    for key in ("logloss", "auc"):  # table-wise sums of the row-wise tables (LOGITS_ATOL)
        np.testing.assert_allclose(got[key], trained["eval"][key], rtol=1e-6, err_msg=key)


def test_round_trip_of_the_trained_run_is_bitwise(trained, tmp_path, no_fingerprints):
    """Row-wise on 8 -> every other sharding type (column-wise accumulators included) on 4 ->
    row-wise on 8: the original arrays, and the original logits bitwise (same layout, same math)."""
    cfg_b = _cfg("auto", 4, per_table=PINS, host_size=2)
    flat, logits = _round_trip(trained["ckpt"], trained["cfg"], cfg_b, tmp_path, with_logits=True)
    assert flat.keys() == trained["flat"].keys()
    for path, want in trained["flat"].items():
        _assert_bitwise(flat[path], want, path)
    _assert_bitwise(logits, trained["logits"], "logits after the round trip")


@pytest.mark.parametrize(
    "opt, kind_a, n_a, kind_b, n_b",
    [
        ("adam", "auto", 4, "row_wise", 2),  # lazy Adam moments: per element, like the rows
        ("sgd", "column_wise", 2, "table_wise", 1),  # no optimizer state
    ],
)
def test_round_trip_is_bitwise_for_every_optimizer(
    opt, kind_a, n_a, kind_b, n_b, tmp_path, no_fingerprints
):
    pins = PINS if kind_a == "auto" else ()
    cfg_a = _cfg(kind_a, n_a, opt, per_table=pins, host_size=2)
    _assert_fabricated_round_trip(cfg_a, _cfg(kind_b, n_b, opt), tmp_path, seed=1)


def _assert_fabricated_round_trip(cfg_a, cfg_b, tmp_path, *, seed: int, check_a=None) -> None:
    """A fabricated state saved under ``cfg_a``, restored under ``cfg_b`` and back: bitwise.
    ``check_a(exp)``: more checks of ``cfg_a``'s experiment."""
    ckpt = Checkpointer(tmp_path / "a", async_save=False)
    with _active(cfg_a) as exp:
        if check_a is not None:
            check_a(exp)
        state = _fabricated(exp, seed=seed)
        want = _flat(state)
        _save(ckpt, state, cfg_a)
    flat, _ = _round_trip(ckpt, cfg_a, cfg_b, tmp_path)
    ckpt.close()
    assert flat.keys() == want.keys()
    for path, value in want.items():
        _assert_bitwise(flat[path], value, path)


def test_packed_buffers_round_trip_bitwise(tmp_path, no_fingerprints):
    """The TPU kernels store narrow buffers packed (``EngineSpec.pack_rows``): a state saved
    with the XLA kernels restores packed, ``LANES / w`` rows a stored row, and back, bitwise;
    the layout description records the packing, so the change asks for a re-layout."""
    cfg_a = _cfg("row_wise", 4)
    tpu = KernelConfig(embedding_bag="pallas_tpu", embedding_update="pallas_tpu")
    cfg_b = dataclasses.replace(cfg_a, kernels=tpu)
    assert relayout.layout_meta(cfg_b)["engine"]["pack_rows"]
    assert relayout.needs_relayout(relayout.layout_meta(cfg_a), cfg_b)
    with _active(cfg_b) as exp:
        coll = nnx.merge(exp.graphdef, exp.abstract_state.params).embeddings
        for bl in coll.layout.buffers:
            shape = exp.abstract_state.params["embeddings"]["buffers"][bl.key].get_value().shape
            assert bl.pack == engine.LANES // bl.width > 1
            assert shape == (4 * bl.rows // bl.pack, engine.LANES), (bl.key, shape)
    _assert_fabricated_round_trip(cfg_a, cfg_b, tmp_path, seed=4)


def test_per_table_bounds_buffers_round_trip_bitwise(tmp_path, no_fingerprints):
    """Per-table exchange bounds put tables into buffers of their own (issue 19): a state saved
    row-wise on 4 devices with them restores table-wise on 2 and back, bitwise."""
    comp = dict(
        comm_compression="error_bounded",
        comm_error_bound=0.002,
        comm_error_bound_tables=("f0=0", "f2=4"),
    )

    def scaled_buffers(exp):
        keys = set(exp.abstract_state.params["embeddings"]["buffers"])
        assert {"sharded_w8_float32_eb0", "sharded_w8_float32_eb4"} < keys, keys

    _assert_fabricated_round_trip(
        _cfg("row_wise", 4, **comp),
        _cfg("table_wise", 2, **comp),
        tmp_path,
        seed=2,
        check_a=scaled_buffers,
    )


def test_a_checkpoint_from_before_skew_and_calibration_were_plan_inputs_restores(
    tmp_path, no_fingerprints
):
    """Its layout meta has neither ``zipf_exponents`` nor ``lookup_factor``: it was planned
    uniform and uncalibrated (``_PLAN_DEFAULTS``), and restores bitwise onto a run whose
    measured calibration plans the tables elsewhere."""
    cfg_a = _cfg("auto", 4)
    cfg_b = _cfg("auto", 4, zipf_exponents=("f0=1.3", "f2=2"), cost_lookup_factor=40.0)
    ckpt = Checkpointer(tmp_path / "a", async_save=False)
    with _active(cfg_a) as exp:
        state = _fabricated(exp, seed=3)
        want = _tables(exp, state)
        buffers_a = set(exp.abstract_state.params["embeddings"]["buffers"])
        meta = relayout.layout_meta(cfg_a)
        new = ("zipf_exponents", "lookup_factor")
        meta["engine"] = {k: v for k, v in meta["engine"].items() if k not in new}
        items = {
            "params": state.params,
            "opt_state": state.opt_state,
            "batch_stats": state.batch_stats,
            "rng": {"key_data": state.rng},
        }
        ckpt.save(STEPS, items, {"step": STEPS, "layout": meta})
        ckpt.wait()
    assert not relayout.needs_relayout(meta, cfg_a) and relayout.needs_relayout(meta, cfg_b)
    with _active(cfg_b) as exp:
        assert set(exp.abstract_state.params["embeddings"]["buffers"]) != buffers_a
        got = _tables(exp, _restore(ckpt, STEPS, exp, cfg_b))
    ckpt.close()
    for name, per in want.items():
        for k, value in per.items():
            _assert_bitwise(got[name][k], value, f"{name} {k}")


def test_engine_off_restores_onto_another_device_count_through_orbax(tmp_path, no_fingerprints):
    cfg_a, cfg_b = _cfg("off", 8), _cfg("off", 2)
    ckpt = Checkpointer(tmp_path, async_save=False)
    with _active(cfg_a) as exp:
        state = _fabricated_off(exp)
        want, logits = _flat(state), _logits(exp, state)
        _save(ckpt, state, cfg_a)
    with _active(cfg_b) as exp:
        saved = ckpt.read_meta(STEPS)["layout"]
        assert not relayout.needs_relayout(saved, cfg_b)  # the trainer's plain restore does it
        back = _restore(ckpt, STEPS, exp, cfg_b)
        table = back.params["embeddings"]["tables"]["f0"][...]
        assert table.sharding.mesh.shape[sharding.DATA_AXIS] == 2
        flat = _flat(back)
        for path, value in want.items():
            _assert_bitwise(flat[path], value, path)
        np.testing.assert_allclose(_logits(exp, back), logits, rtol=0, atol=LOGITS_ATOL)
    ckpt.close()


def _fabricated_off(exp) -> TrainState:
    rng = np.random.default_rng(2)

    def fake(sds):
        value = (
            rng.standard_normal(sds.shape) * 0.1
            if jnp.issubdtype(sds.dtype, jnp.floating)
            else np.zeros(sds.shape)
        )
        return jax.device_put(value.astype(sds.dtype), sds.sharding)

    a = exp.abstract_state
    params, opt_state, batch_stats, rng_ = jax.tree.map(
        fake, (a.params, a.opt_state, a.batch_stats, a.rng)
    )
    return TrainState(
        step=jnp.asarray(STEPS, jnp.int32),
        params=params,
        opt_state=opt_state,
        batch_stats=batch_stats,
        rng=rng_,
    )


def test_layout_meta_and_when_a_relayout_is_needed():
    row8 = _cfg("row_wise", 8)
    meta = relayout.layout_meta(row8)
    assert json.loads(json.dumps(meta)) == meta  # it goes into the checkpoint's JSON meta
    assert meta["device_count"] == 8 and meta["embeddings"]["sharding"] == "row_wise"
    assert meta["engine"]["profile"] == engine.default_profile()  # resolved: plans differ by it
    assert not relayout.needs_relayout(None, row8)  # written before layouts were recorded
    assert not relayout.needs_relayout(meta, row8)
    # a checkpoint from before comm_dtype was a plan input was planned as with float32
    old = {**meta, "engine": {k: v for k, v in meta["engine"].items() if k != "comm_dtype"}}
    assert meta["engine"]["comm_dtype"] == "float32" and not relayout.needs_relayout(old, row8)
    # nor skew and the lookup calibration: the planner took every table as uniform, factor 1
    new = ("zipf_exponents", "lookup_factor")
    older = {**meta, "engine": {k: v for k, v in meta["engine"].items() if k not in new}}
    assert not relayout.needs_relayout(older, row8)
    comm = _cfg("row_wise", 8, comm_dtype="bfloat16")  # the planner costs exchanges with it
    for other in (
        _cfg("row_wise", 8, zipf_exponents=("f0=1.1",)),
        _cfg("row_wise", 8, cost_lookup_factor=2.0),
        comm,
        _cfg("row_wise", 4),
        _cfg("table_wise", 8),
        _cfg("auto", 8, per_table=PINS),
        _cfg("row_wise", 8, host_size=2),
        _cfg("off", 8),
    ):
        assert relayout.needs_relayout(meta, other), other.embeddings
    off = relayout.layout_meta(_cfg("off", 8))
    assert off["engine"] is None and not relayout.needs_relayout(off, _cfg("off", 2))
    with sharding.activate(sharding.make_mesh(_cfg("row_wise", 2).mesh), "row_sharded"):
        assert relayout.layout_meta(row8)["device_count"] == 2  # the active mesh's


def test_what_cannot_be_relaid_out_exactly_is_refused():
    def refuse(saved_cfg, cfg, match):
        saved = relayout.layout_meta(saved_cfg)
        with pytest.raises(ValueError, match=match):
            relayout.restore_relaid(None, 0, None, cfg, build_model, saved)

    refuse(
        _cfg("row_wise", 8),
        _cfg("table_wise", 2, storage_dtype="bfloat16"),
        "embeddings.storage_dtype changed from 'float32' to 'bfloat16'.*not exact",
    )
    refuse(
        _cfg("row_wise", 8),
        _cfg("row_wise", 8, "adam"),
        "embedding_optim.name changed from 'rowwise_adagrad' to 'adam'",
    )
    refuse(
        _cfg("off", 8),
        _cfg("row_wise", 8),
        "engine being turned on.*embeddings.sharding='off'.*'row_wise'",
    )
    refuse(
        _cfg("table_wise", 2),
        _cfg("off", 2),
        "engine being turned off.*embeddings.sharding='table_wise'",
    )
    with pytest.raises(ValueError, match="not a layout description"):
        relayout.needs_relayout({"device_count": 8}, _cfg("row_wise", 8))


def test_the_trainer_resumes_row_wise_on_8_as_table_wise_on_2_and_goes_on(tmp_path, capfd):
    """Through ``train``: a run stopped at step 4 (its checkpoint alone) resumes with another
    device count and sharding type, and trains on as the uninterrupted run does."""
    import shutil  # noqa: PLC0415

    from recscale.train.loop import train  # noqa: PLC0415

    def with_train(cfg):
        return dataclasses.replace(
            cfg,
            train=dataclasses.replace(
                cfg.train,
                num_steps=8,
                checkpoint_every=4,
                log_every=1,
                progress=False,
                async_checkpoint=False,
            ),
        )

    def losses(wd):
        rows = map(json.loads, (wd / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}

    full = tmp_path / "full"
    ev_full = train(with_train(_cfg("row_wise", 8)), build_model, full)
    moved = tmp_path / "moved"
    (moved / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "config.json", moved / "config.json")
    shutil.copytree(full / "checkpoints" / "4", moved / "checkpoints" / "4")
    capfd.readouterr()
    ev_moved = train(with_train(_cfg("table_wise", 2)), build_model, moved)
    assert "re-laid out checkpoint step 4 from 8 devices" in capfd.readouterr().err
    got, want = losses(moved), {s: v for s, v in losses(full).items() if s > 4}
    assert sorted(got) == sorted(want) == [5, 6, 7, 8]
    # Table-wise sums a bag's rows in another order than row-wise (see LOGITS_ATOL); four steps
    # carry that rounding on, so the losses agree to float32 rounding, not bitwise.
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-5)
    np.testing.assert_allclose(ev_moved["logloss"], ev_full["logloss"], rtol=1e-5)
