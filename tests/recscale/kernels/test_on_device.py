"""Every Pallas kernel compiled on a real GPU or TPU against the XLA reference on the same
device, at multi-block shapes (many grid programs, ragged last blocks, repeated ids). CPU runs
skip these (``tests/conftest.py``); on a device: ``JAX_PLATFORMS=cuda pytest -m gpu
tests/recscale/kernels/test_on_device.py`` (``JAX_PLATFORMS=tpu ... -m tpu``). A kernel that
passes here on a device kind is what ``common.HARDWARE_VERIFIED`` may list."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recscale.kernels import common
from recscale.kernels.dot_interaction import api as dot_api
from recscale.kernels.embedding_bag import api as bag_api
from recscale.kernels.embedding_update import api as update_api
from recscale.kernels.fm_interaction import api as fm_api
from recscale.kernels.hstu_attention import api as hstu_api
from recscale.kernels.quantized_embedding_bag import api as q_api
from recscale.optim.cowclip import CowClip

IMPLS = [
    pytest.param("pallas_gpu", marks=pytest.mark.gpu),
    pytest.param("pallas_tpu", marks=pytest.mark.tpu),
]
DTYPES = [jnp.float32, jnp.bfloat16]
V, D, N = 100_003, 128, 4099  # odd sizes: ragged last blocks


def _close(got, want, dtype, magnitude=None):
    """``got`` within the dtype's tolerance of ``want``. ``magnitude``: the accumulated
    magnitude of each output's sum of products (the same function of the inputs' and the
    cotangent's absolute values: these ops are multilinear), which bounds its rounding in any
    summation order: the tolerance is relative to it, as ``common.TOLERANCES`` states, not to
    the result, which cancellation can make arbitrarily small."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if magnitude is None:
        np.testing.assert_allclose(got, want, **common.tolerance(dtype))
        return
    tol = common.tolerance(dtype)
    bound = tol["atol"] + tol["rtol"] * np.maximum(np.abs(want), np.asarray(magnitude))
    bad = np.abs(got - want) > bound
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} elements beyond {tol} of the accumulated magnitude; "
        f"max |error| {np.abs(got - want).max():.3g}"
    )


def _reference(f, *args):
    """``f(*args)`` and its VJP in float32 at HIGHEST precision on upcast inputs (XLA's default
    float32 matmul on a GPU is TF32, 10 mantissa bits), as the interpret-mode tests do."""
    up = [a.astype(jnp.float32) for a in args]
    with jax.default_matmul_precision("highest"):
        out, vjp = jax.vjp(f, *up)

    def vjp_highest(g):  # the transposed matmuls are bound here, at call time
        with jax.default_matmul_precision("highest"):
            return vjp(g)

    return out, vjp_highest


def _ids(key, n, h):
    # Skewed: half the ids from 50 hot rows (repeats within and across bags), some padding.
    k1, k2, k3 = jax.random.split(key, 3)
    hot = jax.random.randint(k1, (n, h), 0, 50)
    cold = jax.random.randint(k2, (n, h), 0, V)
    ids = jnp.where(jax.random.bernoulli(k3, 0.5, (n, h)), hot, cold)
    return ids.at[::7, -1].set(-1)


def _no_fallback(before):
    assert dict(common.FALLBACKS) == before, "the kernel fell back to the reference"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [1, 20])
def test_embedding_bag(impl, dtype, h):
    key = jax.random.key(0)
    table = jax.random.normal(key, (V, D), jnp.float32).astype(dtype)
    ids = _ids(key, N, h)
    g = jax.random.normal(jax.random.key(1), (N, D), jnp.float32)
    before = dict(common.FALLBACKS)
    for pooling in ("sum", "mean"):
        out, vjp = jax.vjp(lambda t, p=pooling: bag_api.pool(t, ids, pooling=p, impl=impl), table)
        ref, ref_vjp = _reference(
            lambda t, p=pooling: bag_api.pool(t, ids, pooling=p, impl="xla"), table
        )
        # The same pooling over |table| (forward) and of |g| (backward: the pooling is linear).
        mag, mag_vjp = _reference(
            lambda t, p=pooling: bag_api.pool(t, ids, pooling=p, impl="xla"), jnp.abs(table)
        )
        _close(out, ref, dtype, mag)
        _close(vjp(g)[0], ref_vjp(g)[0], dtype, mag_vjp(jnp.abs(g))[0])
    _no_fallback(before)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize(
    "clip", [None, CowClip(ratio=0.5, min_norm=1e-3, row_l2=1e-2)], ids=["plain", "cowclip"]
)
def test_embedding_update(impl, dtype, optimizer, clip):
    key = jax.random.key(2)
    table = jax.random.normal(key, (V, D), jnp.float32).astype(dtype)
    acc = jax.random.uniform(key, (V,), jnp.float32) if optimizer == "rowwise_adagrad" else None
    ids = _ids(key, N, 20)
    grad = jax.random.normal(jax.random.key(3), (N, D), jnp.float32)
    before = dict(common.FALLBACKS)
    kw = dict(optimizer=optimizer, clip=clip)
    got = update_api.update(table, acc, ids, grad, 0.05, impl=impl, **kw)
    want = update_api.update(table, acc, ids, grad, 0.05, impl="xla", **kw)
    _close(got[0], want[0], dtype)
    if acc is not None:
        _close(got[1], want[1], jnp.float32)
    _close(got[2], want[2], jnp.float32)
    _no_fallback(before)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("self_interaction", [False, True])
def test_dot_interaction(impl, dtype, self_interaction):
    x = jax.random.normal(jax.random.key(4), (N, 27, D), jnp.float32).astype(dtype) * 0.3
    before = dict(common.FALLBACKS)

    def f(x, impl):
        return dot_api.dot_interaction(x, self_interaction=self_interaction, impl=impl)

    out, vjp = jax.vjp(lambda x: f(x, impl), x)
    ref, ref_vjp = _reference(lambda x: f(x, "xla"), x)
    mag, mag_vjp = _reference(lambda x: f(x, "xla"), jnp.abs(x))
    g = jax.random.normal(jax.random.key(5), out.shape, jnp.float32).astype(out.dtype)
    g32 = g.astype(jnp.float32)
    _close(out, ref, dtype, mag)
    _close(vjp(g)[0], ref_vjp(g32)[0], dtype, mag_vjp(jnp.abs(g32))[0])
    _no_fallback(before)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(32, 128, 24), (56, 192, 32)])
def test_fm_interaction(impl, dtype, shape):
    e, d, k = shape
    x = jax.random.normal(jax.random.key(6), (N, e, d), jnp.float32).astype(dtype) * 0.2
    y = jax.random.normal(jax.random.key(7), (e, k), jnp.float32).astype(dtype) * 0.2
    before = dict(common.FALLBACKS)
    out, vjp = jax.vjp(lambda x, y: fm_api.fm_interaction(x, y, impl=impl), x, y)
    ref, ref_vjp = _reference(lambda x, y: fm_api.fm_interaction(x, y, impl="xla"), x, y)
    mag, mag_vjp = _reference(
        lambda x, y: fm_api.fm_interaction(x, y, impl="xla"), jnp.abs(x), jnp.abs(y)
    )
    g = jax.random.normal(jax.random.key(8), out.shape, jnp.float32).astype(out.dtype)
    g32 = g.astype(jnp.float32)
    _close(out, ref, dtype, mag)
    for a, b, m in zip(vjp(g), ref_vjp(g32), mag_vjp(jnp.abs(g32)), strict=True):
        _close(a, b, dtype, m)
    _no_fallback(before)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("h", [1, 20])
def test_quantized_embedding_bag(impl, h):
    table = jax.random.normal(jax.random.key(9), (V, D), jnp.float32)
    q, sb = q_api.quantize_rowwise(table)
    ids = _ids(jax.random.key(10), N, h)
    before = dict(common.FALLBACKS)
    _close(q_api.pool(q, sb, ids, impl=impl), q_api.pool(q, sb, ids, impl="xla"), jnp.float32)
    _no_fallback(before)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masks", ["all", "causal"])
def test_hstu_attention(impl, dtype, masks):
    """Jagged batch of 9 sequences up to N=1000 (one empty, ragged lengths); ``all``: targets,
    a contextual prefix, a local window and a per-head bias (d 128); ``causal``: none of them
    (d 256 keys, 128 values); outputs and gradients against the reference on the same device."""
    n_max, h = 1000, 2
    d, e = (128, 128) if masks == "all" else (256, 128)
    lens = np.array([1000, 0, 1, 777, 130, 999, 64, 513, 2])
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    ks = jax.random.split(jax.random.key(11), 4)
    t = int(lens.sum())
    q, k = (jax.random.normal(x, (t, h, d), jnp.float32) * 0.3 for x in ks[:2])
    v = jax.random.normal(ks[2], (t, h, e), jnp.float32) * 0.3
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    if masks == "all":
        nt = jnp.asarray(np.minimum(lens // 8, np.maximum(lens - 3, 0)), jnp.int32)
        bias = jax.random.normal(ks[3], (h, 24), jnp.float32) * 0.1
        kw = dict(max_seq_len=n_max, alpha=d**-0.5, contextual_seq_len=3, max_attn_len=300)
    else:
        nt, bias = None, None
        kw = dict(max_seq_len=n_max, alpha=d**-0.5)
    before = dict(common.FALLBACKS)

    args = (q, k, v) if bias is None else (q, k, v, bias)

    def f(*a, impl):
        return hstu_api.hstu_attention(*a[:3], offsets, nt, *a[3:], impl=impl, **kw)

    out, vjp = jax.vjp(functools.partial(f, impl=impl), *args)
    ref, ref_vjp = _reference(functools.partial(f, impl="xla"), *args)
    g = jax.random.normal(jax.random.key(12), out.shape, jnp.float32).astype(out.dtype)
    _close(out, ref, dtype)
    for a, b in zip(vjp(g), ref_vjp(g.astype(jnp.float32)), strict=True):
        _close(a, b, dtype)
    _no_fallback(before)
