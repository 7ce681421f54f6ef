"""Every kernel under ``jax.vmap`` over a population's members (``recscale.train.population``):
one call for all members (the C++ kernels' member loop, ``native.VMAP``; the Pallas kernels'
member grid axis, from ``pallas_call``'s batching rule) equals each member's own call bitwise,
outputs and gradients, with the members' data shared (``in_axes=None``) or their own."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recscale.kernels.dot_interaction import api as dot_api
from recscale.kernels.dot_interaction import cpu_ffi as dot_ffi
from recscale.kernels.embedding_bag import api as bag_api
from recscale.kernels.embedding_bag import cpu_ffi as bag_ffi
from recscale.kernels.embedding_update import api as update_api
from recscale.kernels.embedding_update import cpu_ffi as update_ffi
from recscale.kernels.fm_interaction import api as fm_api

K = 3  # members
IMPLS = ["xla", "cpu_ffi", "pallas_gpu", "pallas_tpu"]
PLATFORMS = [
    ("cuda", "pallas_gpu", "__gpu$xla.gpu.triton"),
    ("tpu", "pallas_tpu", "tpu_custom_call"),
]


def _needs(impl: str, ffi) -> None:
    if impl == "cpu_ffi" and not ffi.available():
        pytest.skip("the C++ CPU kernel did not build here")


def _interpret(impl: str):
    """The TPU kernels run in Pallas's generic interpreter: the TPU interpreter of this JAX
    (``pltpu.InterpretParams``) zips a batched grid with the kernel's own dimension semantics
    and fails, where Mosaic's lowering adds a parallel semantic per batched axis
    (``test_tpu_kernels_lower_with_a_member_grid_axis``)."""
    return True if impl == "pallas_tpu" else None


def _members(fn, *args):
    """``fn`` on each member's slice of ``args`` (a leading axis, or None: shared), stacked."""
    outs = [fn(*(a if ax is None else a[m] for a, ax in args)) for m in range(K)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def _assert_equal(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _ids(rng, v, n, h):
    ids = rng.integers(0, 9, (n, h))  # repeats within and across bags
    ids[rng.random((n, h)) < 0.2] = -1  # padding
    return ids


@pytest.mark.parametrize("shared_ids", [False, True], ids=["own-ids", "shared-ids"])
@pytest.mark.parametrize("impl", IMPLS)
def test_pooled_lookup_and_its_table_gradient(impl, shared_ids):
    _needs(impl, bag_ffi)
    v, d, n, h = 37, 8, 24, 3
    rng = np.random.default_rng(0)
    tables = jnp.asarray(rng.standard_normal((K, v, d)), jnp.float32)
    ids = jnp.asarray(np.stack([_ids(rng, v, n, h) for _ in range(K)]), jnp.int32)
    g = jnp.asarray(rng.standard_normal((K, n, d)), jnp.float32)
    ids_ax = None if shared_ids else 0
    ids_in = ids[0] if shared_ids else ids

    def fwd_bwd(table, ids, g):
        out, vjp = jax.vjp(
            lambda t: bag_api.pool(t, ids, impl=impl, interpret=_interpret(impl)), table
        )
        return out, vjp(g)[0]

    got = jax.jit(jax.vmap(fwd_bwd, in_axes=(0, ids_ax, 0)))(tables, ids_in, g)
    want = _members(fwd_bwd, (tables, 0), (ids_in, ids_ax), (g, 0))
    _assert_equal(got, want)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "sgd"])
@pytest.mark.parametrize("impl", IMPLS)
def test_row_update_with_each_members_learning_rate(impl, optimizer):
    _needs(impl, update_ffi)
    v, d, n, h = 37, 8, 24, 3
    rng = np.random.default_rng(1)
    tables = jnp.asarray(rng.standard_normal((K, v, d)), jnp.float32)
    accs = jnp.asarray(rng.uniform(0.1, 1.0, (K, v)), jnp.float32)
    ids = jnp.asarray(_ids(rng, v, n, h), jnp.int32)  # one batch for all members
    grads = jnp.asarray(rng.standard_normal((K, n, d)), jnp.float32)
    lrs = jnp.asarray([0.05, 0.1, 0.2], jnp.float32)

    def step(table, acc, ids, grad, lr):
        return update_api.update(
            table,
            None if optimizer == "sgd" else acc,
            ids,
            grad,
            lr,
            optimizer=optimizer,
            impl=impl,
            interpret=_interpret(impl),
        )

    axes = (0, 0, None, 0, 0)
    got = jax.jit(jax.vmap(step, in_axes=axes))(tables, accs, ids, grads, lrs)
    want = _members(step, *zip((tables, accs, ids, grads, lrs), axes, strict=True))
    _assert_equal(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_dot_interaction_and_its_gradient(impl):
    _needs(impl, dot_ffi)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((K, 16, 5, 8)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((K, 16, 10)), jnp.float32)

    def fwd_bwd(x, g):
        out, vjp = jax.vjp(
            lambda x: dot_api.dot_interaction(x, impl=impl, interpret=_interpret(impl)), x
        )
        return out, vjp(g)[0]

    got = jax.jit(jax.vmap(fwd_bwd))(x, g)
    _assert_equal(got, _members(fwd_bwd, (x, 0), (g, 0)))


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu", "pallas_tpu"])
def test_fm_interaction_and_its_gradients(impl):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((K, 16, 6, 8)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((K, 6, 4)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((K, 16, 6, 4)), jnp.float32)

    def fwd_bwd(x, y, g):
        out, vjp = jax.vjp(
            lambda x, y: fm_api.fm_interaction(x, y, impl=impl, interpret=_interpret(impl)), x, y
        )
        return out, vjp(g)

    got = jax.jit(jax.vmap(fwd_bwd))(x, y, g)
    _assert_equal(got, _members(fwd_bwd, (x, 0), (y, 0), (g, 0)))


# (ids that are not the names of the gpu/tpu marks, which would skip the tests off those devices)
@pytest.mark.parametrize(("platform", "impl", "marker"), PLATFORMS, ids=["triton", "mosaic"])
def test_kernels_lower_for_all_members_at_once(platform, impl, marker):
    f32, i32 = jnp.float32, jnp.int32
    kw = {"impl": impl, "interpret": False}

    def lower(fn, args, axes):
        with _tpu_target() if platform == "tpu" else contextlib.nullcontext():
            traced = jax.jit(jax.vmap(fn, in_axes=axes)).trace(*args)
            return traced.lower(lowering_platforms=(platform,)).as_text()

    table, ids = jax.ShapeDtypeStruct((K, 4096, 128), f32), jax.ShapeDtypeStruct((1024, 4), i32)
    g = jax.ShapeDtypeStruct((K, 1024, 128), f32)
    # One kernel for the K members, no loop: the lookup over the stacked tables, the dot
    # interaction with a member grid axis.
    for fn, args, axes in (
        (lambda t, i: bag_api.pool(t, i, **kw), (table, ids), (0, None)),
        (
            lambda x: dot_api.dot_interaction(x, **kw),
            (jax.ShapeDtypeStruct((K, 1024, 8, 128), f32),),
            (0,),
        ),
    ):
        text = lower(fn, args, axes)
        assert text.count(marker) == 1 and "stablehlo.while" not in text
    # The fused update: one kernel per member in a loop of the one program.
    acc = jax.ShapeDtypeStruct((K, 4096), f32)
    text = lower(
        lambda t, a, i, g: update_api.update(t, a, i, g, 0.1, **kw),
        (table, acc, ids, g),
        (0, 0, None, 0),
    )
    assert text.count(marker) == 1 and "stablehlo.while" in text


def _tpu_target():
    """An abstract TPU device: Mosaic lowering reads the target chip's tiling, which a CPU
    host does not have (as ``test_embedding_update``'s lowering tests)."""
    device = jax.sharding.AbstractDevice(device_kind="TPU v5p", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device
    )
    return jax.sharding.use_abstract_mesh(mesh)
