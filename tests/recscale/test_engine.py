"""The sharded embedding engine: every sharding type on the 8-device CPU mesh equals the
single-device run, sparse updates equal the dense optax reference, no table-sized temporaries
(the engine in the trainer: ``test_engine_training.py``)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlrm.presets  # noqa: F401
from data.batch import Batch, FeatureInfo, Schema
from data.config import DataConfig
from dlrm.config import DLRMConfig, DLRMModelConfig
from dlrm.model import build_model
from recscale import sharding
from recscale.config import (
    DenseOptimConfig,
    EmbeddingOptimConfig,
    EmbeddingShardingConfig,
    KernelConfig,
    MeshConfig,
)
from recscale.embeddings import engine
from recscale.embeddings.spec import one_table_per_feature
from recscale.kernels.embedding_update import reference as update_ref
from recscale.optim import cowclip
from recscale.train.loop import make_optimizer
from recscale.train.steps import (
    TrainState,
    initial_rng,
    make_eval_step,
    make_train_step,
)

TYPES = (
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
)
F, V, D, H, B = 4, 100, 8, 3, 16
SCHEMA = Schema(
    dense_names=("a", "b"),
    features=tuple(
        FeatureInfo(name=f"f{i}", vocab_size=V + 10 * i, max_hotness=H) for i in range(F)
    ),
)


def _cfg(sharding_kind, n, opt="rowwise_adagrad", **emb):
    return DLRMConfig(
        model=DLRMModelConfig(embed_dim=D, bottom_mlp=(8, D), top_mlp=(8, 1)),
        data=DataConfig(batch_size=B, eval_batch_size=B),
        dense_optim=DenseOptimConfig(name="sgd", learning_rate=0.1, b1=0.0),
        embedding_optim=EmbeddingOptimConfig(name=opt, learning_rate=0.1),
        mesh=MeshConfig(data_parallel=n),
        # host_size 4: two "hosts" of 4 devices, so the table_* hybrids differ from row/column-wise
        embeddings=EmbeddingShardingConfig(sharding=sharding_kind, host_size=4, **emb),
    )


def _xla_kernels(cfg):
    """``cfg`` with the engine's lookups and updates in the XLA reference (no C++ kernels)."""
    return dataclasses.replace(
        cfg, kernels=KernelConfig(embedding_bag="xla", embedding_update="xla")
    )


def _batches(steps, seed=0, vocab=V):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = rng.integers(0, 12, (B, F, H)) if vocab == "hot" else rng.integers(-1, V, (B, F, H))
        out.append(
            Batch(
                dense_bn=rng.standard_normal((B, 2)).astype(np.float32),
                ids_bfh=ids.astype(np.int32),
                labels_b=rng.integers(0, 2, B).astype(np.float32),
                weights_b=np.ones(B, np.float32),
            )
        )
    return out


def _tables(model, params) -> dict[str, np.ndarray]:
    emb = model.embeddings
    if emb.layout is None:
        return {
            t.name: np.asarray(params["embeddings"]["tables"][t.name][...])[: t.num_rows]
            for t in emb.table_specs
        }
    bufs = {k: v[...] for k, v in params["embeddings"]["buffers"].items()}
    return engine.export_tables(emb.layout, bufs, emb.table_specs, emb.feature_specs)


def _build(cfg, schema, spec):
    """Model, graphdef, initial state and (unjitted) train step, inside an active mesh."""
    model = build_model(cfg, schema, nnx.Rngs(params=0))
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    tx = make_optimizer(cfg, params)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        batch_stats=stats,
        rng=initial_rng(0),
    )
    clip = cowclip.from_config(cfg.embedding_optim)
    return model, graphdef, state, make_train_step(graphdef, tx, embedding_clip=clip)


def _run(cfg, batches):
    """Eval logits before each step, then the tables and dense parameters after the steps."""
    mesh = sharding.make_mesh(cfg.mesh)
    spec = engine.EngineSpec.from_config(cfg)
    with sharding.activate(mesh, cfg.mesh):
        model, graphdef, state, step = _build(cfg, SCHEMA, spec)
        step = jax.jit(step, donate_argnums=0)
        ev = jax.jit(make_eval_step(graphdef))
        logits = []
        for b in batches:
            logits.append(np.asarray(ev(state.params, state.batch_stats, b)))
            state, metrics = step(state, b)
        dense = {
            "/".join(map(str, p)): np.asarray(v[...])
            for p, v in nnx.to_flat_state(state.params)
            if "embeddings" not in p
        }
        return logits, _tables(model, state.params), dense, jax.device_get(metrics)


# Tolerances: the 8-device runs all-reduce the dense gradients in another order than one device
# sums them, and a row-wise bag's partial sums are added across devices; float32 rounding of
# that order, compounded over 3 steps, stays below 2e-6 here. The sparse-vs-dense comparison
# sums a row's repeated gradients in another order than the dense transpose does.
TOL = dict(rtol=2e-5, atol=2e-6)


@pytest.fixture(scope="module")
def reference():
    """The dense optax path (per-table arrays) on one device: the semantics to match."""
    return _run(_cfg("off", 1), _batches(3))


@functools.cache
def _on_8_devices(kind: str):
    """The 3-step run of one sharding type on 8 devices (shared by the tests that need it)."""
    return _run(_cfg(kind, 8), _batches(3))


@pytest.mark.parametrize("kind", TYPES + ("auto",))
def test_every_sharding_type_on_8_devices_equals_one_device(kind, reference):
    ref_logits, ref_tables, ref_dense, ref_m = reference
    logits, tables, dense, m = _on_8_devices(kind)
    for a, b in zip(ref_logits, logits, strict=True):
        np.testing.assert_allclose(b, a, **TOL)
    for name, t in ref_tables.items():
        assert not np.array_equal(t, _run_init_table(name)), "the tables must have moved"
        np.testing.assert_allclose(tables[name], t, **TOL, err_msg=name)
    for name, p in ref_dense.items():
        np.testing.assert_allclose(dense[name], p, **TOL, err_msg=name)
    np.testing.assert_allclose(m["loss"], ref_m["loss"], **TOL)
    np.testing.assert_allclose(m["grad_norm"], ref_m["grad_norm"], **TOL)


@pytest.mark.parametrize("kind", ["data_parallel", "row_wise", "table_wise"])
def test_the_plain_jax_path_equals_one_device_too(kind, reference):
    """The same with the XLA reference kernels (the path compiler-less CPUs take)."""
    _assert_same_run(_run(_xla_kernels(_cfg(kind, 8)), _batches(3)), reference)


def _assert_same_run(got, want) -> None:
    """Two ``_run`` results equal to ``TOL``: logits before each step, tables, dense
    parameters and the last step's loss."""
    for a, b in zip(want[0], got[0], strict=True):
        np.testing.assert_allclose(b, a, **TOL)
    for name, t in want[1].items():
        np.testing.assert_allclose(got[1][name], t, **TOL, err_msg=name)
    for name, p in want[2].items():
        np.testing.assert_allclose(got[2][name], p, **TOL, err_msg=name)
    np.testing.assert_allclose(got[3]["loss"], want[3]["loss"], **TOL)


@pytest.mark.parametrize("kind", ["data_parallel", "table_wise", "column_wise"])
def test_packed_buffers_under_the_tpu_kernels_equal_one_device(kind, reference):
    """With the TPU kernels (interpret mode here) the engine stores its 8-wide buffers packed,
    16 rows a 128-lane row, and pools and updates them in place; a column-split table's rows
    (updated outside the kernel, from the rows' view) too. The run equals the reference."""
    cfg = dataclasses.replace(
        _cfg(kind, 8),
        kernels=KernelConfig(embedding_bag="pallas_tpu", embedding_update="pallas_tpu"),
    )
    spec = engine.EngineSpec.from_config(cfg)
    assert spec.pack_rows
    features = tuple((f.name, f.vocab_size, f.max_hotness) for f in SCHEMA.features)
    layout = engine.build_layout(*one_table_per_feature(features, D), 8, spec)
    assert {bl.pack for bl in layout.buffers} == {128 // bl.width for bl in layout.buffers}
    assert all(bl.pack > 1 and bl.rows % (8 * bl.pack) == 0 for bl in layout.buffers)
    _assert_same_run(_run(cfg, _batches(3)), reference)


def _run_init_table(name):
    mesh = sharding.make_mesh(MeshConfig(data_parallel=1))
    with sharding.activate(mesh, "replicated"):
        model = build_model(_cfg("off", 1), SCHEMA, nnx.Rngs(params=0))
        t = model.embeddings.tables[name][...]
        return np.asarray(t)[
            : next(s.num_rows for s in model.embeddings.table_specs if s.name == name)
        ]


def test_the_plan_is_what_was_asked_for():
    mesh = sharding.make_mesh(MeshConfig(data_parallel=8))
    pins = ("f0=row_wise", "f1=table_wise", "f2=column_wise", "f3=table_row_wise")
    with sharding.activate(mesh, "replicated"):
        model = build_model(_cfg("auto", 8, per_table=pins), SCHEMA, nnx.Rngs(params=0))
    layout = model.embeddings.layout
    for pin in pins:
        name, kind = pin.split("=")
        assert f"│ {name}    │ {kind}" in layout.plan_text, layout.plan_text
    slots = {}  # feature -> [(device, rows, cols)]
    for bl in layout.buffers:
        for d, feats in enumerate(bl.feature):
            for s, f in enumerate(feats):
                if bl.row_count[d][s]:
                    slots.setdefault(f, []).append((d, bl.row_count[d][s], bl.width))
    assert len(slots[0]) == 8 and sum(r for _, r, _ in slots[0]) == V  # rows over 8 devices
    assert len(slots[1]) == 1 and slots[1][0][1:] == (V + 10, D)  # one whole table
    assert len(slots[2]) >= 2 and sum(w for *_, w in slots[2]) == D  # column slices
    assert len(slots[3]) == 4 and len({d // 4 for d, *_ in slots[3]}) == 1  # one host's rows


def test_the_plan_takes_the_tables_skew_and_the_lookup_calibration():
    """``embeddings.zipf_exponents`` load a row-wise table's busiest shard with its hot row;
    ``cost_lookup_factor`` scales every shard's lookup term (placement pinned, so the same)."""
    pins = ("f0=row_wise", "f1=table_wise", "f2=column_wise", "f3=data_parallel")
    specs = one_table_per_feature(
        tuple((f.name, f.vocab_size, f.max_hotness) for f in SCHEMA.features), D
    )

    def planned(**emb):
        spec = engine.EngineSpec.from_config(_cfg("auto", 8, per_table=pins, **emb))
        return engine.plan_engine(*specs, 8, spec).by_table()

    base = planned()
    skewed = planned(zipf_exponents=("f0=1.5",))
    hot = max(s.lookup_s for s in skewed["f0"].shards)
    assert hot > 2 * max(s.lookup_s for s in base["f0"].shards)
    assert skewed["f1"] == base["f1"]  # the others are uniform still
    slow = planned(cost_lookup_factor=3.0)
    for name, tp in base.items():
        for a, b in zip(tp.shards, slow[name].shards, strict=True):
            assert (a.device, a.rows, a.cols) == (b.device, b.rows, b.cols)
            assert b.lookup_s == pytest.approx(3 * a.lookup_s, rel=1e-12)
            assert (b.comm_s, b.compute_s) == (a.comm_s, a.compute_s)
    with pytest.raises(ValueError, match=r"zipf_exponents names unknown tables \['nope'\]"):
        planned(zipf_exponents=("nope=1.0",))
    for bad, match in (
        (dict(zipf_exponents=("f0",)), "zipf_exponents entry 'f0': expected TABLE=S"),
        (dict(zipf_exponents=("f0=-1",)), "zipf_exponents entry 'f0=-1'"),
        (dict(zipf_exponents=("f0=x",)), "zipf_exponents entry 'f0=x'"),
        (dict(measure_skew=-1), "measure_skew must be >= 0"),
        (dict(cost_lookup_factor=float("nan")), "cost_lookup_factor must be finite"),
    ):
        with pytest.raises(ValueError, match=match):
            EmbeddingShardingConfig(**bad)


def test_the_default_profile_is_the_devices_and_an_unknown_kind_warns(capsys):
    from types import SimpleNamespace  # noqa: PLC0415

    from recscale.embeddings import layout  # noqa: PLC0415

    assert engine.default_profile() == "cpu-2core"  # this host's simulated devices
    h200 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
    v5e = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    assert (engine.default_profile(h200), engine.default_profile(v5e)) == ("gpu-h200", "tpu-v5e")
    assert capsys.readouterr().err == ""
    layout._WARNED.discard("TPU7x")
    for _ in range(2):  # warned once
        assert engine.default_profile(SimpleNamespace(platform="tpu", device_kind="TPU7x")) == (
            "tpu-v5p"
        )
    err = capsys.readouterr().err
    assert err.count("no hardware profile for device kind 'TPU7x'") == 1, err
    assert "as tpu-v5p (set --embeddings.profile)" in err


def test_mixed_pins_and_bf16_storage_and_communication(reference):
    ref_logits, ref_tables, *_ = reference
    pins = ("f0=row_wise", "f1=table_wise", "f2=column_wise", "f3=data_parallel")
    logits, tables, *_ = _run(_cfg("auto", 8, per_table=pins), _batches(3))
    for a, b in zip(ref_logits, logits, strict=True):
        np.testing.assert_allclose(b, a, **TOL)
    logits, tables, *_ = _run(
        _cfg("row_wise", 8, storage_dtype="bfloat16", comm_dtype="bfloat16"), _batches(3)
    )
    # bf16 keeps 8 mantissa bits: a relative error of 2^-8 per stored value and exchange.
    for a, b in zip(ref_logits, logits, strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2)
    for name, t in ref_tables.items():
        np.testing.assert_allclose(tables[name], t, rtol=2e-2, atol=1e-2, err_msg=name)


def test_compressed_exchanges_with_no_error_are_bitwise_and_with_a_bound_stay_close():
    """Issue 19: ``error_bounded`` at ε = 0 trains bitwise as the float32 exchange; at ε = 0.002
    (8-bit codes, both ways; row-wise) and with fp8 (column-wise: slices of a row's width) it
    moves the run a little, not a lot."""
    eb = dict(comm_compression="error_bounded", comm_error_bound=0.002, comm_error_bound_grad=0.002)
    for kind, comp in (("row_wise", eb), ("column_wise", dict(comm_compression="fp8_e4m3"))):
        exact = _on_8_devices(kind)
        if kind == "row_wise":
            zero = _run(_cfg(kind, 8, comm_compression="error_bounded"), _batches(3))
            for a, b in zip(jax.tree.leaves(exact), jax.tree.leaves(zero), strict=True):
                np.testing.assert_array_equal(b, a)
        logits, tables, *_ = _run(_cfg(kind, 8, **comp), _batches(3))
        assert any(not np.array_equal(a, b) for a, b in zip(exact[0], logits, strict=True))
        # Measured: logits within 1.9e-3 (8-bit codes) and 9.6e-3 (fp8), tables within 3.2e-3
        # and 2.8e-2 (row-wise Adagrad divides by a row's own gradient scale, so its update
        # carries the exchange's relative error in full); allowed: about 2.5x that.
        tol_logits, tol_tables = (5e-3, 8e-3) if kind == "row_wise" else (2.5e-2, 7e-2)
        for a, b in zip(exact[0], logits, strict=True):
            np.testing.assert_allclose(b, a, rtol=tol_logits, atol=tol_logits)
        for name, t in exact[1].items():
            np.testing.assert_allclose(
                tables[name], t, rtol=tol_logits, atol=tol_tables, err_msg=name
            )


def test_exchange_bytes_are_the_planners_and_shrink_by_the_code_width():
    mesh = sharding.make_mesh(MeshConfig(data_parallel=8))
    eb = dict(
        comm_compression="error_bounded", comm_error_bound=0.002, comm_error_bound_grad=0.036
    )  # 8-bit codes forward, 4-bit back
    with sharding.activate(mesh, "replicated"):
        plain = build_model(_cfg("row_wise", 8), SCHEMA, nnx.Rngs(params=0)).embeddings.layout
        comp = build_model(_cfg("row_wise", 8, **eb), SCHEMA, nnx.Rngs(params=0)).embeddings.layout
    x = plain.exchange_bytes(B)
    # float32 both ways: what the planner costs on a non-TPU profile
    assert x["forward"] + x["backward"] == x["float32"] == plain.plan_all_to_all_bytes > 0
    y = comp.exchange_bytes(B)
    assert y["float32"] == x["float32"]
    # F slots x 8 devices x 8 destinations, each (B/8)·D values: 2 header words + packed codes
    blocks, m = F * 8 * 8, (B // 8) * D
    assert y["forward"] == blocks * 4 * (2 + m * 8 // 32)
    assert y["backward"] == blocks * 4 * (2 + m * 4 // 32)


def test_per_table_bounds_group_tables_into_buffers_of_their_own_code_width():
    """Issue 19, per-table bounds: each table's exchange is bounded by the base bound times its
    scale, element-wise (f2 at a quarter of the base: 10-bit codes; f3 at 4x: 7 bits); a table
    at scale 0 goes uncompressed, bitwise; bytes are counted per buffer; and a run whose tables
    are all at scale 0 trains bitwise as the float32 exchange."""
    eb = dict(comm_compression="error_bounded", comm_error_bound=0.002, comm_error_bound_grad=0.002)
    scales = ("f1=0", "f2=0.25:1", "f3=4")  # f2: a quarter of the bound forward, the base back
    mesh = sharding.make_mesh(MeshConfig(data_parallel=8))
    ids = jnp.asarray(_batches(1)[0].ids_bfh)
    outs = {}
    with sharding.activate(mesh, "replicated"):
        for name, emb in (("exact", {}), ("scaled", dict(eb, comm_error_bound_tables=scales))):
            coll = build_model(_cfg("table_wise", 8, **emb), SCHEMA, nnx.Rngs(params=0)).embeddings
            outs[name] = [np.asarray(x) for x in jax.jit(lambda c, i: c.lookup(i))(coll, ids)]
    layout = coll.layout
    by_key = {bl.key: bl for bl in layout.buffers}
    for key, table in (("", 0), ("_eb0", 1), ("_eb0p25_g1", 2), ("_eb4", 3)):
        bl = by_key.pop("sharded_w8_float32" + key)
        held = {
            f
            for fs, cs in zip(bl.feature, bl.row_count, strict=True)
            for f, c in zip(fs, cs, strict=True)
            if c
        }
        assert held == {table}, (key, held)
    assert not by_key
    by_key = {bl.key: bl for bl in layout.buffers}
    codes = {k: layout.compression_of(bl).describe() for k, bl in by_key.items()}
    assert (
        codes["sharded_w8_float32_eb0p25_g1"]
        == "error_bounded, 10-bit codes forward, 8-bit codes back"
    )
    assert codes["sharded_w8_float32_eb4"].startswith("error_bounded, 7-bit codes")
    assert codes["sharded_w8_float32_eb0"] == "none"
    # bytes: each buffer's slots (one per device holding a table, padded to the most) at its width
    x = layout.exchange_bytes(B)
    m = (B // 8) * D
    for way, scale in (("forward", "bound_scale"), ("backward", "bound_scale_grad")):
        expect = 0.0
        for bl in layout.buffers:
            blocks = 8 * len(bl.feature[0]) * 8
            bits = {0.0: 32, 0.25: 10, 1.0: 8, 4.0: 7}[getattr(bl, scale)]
            expect += blocks * 4 * (m if bits == 32 else 2 + -(-m * bits // 32))
        assert x[way] == expect, way
    # element-wise: within the scaled bound of the block's range (at most the batch's range)
    for f, eps in ((0, 0.002), (2, 0.0005), (3, 0.008)):
        a, b = outs["exact"][f], outs["scaled"][f]
        err = np.abs(b - a).max()
        assert 0 < err <= eps * (a.max() - a.min()) * (1 + 1e-5), (f, err)
    np.testing.assert_array_equal(outs["scaled"][1], outs["exact"][1])  # scale 0: float32
    # 7-bit codes at 4x the bound do err beyond the base's 8-bit bound somewhere
    a, b = outs["exact"][3], outs["scaled"][3]
    assert np.abs(b - a).max() > 0.002 * (a.max() - a.min())
    exact = _on_8_devices("row_wise")
    zero = _run(
        _cfg("row_wise", 8, **eb, comm_error_bound_tables=tuple(f"f{i}=0" for i in range(F))),
        _batches(3),
    )
    for a, b in zip(jax.tree.leaves(exact), jax.tree.leaves(zero), strict=True):
        np.testing.assert_array_equal(b, a)


def test_per_table_bounds_clear_errors():
    eb = dict(sharding="row_wise", comm_compression="error_bounded", comm_error_bound=0.002)
    with pytest.raises(ValueError, match=r"TABLE=SCALE\[:SCALE_GRAD\]"):
        EmbeddingShardingConfig(**eb, comm_error_bound_tables=("f0:2",))
    with pytest.raises(ValueError, match="each table once"):
        EmbeddingShardingConfig(**eb, comm_error_bound_tables=("f0=2", "f0=1"))
    with pytest.raises(ValueError, match=r"bound 0\.8 .*outside"):
        EmbeddingShardingConfig(**eb, comm_error_bound_tables=("f0=400",))
    with pytest.raises(ValueError, match="fp8_e4m3 has no bound to scale"):
        EmbeddingShardingConfig(
            sharding="row_wise", comm_compression="fp8_e4m3", comm_error_bound_tables=("f0=2",)
        )
    with pytest.raises(ValueError, match="needs the engine and a comm_compression"):
        EmbeddingShardingConfig(sharding="row_wise", comm_error_bound_tables=("f0=0",))
    mesh = sharding.make_mesh(MeshConfig(data_parallel=8))
    with (
        sharding.activate(mesh, "replicated"),
        pytest.raises(ValueError, match=r"comm_error_bound_tables names unknown tables \['nope'\]"),
    ):
        build_model(
            _cfg(
                "row_wise",
                8,
                **{k: v for k, v in eb.items() if k != "sharding"},
                comm_error_bound_tables=("nope=2",),
            ),
            SCHEMA,
            nnx.Rngs(params=0),
        )


@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad"])
def test_sparse_updates_equal_the_dense_reference_with_repeated_ids(opt):
    # Few distinct ids: many repeats within a bag and across a batch.
    ref = _run(_cfg("off", 1, opt=opt), _batches(3, vocab="hot"))
    got = _run(_cfg("data_parallel", 1, opt=opt), _batches(3, vocab="hot"))
    for name, t in ref[1].items():
        np.testing.assert_allclose(got[1][name], t, **TOL, err_msg=name)
    got8 = _run(_cfg("column_wise", 8, opt=opt), _batches(3, vocab="hot"))
    for name, t in ref[1].items():
        np.testing.assert_allclose(got8[1][name], t, **TOL, err_msg=name)


def _initial_tables_and_gradients(batch):
    """``(table specs, {name: (initial rows, their gradient)})``: the dense reference model's
    tables before any step and the batch-mean loss's table gradients on ``batch``."""
    from recscale.train.steps import weighted_bce

    ref_cfg = _cfg("off", 1, opt="sgd")
    with sharding.activate(sharding.make_mesh(ref_cfg.mesh), "replicated"):
        model = build_model(ref_cfg, SCHEMA, nnx.Rngs(params=0))
        graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

    def loss(p, b):
        m = nnx.merge(graphdef, p, stats, copy=True)
        return weighted_bce(m(b.dense_bn, b.ids_bfh), b.labels_b, b.weights_b)

    g = jax.grad(loss)(params, batch)
    specs = model.embeddings.table_specs
    return specs, {
        t.name: tuple(
            np.asarray(x["embeddings"]["tables"][t.name][...])[: t.num_rows] for x in (params, g)
        )
        for t in specs
    }


def test_lazy_adam_updates_only_touched_rows_like_numpy():
    batches = _batches(2)
    cfg = _cfg("row_wise", 8, opt="adam")
    _, tables, *_ = _run(cfg, batches)
    # numpy lazy Adam on the tables, with the table gradients of the dense reference model
    # One step from the initial tables: m = 0.1 g, v = 0.001 g², update = -lr·sign-like.
    specs, start = _initial_tables_and_gradients(batches[0])
    _, tables1, *_ = _run(cfg, batches[:1])
    for t in specs:
        w0, gt = start[t.name]
        ids = batches[0].ids_bfh[:, int(t.name[1:])].reshape(-1)
        touched = np.zeros(t.num_rows, bool)
        touched[ids[ids >= 0]] = True
        m_hat, v_hat = gt, gt * gt  # bias-corrected first step
        want = np.where(touched[:, None], w0 - 0.1 * m_hat / (np.sqrt(v_hat) + 1e-8), w0)
        np.testing.assert_allclose(tables1[t.name], want, rtol=1e-4, atol=1e-5)
        assert np.array_equal(tables1[t.name][~touched], w0[~touched])  # untouched: bitwise
    assert not np.allclose(tables1["f0"], tables["f0"])


def test_batched_unique_matches_numpy():
    rng = np.random.default_rng(0)
    sentinel = 100
    # slot s reads rows [30 s, 30 s + 30): disjoint, as the layout guarantees
    keys = (rng.integers(0, 30, (3, 50)) + 30 * np.arange(3)[:, None]).astype(np.int32)
    keys[rng.random((3, 50)) < 0.2] = sentinel
    uids, inv = jax.jit(update_ref.batched_distinct_rows, static_argnums=1)(keys, sentinel)
    for s in range(3):
        valid = keys[s] < sentinel
        firsts = list(dict.fromkeys(keys[s][valid].tolist()))  # first-occurrence order
        np.testing.assert_array_equal(uids[s, : len(firsts)], firsts)
        assert np.all(np.asarray(uids[s, len(firsts) :]) == sentinel)
        np.testing.assert_array_equal(
            np.asarray(uids[s])[np.asarray(inv[s])][valid], keys[s][valid]
        )


@pytest.mark.parametrize("path", ["kernels", "plain", "off"])
def test_the_train_step_builds_no_table_sized_temporary(path):
    """XLA's memory analysis of the compiled step: temporaries scale with the batch, not the
    tables (here 4 tables of 200,000 x 8, 25.6 MB, against a batch of 16 x 3 ids)."""
    schema = Schema(
        dense_names=("a", "b"),
        features=tuple(
            FeatureInfo(name=f"f{i}", vocab_size=200_000, max_hotness=H) for i in range(F)
        ),
    )
    for kind in ("off",) if path == "off" else ("data_parallel",):
        cfg = _xla_kernels(_cfg(kind, 1)) if path == "plain" else _cfg(kind, 1)
        mesh = sharding.make_mesh(cfg.mesh)
        spec = engine.EngineSpec.from_config(cfg)
        with sharding.activate(mesh, "replicated"):
            _, _, state, step = _build(cfg, schema, spec)
            b = _batches(1)[0]
            mem = jax.jit(step, donate_argnums=0).lower(state, b).compile()
            temp = mem.memory_analysis().temp_size_in_bytes
        table_bytes = F * 200_000 * D * 4
        if kind == "off":
            assert temp > table_bytes  # the dense path: a table-sized gradient (and more)
        else:
            # the batch term (a few [S, B, H]- and [S, B·H, w]-sized arrays) and, on the plain
            # path, the dedup's first-seen map: 4 bytes per row, an eighth of these tables
            assert temp < 0.3 * table_bytes, (temp, table_bytes)


def test_clear_errors():
    mesh = sharding.make_mesh(MeshConfig(data_parallel=8))
    l2 = dataclasses.replace(_cfg("row_wise", 8), embedding_optim=EmbeddingOptimConfig(l2=0.1))
    with (
        sharding.activate(mesh, "replicated"),
        pytest.raises(ValueError, match="coupled L2 of whole tables.*'f0' is asked to be row_wise"),
    ):
        build_model(l2, SCHEMA, nnx.Rngs(params=0))
    with pytest.raises(ValueError, match="TABLE=TYPE"):
        EmbeddingShardingConfig(sharding="auto", per_table=("f0:row_wise",))
    with pytest.raises(ValueError, match="expected off, auto"):
        EmbeddingShardingConfig(sharding="rows")
    cfg = _cfg("auto", 8, per_table=("nope=row_wise",))
    with (
        sharding.activate(mesh, "replicated"),
        pytest.raises(ValueError, match="unknown tables"),
    ):
        build_model(cfg, SCHEMA, nnx.Rngs(params=0))
    from recscale.embeddings import EmbeddingCollection, FeatureSpec, TableSpec

    with (
        sharding.activate(mesh, "replicated"),
        pytest.raises(ValueError, match=r"tables \['u'\] are read by no feature"),
    ):
        EmbeddingCollection(
            (TableSpec(name="t", num_rows=10, dim=4), TableSpec(name="u", num_rows=10, dim=4)),
            (FeatureSpec(name="a", table="t"), FeatureSpec(name="b", table="t")),
            rngs=nnx.Rngs(params=0),
            engine=engine.EngineSpec.from_config(cfg),
        )
