"""hstu_attention (HSTU's jagged SiLU attention): the reference against a dense per-sequence
numpy loop (the mask transcribed from generative-recommenders' ``_get_valid_attn_mask``), the
written-out backward against autodiff, each Pallas kernel (interpret mode) forward and VJP
against the reference, fallbacks, and Triton / Mosaic lowering at production shapes.

Kept cheap (the CI suite is at its time limit): one awkward jagged batch (an empty sequence,
length 1, lengths that are not multiples of the block of 16, one at ``max_seq_len``, one past
it, trailing tokens outside every sequence), a few mask configurations, two dtypes.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recscale.kernels import common
from recscale.kernels.hstu_attention import api, pallas_gpu, reference
from tests.tpu_chip import needs_libtpu, replicated_on_a_v5p_chip

N, H, D, E = 24, 2, 8, 12
LENS = [0, 1, 17, 5, 24, 30]  # 30 > N: its last 6 tokens are dropped
TARGETS = [0, 0, 3, 1, 4, 2]
BLOCK = 16
ALPHA = 0.5
# mask configurations: name -> (num_targets?, contextual_seq_len, max_attn_len, bias?)
CONFIGS = {
    "causal": (False, 0, 0, 0),
    "targets_window": (True, 0, 0, 5),
    "contextual_targets_window": (True, 2, 0, 6),
    "all_bias": (True, 2, 1, 6),
}
PLATFORM = {"pallas_gpu": "cuda", "pallas_tpu": "tpu"}
CUSTOM_CALL = {"pallas_gpu": "triton", "pallas_tpu": "tpu_custom_call"}


def _batch(dtype=jnp.float32, *, bias_heads=H, seed=0, num_buckets=6):
    offsets = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
    t = int(offsets[-1]) + 3  # trailing tokens outside every sequence
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (t, H, D)) * D**-0.25
    k = jax.random.normal(ks[1], (t, H, D)) * D**-0.25
    v = jax.random.normal(ks[2], (t, H, E)) * N**0.5  # out of order one despite the 1/N
    g = jax.random.normal(ks[3], (t, H, E))
    bias = jax.random.normal(ks[4], (bias_heads, num_buckets)) * 0.5
    cast = [x.astype(dtype) for x in (q, k, v, g)]
    return (*cast, jnp.asarray(offsets), jnp.asarray(TARGETS, jnp.int32), bias)


def _kwargs(config):
    targets, c, m_len, _ = CONFIGS[config]
    return dict(max_seq_len=N, alpha=ALPHA, contextual_seq_len=c, max_attn_len=m_len), targets


def _np_valid_mask(n_max, n, nt, c, m_len):
    """``_get_valid_attn_mask`` (pt_hstu_attention.py) for one sequence, causal, in numpy."""
    ids = np.arange(n_max)
    max_ids = n
    if c > 0:
        ids = np.maximum(ids - c + 1, 0)
        max_ids = n - c + 1
    max_ids -= nt
    ids = np.minimum(ids, max_ids)
    row, col = ids[:, None], ids[None, :]
    dist = row - col
    valid = np.eye(n_max, dtype=bool) | (dist > 0)
    if m_len > 0:
        valid &= dist <= m_len
    if c > 0:
        valid |= (row == 0) & (col < max_ids)
    return valid


def _np_attention(q, k, v, offsets, nt, bias, *, max_seq_len, alpha, contextual_seq_len, m_len):
    """Dense loop per sequence and head, float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros(v.shape)
    pos = np.arange(max_seq_len)
    for b in range(len(offsets) - 1):
        start, n = offsets[b], min(offsets[b + 1] - offsets[b], max_seq_len)
        valid = _np_valid_mask(max_seq_len, n, nt[b], contextual_seq_len, m_len)[:n, :n]
        for h in range(q.shape[1]):
            s = alpha * q[start : start + n, h] @ k[start : start + n, h].T
            if bias is not None:
                table = np.asarray(bias, np.float64)[h if bias.shape[0] > 1 else 0]
                dist = np.abs(pos[:n, None] - pos[None, :n])
                edges = np.asarray(reference.bucket_boundaries(table.shape[0]))
                s = s + table[(dist[..., None] >= edges).sum(-1)]
            attn = s / (1 + np.exp(-s)) / max_seq_len * valid
            out[start : start + n, h] = attn @ v[start : start + n, h]
    return out


def test_mask_semantics():
    """The transcribed mask says what the docstring says: targets attend history and self only,
    the contextual prefix attends every non-target token, the window bounds distances."""
    n, nt, c, m_len = 12, 3, 2, 4
    valid = _np_valid_mask(16, n, nt, c, m_len)[:n, :n]
    uih = n - nt
    for i in range(uih, n):  # targets
        np.testing.assert_array_equal(valid[i, uih:], np.arange(uih, n) == i)
        assert valid[i, max(uih - m_len, c) : uih].all()
    assert valid[:c, :uih].all() and not valid[:c, uih:].any()  # the contextual prefix
    assert not valid[c + m_len + 1, c - 1]  # the window applies to the prefix too
    got = reference.valid_mask(
        jnp.arange(16)[:, None],
        jnp.arange(16)[None, :],
        n,
        nt,
        contextual_seq_len=c,
        max_attn_len=m_len,
    )
    np.testing.assert_array_equal(np.asarray(got)[:n, :n], valid)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_reference_matches_dense_loop(config):
    q, k, v, _, offsets, nt, bias = _batch()
    kw, targets = _kwargs(config)
    nt = nt if targets else None
    bias = bias if CONFIGS[config][3] else None
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda q, k, v: reference.hstu_attention(q, k, v, offsets, nt, bias, **kw))(
            q, k, v
        )
    want = _np_attention(
        q,
        k,
        v,
        np.asarray(offsets),
        np.zeros(len(LENS), int) if nt is None else np.asarray(nt),
        bias,
        max_seq_len=N,
        alpha=ALPHA,
        contextual_seq_len=kw["contextual_seq_len"],
        m_len=kw["max_attn_len"],
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 0.5  # order one: the tolerance is meaningful


@jax.jit
def _autodiff_f32(q, k, v, offsets, nt, bias, g):
    kw, _ = _kwargs("all_bias")
    fn = lambda q, k, v, b: reference.hstu_attention(q, k, v, offsets, nt, b, **kw)  # noqa: E731
    out, vjp = jax.vjp(fn, q, k, v, bias)
    return out, *vjp(g)


def _reference_vjp(q, k, v, g, offsets, nt, bias):
    """Output and VJP of the reference by autodiff, float32 at HIGHEST (inputs upcast)."""
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        return _autodiff_f32(*up, offsets, nt, bias, g.astype(jnp.float32))


def test_backward_equations():
    """``reference.hstu_attention_vjp`` (the XLA path's and the kernels' backward) equals
    autodiff of the reference, bias table included."""
    q, k, v, g, offsets, nt, bias = _batch()
    kw, _ = _kwargs("all_bias")
    want = _reference_vjp(q, k, v, g, offsets, nt, bias)[1:]
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda *a: reference.hstu_attention_vjp(*a, **kw), static_argnums=())(
            q, k, v, offsets, nt, bias, g
        )
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _fallbacks(impl):
    return sum(n for (op, i, _), n in common.FALLBACKS.items() if op == api.OP and i == impl)


# float32: every option, one bias row per head; bfloat16: causal with targets and a bias row
# shared by the heads (the kernels' other static branches). Tolerances: common.tolerance
# (float32 1e-5, bfloat16 1.6e-2, relative and absolute; outputs and gradients of order one).
# (id, dtype, config, bias heads, buckets): 12 buckets reach edges (32, 48) past every tile of
# 16 (the GPU kernel skips those), edges inside the tiles and edges every pair is past.
KERNEL_CASES = [
    ("float32", jnp.float32, "all_bias", H, 12),
    ("bfloat16", jnp.bfloat16, "targets_window", 1, 6),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
@pytest.mark.parametrize("impl", ["xla", "pallas_gpu", "pallas_tpu"])
def test_matches_reference(impl, case):
    _, dtype, config, bias_heads, buckets = case
    q, k, v, g, offsets, nt, bias = _batch(dtype, bias_heads=bias_heads, num_buckets=buckets)
    kw, _ = _kwargs(config)
    # The TPU kernels run in the generic interpreter: pltpu.InterpretParams' TPU interpreter
    # runs ~10 s per call here (tests/recscale/kernels/test_vmap.py does the same).
    interpret = True if impl == "pallas_tpu" else None

    @jax.jit
    def fwd_bwd(q, k, v, bias, g):
        def fn(q, k, v, bias):
            return api.hstu_attention(
                q, k, v, offsets, nt, bias, impl=impl, interpret=interpret, block=BLOCK, **kw
            )

        out, vjp = jax.vjp(fn, q, k, v, bias)
        return out, *vjp(g)

    before = _fallbacks(impl)
    got = fwd_bwd(q, k, v, bias, g)
    assert _fallbacks(impl) == before
    want = _autodiff(q, k, v, g, offsets, nt, bias, config)
    tol = common.tolerance(dtype)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), got, want, strict=True):
        assert a.dtype == (bias.dtype if name == "dbias" else dtype), name
        np.testing.assert_allclose(a.astype(jnp.float32), b, err_msg=name, **tol)


def _autodiff(q, k, v, g, offsets, nt, bias, config):
    kw, _ = _kwargs(config)
    up = [x.astype(jnp.float32) for x in (q, k, v, g)]

    @jax.jit
    def run(q, k, v, bias, g):
        fn = lambda q, k, v, b: reference.hstu_attention(q, k, v, offsets, nt, b, **kw)  # noqa: E731
        out, vjp = jax.vjp(fn, q, k, v, bias)
        return out, *vjp(g)

    with jax.default_matmul_precision("highest"):
        return run(*up[:3], bias, up[3])


def test_unsupported_falls_back():
    """float16 (neither kernel lists it) falls back to the reference, counted with its reason;
    a head dim past the Triton kernel's registers is refused with one."""
    q, k, v, _, offsets, _, _ = _batch(jnp.float16)
    kw, _ = _kwargs("causal")
    want = jax.jit(lambda q, k, v: reference.hstu_attention(q, k, v, offsets, **kw))(q, k, v)
    for impl in ("pallas_gpu", "pallas_tpu"):
        key = (api.OP, impl, "dtype float16 (have float32, bfloat16)")
        before = common.FALLBACKS[key]
        got = jax.jit(lambda q, k, v, i=impl: api.hstu_attention(q, k, v, offsets, impl=i, **kw))(
            q, k, v
        )
        np.testing.assert_array_equal(got, want)
        assert common.FALLBACKS[key] == before + 1
    assert "register" in pallas_gpu.unsupported_reason((8, 2, 512), (8, 2, 64), 1, None)


def test_bad_inputs_raise():
    q, k, v, _, offsets, nt, bias = _batch()
    kw, _ = _kwargs("causal")
    with pytest.raises(ValueError, match="q and k"):
        api.hstu_attention(q, k[:, :1], v, offsets, **kw)
    with pytest.raises(ValueError, match="num_targets"):
        api.hstu_attention(q, k, v, offsets, nt[:2], **kw)
    with pytest.raises(ValueError, match="rel_bias"):
        api.hstu_attention(q, k, v, offsets, None, bias[None], **kw)
    with pytest.raises(ValueError, match="unknown implementation"):
        api.hstu_attention(q, k, v, offsets, impl="cpu_ffi", **kw)


def _tpu_target():
    """An abstract TPU device for Mosaic lowering from a CPU host (as test_vmap.py)."""
    device = jax.sharding.AbstractDevice(device_kind="TPU v5p", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device
    )
    return jax.sharding.use_abstract_mesh(mesh)


# (max_seq_len, head dim, dtype): each of 4,096 / 8,192 and 128 / 256 once; 4 sequences of
# max_seq_len, 4 heads, every mask option and a per-head bias; forward and backward.
PROD = [(4096, 128, jnp.bfloat16), (8192, 256, jnp.float32)]


@pytest.mark.parametrize("prod", PROD, ids=["n4096_d128_bf16", "n8192_d256_f32"])
@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_lowers_at_production_shapes(impl, prod):
    n, d, dtype = prod
    b, h = 4, 4
    x = jax.ShapeDtypeStruct((b * n, h, d), dtype)
    offsets = jax.ShapeDtypeStruct((b + 1,), jnp.int32)
    nt = jax.ShapeDtypeStruct((b,), jnp.int32)
    bias = jax.ShapeDtypeStruct((h, 32), jnp.float32)

    def fwd_bwd(q, k, v, offsets, nt, bias):
        def fn(q, k, v, bias):
            return api.hstu_attention(
                q,
                k,
                v,
                offsets,
                nt,
                bias,
                max_seq_len=n,
                alpha=d**-0.5,
                contextual_seq_len=3,
                max_attn_len=512,
                impl=impl,
                interpret=False,
            )

        out, vjp = jax.vjp(fn, q, k, v, bias)
        return out, *vjp(out)

    before = _fallbacks(impl)
    with _tpu_target() if impl == "pallas_tpu" else contextlib.nullcontext():
        traced = jax.jit(fwd_bwd).trace(x, x, x, offsets, nt, bias)
        text = traced.lower(lowering_platforms=(PLATFORM[impl],)).as_text()
    assert _fallbacks(impl) == before
    assert text.count(CUSTOM_CALL[impl]) >= 3
    for name in ("hstu_attention_fwd", "hstu_attention_bwd_dkdv", "hstu_attention_bwd_dq"):
        assert name in text


@needs_libtpu
@pytest.mark.parametrize("prod", PROD, ids=["n4096_d128_bf16", "n8192_d256_f32"])
def test_mosaic_compiles_at_production_shapes(prod, monkeypatch):
    """Past lowering: libtpu's Mosaic compiler accepts the three TPU kernels (forward, dk/dv,
    dq) for a v5p chip at production shapes, every mask option and a per-head bias."""
    rep = replicated_on_a_v5p_chip(monkeypatch)
    n, d, dtype = prod
    mesh = rep.mesh
    b, h = 4, 4
    x = jax.ShapeDtypeStruct((b * n, h, d), dtype, sharding=rep)
    offsets = jax.ShapeDtypeStruct((b + 1,), jnp.int32, sharding=rep)
    nt = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rep)
    bias = jax.ShapeDtypeStruct((h, 32), jnp.float32, sharding=rep)

    def fwd_bwd(q, k, v, offsets, nt, bias):
        def fn(q, k, v, bias):
            kw = dict(max_seq_len=n, alpha=d**-0.5, contextual_seq_len=3, max_attn_len=512)
            return api.hstu_attention(
                q, k, v, offsets, nt, bias, impl="pallas_tpu", interpret=False, **kw
            )

        out, vjp = jax.vjp(fn, q, k, v, bias)
        return out, *vjp(out)

    with common.target_backend("tpu"), jax.set_mesh(mesh):
        compiled = jax.jit(fwd_bwd).lower(x, x, x, offsets, nt, bias).compile()
    assert compiled.as_text().count("tpu_custom_call") == 3
