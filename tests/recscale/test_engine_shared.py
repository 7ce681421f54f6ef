"""The engine with a table shared by several features: every sharding type on 8 devices equals
the per-table reference on one device (SGD and row-wise Adagrad, in the kernels and in plain
jnp), and lazy Adam takes one step per touched row with the features' gradients combined."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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
from recscale.optim import cowclip
from recscale.serving.export import float_tables
from recscale.train.loop import make_optimizer
from recscale.train.steps import TrainState, initial_rng, make_train_step, weighted_bce

V, D, H, B = 60, 8, 3, 16
# f0 and f2 share table "pair", f1 and f3 have their own: shared slots sit among unshared ones
SCHEMA = Schema(
    dense_names=("a",),
    features=(
        FeatureInfo(name="f0", vocab_size=V, max_hotness=H, table="pair"),
        FeatureInfo(name="f1", vocab_size=V + 7, max_hotness=2),
        FeatureInfo(name="f2", vocab_size=V, max_hotness=H, table="pair"),
        FeatureInfo(name="f3", vocab_size=V + 3, max_hotness=H),
    ),
)
TOL = dict(rtol=2e-5, atol=2e-6)  # test_engine.py's: summation order across devices


def _cfg(kind: str, n: int, opt: str, kernels: str = "auto", **optim) -> DLRMConfig:
    return DLRMConfig(
        model=DLRMModelConfig(embed_dim=D, bottom_mlp=(8, D), top_mlp=(8, 1)),
        data=DataConfig(batch_size=B, eval_batch_size=B),
        dense_optim=DenseOptimConfig(name="sgd", learning_rate=0.1, b1=0.0),
        embedding_optim=EmbeddingOptimConfig(name=opt, learning_rate=0.1, **optim),
        mesh=MeshConfig(data_parallel=n),
        embeddings=EmbeddingShardingConfig(sharding=kind, host_size=4),
        kernels=KernelConfig(embedding_bag=kernels, embedding_update=kernels),
    )


def _batches(steps: int, hot: int = 0) -> list[Batch]:
    """Random bags; with ``hot``, ids in ``[0, hot)``, so the shared rows repeat across
    features, bags and examples."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        ids = rng.integers(0, hot, (B, 4, H)) if hot else rng.integers(-1, V, (B, 4, H))
        ids[:, 1, 2:] = -1  # f1's max_hotness
        out.append(
            Batch(
                dense_bn=rng.standard_normal((B, 1)).astype(np.float32),
                ids_bfh=ids.astype(np.int32),
                labels_b=rng.integers(0, 2, B).astype(np.float32),
                weights_b=np.ones(B, np.float32),
            )
        )
    return out


def _run(cfg: DLRMConfig, batches: list[Batch]):
    """The tables after the steps, and the last step's metrics."""
    with sharding.activate(sharding.make_mesh(cfg.mesh), cfg.mesh):
        model = build_model(cfg, SCHEMA, nnx.Rngs(params=0))
        graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
        tx = make_optimizer(cfg, params)
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            batch_stats=stats,
            rng=initial_rng(0),
        )
        clip = cowclip.from_config(cfg.embedding_optim)  # the per-table path's, before tx
        step = jax.jit(make_train_step(graphdef, tx, embedding_clip=clip), donate_argnums=0)
        metrics = None
        for b in batches:
            state, metrics = step(state, b)
        trained = nnx.merge(graphdef, state.params, state.batch_stats)
        return float_tables(trained.embeddings), jax.device_get(metrics)


def test_the_layout_stores_a_shared_table_once_with_a_slot_per_feature():
    cfg = _cfg("row_wise", 8, "sgd")
    with sharding.activate(sharding.make_mesh(cfg.mesh), cfg.mesh):
        layout = build_model(cfg, SCHEMA, nnx.Rngs(params=0)).embeddings.layout
    (bl,) = [b for b in layout.buffers if 0 in b.feature[0]]
    assert bl.shared
    for d in range(8):
        s0, s2 = bl.feature[d].index(0), bl.feature[d].index(2)
        assert bl.offset[d][s0] == bl.offset[d][s2] and bl.owner[d][s2] == s0
        assert bl.row_start[d][s0] == bl.row_start[d][s2]
    groups = bl.update_groups()  # [N, G, K]: the pair's two slots in one group per device
    assert groups.shape[2] == 2
    assert all(
        [s0, s2] in groups[d].tolist()
        for d, (s0, s2) in enumerate(
            (bl.feature[d].index(0), bl.feature[d].index(2)) for d in range(8)
        )
    )


@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad"])
def test_every_sharding_type_equals_the_per_table_reference(opt):
    batches = _batches(3, hot=10)
    ref, ref_m = _run(_cfg("off", 1, opt), batches)
    runs = [(kind, "auto") for kind in ("data_parallel", "row_wise", "column_wise", "auto")]
    runs += [("table_wise", "xla"), ("row_wise", "xla")]
    for kind, kernels in runs:
        got, m = _run(_cfg(kind, 8, opt, kernels), batches)
        for name, t in ref.items():
            np.testing.assert_allclose(got[name], t, **TOL, err_msg=f"{kind}/{kernels}: {name}")
        np.testing.assert_allclose(m["grad_norm"], ref_m["grad_norm"], **TOL)
        np.testing.assert_allclose(m["loss"], ref_m["loss"], **TOL)


def test_a_shared_row_takes_one_adagrad_step_not_one_per_feature():
    """The case the grouping exists for: the same row read by both features in one step. One
    step per feature would add two accumulator terms and move the row twice."""
    batches = _batches(1, hot=4)
    ref, _ = _run(_cfg("off", 1, "rowwise_adagrad"), batches)
    got, _ = _run(_cfg("column_wise", 8, "rowwise_adagrad"), batches)
    np.testing.assert_allclose(got["pair"], ref["pair"], **TOL)


def test_lazy_adam_on_a_shared_table_steps_touched_rows_with_combined_gradients():
    batch = _batches(1)[0]
    ref_cfg = _cfg("off", 1, "sgd")
    with sharding.activate(sharding.make_mesh(ref_cfg.mesh), ref_cfg.mesh):
        model = build_model(ref_cfg, SCHEMA, nnx.Rngs(params=0))
        graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

    def loss(p):
        m = nnx.merge(graphdef, p, stats, copy=True)
        return weighted_bce(m(batch.dense_bn, batch.ids_bfh), batch.labels_b, batch.weights_b)

    g = jax.grad(loss)(params)["embeddings"]["tables"]["pair"][...][:V]
    w0 = np.asarray(params["embeddings"]["tables"]["pair"][...])[:V]
    ids = batch.ids_bfh[:, [0, 2]].reshape(-1)
    touched = np.zeros(V, bool)
    touched[ids[ids >= 0]] = True
    want = np.where(touched[:, None], w0 - 0.1 * g / (np.sqrt(g * g) + 1e-8), w0)
    got, _ = _run(_cfg("row_wise", 8, "adam"), [batch])
    np.testing.assert_allclose(got["pair"], want, rtol=1e-4, atol=1e-5)
    assert np.array_equal(got["pair"][~touched], w0[~touched])


@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad", "adam"])
def test_coupled_l2_equals_the_per_table_reference(opt):
    """Coupled L2 (``embedding_optim.l2``) keeps the tables data-parallel and updates every row
    every step, Adam's moments of untouched rows included: the per-table reference's
    semantics, on 8 devices, with CowClip on top."""
    batches = _batches(3)
    optim = dict(l2=0.05, cowclip_ratio=1.0)
    ref, ref_m = _run(_cfg("off", 1, opt, **optim), batches)
    got, m = _run(_cfg("auto", 8, opt, **optim), batches)
    for name, t in ref.items():
        np.testing.assert_allclose(got[name], t, **TOL, err_msg=name)
    np.testing.assert_allclose(m["update_norm"], ref_m["update_norm"], **TOL)
    untouched = np.ones(V, bool)  # rows of "pair" no batch read: moved by L2 alone
    for b in batches:
        ids = b.ids_bfh[:, [0, 2]].reshape(-1)
        untouched[ids[ids >= 0]] = False
    assert untouched.any()
    init, _ = _run(_cfg("off", 1, opt, **optim), [])
    assert not np.array_equal(got["pair"][untouched], init["pair"][untouched])


def test_a_table_no_feature_reads_is_a_clear_error():
    from recscale.embeddings.layout import EngineSpec, build_layout
    from recscale.embeddings.spec import FeatureSpec, TableSpec

    spec = dataclasses.replace(
        EngineSpec.from_config(_cfg("row_wise", 8, "sgd")), profile="cpu-2core"
    )
    tables = (TableSpec(name="a", num_rows=8, dim=4), TableSpec(name="b", num_rows=8, dim=4))
    with pytest.raises(ValueError, match=r"tables \['b'\] are read by no feature"):
        build_layout(tables, (FeatureSpec(name="x", table="a"),), 8, spec)
