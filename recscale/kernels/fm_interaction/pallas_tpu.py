"""Wukong's optimized FM ``X (Xᵀ Y)`` in Pallas (Mosaic TPU backend): forward and backward.

Design. XLA computes the op as two batched einsums, writing ``T = Xᵀ Y`` ([B, D, K]) to HBM
and reading it back (and ``T``, ``dT`` again in the backward). Here the grid walks blocks of
``block_b`` examples; BlockSpecs DMA each block's ``X`` [block_b, E, D] (and ``G``) into VMEM,
double-buffered behind the previous block's compute, and the kernel loops over the block's
examples with 2-D MXU matmuls whose intermediates stay in vregs/VMEM. Per example it works
with ``Tᵀ`` [K, D] instead of ``T`` [D, K], so every product has D (128, 192) on lanes and only
the small [E, K] operands (``Y``, ``G``) are ever transposed, never ``X``:

    forward   Tᵀ = Yᵀ X,  O = X (Tᵀ)ᵀ                       2 matmuls; reads X, writes O
    backward  Tᵀ = Yᵀ X,  dTᵀ = Gᵀ X,  dX = G Tᵀ + Y dTᵀ,   5 matmuls; reads X and G once,
              dY += X (dTᵀ)ᵀ                                writes dX

``T`` is recomputed in the backward rather than saved: saving it would write and re-read
B·D·K values (3/4 of X's bytes at D=128, K=24, E=32) to spare one small matmul per example,
and the op is bound by HBM bandwidth, not by the MXU. The shared ``Y`` (and ``Yᵀ``, transposed
once by XLA) is a resident [E, K] block. ``dY = Σ_b X_b dT_b`` accumulates in float32 in a
resident output block across the grid's sequential ("arbitrary") axis; the leading "parallel"
axis splits the blocks in two halves (one per TensorCore on megacore chips), each with its own
partial, which XLA sums. In the attentive variant (``y`` [B, E, K]) ``Y`` is blocked like ``X``
and ``dY`` written per example.

``block_b`` is sized so the double-buffered blocks fit in ~8 MiB of VMEM (under every
generation's default scoped limit). When it does not divide B the last block is partial: the
example loop stops at B (rows past it are garbage in VMEM and dropped on write-back), so they
never reach ``dY``.

Precision: bfloat16 runs on the MXU with float32 accumulation; ``T`` and ``dT`` are rounded
to bfloat16 before the matmuls that consume them, as XLA's einsums would. float32 uses
HIGHEST (full float32 contraction). float16 falls back (Mosaic TPU has no float16 matmul on
most generations).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from recscale.kernels import common

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
VMEM_BUDGET = 8 * 1024 * 1024  # bytes for all double-buffered blocks of one grid step
MAX_BLOCK_B = 512


def _tile_bytes(rows: int, cols: int, dtype) -> int:
    """VMEM bytes of a [rows, cols] slab: (8·packing, 128) tiles."""
    itemsize = jnp.dtype(dtype).itemsize
    sublanes = 8 * (4 // itemsize)
    return common.round_up(rows, sublanes) * common.round_up(cols, 128) * itemsize


def _bytes_per_example(e: int, d: int, k: int, dtype, *, backward: bool, shared_y: bool) -> int:
    ed, ek = _tile_bytes(e, d, dtype), _tile_bytes(e, k, dtype)
    if backward:  # X, G, dX (+ Y, dY per example)
        return 2 * ed + ek + (0 if shared_y else 2 * ek)
    return ed + ek + (0 if shared_y else ek)  # X, O (+ Y per example)


def default_block_b(b: int, e: int, d: int, k: int, dtype, *, backward: bool, shared_y: bool):
    """Examples per grid step: as many as fit the VMEM budget double-buffered (<= 512, <= B)."""
    per_example = 2 * _bytes_per_example(e, d, k, dtype, backward=backward, shared_y=shared_y)
    return max(1, min(b, MAX_BLOCK_B, VMEM_BUDGET // per_example))


def unsupported_reason(x_shape: tuple, y_shape: tuple, dtype) -> str | None:
    """Why these kernels cannot run a non-empty call of one of ``DTYPES`` (None when they can;
    ``api`` checks the dtype and the batch first)."""
    _, e, d = x_shape
    per_example = 2 * _bytes_per_example(
        e, d, y_shape[-1], dtype, backward=True, shared_y=len(y_shape) == 2
    )
    if per_example > VMEM_BUDGET:
        return f"one example's blocks ({per_example} bytes) exceed the VMEM budget"
    return None


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot(a, b, contract: tuple[int, int], precision) -> jax.Array:
    """2-D ``a·b`` contracting ``a``'s dim ``contract[0]`` with ``b``'s ``contract[1]``, in f32."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _num_live(num_b: int, block_b: int, block) -> jax.Array:
    """Examples of ``block`` inside the batch: ``block_b`` except in a partial last block, whose
    rows past B are garbage in VMEM (dropped on write-back) and are not computed at all."""
    return jnp.minimum(block_b, num_b - block * block_b)


def _fwd_kernel(x_ref, y_ref, o_ref, *, num_b: int, block_b: int, shared_y: bool, precision):
    # x_ref [block_b, E, D]; y_ref: Yᵀ [K, E] (shared) or Y [block_b, E, K]; o_ref [block_b, E, K].
    yt_ke = y_ref[...] if shared_y else None

    def body(i, carry):
        x_ed = x_ref[i]
        if shared_y:
            tt_kd = _dot(yt_ke, x_ed, (1, 0), precision)  # Tᵀ = Yᵀ X
        else:
            tt_kd = _dot(y_ref[i], x_ed, (0, 0), precision)
        o_ek = _dot(x_ed, tt_kd.astype(x_ed.dtype), (1, 1), precision)  # X T
        o_ref[i] = o_ek.astype(o_ref.dtype)
        return carry

    lax.fori_loop(0, _num_live(num_b, block_b, pl.program_id(0)), body, 0)


def _bwd_kernel(*refs, num_b: int, block_b: int, shared_y: bool, precision):
    if shared_y:
        # x [block_b, E, D], Yᵀ [K, E], Y [E, K], g [block_b, E, K] -> dx, dY partial [E, K] f32
        x_ref, yt_ref, y_ref, g_ref, dx_ref, dy_ref = refs
    else:
        # x [block_b, E, D], Y [block_b, E, K], g [block_b, E, K] -> dx, dY [block_b, E, K]
        x_ref, y_ref, g_ref, dx_ref, dy_ref = refs
    split, step = pl.program_id(0), pl.program_id(1)
    block = split * pl.num_programs(1) + step

    if shared_y:

        @pl.when(step == 0)
        def _init():
            dy_ref[...] = jnp.zeros_like(dy_ref)

    shared_y_ek = y_ref[...] if shared_y else None
    shared_yt_ke = yt_ref[...] if shared_y else None

    def body(i, dy_acc_ek):
        x_ed, g_ek = x_ref[i], g_ref[i]
        cd = x_ed.dtype
        if shared_y:
            y_ek = shared_y_ek
            tt_kd = _dot(shared_yt_ke, x_ed, (1, 0), precision)  # Tᵀ = Yᵀ X
        else:
            y_ek = y_ref[i]
            tt_kd = _dot(y_ek, x_ed, (0, 0), precision)
        dtt_kd = _dot(g_ek, x_ed, (0, 0), precision).astype(cd)  # dTᵀ = Gᵀ X
        dx_ed = _dot(g_ek, tt_kd.astype(cd), (1, 0), precision)  # G Tᵀ
        dx_ed += _dot(y_ek, dtt_kd, (1, 0), precision)  # + Y dTᵀ
        dx_ref[i] = dx_ed.astype(dx_ref.dtype)
        dy_ek = _dot(x_ed, dtt_kd, (1, 1), precision)  # X dT
        if not shared_y:
            dy_ref[i] = dy_ek.astype(dy_ref.dtype)
            return dy_acc_ek
        return dy_acc_ek + dy_ek

    acc_shape = dy_ref.shape if shared_y else (1, 1)
    num_live = _num_live(num_b, block_b, block)
    dy_acc_ek = lax.fori_loop(0, num_live, body, jnp.zeros(acc_shape, jnp.float32))
    if shared_y:
        dy_ref[...] += dy_acc_ek


@functools.partial(jax.jit, static_argnames=("interpret", "block_b"))
def fm_interaction_fwd(
    x_bed: jax.Array, y: jax.Array, *, interpret: Any = False, block_b: int | None = None
) -> jax.Array:
    """``O = X (Xᵀ Y)`` ``[B, E, K]`` in ``x_bed``'s dtype; ``y`` ``[E, K]`` or ``[B, E, K]``."""
    b, e, d = x_bed.shape
    k = y.shape[-1]
    shared_y = y.ndim == 2
    cd = x_bed.dtype
    block_b = block_b or default_block_b(b, e, d, k, cd, backward=False, shared_y=shared_y)
    if shared_y:
        y_in, y_spec = y.astype(cd).T, pl.BlockSpec((k, e), lambda i: (0, 0))
    else:
        y_in, y_spec = y.astype(cd), pl.BlockSpec((block_b, e, k), lambda i: (i, 0, 0))
    kernel = functools.partial(
        _fwd_kernel, num_b=b, block_b=block_b, shared_y=shared_y, precision=_precision(cd)
    )
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(b, block_b),),
        in_specs=[pl.BlockSpec((block_b, e, d), lambda i: (i, 0, 0)), y_spec],
        out_specs=pl.BlockSpec((block_b, e, k), lambda i: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, e, k), cd),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="fm_interaction_fwd",
    )(x_bed, y_in)


@functools.partial(jax.jit, static_argnames=("interpret", "block_b"))
def fm_interaction_bwd(
    x_bed: jax.Array,
    y: jax.Array,
    g_bek: jax.Array,
    *,
    interpret: Any = False,
    block_b: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(dX [B, E, D], dY)`` for the cotangent ``g_bek`` of ``X (Xᵀ Y)``; ``dY`` is shaped like
    ``y`` and has its dtype (summed over the batch in float32 when ``y`` is shared)."""
    b, e, d = x_bed.shape
    k = y.shape[-1]
    shared_y = y.ndim == 2
    cd = x_bed.dtype
    block_b = block_b or default_block_b(b, e, d, k, cd, backward=True, shared_y=shared_y)
    num_blocks = pl.cdiv(b, block_b)
    splits = 2 if num_blocks % 2 == 0 else 1  # one half per TensorCore on megacore chips
    steps = num_blocks // splits

    def example_block(c, j):
        return (c * steps + j, 0, 0)

    ed_spec = pl.BlockSpec((block_b, e, d), example_block)
    ek_spec = pl.BlockSpec((block_b, e, k), example_block)
    yc = y.astype(cd)
    if shared_y:
        operands = (x_bed, yc.T, yc, g_bek.astype(cd))
        in_specs = [
            ed_spec,
            pl.BlockSpec((k, e), lambda c, j: (0, 0)),
            pl.BlockSpec((e, k), lambda c, j: (0, 0)),
            ek_spec,
        ]
        dy_spec = pl.BlockSpec((None, e, k), lambda c, j: (c, 0, 0))  # resident accumulator
        dy_shape = jax.ShapeDtypeStruct((splits, e, k), jnp.float32)
    else:
        operands = (x_bed, yc, g_bek.astype(cd))
        in_specs = [ed_spec, ek_spec, ek_spec]
        dy_spec, dy_shape = ek_spec, jax.ShapeDtypeStruct((b, e, k), cd)
    kernel = functools.partial(
        _bwd_kernel, num_b=b, block_b=block_b, shared_y=shared_y, precision=_precision(cd)
    )
    dx, dy = pl.pallas_call(
        kernel,
        grid=(splits, steps),
        in_specs=in_specs,
        out_specs=[ed_spec, dy_spec],
        out_shape=[jax.ShapeDtypeStruct((b, e, d), cd), dy_shape],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="fm_interaction_bwd",
    )(*operands)
    if shared_y:
        dy = dy.sum(0)
    return dx, dy.astype(y.dtype)
