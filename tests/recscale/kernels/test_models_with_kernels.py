"""Models trained with the kernels equal models trained with the XLA reference: DLRM and Wukong,
tiny, on the 8-device mesh with the sharded embedding engine, every kernel selected
(``kernels.*``), Pallas in interpret mode on CPU; same logits, loss curve, tables and dense
parameters after a few steps."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from data.batch import Batch, FeatureInfo, Schema
from data.config import DataConfig
from dlrm import model as dlrm_model
from dlrm.config import DLRMConfig, DLRMModelConfig
from recscale import sharding
from recscale.config import (
    DenseOptimConfig,
    EmbeddingOptimConfig,
    EmbeddingShardingConfig,
    KernelConfig,
    MeshConfig,
    from_dict,
    to_dict,
)
from recscale.kernels import common
from recscale.kernels.dot_interaction import cpu_ffi as dot_cpu_ffi
from recscale.train.loop import make_optimizer
from recscale.train.steps import (
    TrainState,
    initial_rng,
    make_eval_step,
    make_train_step,
)
from wukong import model as wukong_model
from wukong.config import WukongConfig, WukongModelConfig

F, V, D, H, B, STEPS = 3, 50, 8, 3, 16, 3
SCHEMA = Schema(
    dense_names=("a", "b"),
    features=tuple(
        FeatureInfo(name=f"f{i}", vocab_size=V + 7 * i, max_hotness=H) for i in range(F)
    ),
)
# Kernels sum bags, row gradients and matmul partial products in another order than XLA; float32
# rounding of that order, compounded over 3 SGD / row-wise Adagrad steps through the network,
# stays far below these (the first step's logits agree to the kernel tolerance table's 1e-5).
TOL = dict(rtol=1e-4, atol=1e-5)


def _cfg(family: str, impl: str, devices: int = 8):
    common_fields = dict(
        data=DataConfig(batch_size=B, eval_batch_size=B),
        dense_optim=DenseOptimConfig(name="sgd", learning_rate=0.1, b1=0.0),
        embedding_optim=EmbeddingOptimConfig(name="rowwise_adagrad", learning_rate=0.1),
        mesh=MeshConfig(data_parallel=devices),
        embeddings=EmbeddingShardingConfig(sharding="row_wise"),
        kernels=KernelConfig(
            embedding_bag=impl,
            embedding_update=impl,
            dot_interaction=impl,
            fm_interaction="xla" if impl == "cpu_ffi" else impl,  # (no C++ FMB kernel)
        ),
    )
    if family == "dlrm":
        model = DLRMModelConfig(embed_dim=D, bottom_mlp=(8, D), top_mlp=(8, 1))
        return DLRMConfig(model=model, **common_fields), dlrm_model.build_model
    model = WukongModelConfig(
        embed_dim=D,
        num_layers=2,
        n_fmb=3,
        n_lcb=2,
        fmb_rank=2,
        fmb_mlp_width=8,
        fmb_mlp_depth=1,
        dense_mlp=(8,),
        top_mlp=(8, 1),
    )
    return WukongConfig(model=model, **common_fields), wukong_model.build_model


def _batches():
    rng = np.random.default_rng(0)
    return [
        Batch(
            dense_bn=rng.standard_normal((B, 2)).astype(np.float32),
            ids_bfh=rng.integers(-1, V, (B, F, H)).astype(np.int32),
            labels_b=rng.integers(0, 2, B).astype(np.float32),
            weights_b=np.ones(B, np.float32),
        )
        for _ in range(STEPS)
    ]


def _state_and_step(cfg, build):
    """Graphdef, initial state and jitted sparse train step (inside the active mesh)."""
    model = build(cfg, SCHEMA, nnx.Rngs(params=0))
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    tx = make_optimizer(cfg, params)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        batch_stats=stats,
        rng=initial_rng(0),
    )
    return graphdef, state, jax.jit(make_train_step(graphdef, tx), donate_argnums=0)


def _train(family: str, impl: str, devices: int):
    cfg, build = _cfg(family, impl, devices)
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.activate(mesh, cfg.mesh):
        graphdef, state, step = _state_and_step(cfg, build)
        ev = jax.jit(make_eval_step(graphdef))
        logits, losses = [], []
        for b in _batches():
            logits.append(np.asarray(ev(state.params, state.batch_stats, b)))
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
        flat = {
            "/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(state.params)
        }
        return logits, losses, flat


# DLRM with the TPU kernels (embedding bag, fused update, dot interaction) and Wukong with the
# GPU kernels (embedding bag, fused update, FMB core): every op trains in a model with at least
# one backend's kernel; the other pairings are covered op by op (and would cost CI a minute).
# DLRM with the C++ CPU kernels (all three ops) on the 8-device mesh, each per device.
@pytest.mark.parametrize(
    ("family", "impl"), [("dlrm", "pallas_tpu"), ("wukong", "pallas_gpu"), ("dlrm", "cpu_ffi")]
)
def test_training_with_kernels_equals_the_reference(family, impl):
    # The TPU interpreter emulates every DMA and semaphore through host callbacks: on the
    # 8-device CPU mesh one device's kernels outlast XLA:CPU's 40 s collective rendezvous, so
    # the TPU kernels train on one device (the GPU kernels on all eight).
    devices = 1 if impl == "pallas_tpu" else 8
    if impl == "cpu_ffi" and not dot_cpu_ffi.available():
        pytest.skip("the C++ kernels did not build here")
    common.FALLBACKS.clear()
    ref_logits, ref_losses, ref_params = _train(family, "xla", devices)
    logits, losses, params = _train(family, impl, devices)
    # Every op ran its kernel: nothing fell back to the reference.
    assert not common.FALLBACKS, dict(common.FALLBACKS)
    np.testing.assert_allclose(logits[0], ref_logits[0], **common.tolerance(jnp.float32))
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    for a, b in zip(logits, ref_logits, strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    assert params.keys() == ref_params.keys()
    for k in ref_params:
        got = params[k]
        if got.shape != ref_params[k].shape:  # the TPU kernels' packed buffers, as rows
            rows, width = ref_params[k].shape
            got = got.reshape(-1, width)  # one device: the same rows, then more padding
            assert impl == "pallas_tpu" and "buffers" in k and not got[rows:].any(), k
            got = got[:rows]
        np.testing.assert_allclose(got, ref_params[k], **TOL, err_msg=k)
    # The steps changed the parameters (so equality above is not of two untouched states).
    init = _initial_params(family, devices)
    assert any(not np.allclose(init[k], ref_params[k]) for k in ref_params if "buffers" in k)


def _initial_params(family: str, devices: int):
    cfg, build = _cfg(family, "xla", devices)
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.activate(mesh, cfg.mesh):
        model = build(cfg, SCHEMA, nnx.Rngs(params=0))
        _, params, _ = nnx.split(model, nnx.Param, nnx.BatchStat)
        return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(params)}


def test_kernel_config_round_trips_and_rejects_unknown_impls():
    cfg, _ = _cfg("dlrm", "pallas_tpu")
    assert from_dict(type(cfg), to_dict(cfg)).kernels == cfg.kernels
    with pytest.raises(ValueError, match="kernels.dot_interaction='cuda_magic'"):
        KernelConfig(dot_interaction="cuda_magic")
    with pytest.raises(ValueError, match="kernels.fm_interaction='cpu_ffi'"):
        KernelConfig(fm_interaction="cpu_ffi")  # no C++ kernel for the FMB


@pytest.mark.parametrize("family", ["dlrm", "wukong"])
def test_the_whole_train_step_with_kernels_lowers_for_cuda(family):
    """The sparse train step of the 8-device engine, every op on its GPU kernel (compiled, not
    interpreted, under ``target_backend("gpu")``), lowers for ``cuda`` from this CPU host: the
    kernels compose with the engine's ``shard_map``s, the custom VJPs and donation."""
    cfg, build = _cfg(family, "pallas_gpu")
    mesh = sharding.make_mesh(cfg.mesh)
    common.FALLBACKS.clear()
    with (
        common.target_backend("gpu"),
        sharding.activate(mesh, cfg.mesh),
    ):
        graphdef, state, step = _state_and_step(cfg, build)
        text = step.trace(state, _batches()[0]).lower(lowering_platforms=("cuda",)).as_text()
    assert not common.FALLBACKS, dict(common.FALLBACKS)
    # One lookup and one update kernel per engine buffer (one here), and each interaction
    # kernel forward and backward: DLRM's once, Wukong's per layer.
    interaction = "dot_interaction" if family == "dlrm" else "fm_interaction"
    layers = 1 if family == "dlrm" else cfg.model.num_layers
    want = {
        "embedding_bag": 1,
        "embedding_update": 1,
        f"{interaction}_fwd": layers,
        f"{interaction}_bwd": layers,
    }
    assert text.count("xla.gpu.triton") == sum(want.values())
    names = collections.Counter(re.findall(r'name = "(\w+)"', text))
    assert {k: names[k] for k in want} == want, names
