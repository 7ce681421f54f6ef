"""The fused embedding backward + sparse optimizer update: every implementation against a dense
oracle written from the equations, fallbacks, bad input, aliasing, and GPU/TPU lowering at
production shapes."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recscale.kernels import common
from recscale.kernels.embedding_bag import cpu_ffi
from recscale.kernels.embedding_update import api, pallas_gpu, reference

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
            if impl == "pallas_tpu" and dtype == jnp.float16:
                continue  # no float16 on TPU (ditto)
            name = f"{impl}-{opt}-{pooling}-D{d}-N{n}-H{h}-{jnp.dtype(dtype).name}"
            out.append(pytest.param(impl, d, n, h, dtype, opt, pooling, id=name))
    return out


def _needs(impl: str) -> None:
    if impl == "cpu_ffi" and not cpu_ffi.available():
        pytest.skip("the C++ CPU kernels did not build here (no compiler?)")


def _inputs(d: int, n: int, h: int, dtype, seed: int = 0):
    """Random rows with heavy repeats (id 3 fills bag 0 and recurs in many bags, id 7 in
    every other bag) and padding (-1, V, V + 5)."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((V, d)).astype(np.float32)
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


@functools.partial(jax.jit, static_argnames=("lr", "optimizer", "pooling", "eps"))
def _oracle(table, acc, ids, grad, lr, optimizer, pooling, eps):
    """Dense formulation at float32 HIGHEST: ``g = Aᵀ (w ⊙ grad)`` with ``A [N, V]`` the
    number of times bag ``n`` reads row ``r``."""
    t = jnp.asarray(table, jnp.float32)
    valid = (ids >= 0) & (ids < V)
    a_nv = jnp.sum(jax.nn.one_hot(jnp.where(valid, ids, -1), V, dtype=jnp.float32), axis=1)
    w_n = jnp.ones(ids.shape[0], jnp.float32)
    if pooling == "mean":
        w_n = 1.0 / jnp.maximum(valid.sum(1), 1).astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        g = a_nv.T @ (w_n[:, None] * grad.astype(jnp.float32))
    touched = a_nv.sum(0) > 0
    if optimizer == "sgd":
        upd, new_acc = -lr * g, acc
    else:
        new_acc = jnp.where(touched, acc + jnp.mean(g * g, axis=1), acc)
        nz = jnp.any(g != 0, axis=1, keepdims=True)
        upd = jnp.where(nz, -lr * g / (jnp.sqrt(new_acc)[:, None] + eps), 0.0)
    new_t = jnp.where(touched[:, None], (t + upd).astype(table.dtype), table)
    stats = jnp.stack([jnp.sum(upd * upd), jnp.sum(g * g)])
    return new_t, new_acc, stats, touched


def oracle(table, acc, ids, grad, lr, optimizer, pooling, eps=1e-8):
    new_t, new_acc, stats, touched = _oracle(
        table, acc, ids, grad, lr=lr, optimizer=optimizer, pooling=pooling, eps=eps
    )
    return new_t, new_acc, stats, np.asarray(touched)


@pytest.mark.parametrize("impl,d,n,h,dtype,optimizer,pooling", _params())
def test_update_matches_oracle(impl, d, n, h, dtype, optimizer, pooling):
    _needs(impl)
    table, acc, ids, grad = _inputs(d, n, h, dtype)
    acc_in = acc if optimizer == "rowwise_adagrad" else None
    before = dict(common.FALLBACKS)
    fn = jax.jit(
        lambda t, a, i, g, lr: api.update(
            t, a, i, g, lr, optimizer=optimizer, pooling=pooling, impl=impl
        )
    )
    new_t, new_acc, stats = fn(table, acc_in, ids, grad, LR)
    assert dict(common.FALLBACKS) == before, "the implementation fell back"
    want_t, want_acc, want_stats, touched = oracle(table, acc, ids, grad, LR, optimizer, pooling)
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


def test_auto_on_cpu_uses_the_cpp_kernel_for_multi_id_float32_bags_only():
    _needs("cpu_ffi")

    def hlo(h, dtype):
        table, acc, ids, grad = _inputs(16, 6, h, dtype)
        f = jax.jit(lambda t, a, i, g: api.update(t, a, i, g, LR))
        return f.trace(table, acc, ids, grad).lower().as_text()

    before = dict(common.FALLBACKS)
    assert "recscale_update" in hlo(4, jnp.float32)
    assert "recscale_update" not in hlo(1, jnp.float32)  # one-id bags stay in XLA
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


def _lower(impl: str, platform: str, h: int, dtype, optimizer: str) -> str:
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
            t, a, i, g, lr, optimizer=optimizer, impl=impl, interpret=False
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
    "h,dtype,optimizer",
    [
        (1, jnp.float32, "rowwise_adagrad"),
        (20, jnp.float32, "rowwise_adagrad"),
        (20, jnp.bfloat16, "rowwise_adagrad"),
        (1, jnp.bfloat16, "sgd"),
    ],
)
def test_lowers_at_production_shapes_with_the_table_aliased(
    impl, platform, target, h, dtype, optimizer
):
    text = _lower(impl, platform, h, dtype, optimizer)
    calls = [line for line in text.splitlines() if "custom_call" in line and target in line]
    assert len(calls) == 1, f"expected one {target} call"
    (call,) = calls
    # the kernel writes the table (and accumulator) in place: outputs aliased to its operands
    aliased = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d)\]", call)
    assert aliased == (["0", "1"] if optimizer == "rowwise_adagrad" else ["0"])
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
