"""The fused embedding backward + sparse optimizer update: every implementation against a dense
oracle written from the equations (with and without CowClip and the rows' L2), against the
engine's own row path, fallbacks, bad input, aliasing, and GPU/TPU lowering at production
shapes."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recscale.embeddings import update as engine_update
from recscale.kernels import common
from recscale.kernels.embedding_update import api, cpu_ffi, pallas_gpu, reference
from recscale.optim.cowclip import CowClip
from tests.tpu_chip import needs_libtpu, replicated_on_a_v5p_chip

V = 41
LR = 0.05
IMPLS = ("xla", "cpu_ffi", "pallas_gpu", "pallas_tpu")

# (D, N, H, storage dtype, optimizer, pooling, run by the interpreted Pallas kernels too):
# a covering design rather than the full product (the interpreters take seconds a case): every
# value of each axis at least twice for XLA and the C++ kernel and at least once for each Pallas
# kernel, with awkward widths (8 < Triton's 16, 48 not a power of two) and one-id bags.
CASES = [
    (8, 6, 1, jnp.float32, "sgd", "sum", True),
    (48, 20, 4, jnp.float32, "rowwise_adagrad", "mean", True),
    (128, 20, 4, jnp.float32, "sgd", "mean", False),
    (48, 20, 1, jnp.float32, "rowwise_adagrad", "sum", True),
    (128, 20, 4, jnp.bfloat16, "rowwise_adagrad", "sum", True),
    (48, 6, 4, jnp.bfloat16, "sgd", "mean", True),
    (8, 20, 4, jnp.bfloat16, "rowwise_adagrad", "mean", False),
    (128, 6, 1, jnp.float16, "rowwise_adagrad", "mean", True),
    (8, 20, 4, jnp.float16, "sgd", "sum", True),
]


def _params():
    out = []
    for impl in IMPLS:
        for d, n, h, dtype, opt, pooling, pallas in CASES:
            if impl.startswith("pallas") and not pallas:
                continue
            if impl == "cpu_ffi" and dtype != jnp.float32:
                continue  # float32 storage only (its fallback has its own test)
            if impl == "pallas_tpu" and dtype != jnp.float32:
                continue  # 16-bit storage falls back on TPU (ditto)
            name = f"{impl}-{opt}-{pooling}-D{d}-N{n}-H{h}-{jnp.dtype(dtype).name}"
            out.append(pytest.param(impl, d, n, h, dtype, opt, pooling, id=name))
    return out


def _needs(impl: str) -> None:
    if impl == "cpu_ffi" and not cpu_ffi.available():
        pytest.skip("the C++ CPU kernels did not build here (no compiler?)")


def _inputs(d: int, n: int, h: int, dtype, seed: int = 0, zero_rows=()):
    """Random rows with heavy repeats (id 3 fills bag 0 and recurs in many bags, id 7 in
    every other bag) and padding (-1, V, V + 5); ``zero_rows`` set to zero (fresh rows, whose
    CowClip threshold is the floor)."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((V, d)).astype(np.float32)
    table[list(zero_rows)] = 0.0
    acc = (rng.random(V) + 0.1).astype(np.float32)
    ids = rng.integers(0, V, (n, h))
    ids[rng.random((n, h)) < 0.3] = 3
    if h > 1:
        ids[0] = 3
        ids[::2, 1] = 7
    pad = rng.random((n, h)) < 0.15
    ids[pad] = rng.choice([-1, V, V + 5], size=pad.sum())
    ids[-1] = -1  # a bag of padding only (its mean weight divides by max(0, 1))
    grad = rng.standard_normal((n, d)).astype(np.float32)
    return (
        jnp.asarray(table, dtype),
        jnp.asarray(acc),
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(grad, dtype),
    )


@functools.partial(jax.jit, static_argnames=("lr", "optimizer", "pooling", "eps", "clip"))
def _oracle(table, acc, ids, grad, lr, optimizer, pooling, eps, clip):
    """Dense formulation at float32 HIGHEST: ``g = Aᵀ (w ⊙ grad)`` with ``A [N, V]`` the
    number of times bag ``n`` reads row ``r``; with ``clip = (ratio, min_norm, row_l2)``,
    CowClip as the paper writes it: ``g_r += row_l2·t_r``, then ``g_r·limit/‖g_r‖`` where
    ``‖g_r‖ > limit = c_r·max(ratio·‖t_r‖, min_norm)``, ``c_r = Σ_n A[n, r]``."""
    t = jnp.asarray(table, jnp.float32)
    valid = (ids >= 0) & (ids < V)
    a_nv = jnp.sum(jax.nn.one_hot(jnp.where(valid, ids, -1), V, dtype=jnp.float32), axis=1)
    w_n = jnp.ones(ids.shape[0], jnp.float32)
    if pooling == "mean":
        w_n = 1.0 / jnp.maximum(valid.sum(1), 1).astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        g = a_nv.T @ (w_n[:, None] * grad.astype(jnp.float32))
    count = a_nv.sum(0)
    touched = count > 0
    g_sq = jnp.sum(g * g)
    clipped = jnp.zeros_like(touched)
    if clip is not None:
        ratio, min_norm, row_l2 = clip
        g = jnp.where(touched[:, None], g + row_l2 * t, g)
        if ratio > 0:
            limit = count * jnp.maximum(ratio * jnp.linalg.norm(t, axis=1), min_norm)
            norm = jnp.linalg.norm(g, axis=1)
            clipped = touched & (norm > limit)
            g = jnp.where(clipped[:, None], g * (limit / jnp.where(clipped, norm, 1.0))[:, None], g)
    if optimizer == "sgd":
        upd, new_acc = -lr * g, acc
    else:
        new_acc = jnp.where(touched, acc + jnp.mean(g * g, axis=1), acc)
        nz = jnp.any(g != 0, axis=1, keepdims=True)
        upd = jnp.where(nz, -lr * g / (jnp.sqrt(new_acc)[:, None] + eps), 0.0)
    new_t = jnp.where(touched[:, None], (t + upd).astype(table.dtype), table)
    stats = jnp.stack([jnp.sum(upd * upd), g_sq])
    return new_t, new_acc, stats, touched, clipped


def oracle(table, acc, ids, grad, lr, optimizer, pooling, eps=1e-8, clip=None):
    """``(table, acc, stats, touched rows)``, and with ``clip`` the clipped rows too."""
    new_t, new_acc, stats, touched, clipped = _oracle(
        table, acc, ids, grad, lr=lr, optimizer=optimizer, pooling=pooling, eps=eps, clip=clip
    )
    out = new_t, new_acc, stats, np.asarray(touched)
    return out if clip is None else (*out, np.asarray(clipped))


@pytest.mark.parametrize("impl,d,n,h,dtype,optimizer,pooling", _params())
def test_update_matches_oracle(impl, d, n, h, dtype, optimizer, pooling):
    _needs(impl)
    table, acc, ids, grad = _inputs(d, n, h, dtype)
    got = _update(impl, table, acc, ids, grad, optimizer, pooling)
    want = oracle(table, acc, ids, grad, LR, optimizer, pooling)
    _compare(got, want, table, acc, optimizer)


# (D, N, H, storage dtype, optimizer, pooling, (ratio, min_norm, row_l2), Pallas too): CowClip
# with the rows' L2, CowClip alone and the L2 alone, for both optimizers, sum and mean pooling,
# one-id and multi-id bags, float32 and bfloat16 storage.
CLIP_CASES = [
    (48, 20, 4, jnp.float32, "sgd", "sum", (1.0, 0.5, 0.05), True),
    (48, 20, 4, jnp.float32, "rowwise_adagrad", "sum", (1.0, 0.5, 0.05), True),
    (8, 20, 1, jnp.float32, "rowwise_adagrad", "mean", (1.0, 0.5, 0.0), True),
    (16, 20, 4, jnp.float32, "sgd", "mean", (0.0, 0.0, 0.1), True),
    (48, 20, 4, jnp.bfloat16, "rowwise_adagrad", "sum", (1.0, 0.5, 0.05), True),
    (128, 20, 4, jnp.float32, "rowwise_adagrad", "mean", (0.0, 0.0, 0.1), False),
    (16, 20, 4, jnp.float32, "sgd", "sum", (1.0, 0.5, 0.0), False),
]


def _clip_params():
    out = []
    for impl in IMPLS:
        for d, n, h, dtype, opt, pooling, clip, pallas in CLIP_CASES:
            if (impl.startswith("pallas") and not pallas) or (
                impl in ("cpu_ffi", "pallas_tpu") and dtype != jnp.float32
            ):
                continue
            name = f"{impl}-{opt}-{pooling}-D{d}-H{h}-{jnp.dtype(dtype).name}-clip{clip}"
            out.append(pytest.param(impl, d, n, h, dtype, opt, pooling, clip, id=name))
    return out


@pytest.mark.parametrize("impl,d,n,h,dtype,optimizer,pooling,clip", _clip_params())
def test_update_with_cowclip_matches_oracle(impl, d, n, h, dtype, optimizer, pooling, clip):
    """CowClip (threshold ``c_r·max(ratio·‖t_r‖, min_norm)``) and the touched rows' L2 inside
    every implementation, on rows with repeats, padding and zero rows (the floor's case)."""
    _needs(impl)
    table, acc, ids, grad = _inputs(d, n, h, dtype, zero_rows=(3, 11))  # 3: hot
    cow = CowClip(ratio=clip[0], min_norm=clip[1], row_l2=clip[2])
    got = _update(impl, table, acc, ids, grad, optimizer, pooling, clip=cow)
    *want, clipped = oracle(table, acc, ids, grad, LR, optimizer, pooling, clip=clip)
    touched = want[3]
    if cow.clips:  # both sides of the threshold, and the floor, are exercised
        assert clipped.any() and (touched & ~clipped).any(), clipped
        assert clipped[[3, 11]].any()
    _compare(got, want, table, acc, optimizer)
    plain = oracle(table, acc, ids, grad, LR, optimizer, pooling)  # the clip changes the step
    assert not np.allclose(np.float32(got[0]), np.float32(plain[0]), **common.tolerance(dtype))


def _update(impl, table, acc, ids, grad, optimizer, pooling, clip=None):
    acc_in = acc if optimizer == "rowwise_adagrad" else None
    before = dict(common.FALLBACKS)
    fn = jax.jit(
        lambda t, a, i, g, lr: api.update(
            t, a, i, g, lr, optimizer=optimizer, pooling=pooling, clip=clip, impl=impl
        )
    )
    out = fn(table, acc_in, ids, grad, LR)
    assert dict(common.FALLBACKS) == before, "the implementation fell back"
    return out


def _compare(got, want, table, acc, optimizer):
    new_t, new_acc, stats = got
    want_t, want_acc, want_stats, touched = want
    dtype = table.dtype
    assert new_t.dtype == table.dtype and new_t.shape == table.shape
    tol = common.tolerance(dtype)
    np.testing.assert_allclose(np.float32(new_t), np.float32(want_t), **tol)
    # rows no id touches: bit-identical
    np.testing.assert_array_equal(np.asarray(new_t)[~touched], np.asarray(table)[~touched])
    assert not np.array_equal(np.asarray(new_t)[touched], np.asarray(table)[touched])
    f32 = common.tolerance(jnp.float32)  # accumulators and statistics are float32 throughout
    np.testing.assert_allclose(stats, want_stats, **f32)
    if optimizer == "rowwise_adagrad":
        np.testing.assert_allclose(new_acc, want_acc, **f32)
        np.testing.assert_array_equal(np.asarray(new_acc)[~touched], np.asarray(acc)[~touched])
    else:
        assert new_acc is None


@pytest.mark.parametrize(
    "clip", [None, (0.3, 0.5, 0.05), (0.3, 0.5, 0.0), (0.0, 0.0, 0.05)], ids=lambda c: f"clip{c}"
)
@pytest.mark.parametrize("optimizer", reference.OPTIMIZERS)
@pytest.mark.parametrize("impl", IMPLS)
def test_kernel_equals_the_engine_row_path(impl, optimizer, clip):
    """The two branches of the engine's update (``recscale.embeddings.update.apply_update``) on
    one device's slots: the update kernel on the ``[S·B, H]`` keys, and the row path it takes
    for column-split tables and lazy Adam (distinct rows and their counts by one scatter, then
    ``_clip_rows`` + ``_update_rows``), give the same buffer, accumulators and statistics."""
    _needs(impl)
    s, b, h, w, r = 3, 16, 4, 16, 90
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 10, (s, b, h)) + 30 * np.arange(s)[:, None, None]  # slots disjoint
    keys[rng.random((s, b, h)) < 0.2] = r  # the engine's padding key
    keys = jnp.asarray(keys, jnp.int32)
    buf = rng.standard_normal((r, w)).astype(np.float32)
    buf[[4, 35]] = 0.0
    buf = jnp.asarray(buf)
    acc = jnp.asarray(rng.random(r) + 0.1, jnp.float32)
    g = jnp.asarray(rng.standard_normal((s, b, w)), jnp.float32)
    cow = None if clip is None else CowClip(ratio=clip[0], min_norm=clip[1], row_l2=clip[2])
    rule = engine_update.UpdateRule(optimizer, clip=cow)
    adagrad = optimizer == "rowwise_adagrad"

    @jax.jit
    def row_path(buf, acc, keys, g):
        count = None
        if cow is not None:
            g = jnp.concatenate([g, jnp.ones((s, b, 1), jnp.float32)], axis=-1)
        uids, grad = reference.batched_row_gradients(keys, g, r)
        if cow is not None:
            grad, count = grad[..., :-1], grad[..., -1]
        new_buf, st, sq = engine_update._update_rows(
            buf,
            {"acc": acc} if adagrad else {},
            uids,
            grad,
            jnp.zeros((s,), jnp.int32),
            jnp.full((s,), w, jnp.int32),
            LR,
            jnp.zeros((), jnp.int32),
            rule,
            0,
            count,
        )
        return new_buf, st.get("acc"), jnp.stack([sq, jnp.sum(grad * grad)])

    before = dict(common.FALLBACKS)
    got = jax.jit(
        lambda buf, acc, keys, g: api.update(
            buf,
            acc if adagrad else None,
            keys.reshape(s * b, h),
            g.reshape(s * b, w),
            LR,
            optimizer=optimizer,
            eps=rule.eps,
            clip=rule.clip,
            impl=impl,
        )
    )(buf, acc, keys, g)
    assert dict(common.FALLBACKS) == before, "the implementation fell back"
    want = row_path(buf, acc, keys, g)
    f32 = common.tolerance(jnp.float32)
    for name, a, e in zip(("buffer", "accumulators", "statistics"), got, want, strict=True):
        if e is None:
            assert a is None
        else:
            np.testing.assert_allclose(a, e, **f32, err_msg=name)
    if cow is not None:  # the clip does something here
        unclipped = api.update(
            buf,
            acc if adagrad else None,
            keys.reshape(s * b, h),
            g.reshape(s * b, w),
            LR,
            optimizer=optimizer,
            impl="xla",
        )
        assert not np.allclose(got[0], unclipped[0], **f32)


def test_sorted_segments_list_each_distinct_row_with_its_bags():
    """The Pallas kernels' prologue: distinct rows ascending, each with the bags that read it
    (repeats kept, in bag order), unused entries empty."""
    _, _, ids, _ = _inputs(8, 20, 4, jnp.float32)
    segments = jax.jit(
        lambda i: reference.sorted_segments(reference.pair_keys(i, V), V, row_block=32, pair_pad=8)
    )
    seg = segments(ids)
    ids = np.asarray(ids)
    rows = np.unique(ids[(ids >= 0) & (ids < V)])
    nd = int(seg.num_distinct[0])
    assert nd == len(rows) and seg.row_u.shape == (96,) and seg.bag_p.shape == (88,)
    np.testing.assert_array_equal(seg.row_u[:nd], rows)
    np.testing.assert_array_equal(seg.row_u[nd:], V)
    np.testing.assert_array_equal(seg.end_u[nd:] - seg.start_u[nd:], 0)
    bag_p, seg_p = np.asarray(seg.bag_p), np.asarray(seg.seg_p)
    for u, r in enumerate(rows):
        lo, hi = int(seg.start_u[u]), int(seg.end_u[u])
        want = np.repeat(np.arange(20), (ids == r).sum(1))
        np.testing.assert_array_equal(bag_p[lo:hi], want)
        np.testing.assert_array_equal(seg_p[lo:hi], u)


@pytest.mark.parametrize("impl", IMPLS)
def test_touched_rows_with_zero_gradient_do_not_move(impl):
    """Adagrad skips rows whose gradient is zero: with ``acc = 0`` and ``eps = 0`` their step
    would be 0/0."""
    _needs(impl)
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.standard_normal((V, 16)), jnp.float32)
    ids = rng.integers(10, V, (8, 3))
    ids[0] = [5, 5, 9]  # rows 5 and 9 are read by bag 0 only, whose gradient is zero
    ids = jnp.asarray(ids, jnp.int32)
    grad = rng.standard_normal((8, 16)).astype(np.float32)
    grad[0] = 0.0
    grad = jnp.asarray(grad)
    acc = rng.random(V).astype(np.float32) + 0.1
    acc[[5, 9]] = 0.0
    acc = jnp.asarray(acc)
    fn = jax.jit(lambda t, a, i, g: api.update(t, a, i, g, LR, eps=0.0, impl=impl))
    new_t, new_acc, stats = fn(table, acc, ids, grad)
    want_t, want_acc, want_stats, _ = oracle(
        table, acc, ids, grad, LR, "rowwise_adagrad", "sum", eps=0.0
    )
    assert np.isfinite(np.asarray(new_t)).all()
    np.testing.assert_array_equal(np.asarray(new_t)[[5, 9]], np.asarray(table)[[5, 9]])
    np.testing.assert_array_equal(np.asarray(new_acc)[[5, 9]], 0.0)
    np.testing.assert_allclose(new_t, want_t, **common.tolerance(jnp.float32))
    np.testing.assert_allclose(stats, want_stats, **common.tolerance(jnp.float32))


@pytest.mark.parametrize(
    "impl,dtype,d,reason",
    [
        ("pallas_tpu", jnp.float16, 16, "float16 storage"),
        ("pallas_gpu", jnp.float32, pallas_gpu.MAX_DIM + 8, f"> {pallas_gpu.MAX_DIM}"),
        ("cpu_ffi", jnp.bfloat16, 16, "storage dtype bfloat16"),
    ],
)
def test_unsupported_call_falls_back_and_is_counted(impl, dtype, d, reason):
    table, acc, ids, grad = _inputs(d, 6, 4, dtype)
    keys = [k for k in common.FALLBACKS if k[0] == api.OP and k[1] == impl and reason in k[2]]
    before = sum(common.FALLBACKS[k] for k in keys)
    new_t, new_acc, stats = jax.jit(lambda *a: api.update(*a, LR, impl=impl))(table, acc, ids, grad)
    keys = [k for k in common.FALLBACKS if k[0] == api.OP and k[1] == impl and reason in k[2]]
    assert sum(common.FALLBACKS[k] for k in keys) == before + 1
    want_t, want_acc, want_stats, _ = oracle(table, acc, ids, grad, LR, "rowwise_adagrad", "sum")
    np.testing.assert_allclose(np.float32(new_t), np.float32(want_t), **common.tolerance(dtype))
    np.testing.assert_allclose(new_acc, want_acc, **common.tolerance(jnp.float32))


def test_auto_on_cpu_uses_the_cpp_kernel_for_float32_bags_only():
    _needs("cpu_ffi")

    def hlo(h, dtype):
        table, acc, ids, grad = _inputs(16, 6, h, dtype)
        f = jax.jit(lambda t, a, i, g: api.update(t, a, i, g, LR))
        return f.trace(table, acc, ids, grad).lower().as_text()

    before = dict(common.FALLBACKS)
    assert "recscale_update" in hlo(4, jnp.float32)
    assert "recscale_update" in hlo(1, jnp.float32)  # one-id bags too (faster there as well)
    assert "recscale_update" not in hlo(4, jnp.bfloat16)
    assert dict(common.FALLBACKS) == before  # auto's choices are plans, not fallbacks


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"optimizer": "adam"}, "optimizer"),
        ({"pooling": "max"}, "pooling"),
        ({"acc": None}, "acc"),
        ({"grad": jnp.zeros((6, 9))}, "grad"),
        ({"ids": jnp.zeros((6, 4), jnp.float32)}, "integers"),
    ],
)
def test_bad_input_raises_a_clear_error(kwargs, match):
    table, acc, ids, grad = _inputs(16, 6, 4, jnp.float32)
    args = {"table": table, "acc": acc, "ids": ids, "grad": grad} | kwargs
    with pytest.raises(ValueError, match=match):
        api.update(
            args.pop("table"), args.pop("acc"), args.pop("ids"), args.pop("grad"), LR, **args
        )


def test_unknown_implementation_is_an_error():
    table, acc, ids, grad = _inputs(16, 6, 4, jnp.float32)
    with pytest.raises(ValueError, match="unknown implementation"):
        api.update(table, acc, ids, grad, LR, impl="pallas_mosaic_gpu")


# ------------------------------------------------------------------------------------------------
# Lowering for the real backends, at production shapes (nothing allocated: ShapeDtypeStructs).

PROD_V, PROD_D, PROD_N = 1_000_000, 128, 65_536


def _tpu_target():
    """An abstract TPU device: Mosaic lowering reads the target chip's tiling (for rank-1
    operands), which a CPU host does not have."""
    device = jax.sharding.AbstractDevice(device_kind="TPU v5p", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device
    )
    return jax.sharding.use_abstract_mesh(mesh)


def _lower(impl: str, platform: str, h: int, dtype, optimizer: str, clip=None) -> str:
    adagrad = optimizer == "rowwise_adagrad"
    args = (
        jax.ShapeDtypeStruct((PROD_V, PROD_D), dtype),
        jax.ShapeDtypeStruct((PROD_V,), jnp.float32) if adagrad else None,
        jax.ShapeDtypeStruct((PROD_N, h), jnp.int32),
        jax.ShapeDtypeStruct((PROD_N, PROD_D), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    f = jax.jit(
        lambda t, a, i, g, lr: api.update(
            t, a, i, g, lr, optimizer=optimizer, clip=clip, impl=impl, interpret=False
        ),
        donate_argnums=(0, 1),
    )
    before = dict(common.FALLBACKS)
    if platform == "tpu":
        with _tpu_target():
            text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    else:
        text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert dict(common.FALLBACKS) == before, "the kernel fell back instead of lowering"
    return text


@pytest.mark.parametrize(
    "impl,platform,target",
    [("pallas_gpu", "cuda", "__gpu$xla.gpu.triton"), ("pallas_tpu", "tpu", "tpu_custom_call")],
)
@pytest.mark.parametrize(
    "h,dtype,optimizer,clip",
    [
        (1, jnp.float32, "rowwise_adagrad", None),
        (20, jnp.float32, "rowwise_adagrad", None),
        (20, jnp.bfloat16, "rowwise_adagrad", None),
        (1, jnp.bfloat16, "sgd", None),
        (20, jnp.float32, "rowwise_adagrad", CowClip(ratio=1.0, min_norm=1e-5, row_l2=1e-4)),
        (1, jnp.bfloat16, "sgd", CowClip(ratio=1.0, min_norm=1e-5)),
    ],
)
def test_lowers_at_production_shapes_with_the_table_aliased(
    impl, platform, target, h, dtype, optimizer, clip
):
    if impl == "pallas_tpu" and dtype != jnp.float32:
        pytest.skip("16-bit storage falls back on TPU (test_unsupported_call_falls_back...)")
    text = _lower(impl, platform, h, dtype, optimizer, clip)
    calls = [line for line in text.splitlines() if "custom_call" in line and target in line]
    assert len(calls) == 1, f"expected one {target} call"
    (call,) = calls
    # the kernel writes the table (and the GPU kernel the accumulator) in place: outputs
    # aliased to its operands (the TPU kernel's accumulators go in and out through SMEM
    # blocks, XLA gathering and scattering the touched rows' values)
    aliased = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d)\]", call)
    both = optimizer == "rowwise_adagrad" and impl == "pallas_gpu"
    assert aliased == (["0", "1"] if both else ["0"])
    # and the jitted call donates them, so XLA passes the caller's buffers through
    assert text.count("tf.aliasing_output") == (2 if optimizer == "rowwise_adagrad" else 1)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_many_row_blocks_match_the_reference(impl):
    """400 rows, 120 bags of 4: several blocks of distinct rows on both kernels (V = 41 above
    fits one TPU block), against the XLA path (checked against the oracle above)."""
    rng = np.random.default_rng(5)
    v, d, n, h = 400, 16, 120, 4
    table = jnp.asarray(rng.standard_normal((v, d)), jnp.float32)
    acc = jnp.asarray(rng.random(v) + 0.1, jnp.float32)
    ids = rng.integers(0, v, (n, h))
    ids[rng.random((n, h)) < 0.3] = 11  # a hot row
    ids[rng.random((n, h)) < 0.1] = -1
    ids = jnp.asarray(ids, jnp.int32)
    grad = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    assert len(np.unique(np.asarray(ids))) > 2 * 64  # more distinct rows than one block holds
    before = dict(common.FALLBACKS)
    got = api.update(table, acc, ids, grad, LR, impl=impl)
    assert dict(common.FALLBACKS) == before
    want = api.update(table, acc, ids, grad, LR, impl="xla")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, **common.tolerance(jnp.float32))


@pytest.mark.parametrize(
    ("width", "dtype", "optimizer", "pooling", "clip"),
    [
        (32, jnp.float32, "rowwise_adagrad", "sum", None),
        (32, jnp.float32, "sgd", "mean", (0.3, 0.5, 0.05)),
        (8, jnp.float32, "rowwise_adagrad", "mean", (0.3, 0.5, 0.0)),
        (64, jnp.float32, "rowwise_adagrad", "sum", (0.0, 0.0, 0.05)),
        (16, jnp.float32, "sgd", "sum", None),
    ],
)
def test_packed_rows_update_as_the_unpacked_table(width, dtype, optimizer, pooling, clip):
    """A table stored packed (``128 / width`` rows per stored row) updated by the TPU kernel
    (interpret mode) equals the XLA update of the same rows unpacked: neighbours in one stored
    row touched in one batch (rows 4..6, and 3 and 7 from many bags) and across the kernel's
    row blocks (400 ids), repeats, padding; rows no id touches, those sharing a stored row
    with touched ones included, bit-identical."""
    pack = 128 // width
    v = 96 * pack
    rng = np.random.default_rng(width)
    table = jnp.asarray(rng.standard_normal((v, width)), dtype)
    acc = jnp.asarray(rng.random(v) + 0.1, jnp.float32)
    ids = rng.integers(0, v, (100, 4))
    ids[rng.random(ids.shape) < 0.3] = 3
    ids[::2, 1] = 7
    ids[rng.random(ids.shape) < 0.15] = -1
    ids[1, :3] = (4, 5, 6)
    ids[-1] = v  # padding only
    ids = jnp.asarray(ids, jnp.int32)
    grad = jnp.asarray(rng.standard_normal((100, width)), jnp.float32)
    cow = None if clip is None else CowClip(ratio=clip[0], min_norm=clip[1], row_l2=clip[2])
    acc_in = acc if optimizer == "rowwise_adagrad" else None
    kw = dict(optimizer=optimizer, pooling=pooling, clip=cow)
    want_t, want_acc, want_stats = api.update(table, acc_in, ids, grad, LR, impl="xla", **kw)
    packed = table.reshape(v // pack, 128)
    before = dict(common.FALLBACKS)
    got_t, got_acc, got_stats = jax.jit(
        lambda t, a: api.update(t, a, ids, grad, LR, impl="pallas_tpu", pack=pack, **kw)
    )(packed, acc_in)
    assert dict(common.FALLBACKS) == before, "the kernel fell back"
    assert got_t.shape == packed.shape and got_t.dtype == table.dtype
    got_t = got_t.reshape(v, width)
    touched = np.zeros(v, bool)
    touched[np.asarray(ids)[(np.asarray(ids) >= 0) & (np.asarray(ids) < v)]] = True
    assert touched[[3, 4, 5, 6, 7]].all() and not touched.all()
    np.testing.assert_array_equal(np.asarray(got_t)[~touched], np.asarray(table)[~touched])
    tol = common.tolerance(dtype)
    np.testing.assert_allclose(np.float32(got_t), np.float32(want_t), **tol)
    f32 = common.tolerance(jnp.float32)
    np.testing.assert_allclose(got_stats, want_stats, **f32)
    if optimizer == "rowwise_adagrad":
        np.testing.assert_allclose(got_acc, want_acc, **f32)
        np.testing.assert_array_equal(np.asarray(got_acc)[~touched], np.asarray(acc)[~touched])


@needs_libtpu
def test_mosaic_updates_a_packed_table_in_place(monkeypatch):
    """Past lowering: libtpu's Mosaic compiles the update kernel (row-wise Adagrad with
    CowClip) for a v5p chip, and a packed 4M x 32 float32 table is updated where it lies (no
    copy); unpacked, XLA copies the table into a padded row-major layout and back."""
    rep = replicated_on_a_v5p_chip(monkeypatch)
    mesh = rep.mesh
    v, d, n, h = 4 << 20, 32, 16384, 8
    sds = functools.partial(jax.ShapeDtypeStruct, sharding=rep)
    clip = CowClip(ratio=1.0, min_norm=0.1, row_l2=0.01)
    temps = {}
    for pack in (1, 4):
        args = (
            sds((v // pack, d * pack), jnp.float32),
            sds((v,), jnp.float32),
            sds((n, h), jnp.int32),
            sds((n, d), jnp.float32),
        )

        def fn(t, a, i, g, p=pack):
            kw = dict(impl="pallas_tpu", interpret=False, pack=p, clip=clip)
            return api.update(t, a, i, g, 0.01, **kw)

        with common.target_backend("tpu"), jax.set_mesh(mesh):
            compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile()
        assert compiled.as_text().count("tpu_custom_call") == 1
        temps[pack] = compiled.memory_analysis().temp_size_in_bytes
    table_bytes = v * d * 4
    assert temps[1] >= table_bytes  # the padded copy
    assert temps[4] < table_bytes / 4
