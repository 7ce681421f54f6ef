"""quantized_embedding_bag: the row-wise int8 format keeps every element within half a
quantization step, the pooled int8 lookup stays within the summed bound of the float lookup,
the kernels equal the reference, bad input is refused, and the kernels lower for GPU and TPU at
production shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recscale.kernels import common
from recscale.kernels.embedding_bag import reference as float_reference
from recscale.kernels.quantized_embedding_bag import api, reference

IMPLS = ["xla", "pallas_gpu", "pallas_tpu"]
SHAPES = [(37, 48, 5, 3), (37, 8, 24, 7), (37, 128, 24, 1)]  # (V, D, N, H)
EPS = float(np.finfo(np.float32).eps)


def _table(v: int, d: int, seed: int = 0) -> jax.Array:
    """Rows of very different ranges and offsets, one constant row, one with a single outlier."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((v, d)) * rng.uniform(0.01, 10.0, (v, 1)) + rng.normal(0, 5, (v, 1))
    x[3] = 1.25  # max == min: scale 1, exact
    x[4, 0] = 1e3  # a coarse step for the rest of the row
    return jnp.asarray(x, jnp.float32)


def _ids(v: int, n: int, h: int, seed: int = 0) -> jax.Array:
    """Repeats, -1 and V padding, ids past V, and one bag of padding only."""
    rng = np.random.default_rng(seed + 1)
    ids = rng.integers(0, 9, (n, h))
    ids[rng.random((n, h)) < 0.15] = v - 1
    ids[rng.random((n, h)) < 0.2] = -1
    ids[rng.random((n, h)) < 0.1] = v
    ids[rng.random((n, h)) < 0.05] = v + 3
    ids[0] = -1
    return jnp.asarray(ids, jnp.int32)


def test_quantization_error_is_at_most_half_a_step():
    x = _table(64, 40)
    q, sb = api.quantize_rowwise(x)
    assert q.dtype == jnp.uint8 and q.shape == x.shape
    assert sb.dtype == jnp.float32 and sb.shape == (64, 2)
    x, q, sb = np.asarray(x), np.asarray(q), np.asarray(sb)
    scale, bias = sb[:, :1], sb[:, 1:]
    np.testing.assert_array_equal(bias[:, 0], x.min(1))
    want_scale = np.where(np.ptp(x, 1) > 0, np.ptp(x, 1) / 255, 1.0)
    np.testing.assert_allclose(scale[:, 0], want_scale, rtol=1e-6)
    assert q.min() == 0 and q.max() == 255  # the row's min and max hit the ends of the range
    err = np.abs(np.asarray(api.dequantize_rowwise(q, sb)) - x)
    # Half a step, plus float32 rounding of q * scale + bias.
    bound = scale / 2 * (1 + 1e-4) + 2 * EPS * (np.abs(bias) + 255 * scale)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound)}"
    assert np.all(err[3] == 0) and np.all(q[3] == 0) and scale[3, 0] == 1.0  # the constant row


@pytest.mark.parametrize("pooling", float_reference.POOLINGS)
def test_pooled_int8_lookup_is_within_the_bound_of_the_float_lookup(pooling):
    v, d, n, h = SHAPES[1]
    x, ids = _table(v, d), _ids(v, n, h)
    q, sb = api.quantize_rowwise(x)
    got = np.asarray(api.pool(q, sb, ids, pooling=pooling, impl="xla"))
    want = np.asarray(float_reference.pool(x, ids, pooling=pooling))
    # Each valid id adds at most half its row's step; float32 rounding on top.
    valid = np.asarray(float_reference.valid_ids(ids, v))
    steps = np.asarray(sb)[np.clip(np.asarray(ids), 0, v - 1), 0] * valid  # [N, H]
    bound = steps.sum(1, keepdims=True) / 2
    if pooling == "mean":
        bound = bound / np.maximum(valid.sum(1, keepdims=True), 1)
    slack = 1e-5 * (np.abs(want) + 1)
    assert np.all(np.abs(got - want) <= bound + slack), np.max(np.abs(got - want) - bound)
    assert np.any(np.abs(got - want) > 0)  # it is a lossy format: the bound is exercised


def test_reference_against_numpy():
    """The fused reference equals pooling the fully dequantized table by a loop over bags."""
    v, d, n, h = SHAPES[1]
    q, sb = api.quantize_rowwise(_table(v, d))
    ids = _ids(v, n, h)
    deq, k = np.asarray(api.dequantize_rowwise(q, sb)), np.asarray(ids)
    want = np.zeros((n, d), np.float32)
    for i, bag in enumerate(k):
        for j in bag:
            if 0 <= j < v:
                want[i] += deq[j]
    counts = np.maximum(((k >= 0) & (k < v)).sum(1, keepdims=True), 1)
    np.testing.assert_allclose(reference.pool(q, sb, ids), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(
        reference.pool(q, sb, ids, pooling="mean"), want / counts, rtol=1e-5, atol=1e-4
    )
    assert not np.any(np.asarray(reference.pool(q, sb, ids))[0])  # the all-padding bag


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "V{}-D{}-N{}-H{}".format(*s))
@pytest.mark.parametrize("impl", IMPLS)
def test_kernel_matches_the_reference(impl, shape):
    v, d, n, h = shape
    q, sb = api.quantize_rowwise(_table(v, d))
    ids = _ids(v, n, h)
    assert api._choose(q, ids, impl) == impl  # not a silent fallback
    run = jax.jit(
        lambda q, sb, ids: {
            p: api.pool(q, sb, ids, pooling=p, impl=impl) for p in float_reference.POOLINGS
        }
    )
    got = run(q, sb, ids)
    with jax.default_matmul_precision("highest"):
        for pooling in float_reference.POOLINGS:
            want = reference.pool(q, sb, ids, pooling=pooling)
            assert got[pooling].dtype == jnp.float32 and got[pooling].shape == (n, d)
            np.testing.assert_allclose(
                got[pooling], want, **common.tolerance(jnp.float32), err_msg=pooling
            )


def test_unsupported_call_falls_back_and_is_counted():
    q, sb = api.quantize_rowwise(_table(11, 4100))
    ids = _ids(11, 3, 2)
    key_prefix = (api.OP, "pallas_gpu")
    before = sum(c for k, c in common.FALLBACKS.items() if k[:2] == key_prefix)
    out = api.pool(q, sb, ids, impl="pallas_gpu")
    keys = [k for k in common.FALLBACKS if k[:2] == key_prefix and "D=4100" in k[2]]
    assert keys and sum(c for k, c in common.FALLBACKS.items() if k[:2] == key_prefix) == before + 1
    np.testing.assert_allclose(out, reference.pool(q, sb, ids), **common.tolerance(jnp.float32))


def test_bad_input_raises():
    v, d, n, h = SHAPES[0]
    q, sb = api.quantize_rowwise(_table(v, d))
    ids = _ids(v, n, h)
    for bad_q in (q.astype(jnp.float32), q.astype(jnp.int8), q[0]):
        with pytest.raises(ValueError, match="q must be a .V, D. uint8 table"):
            api.pool(bad_q, sb, ids)
    for bad_sb in (sb[:, :1], jnp.concatenate([sb, sb[:, :1]], 1), sb[1:], sb.T):
        with pytest.raises(ValueError, match=r"scale_bias must be \[V, 2\]"):
            api.pool(q, bad_sb, ids)
        with pytest.raises(ValueError, match=r"scale_bias must be \[V, 2\]"):
            api.dequantize_rowwise(q, bad_sb)
    with pytest.raises(ValueError, match="scale_bias must be float32"):
        api.pool(q, sb.astype(jnp.float16), ids)
    with pytest.raises(ValueError, match="ids must be integers"):
        api.pool(q, sb, ids.astype(jnp.float32))
    with pytest.raises(ValueError, match="pooling must be one of"):
        api.pool(q, sb, ids, pooling="max")
    with pytest.raises(ValueError, match="table must be a float"):
        api.quantize_rowwise(q)
    with pytest.raises(ValueError, match="unknown implementation"):
        api.pool(q, sb, ids, impl="cpu_ffi")


PROD_V, PROD_D, PROD_N = 1_000_000, 128, 65_536
PLATFORMS = [
    ("cuda", "pallas_gpu", "__gpu$xla.gpu.triton"),
    ("tpu", "pallas_tpu", "tpu_custom_call"),
]


@pytest.mark.parametrize("h", [1, 20])
@pytest.mark.parametrize(("platform", "impl", "marker"), PLATFORMS, ids=[p[0] for p in PLATFORMS])
def test_lowers_at_production_shapes(platform, impl, marker, h):
    args = (
        jax.ShapeDtypeStruct((PROD_V, PROD_D), jnp.uint8),
        jax.ShapeDtypeStruct((PROD_V, 2), jnp.float32),
        jax.ShapeDtypeStruct((PROD_N, h), jnp.int32),
    )
    fn = jax.jit(lambda q, sb, ids: api.pool(q, sb, ids, impl=impl, interpret=False))
    text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert marker in text
    assert "stablehlo.gather" not in text  # no XLA fallback gather: the kernel does it all
