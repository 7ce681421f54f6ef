"""fm_interaction (Wukong's optimized FM X (Xᵀ Y)): every implementation against the reference,
forward and VJP; the written-out backward equations; fallbacks; Triton / Mosaic lowering at
production shapes.

Inputs are drawn at unit scale (X·Xᵀ entries, T, O, dX and dY of order one, as with the model's
layer-normed X and glorot Y), so ``common.tolerance``'s absolute part is meaningful.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recscale.kernels import common
from recscale.kernels.fm_interaction import api, pallas_gpu, pallas_tpu, reference

IMPLS = ["xla", "pallas_gpu", "pallas_tpu"]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (B, E, D, K): each of B {3, 16}, E {2, 7, 26}, D {4, 16, 128}, K {1, 8, 24} at least once,
# none a power of two in every dim.
SHAPES = [(3, 2, 4, 1), (3, 7, 16, 24), (16, 26, 128, 8)]
# Production layers (Wukong paper Table 5-like): each of B {65536, 8192}, E {32, 56},
# D {128, 192}, K {24, 32} twice.
PROD_SHAPES = [(65536, 32, 128, 24), (65536, 56, 192, 32), (8192, 56, 128, 24), (8192, 32, 192, 32)]
PLATFORM = {"pallas_gpu": "cuda", "pallas_tpu": "tpu"}
CUSTOM_CALL = {"pallas_gpu": "triton", "pallas_tpu": "tpu_custom_call"}


def _inputs(b, e, d, k, dtype, *, attentive=False, seed=0):
    kx, ky, kg = jax.random.split(jax.random.key(seed), 3)
    y_scale = min(1.0, (d / e) ** 0.25)  # keeps T = Xᵀ Y (and so dX) of order one
    x = jax.random.normal(kx, (b, e, d)) * (e * d) ** -0.25
    y = jax.random.normal(ky, (b, e, k) if attentive else (e, k)) * y_scale
    g = jax.random.normal(kg, (b, e, k)) / k**0.5
    return x.astype(dtype), y.astype(dtype), g.astype(dtype)


def _f32(a):
    return a.astype(jnp.float32)


@jax.jit
def _reference_vjp_f32(x, y, g):
    o, vjp = jax.vjp(reference.fm_interaction, x, y)
    return o, *vjp(g)


def _reference_vjp(x, y, g):
    """Output and VJP of the reference in float32 at HIGHEST precision (inputs upcast)."""
    with jax.default_matmul_precision("highest"):
        return _reference_vjp_f32(_f32(x), _f32(y), _f32(g))


def _assert_close(got, want, dtype, name):
    tol = common.tolerance(dtype)
    np.testing.assert_allclose(_f32(got), want, err_msg=name, **tol)


def _check_against_reference(fn, x, y, g):
    def fwd_bwd(x, y, g):
        o, vjp = jax.vjp(fn, x, y)
        return o, *vjp(g)

    o, dx, dy = jax.jit(fwd_bwd)(x, y, g)
    assert (o.shape, o.dtype) == (g.shape, x.dtype)
    assert (dx.shape, dx.dtype) == (x.shape, x.dtype)
    assert (dy.shape, dy.dtype) == (y.shape, y.dtype)
    for got, want, name in zip(
        (o, dx, dy), _reference_vjp(x, y, g), ("out", "dx", "dy"), strict=True
    ):
        _assert_close(got, want, x.dtype, name)


def _fallbacks(impl):
    return sum(n for (op, i, _), n in common.FALLBACKS.items() if op == api.OP and i == impl)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference(impl, shape, dtype):
    x, y, g = _inputs(*shape, dtype)
    before = _fallbacks(impl)
    _check_against_reference(lambda x, y: api.fm_interaction(x, y, impl=impl), x, y, g)
    # Only Mosaic's missing float16 falls back; everything else runs the kernel.
    expect_fallback = impl == "pallas_tpu" and dtype == jnp.float16
    assert _fallbacks(impl) - before == int(expect_fallback)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize("impl", IMPLS)
def test_attentive_matches_reference(impl, dtype):
    """y [B, E, K] (one projection per example): supported by both kernels."""
    x, y, g = _inputs(16, 7, 16, 24, dtype, attentive=True)
    before = _fallbacks(impl)
    _check_against_reference(lambda x, y: api.fm_interaction(x, y, impl=impl), x, y, g)
    assert _fallbacks(impl) == before


@pytest.mark.parametrize("attentive", [False, True], ids=["shared", "attentive"])
@pytest.mark.parametrize(
    "kernels,block_b",
    [(pallas_gpu, 5), (pallas_tpu, 3)],
    ids=["pallas_gpu", "pallas_tpu"],
)
def test_partial_last_block(kernels, block_b, attentive):
    """Several programs, the last one partial (B=16): masked rows neither leak into dY nor
    write outside the arrays. TPU: 6 blocks in two "parallel" halves, two dY partials."""
    impl = kernels.__name__.rsplit(".", 1)[-1]
    interpret = common.interpret_for(impl)
    x, y, g = _inputs(16, 26, 16, 8, jnp.float32, attentive=attentive)

    @jax.custom_vjp
    def fn(x, y):
        return kernels.fm_interaction_fwd(x, y, interpret=interpret, block_b=block_b)

    def fn_fwd(x, y):
        return fn(x, y), (x, y)

    def fn_bwd(res, g):
        return kernels.fm_interaction_bwd(*res, g, interpret=interpret, block_b=block_b)

    fn.defvjp(fn_fwd, fn_bwd)
    _check_against_reference(fn, x, y, g)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_mixed_dtypes(impl):
    """bfloat16 activations with a float32 projection: output bfloat16, dY float32."""
    x, _, g = _inputs(3, 7, 16, 8, jnp.bfloat16)
    _, y, _ = _inputs(3, 7, 16, 8, jnp.float32, seed=1)
    _check_against_reference(lambda x, y: api.fm_interaction(x, y, impl=impl), x, y, g)


@pytest.mark.parametrize("attentive", [False, True], ids=["shared", "attentive"])
def test_backward_equations(attentive):
    """dX = G Tᵀ + Y (Xᵀ G)ᵀ and dY = Σ_b X_b Xᵀ_b G_b (the kernels' backward) equal autodiff."""
    x, y, g = _inputs(3, 7, 16, 8, jnp.float32, attentive=attentive)
    _, want_dx, want_dy = _reference_vjp(x, y, g)
    with jax.default_matmul_precision("highest"):
        dx, dy = reference.fm_interaction_vjp(x, y, g)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dy, want_dy, rtol=1e-5, atol=1e-5)


def test_unsupported_falls_back():
    """A shape beyond the GPU kernel's register tiles and a dtype Mosaic lacks fall back to the
    reference, counted with their reasons."""
    x, y, _ = _inputs(2, 32, 1024, 8, jnp.float32)  # E_p·D_p = 32768 > 16384
    key = (api.OP, "pallas_gpu", pallas_gpu.unsupported_reason(x.shape, y.shape, x.dtype))
    assert "register budget" in key[2]
    before = common.FALLBACKS[key]
    got = api.fm_interaction(x, y, impl="pallas_gpu")
    np.testing.assert_array_equal(got, reference.fm_interaction(x, y))
    assert common.FALLBACKS[key] == before + 1

    x, y, _ = _inputs(2, 7, 16, 8, jnp.float16)
    key = (api.OP, "pallas_tpu", "dtype float16 (have float32, bfloat16)")
    before = common.FALLBACKS[key]
    got = api.fm_interaction(x, y, impl="pallas_tpu")
    np.testing.assert_array_equal(got, reference.fm_interaction(x, y))
    assert common.FALLBACKS[key] == before + 1


def test_bad_inputs_raise():
    x, y, _ = _inputs(3, 7, 16, 8, jnp.float32)
    with pytest.raises(ValueError, match="x must be"):
        api.fm_interaction(x[0], y)
    with pytest.raises(ValueError, match="y must be"):
        api.fm_interaction(x, y[:5])
    with pytest.raises(ValueError, match="y must be"):
        api.fm_interaction(x, jnp.zeros((4, 7, 8)))
    with pytest.raises(ValueError, match="unknown implementation"):
        api.fm_interaction(x, y, impl="cpu_ffi")


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd_bwd"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize("shape", PROD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_lowers_at_production_shapes(impl, shape, dtype, backward):
    _check_lowering(impl, shape, dtype, backward=backward, attentive=False)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_attentive_lowers(impl):
    _check_lowering(impl, PROD_SHAPES[0], jnp.bfloat16, backward=True, attentive=True)


def _check_lowering(impl, shape, dtype, *, backward, attentive):
    b, e, d, k = shape
    x = jax.ShapeDtypeStruct((b, e, d), dtype)
    y = jax.ShapeDtypeStruct((b, e, k) if attentive else (e, k), dtype)
    g = jax.ShapeDtypeStruct((b, e, k), dtype)

    def op(x, y):
        return api.fm_interaction(x, y, impl=impl, interpret=False)

    def fwd_bwd(x, y, g):
        o, vjp = jax.vjp(op, x, y)
        return o, *vjp(g)

    before = _fallbacks(impl)
    traced = jax.jit(fwd_bwd).trace(x, y, g) if backward else jax.jit(op).trace(x, y)
    text = traced.lower(lowering_platforms=(PLATFORM[impl],)).as_text()
    assert _fallbacks(impl) == before
    assert CUSTOM_CALL[impl] in text
    assert "fm_interaction_fwd" in text
    assert ("fm_interaction_bwd" in text) == backward
