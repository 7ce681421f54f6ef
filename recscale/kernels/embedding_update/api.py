"""The embedding backward fused with the sparse SGD / row-wise Adagrad update: the function the
engine calls, and the choice of its implementation.

Implementations: ``xla`` (:mod:`.reference`: distinct rows + scatter-add, the production
fallback), ``cpu_ffi`` (the engine's C++ XLA-FFI kernel ``recscale_update``, :mod:`.cpu_ffi`;
float32 storage), ``pallas_gpu`` (Triton) and ``pallas_tpu`` (Mosaic TPU), both FBGEMM's
sorted-segment design. ``auto`` means ``pallas_gpu`` on GPU, ``pallas_tpu`` on TPU (once
verified on that hardware (``common.HARDWARE_VERIFIED``), else ``xla``), and on CPU ``cpu_ffi``
where it is built, one-id bags included (1.15-2.5x the XLA reference at one id per bag, widths
4 to 128: BENCHMARKS.md, "The sparse step of many small tables"), else ``xla``. Every implementation applies CowClip and the touched rows' L2
(``clip``) to the whole row gradients it forms, before the optimizer.

There is no VJP: this op *is* the backward pass (it consumes the pooled outputs' gradient and
writes the table). Callers ``jit`` it with the table and accumulator donated; every
implementation then updates both in place (the kernels alias the table to their output; the
TPU kernel hands the touched rows' accumulators to XLA, which scatters them in place).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from recscale.kernels import common, members
from recscale.kernels.embedding_update import pallas_gpu, pallas_tpu, reference

OP = "embedding_update"
STORAGE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _unsupported(table: jax.Array, ids: jax.Array, need_cpu_ffi: bool) -> dict[str, str | None]:
    """Per implementation, None or why it cannot run this call."""
    dtype = jnp.dtype(table.dtype)
    v, d = table.shape
    n, h = ids.shape
    pallas: str | None = None
    if dtype not in STORAGE_DTYPES:
        pallas = f"storage dtype {dtype} (have float32, bfloat16, float16)"
    elif n * h == 0:
        pallas = "an empty batch"
    elif n * h >= 2**31 - 2**16 or v >= 2**31 - 1:
        pallas = f"{n}x{h} pairs / {v} rows overflow int32 positions"
    gpu = pallas or (f"D={d} > {pallas_gpu.MAX_DIM}" if d > pallas_gpu.MAX_DIM else None)
    tpu = pallas
    if tpu is None and dtype == jnp.float16:
        tpu = "float16 storage (no float16 vector unit on TPU)"
    elif tpu is None and dtype == jnp.bfloat16:
        tpu = (
            "bfloat16 storage: Mosaic refuses a row DMA at a dynamic row of a 16-bit table "
            "(libtpu 0.0.42: 'offsets along tiled dimensions must be aligned to tiles')"
        )
    cpu: str | None
    if dtype != jnp.float32:
        cpu = f"storage dtype {dtype} (the C++ kernel updates float32 tables)"
    elif common.default_backend() != "cpu":
        cpu = f"backend {common.default_backend()} (the FFI target is registered for CPU)"
    elif n * h == 0:
        cpu = "an empty batch"
    elif not need_cpu_ffi:
        cpu = None  # not asked for: do not build the library just to say so
    else:
        from recscale.kernels.embedding_update import cpu_ffi  # noqa: PLC0415 (builds on first use)

        cpu = None if cpu_ffi.available() else "the C++ kernels are not built (no compiler?)"
    return {"pallas_gpu": gpu, "pallas_tpu": tpu, "cpu_ffi": cpu}


def update(
    table: jax.Array,
    acc: jax.Array | None,
    ids: jax.Array,
    grad: jax.Array,
    lr,
    *,
    optimizer: str = "rowwise_adagrad",
    eps: float = 1e-8,
    pooling: str = "sum",
    clip: Any = None,
    impl: str = "auto",
    interpret: Any = None,
    pack: int = 1,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Backward of the pooled lookup fused with the optimizer update of the touched rows.
    table [V, D] (float32, bfloat16 or float16 storage), acc [V] float32 (row-wise Adagrad's
    accumulator; None for sgd), ids [N, H] int32 (ids outside [0, V) are padding), grad [N, D]
    the gradient of the pooled outputs, lr a scalar. Returns (new table, new acc, stats [2]
    float32 = [sum of squared row updates, sum of squared row gradients]).

    The row gradient of row ``r`` is the sum of ``grad[n]`` over every ``(n, h)`` with
    ``ids[n, h] == r`` (times ``1 / max(count_n, 1)`` for ``pooling="mean"``, ``count_n`` the
    valid ids of bag ``n``): repeats are combined before the optimizer. SGD: ``t_r -= lr·g_r``.
    Row-wise Adagrad (FBGEMM ``EXACT_ROWWISE_ADAGRAD``): ``acc_r += mean_d(g_r²)``, ``t_r -=
    lr·g_r / (sqrt(acc_r) + eps)`` for rows with a nonzero gradient. Float32 arithmetic, the
    table stored back in its dtype; rows no id touches are left bit-identical. The statistics'
    row gradients are the combined ones, before any ``clip``.

    Args:
        clip: CowClip and the touched rows' L2 before the optimizer (anything with ``ratio``,
            ``min_norm`` and ``row_l2``: a ``recscale.optim.cowclip.CowClip`` or a
            :class:`.reference.RowClip`; None: neither): ``g_r += row_l2·t_r``, then ``g_r``
            scaled to at most ``c_r·max(ratio·‖t_r‖, min_norm)``, ``c_r`` the pairs that read
            row ``r`` (ratio 0: no clipping).
        impl: ``auto``, ``xla``, ``cpu_ffi``, ``pallas_gpu`` or ``pallas_tpu``; an
            implementation that does not support the call falls back to ``xla`` (counted in
            ``common.FALLBACKS``).
        interpret: the Pallas kernels' ``interpret=`` (None: ``common.interpret_for(impl)``).
        pack: ``table`` is stored packed, ``[V/pack, pack·D]`` (the row-major ``[V, D]``
            reshaped; ``acc`` stays ``[V]``), as ``recscale.embeddings.layout`` stores narrow
            buffers for the TPU kernel, which updates them in place; every other
            implementation updates the ``[V, D]`` view (on a TPU, a copy each way).
    """
    clip = reference.RowClip.of(clip)
    stored = table.shape
    if pack > 1 and (table.ndim != 2 or stored[1] % pack):
        raise ValueError(f"{OP}: a table packed {pack} rows a row needs a width they divide")
    rows = table.reshape(stored[0] * pack, stored[1] // pack) if pack > 1 else table
    reference.check_args(rows, acc, ids, grad, optimizer, pooling, clip)
    ids = jnp.asarray(ids, jnp.int32)
    adagrad = optimizer == "rowwise_adagrad"
    want_ffi = impl in ("cpu_ffi", "auto")  # on CPU, auto means the C++ kernel where it runs
    unsupported = _unsupported(rows, ids, need_cpu_ffi=want_ffi)
    chosen = common.resolve(OP, impl, unsupported, cpu_auto="cpu_ffi")
    if pack > 1 and chosen != "pallas_tpu":
        kw = dict(optimizer=optimizer, eps=eps, pooling=pooling, clip=clip, impl=chosen)
        new_rows, new_acc, stats = update(rows, acc, ids, grad, lr, interpret=interpret, **kw)
        return new_rows.reshape(stored), new_acc, stats
    if chosen == "xla":
        return reference.update(
            table, acc, ids, grad, lr, optimizer=optimizer, eps=eps, pooling=pooling, clip=clip
        )

    v, d = rows.shape
    lr = jnp.asarray(lr, jnp.float32)
    g_nd = reference.weighted_grad(ids, grad, v, pooling)
    acc_in = acc if adagrad else None
    if chosen == "cpu_ffi":
        from recscale.kernels.embedding_update import cpu_ffi  # noqa: PLC0415

        new_table, new_acc, stats = cpu_ffi.update(
            table,
            acc_in if adagrad else jnp.zeros((1,), jnp.float32),
            ids[None],  # the kernel skips ids outside [0, V) itself
            g_nd[None],
            lr,
            jnp.full((1,), d, jnp.int32),
            eps=eps,
            adagrad=adagrad,
            clip=clip,
        )
        return new_table, (new_acc if adagrad else acc), stats
    if interpret is None:
        interpret = common.interpret_for(chosen)

    def kernel(table, acc_in, ids, g_nd, lr):
        keys_nh = reference.pair_keys(ids, v)
        if chosen == "pallas_gpu":
            seg = reference.sorted_segments(keys_nh, v, row_block=pallas_gpu.block_rows(d))
            run = pallas_gpu.update
        else:
            seg = reference.sorted_segments(
                keys_nh,
                v,
                row_block=pallas_tpu.BLOCK_ROWS,
                pair_pad=pallas_tpu.meta_window(),
                pack=pack,
            )
            run = functools.partial(pallas_tpu.update, pack=pack)
            if pack > 1:  # the bags' gradients packed as the table is: [N/pack, pack·D]
                n = g_nd.shape[0]
                g_nd = jnp.pad(g_nd, ((0, -n % pack), (0, 0))).reshape(-1, pack * d)
        new_table, new_acc, stats_g2 = run(
            table, acc_in, seg, g_nd, lr, eps=eps, clip=clip, interpret=interpret
        )
        return new_table, new_acc, jnp.sum(stats_g2, axis=0)

    # A population's members: one kernel each, in one program (``members``).
    if adagrad:
        new_table, new_acc, stats = members.one_by_one(kernel)(table, acc_in, ids, g_nd, lr)
        return new_table, new_acc, stats
    new_table, _, stats = members.one_by_one(lambda t, i, g, r: kernel(t, None, i, g, r))(
        table, ids, g_nd, lr
    )
    return new_table, acc, stats
