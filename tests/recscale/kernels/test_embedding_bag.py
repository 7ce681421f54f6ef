"""embedding_bag.pool: every implementation equals the float32 reference (outputs and the table
VJP), unsupported calls fall back with a counted reason, bad input is refused, and the Pallas
kernels lower for GPU and TPU at production shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recscale.kernels import common
from recscale.kernels.embedding_bag import api, cpu_ffi, pallas_gpu, pallas_tpu, reference
from tests.tpu_chip import needs_libtpu, replicated_on_a_v5p_chip

IMPLS = ["xla", "cpu_ffi", "pallas_gpu", "pallas_tpu"]
# (V, D, N, H): non-power-of-two D and N, one-id bags, a ragged last block of bags.
SHAPES = [(37, 48, 5, 3), (37, 8, 24, 7), (37, 128, 24, 1)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _ids(rng: np.random.Generator, v: int, n: int, h: int) -> jax.Array:
    """Ids with repeats (within and across bags), -1 and V padding, out-of-range ids, the last
    row, and one bag of padding only."""
    ids = rng.integers(0, 9, (n, h))  # few distinct rows: many repeats
    ids[rng.random((n, h)) < 0.15] = v - 1
    ids[rng.random((n, h)) < 0.2] = -1
    ids[rng.random((n, h)) < 0.1] = v
    ids[rng.random((n, h)) < 0.05] = v + 5
    ids[0] = -1
    ids[0, -1] = v
    return jnp.asarray(ids, jnp.int32)


def _inputs(shape, dtype, seed=0):
    v, d, n, h = shape
    rng = np.random.default_rng(seed)
    table = jnp.asarray(rng.standard_normal((v, d)), dtype)
    g = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    return table, _ids(rng, v, n, h), g


def _expected_impl(impl: str, table: jax.Array, ids: jax.Array) -> str:
    """The implementation a call must run: the requested one, except documented fallbacks."""
    if impl == "cpu_ffi" and (table.dtype != jnp.float32 or ids.shape[1] < 2):
        return "xla"
    if impl == "pallas_tpu" and table.dtype in (jnp.float16, jnp.bfloat16):
        return "xla"
    return impl


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "V{}-D{}-N{}-H{}".format(*s))
@pytest.mark.parametrize("impl", IMPLS)
def test_outputs_and_vjp_match_the_reference(impl, shape, dtype):
    if impl == "cpu_ffi" and not cpu_ffi.available():
        pytest.skip("the C++ CPU kernel did not build here")
    table, ids, g = _inputs(shape, dtype)
    # Not a silent fallback: the kernel under test is the one that runs.
    assert api._choose(table, ids, impl) == _expected_impl(impl, table, ids)

    @jax.jit
    def run(table, ids, g):
        res = {}
        for pooling in reference.POOLINGS:
            fn = lambda t, p=pooling: api.pool(t, ids, pooling=p, impl=impl)  # noqa: E731
            out, vjp = jax.vjp(fn, table)
            res[pooling] = (out, vjp(g)[0])
        return res

    got = run(table, ids, g)
    want = _reference(shape, jnp.dtype(dtype).name)
    tol = common.tolerance(dtype)
    for pooling in reference.POOLINGS:
        (out, grad), (want_out, want_grad) = got[pooling], want[pooling]
        assert out.dtype == jnp.float32 and out.shape == want_out.shape
        np.testing.assert_allclose(out, want_out, **tol, err_msg=f"{pooling} output")
        assert grad.dtype == table.dtype and grad.shape == table.shape
        np.testing.assert_allclose(grad.astype(jnp.float32), want_grad, **tol, err_msg=pooling)


@functools.cache
def _reference(shape, dtype_name: str) -> dict:
    """``{pooling: (output, table VJP)}`` of the reference on the inputs upcast to float32, at
    HIGHEST precision (autodiff, not the hand-written backward). Shared by all impls."""
    table, ids, g = _inputs(shape, dtype_name)

    @jax.jit
    def run(table, g):
        res = {}
        for pooling in reference.POOLINGS:
            fn = lambda t, p=pooling: reference.pool(t, ids, pooling=p)  # noqa: E731
            out, vjp = jax.vjp(fn, table.astype(jnp.float32))
            res[pooling] = (out, vjp(g)[0])
        return res

    with jax.default_matmul_precision("highest"):
        return jax.device_get(run(table, g))


def test_reference_against_numpy():
    """The oracle itself, against a loop over bags: padding skipped, repeats counted, mean over
    valid ids (a bag of padding only pools to zero)."""
    table, ids, g = _inputs(SHAPES[1], jnp.float32)
    t, k, g = np.asarray(table), np.asarray(ids), np.asarray(g)
    v = t.shape[0]
    want_sum = np.zeros((k.shape[0], t.shape[1]), np.float32)
    want_grad = np.zeros_like(t)
    for n, bag in enumerate(k):
        for i in bag:
            if 0 <= i < v:
                want_sum[n] += t[i]
                want_grad[i] += g[n]
    counts = np.maximum(((k >= 0) & (k < v)).sum(1, keepdims=True), 1)
    np.testing.assert_allclose(reference.pool(table, ids), want_sum, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        reference.pool(table, ids, pooling="mean"), want_sum / counts, rtol=1e-6, atol=1e-6
    )
    assert not np.any(want_sum[0]) and counts[0, 0] == 1  # the all-padding bag
    np.testing.assert_allclose(
        reference.pool_bwd(ids, g, v, jnp.float32), want_grad, rtol=1e-6, atol=1e-6
    )


def test_xla_path_equals_the_cpu_kernel_bitwise():
    """The reference sums slots in the order the C++ kernel does (the engine's numerics), so the
    two CPU paths agree to the bit."""
    if not cpu_ffi.available():
        pytest.skip("the C++ CPU kernel did not build here")
    table, ids, _ = _inputs(SHAPES[1], jnp.float32)
    for pooling in reference.POOLINGS:
        got = jax.jit(lambda t, i, p=pooling: api.pool(t, i, pooling=p, impl="cpu_ffi"))
        want = jax.jit(lambda t, i, p=pooling: reference.pool(t, i, pooling=p))
        np.testing.assert_array_equal(got(table, ids), want(table, ids))


def test_auto_on_cpu_picks_the_cpu_kernel_where_it_applies():
    table, ids, _ = _inputs(SHAPES[0], jnp.float32)
    ffi = "cpu_ffi" if cpu_ffi.available() else "xla"
    assert api._choose(table, ids, "auto") == ffi
    assert api._choose(table.astype(jnp.bfloat16), ids, "auto") == "xla"
    assert api._choose(table, ids[:, :1], "auto") == "xla"  # one-id bags


@pytest.mark.parametrize(
    ("backend", "hotness", "width", "want"),
    [
        ("gpu", 1, 16, "xla"),  # DLRM config A on the H200: the kernels lost 12% / 27%
        ("cuda", 1, 16, "xla"),
        ("gpu", 1, 128, "xla"),  # the lookup alone: 1.00-1.01x, nothing gained
        ("gpu", 1, 256, "pallas_gpu"),  # not measured: the kernel stays
        ("gpu", 2, 16, "pallas_gpu"),
        ("gpu", 20, 64, "pallas_gpu"),  # configs C (and B, 100 ids): 1.58x (1.76x) training
        ("gpu", 20, 128, "pallas_gpu"),  # the lookup alone: 2.67-2.72x
        ("cpu", 1, 128, "xla"),
        ("cpu", 3, 16, "cpu_ffi"),
        ("tpu", 1, 16, "pallas_tpu"),
        ("tpu", 20, 128, "pallas_tpu"),
    ],
)
def test_auto_plans_by_backend_hotness_and_width(backend, hotness, width, want):
    assert api.auto_choice(backend, hotness, width) == want


def test_auto_on_a_gpu_keeps_one_id_narrow_bags_on_xla(monkeypatch):
    """The plan in the call: under ``target_backend("gpu")`` with the kernel verified, a one-id
    16-wide lookup lowers without the Triton kernel and counts no fallback; a 3-id one and a
    one-id 256-wide one lower with it."""
    monkeypatch.setattr(common, "HARDWARE_VERIFIED", frozenset({(api.OP, "pallas_gpu")}))

    def triton_calls(v, d, h):
        args = (
            jax.ShapeDtypeStruct((v, d), jnp.float32),
            jax.ShapeDtypeStruct((64, h), jnp.int32),
        )
        f = jax.jit(lambda t, i: api.pool(t, i))
        return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("xla.gpu.triton")

    before = dict(common.FALLBACKS)
    with common.target_backend("gpu"):
        assert triton_calls(1000, 16, 1) == 0
        assert triton_calls(1000, 16, 3) == 1
        assert triton_calls(1000, 256, 1) == 1
    assert dict(common.FALLBACKS) == before


@pytest.mark.parametrize(
    ("impl", "shape", "dtype", "reason"),
    [
        ("cpu_ffi", (37, 48, 5, 3), jnp.bfloat16, "float32"),
        ("cpu_ffi", (37, 48, 5, 1), jnp.float32, "one-id bags"),
        ("pallas_gpu", (11, 4100, 3, 2), jnp.float32, "D=4100"),
        ("pallas_tpu", (37, 48, 5, 3), jnp.float16, "float16"),
    ],
)
def test_unsupported_call_falls_back_and_is_counted(impl, shape, dtype, reason):
    table, ids, _ = _inputs(shape, dtype)
    before = {k: c for k, c in common.FALLBACKS.items() if k[:2] == (api.OP, impl)}
    out = api.pool(table, ids, impl=impl)
    counted = [k for k, c in common.FALLBACKS.items() if k[:2] == (api.OP, impl)]
    [key] = [k for k in counted if common.FALLBACKS[k] > before.get(k, 0)]
    assert reason in key[2] and common.FALLBACKS[key] == before.get(key, 0) + 1
    np.testing.assert_allclose(out, reference.pool(table, ids), **common.tolerance(dtype))


def test_bad_input_raises():
    table, ids, _ = _inputs(SHAPES[0], jnp.float32)
    with pytest.raises(ValueError, match="table must be float32"):
        api.pool(table.astype(jnp.int32), ids)
    with pytest.raises(ValueError, match=r"table must be \[V, D\]"):
        api.pool(table[0], ids)
    with pytest.raises(ValueError, match="ids must be integers"):
        api.pool(table, ids.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"ids must be \[N, H\]"):
        api.pool(table, ids[:, 0])
    with pytest.raises(ValueError, match="pooling must be one of"):
        api.pool(table, ids, pooling="max")
    with pytest.raises(ValueError, match="unknown implementation"):
        api.pool(table, ids, impl="cuda")


# Production shapes: a 1M-row table, 64K bags; ShapeDtypeStructs, so nothing is allocated.
PROD_V, PROD_D, PROD_N = 1_000_000, 128, 65_536
PLATFORMS = [
    ("cuda", "pallas_gpu", "__gpu$xla.gpu.triton"),
    ("tpu", "pallas_tpu", "tpu_custom_call"),
]


@pytest.mark.parametrize("h", [1, 20])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(("platform", "impl", "marker"), PLATFORMS, ids=[p[0] for p in PLATFORMS])
def test_lowers_at_production_shapes(platform, impl, marker, dtype, h):
    def fwd_bwd(table, ids, g):
        out, vjp = jax.vjp(lambda t: api.pool(t, ids, impl=impl, interpret=False), table)
        return out, vjp(g)[0]

    args = (
        jax.ShapeDtypeStruct((PROD_V, PROD_D), dtype),
        jax.ShapeDtypeStruct((PROD_N, h), jnp.int32),
        jax.ShapeDtypeStruct((PROD_N, PROD_D), jnp.float32),
    )
    text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    # the forward kernel (bfloat16 on TPU falls back to XLA: pallas_tpu.unsupported)
    assert (text.count(marker) >= 1) == (impl != "pallas_tpu" or dtype == jnp.float32)
    assert "stablehlo.scatter" in text  # the backward: scatter-add into the table gradient


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_many_blocks_match_the_reference(impl):
    """530 bags: several grid programs on both kernels (the shapes above fit one block), with
    a ragged last block."""
    shape = (300, 16, 530, 3)
    assert pallas_gpu.block_bags(530, 16) < 530
    table, ids, g = _inputs(shape, jnp.float32, seed=3)
    assert api._choose(table, ids, impl) == impl
    for pooling in reference.POOLINGS:
        got, vjp = jax.vjp(lambda t, p=pooling: api.pool(t, ids, pooling=p, impl=impl), table)
        want, want_vjp = jax.vjp(lambda t, p=pooling: reference.pool(t, ids, pooling=p), table)
        np.testing.assert_allclose(got, want, **common.tolerance(jnp.float32))
        np.testing.assert_allclose(vjp(g)[0], want_vjp(g)[0], **common.tolerance(jnp.float32))


@pytest.mark.parametrize(("width", "n"), [(8, 40), (64, 40), (32, 270)])
def test_packed_rows_match_the_unpacked_kernel(width, n):
    """A table stored packed (``128 / width`` rows per stored row) pools and differentiates as
    the same table unpacked, in the TPU kernel (interpret mode) and in the XLA fallback, and
    under ``jax.vmap`` (a population's stacked tables); 270 bags of 32 are two blocks, the last
    ragged."""
    pack = 128 // width
    v, h = 40 * pack, 4
    table, ids, g = _inputs((v, width, n, h), jnp.float32, seed=width)
    stored = jax.ShapeDtypeStruct((v // pack, 128), jnp.float32)
    assert (pallas_tpu.block_bags(n, h, (stored,)) < n) == (n > 256)
    packed = table.reshape(v // pack, 128)
    for pooling in reference.POOLINGS:
        want, want_vjp = jax.vjp(lambda t, p=pooling: reference.pool(t, ids, pooling=p), table)
        for impl in ("pallas_tpu", "xla"):
            fn = lambda t, p=pooling, i=impl: api.pool(t, ids, pooling=p, impl=i, pack=pack)  # noqa: E731
            got, vjp = jax.vjp(fn, packed)
            np.testing.assert_allclose(got, want, **common.tolerance(jnp.float32), err_msg=impl)
            grad = vjp(g)[0]
            assert grad.shape == packed.shape
            np.testing.assert_allclose(
                grad.reshape(v, width), want_vjp(g)[0], **common.tolerance(jnp.float32)
            )
    if n > 100:
        return  # the members' check below at the small shapes
    members = jnp.stack([packed, 2 * packed])
    member_ids = jnp.stack([ids, ids[::-1]])
    got = jax.vmap(lambda t, i: api.pool(t, i, impl="pallas_tpu", pack=pack))(members, member_ids)
    for m in range(2):
        want = reference.pool(members[m].reshape(v, width), member_ids[m])
        np.testing.assert_allclose(got[m], want, **common.tolerance(jnp.float32))


def test_packing_needs_a_width_the_rows_divide():
    table, ids, _ = _inputs((30, 12, 4, 2), jnp.float32)
    with pytest.raises(ValueError, match="packed 8 rows a row"):
        api.pool(table, ids, pack=8)


@needs_libtpu
def test_mosaic_reads_a_packed_table_in_place(monkeypatch):
    """Past lowering: libtpu's Mosaic compiles the packed kernel for a v5p chip, and XLA hands
    it the 4M x 32 float32 table (0.5 GiB) as it is: no copy of the table (unpacked, XLA copies
    it into a row-major layout padded to 128 lanes: 2 GiB of temporaries)."""
    rep = replicated_on_a_v5p_chip(monkeypatch)
    mesh = rep.mesh
    v, d, n, h = 4 << 20, 32, 16384, 8
    ids = jax.ShapeDtypeStruct((n, h), jnp.int32, sharding=rep)
    temps = {}
    for pack in (1, 4):
        table = jax.ShapeDtypeStruct((v // pack, d * pack), jnp.float32, sharding=rep)
        fn = lambda t, i, p=pack: api.pool(t, i, impl="pallas_tpu", interpret=False, pack=p)  # noqa: E731
        with common.target_backend("tpu"), jax.set_mesh(mesh):
            compiled = jax.jit(fn).lower(table, ids).compile()
        assert compiled.as_text().count("tpu_custom_call") == 1
        temps[pack] = compiled.memory_analysis().temp_size_in_bytes
    table_bytes = v * d * 4
    assert temps[1] >= table_bytes  # the padded copy
    assert temps[4] < table_bytes / 16
