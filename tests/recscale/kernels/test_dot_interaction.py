"""The dot interaction: every implementation matches the reference (output and VJP), the
reference matches the gather formula, unsupported calls fall back, and the Pallas kernels lower
for GPU and TPU at production shapes.

Shapes x dtypes x self-interaction: by default a pairwise covering (every pair of values of
B, N, D, dtype and self-interaction occurs for each implementation; interpret mode compiles
each case, about 2 s). ``RECSCALE_KERNEL_TESTS=full`` runs the whole product.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from recscale.kernels import common
from recscale.kernels.dot_interaction import api, cpu_ffi, pallas_gpu, pallas_tpu, reference

OP = "dot_interaction"
IMPLS = ["xla", "cpu_ffi", "pallas_gpu", "pallas_tpu"]
BS, NS, DS = (3, 16), (2, 5, 27), (4, 16, 128)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _cases() -> list[tuple]:
    """``(B, N, D, dtype, self_interaction)``: the L9 orthogonal array over N, D, dtype and
    (B, self) in {(3, no), (16, yes), (3, yes)}, plus (16, no), so every pair of values of
    any two factors occurs; or the whole product."""
    if os.environ.get("RECSCALE_KERNEL_TESTS") == "full":
        return list(itertools.product(BS, NS, DS, DTYPES, (False, True)))
    l9 = [
        (0, 0, 0, 0),
        (0, 1, 1, 1),
        (0, 2, 2, 2),
        (1, 0, 1, 2),
        (1, 1, 2, 0),
        (1, 2, 0, 1),
        (2, 0, 2, 1),
        (2, 1, 0, 2),
        (2, 2, 1, 0),
    ]
    b_self = [(3, False), (16, True), (3, True)]
    cases = []
    for n, d, t, s in l9:
        b, self_interaction = b_self[s]
        cases.append((b, NS[n], DS[d], DTYPES[t], self_interaction))
    return cases + [(16, 27, 128, jnp.bfloat16, False)]


def test_the_cases_cover_every_pair():
    cases = _cases()
    levels = [BS, NS, DS, DTYPES, (False, True)]
    for (u, lu), (v, lv) in itertools.combinations(enumerate(levels), 2):
        seen = {(c[u], c[v]) for c in cases}
        assert seen == set(itertools.product(lu, lv)), (u, v)


def _inputs(b: int, n: int, d: int, dtype, self_interaction: bool, seed: int = 0):
    kx, kg = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (b, n, d), jnp.float32).astype(dtype)
    g = jax.random.normal(kg, (b, reference.num_pairs(n, self_interaction)), jnp.float32)
    return x, g.astype(dtype)


def _oracle(x, g, self_interaction):
    """The reference's output and VJP, in float32 at HIGHEST on the upcast inputs."""
    with jax.default_matmul_precision("highest"):
        f = functools.partial(reference.dot_interaction, self_interaction=self_interaction)
        out, vjp = jax.vjp(f, x.astype(jnp.float32))
        return out, vjp(g.astype(jnp.float32))[0]


def _fallbacks(impl: str) -> int:
    return sum(c for (op, i, _), c in common.FALLBACKS.items() if op == OP and i == impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "b,n,d,dtype,self_interaction",
    _cases(),
    ids=lambda v: jnp.dtype(v).name if isinstance(v, type) else repr(v),
)
def test_matches_reference(impl, b, n, d, dtype, self_interaction):
    x, g = _inputs(b, n, d, dtype, self_interaction)
    f = functools.partial(api.dot_interaction, self_interaction=self_interaction, impl=impl)

    @jax.jit
    def run(x, g):
        out, vjp = jax.vjp(f, x)
        return out, vjp(g)[0]

    if impl == "cpu_ffi" and not cpu_ffi.available():
        pytest.skip("the C++ kernel did not build here")
    before = _fallbacks(impl)
    out, dx = run(x, g)
    # the kernel itself ran: only Mosaic TPU's missing float16 and the C++ kernel's non-float32
    # are expected fallbacks
    falls_back = (impl == "pallas_tpu" and jnp.dtype(dtype) == jnp.float16) or (
        impl == "cpu_ffi" and jnp.dtype(dtype) != jnp.float32
    )
    assert _fallbacks(impl) - before == int(falls_back)
    want, dwant = _oracle(x, g, self_interaction)
    assert out.shape == want.shape and out.dtype == x.dtype
    assert dx.shape == x.shape and dx.dtype == x.dtype
    tol = common.tolerance(dtype)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, **tol)
    np.testing.assert_allclose(np.asarray(dx, np.float32), dwant, **tol)


@pytest.mark.parametrize(
    "kernels,interpret,block_b,b",
    [
        (pallas_gpu, True, 8, 19),
        (
            pallas_tpu,
            pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan"),
            16,
            40,
        ),
    ],
    ids=["pallas_gpu", "pallas_tpu"],
)
def test_kernels_over_several_blocks(kernels, interpret, block_b, b):
    """Three grid steps, the last one partial, and D = 200: two D chunks on Triton, a
    lane-unaligned D on Mosaic."""
    x, g = _inputs(b, 27, 200, jnp.float32, True)
    kw = dict(self_interaction=True, interpret=interpret, block_b=block_b)
    out = kernels.forward(x, **kw)
    dx = kernels.backward(x, g, **kw)
    want, dwant = _oracle(x, g, True)
    np.testing.assert_allclose(out, want, **common.tolerance(jnp.float32))
    np.testing.assert_allclose(dx, dwant, **common.tolerance(jnp.float32))


# Widths around the kernel's compile-time ones (4 ... 128) and its 16-column chunks.
CPU_WIDTHS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 130)


@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("d", CPU_WIDTHS)
def test_cpu_kernel_matches_reference_over_awkward_shapes(d, self_interaction):
    """B = 1 and odd N, N across the 16-column chunks (15, 16, 17, 33), N = 1 with the
    diagonal; every width from the compile-time ones to the generic loop."""
    if not cpu_ffi.available():
        pytest.skip("the C++ kernel did not build here")
    shapes = [(1, 27), (3, 5), (2, 16), (2, 17), (1, 33), (4, 2)]
    if self_interaction:
        shapes.append((3, 1))
    f = functools.partial(api.dot_interaction, self_interaction=self_interaction, impl="cpu_ffi")
    before = _fallbacks("cpu_ffi")
    for b, n in shapes:
        x, g = _inputs(b, n, d, jnp.float32, self_interaction, seed=d)
        out, vjp = jax.vjp(f, x)
        dx = vjp(g)[0]
        want, dwant = _oracle(x, g, self_interaction)
        assert out.shape == want.shape and out.dtype == jnp.float32
        np.testing.assert_allclose(out, want, **common.tolerance(jnp.float32), err_msg=(b, n))
        np.testing.assert_allclose(dx, dwant, **common.tolerance(jnp.float32), err_msg=(b, n))
    assert _fallbacks("cpu_ffi") == before


def test_auto_on_cpu_picks_the_cpu_kernel_for_float32_at_measured_widths(monkeypatch):
    """``auto`` on CPU runs the C++ kernel for float32 at D = 4, 8 and 16 on an AVX-512 CPU when
    it built, and XLA for other dtypes and widths, counting nothing as a fallback."""
    calls = []

    def fake(x, self_interaction):
        calls.append((x.dtype, x.shape[2]))
        return reference.dot_interaction(x, self_interaction=self_interaction)

    monkeypatch.setattr(api, "_cpu_ffi", fake)
    before = collections.Counter(common.FALLBACKS)
    widths = [(4, jnp.float32), (4, jnp.bfloat16), (8, jnp.float32), (10, jnp.float32)]
    widths += [(16, jnp.float32), (32, jnp.float32)]
    for d, dtype in widths:
        api.dot_interaction(jnp.ones((4, 5, d), dtype), impl="auto")
    picked = api._has_avx512() and cpu_ffi.available()
    f32 = jnp.dtype(jnp.float32)
    assert calls == ([(f32, 4), (f32, 8), (f32, 16)] if picked else [])
    assert common.FALLBACKS == before
    monkeypatch.setattr(api, "_has_avx512", lambda: False)
    assert api.cpu_auto_choice((4, 5, 4), jnp.float32) == "xla"
    monkeypatch.setattr(api, "_has_avx512", lambda: True)
    assert api.cpu_auto_choice((4, 5, 4), jnp.float32) == "cpu_ffi"
    assert api.cpu_auto_choice((4, 5, 4), jnp.float16) == "xla"
    assert api.cpu_auto_choice((4, 5, 16), jnp.float32) == "cpu_ffi"
    assert api.cpu_auto_choice((4, 5, 32), jnp.float32) == "xla"


@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("n", [1, 2, 6])
def test_reference_matches_the_gather_formula(n, self_interaction):
    """The reference (static slices, one-matmul custom backward) against the naive gather
    ``Σ_d x[:, i_p, d] x[:, j_p, d]`` and its autodiff."""
    x, g = _inputs(4, n, 8, jnp.float32, self_interaction, seed=1)
    li, lj = np.tril_indices(n, 0 if self_interaction else -1)

    def gather(x):
        return jnp.sum(x[:, li] * x[:, lj], axis=-1)

    f = functools.partial(reference.dot_interaction, self_interaction=self_interaction)
    with jax.default_matmul_precision("highest"):
        (out, vjp), (want, vjp_want) = jax.vjp(f, x), jax.vjp(gather, x)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(vjp(g)[0], vjp_want(g)[0], rtol=1e-5, atol=1e-5)
    assert out.shape == (4, reference.num_pairs(n, self_interaction))


@pytest.mark.parametrize(
    "impl,shape,dtype,self_interaction,reason",
    [
        ("pallas_tpu", (4, 5, 8), jnp.float16, False, "float16"),
        ("pallas_gpu", (2, 129, 4), jnp.float32, False, "N=129"),
        ("pallas_gpu", (3, 1, 8), jnp.float32, False, "no pairs"),
        ("pallas_tpu", (3, 1, 8), jnp.bfloat16, False, "no pairs"),
        ("cpu_ffi", (3, 5, 8), jnp.bfloat16, False, "float32"),
        ("cpu_ffi", (3, 1, 8), jnp.float32, False, "no pairs"),
    ],
)
def test_unsupported_calls_fall_back(impl, shape, dtype, self_interaction, reason):
    x, g = _inputs(*shape, dtype, self_interaction)
    before = collections.Counter(common.FALLBACKS)
    f = functools.partial(api.dot_interaction, self_interaction=self_interaction, impl=impl)
    out, vjp = jax.vjp(f, x)
    dx = vjp(g)[0]
    counted = common.FALLBACKS - before
    assert len(counted) == 1
    ((op, got_impl, why),) = counted
    assert (op, got_impl) == (OP, impl) and reason in why
    want, dwant = _oracle(x, g, self_interaction)
    tol = common.tolerance(dtype)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, **tol)
    np.testing.assert_allclose(np.asarray(dx, np.float32), dwant, **tol)


def test_tpu_blocks_fit_the_vmem_budget():
    for n, d, dtype, backward in itertools.product(
        (27, 41), (128, 512), (jnp.float32, jnp.bfloat16), (False, True)
    ):
        bb = pallas_tpu.choose_block_b(65_536, n, d, dtype, False, backward)
        assert bb % pallas_tpu.MIN_BLOCK_B == 0 and bb >= pallas_tpu.MIN_BLOCK_B
        per = pallas_tpu._bytes_per_example(n, d, dtype, False, backward)
        assert bb * per <= pallas_tpu.VMEM_BUDGET
    assert pallas_tpu.unsupported((8, 300, 4096), jnp.float32, False) is not None


def test_bad_input_is_an_error():
    with pytest.raises(ValueError, match=r"\[B, N, D\]"):
        api.dot_interaction(jnp.zeros((4, 5)), impl="xla")
    with pytest.raises(ValueError, match="unknown implementation"):
        api.dot_interaction(jnp.zeros((4, 5, 8)), impl="cuda")


# Criteo: 26 sparse features + the dense vector (N = 27); N = 41 a wider feature set.
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("n", [27, 41])
@pytest.mark.parametrize(
    "impl,platform,custom_call",
    [("pallas_gpu", "cuda", "triton"), ("pallas_tpu", "tpu", "tpu_custom_call")],
)
def test_lowers_at_production_shapes(impl, platform, custom_call, n, dtype, backward):
    x = jax.ShapeDtypeStruct((65_536, n, 128), dtype)

    def fwd(x):
        return api.dot_interaction(x, impl=impl, interpret=False)

    def loss(x):
        return jnp.sum(fwd(x).astype(jnp.float32))

    f = jax.value_and_grad(loss) if backward else fwd
    before = _fallbacks(impl)
    text = jax.jit(f).trace(x).lower(lowering_platforms=(platform,)).as_text()
    assert _fallbacks(impl) == before
    calls = [line for line in text.splitlines() if re.search(r"stablehlo\.custom_call", line)]
    kernels = [line for line in calls if custom_call in line]
    assert len(kernels) == (2 if backward else 1), calls
    assert "dot_interaction_fwd" in text
    assert ("dot_interaction_bwd" in text) == backward


@pytest.mark.parametrize("diagonal", [True, False])
def test_lower_triangle_and_its_gradient_equal_the_gather(diagonal):
    rng = np.random.default_rng(0)
    z = jnp.asarray(rng.standard_normal((4, 7, 7)), jnp.float32)
    li, lj = np.tril_indices(7, 0 if diagonal else -1)
    np.testing.assert_array_equal(reference.lower_triangle(z, diagonal), z[:, li, lj])
    g = jnp.asarray(rng.standard_normal((4, len(li))), jnp.float32)
    got = jax.vjp(lambda x: reference.lower_triangle(x, diagonal), z)[1](g)[0]
    want = jax.vjp(lambda x: x[:, li, lj], z)[1](g)[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("self_interaction", [False, True])
def test_cpu_kernel_is_differentiable_twice(self_interaction):
    """Hessian-vector products (``analysis.curvature``, ``optim.hessian_free``) take a gradient of
    the gradient: through the C++ backward they equal the reference's."""
    if not cpu_ffi.available():
        pytest.skip("the C++ kernel did not build here")
    x = jax.random.normal(jax.random.key(0), (6, 5, 4), jnp.float32)
    v = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)

    def hvp(impl):
        f = functools.partial(api.dot_interaction, self_interaction=self_interaction, impl=impl)
        loss = lambda y: jnp.sum(jnp.sin(f(y)))  # noqa: E731
        return jax.grad(lambda y: jnp.vdot(jax.grad(loss)(y), v))(x)

    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(hvp("cpu_ffi"), hvp("xla"), rtol=1e-5, atol=1e-5)
