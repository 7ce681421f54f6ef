"""Pallas Triton kernel: the embedding backward fused with the SGD / row-wise Adagrad update of
the touched rows (FBGEMM's ``split_embedding_backward_codegen_*_exact`` design).

Design. An XLA prologue (:func:`reference.sorted_segments`) sorts the ``P = N·H`` (row, bag)
pairs by row and gives every distinct row ``u`` its segment of sorted pairs. The kernel's grid
runs over blocks of ``BU`` consecutive distinct rows (one program each). Their pairs are one
contiguous run ``[lo, hi)`` of the sorted order, which the program walks in chunks of ``BP``
pairs (a ``fori_loop`` with a traced trip count, i.e. an ``scf.while``): it loads the chunk's
bags and segment indices, gathers the ``[BP, Dp]`` bags' gradient rows (masked loads; ``Dp``:
``D`` rounded up to a power of two, the columns past ``D`` masked) and adds them to the block's
``[BU, Dp]`` float32 row gradients through a one-hot ``[BU, BP]`` matrix product (IEEE float32,
exact: each product is 0 or the gradient). Then, still in registers, it reads the block's table
rows (storage dtype, float32 arithmetic), applies the row L2 and CowClip where asked (a row's
count is its segment's length), computes the row-wise Adagrad (or SGD) step, writes the rows
and accumulators in place (both aliased to the outputs), and writes its two partial
statistics to a ``[G, 2]`` output that XLA sums.

Fused: the row-gradient scatter-add, its ``[U, D]`` HBM round trip, the gather of the touched
rows and the update scatter of the XLA path are all one pass; HBM traffic is the gradient rows
each pair reads, plus one read and one write of each touched row (and its accumulator).

Chunking over pairs rather than giving each row a lane keeps the work per program proportional
to its pairs: a row repeated ``k`` times costs ``k / BP`` chunk iterations, not ``k`` iterations
for the whole block. Limits: a very hot row still serialises its ``k / BP`` chunks in one
program (FBGEMM splits such segments over several warps); ``D`` up to 1024; ``N·H < 2^31``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from recscale.kernels import common
from recscale.kernels.embedding_update.reference import RowClip, Segments, clip_scale

MAX_DIM = 1024


def block_rows(dim: int) -> int:
    """Distinct rows per program (``BU``): a ``[BU, Dp]`` float32 accumulator of 2–4K
    elements, at least 16 (Triton's smallest dot operand)."""
    return max(16, 4096 // max(16, common.next_pow2(dim)))


def _kernel(
    row_ref,
    start_ref,
    end_ref,
    bag_ref,
    seg_ref,
    grad_ref,
    lr_ref,
    table_ref,
    *refs,
    adagrad: bool,
    eps: float,
    clip: RowClip | None,
    dim: int,
    bu: int,
    bp: int,
    dp: int,
):
    if adagrad:
        acc_ref, table_out, acc_out, stats_ref = refs
    else:
        table_out, stats_ref = refs
    num_rows = table_ref.shape[0]
    pid = pl.program_id(0)
    u0 = pid * bu
    u_b = u0 + jnp.arange(bu, dtype=jnp.int32)
    row_b = row_ref[u_b]
    # The block's pairs are contiguous in the sorted order; unused rows have empty [0, 0).
    lo = start_ref[u0]
    hi = jnp.max(end_ref[u_b])
    num_chunks = jnp.maximum(hi - lo + bp - 1, 0) // bp
    col_c = jnp.arange(dp, dtype=jnp.int32)
    colmask_c = col_c < dim
    local_b = jnp.arange(bu, dtype=jnp.int32)

    def chunk(k, g_bc):
        p_q = lo + k * bp + jnp.arange(bp, dtype=jnp.int32)
        in_q = p_q < hi
        bag_q = plgpu.load(bag_ref.at[p_q], mask=in_q, other=0)
        seg_q = plgpu.load(seg_ref.at[p_q], mask=in_q, other=-1)
        x_qc = plgpu.load(
            grad_ref.at[bag_q[:, None], col_c[None, :]],
            mask=in_q[:, None] & colmask_c[None, :],
            other=0.0,
        )
        onehot_bq = (local_b[:, None] == (seg_q - u0)[None, :]).astype(jnp.float32)
        return g_bc + jnp.dot(onehot_bq, x_qc, precision=jax.lax.Precision.HIGHEST)

    g_bc = jax.lax.fori_loop(0, num_chunks, chunk, jnp.zeros((bu, dp), jnp.float32))

    valid_b = row_b < num_rows
    mask_bc = valid_b[:, None] & colmask_c[None, :]
    t_idx = (row_b[:, None], col_c[None, :])
    t_bc = plgpu.load(table_ref.at[t_idx], mask=mask_bc, other=0).astype(jnp.float32)
    lr = lr_ref[0]
    sq_b = jnp.sum(g_bc * g_bc, axis=1)
    gsq = jnp.sum(sq_b)  # the statistic: the row gradients before the L2 and the clip
    if clip is not None:  # reference.clip_rows; every valid row of the block is touched
        if clip.row_l2:
            g_bc = g_bc + clip.row_l2 * t_bc  # zero for unused rows and padded columns
        sq_b = jnp.sum(g_bc * g_bc, axis=1)
        if clip.ratio > 0:
            count_b = end_ref[u_b] - start_ref[u_b]  # the row's pairs (0 for unused rows)
            w_sq_b = jnp.sum(t_bc * t_bc, axis=1)
            scale_b = clip_scale(sq_b, w_sq_b, count_b, clip.ratio, clip.min_norm)
            g_bc = g_bc * scale_b[:, None]
            sq_b = jnp.sum(g_bc * g_bc, axis=1)
    if adagrad:
        a_b = plgpu.load(acc_ref.at[row_b], mask=valid_b, other=0.0)
        a_b = a_b + sq_b / jnp.float32(dim)
        touched_b = jnp.max(jnp.abs(g_bc), axis=1) > 0
        denom_b = jnp.where(touched_b, jnp.sqrt(a_b) + jnp.float32(eps), 1.0)
        upd_bc = jnp.where(touched_b[:, None], g_bc / denom_b[:, None], 0.0) * -lr
        plgpu.store(acc_out.at[row_b], a_b, mask=valid_b)
    else:
        upd_bc = g_bc * -lr
    plgpu.store(table_out.at[t_idx], (t_bc + upd_bc).astype(table_out.dtype), mask=mask_bc)
    two = jnp.arange(2, dtype=jnp.int32)
    stats_ref[pid, two] = jnp.where(two == 0, jnp.sum(upd_bc * upd_bc), gsq)


def update(
    table: jax.Array,
    acc: jax.Array | None,
    seg: Segments,
    g_nd: jax.Array,
    lr: jax.Array,
    *,
    eps: float,
    interpret: bool,
    clip: RowClip | None = None,
    block_pairs: int = 32,
    num_warps: int | None = None,
    num_stages: int = 1,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Updates the rows of ``table [V, D]`` (and ``acc [V]``; None: SGD) that the sorted pairs
    ``seg`` touch, with the float32 bag gradients ``g [N, D]``; returns ``(table, acc, stats
    [G, 2])``, the row gradients clipped first by ``clip`` (None: not). ``seg`` must come from
    ``sorted_segments(..., row_block=block_rows(D))``."""
    v, d = table.shape
    bu = block_rows(d)
    dp = max(16, common.next_pow2(d))
    (ub,) = seg.row_u.shape
    if ub % bu:
        raise ValueError(f"segments have {ub} rows, not a multiple of the row block {bu}")
    grid = ub // bu
    if num_warps is None:  # ~32 accumulator elements per thread; wide rows get 8 warps
        num_warps = 4 if bu * dp <= 4096 else 8
    adagrad = acc is not None
    args = [
        seg.row_u,
        seg.start_u,
        seg.end_u,
        seg.bag_p,
        seg.seg_p,
        g_nd,
        jnp.reshape(lr, (1,)).astype(jnp.float32),
        table,
    ]
    out_shape = [jax.ShapeDtypeStruct(table.shape, table.dtype)]
    aliases = {7: 0}
    if adagrad:
        args.append(acc)
        out_shape.append(jax.ShapeDtypeStruct(acc.shape, acc.dtype))
        aliases[8] = 1
    out_shape.append(jax.ShapeDtypeStruct((grid, 2), jnp.float32))
    kernel = functools.partial(
        _kernel, adagrad=adagrad, eps=eps, clip=clip, dim=d, bu=bu, bp=block_pairs, dp=dp
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(grid,),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="embedding_update",
    )(*args)
    if adagrad:
        return outs[0], outs[1], outs[2]
    return outs[0], None, outs[1]
