"""Pallas Mosaic TPU kernel: the embedding backward fused with the SGD / row-wise Adagrad update
of the touched rows, in place in HBM (FBGEMM's sorted-segment design, moved by DMAs).

Design. An XLA prologue (:func:`reference.sorted_segments`) sorts the ``P = N·H`` (row, bag)
pairs by row and gives every distinct row ``u`` its segment of sorted pairs. The grid runs over
blocks of ``BU`` consecutive distinct rows (``parallel``: blocks touch disjoint rows, so the two
TensorCores of a megacore chip split them). Memory:

- table ``[V, D]``, accumulator ``[V]``, bag gradients ``[N, D]`` float32 and the sorted pairs'
  bags / segment indices ``[Pb]`` stay in HBM (``memory_space=ANY``); the table and the
  accumulator are aliased to the outputs and only the touched rows are read and written;
- the number of distinct rows is the scalar prefetch (blocks past it do nothing), the block's
  rows and segment bounds come in as ``[BU]`` SMEM blocks (the whole ``[U]`` metadata would not
  fit SMEM's 1 MiB at production sizes), the learning rate as an SMEM scalar.

Per block: (1) start DMAs of its ``BU`` table rows (storage dtype) and accumulators (SMEM);
(2) walk the block's pairs, one contiguous run ``[lo, hi)`` of the sorted order, in chunks of
``C``: a chunk's bag / segment indices are copied to SMEM, then ``C`` row DMAs gather the bags'
gradient rows into VMEM, double-buffered (chunk ``c + 1``'s gathers are in flight while chunk
``c`` is summed), each row added in float32 to its distinct row's accumulator in VMEM;
(3) per row, the row L2 and CowClip where asked (the row's count is its segment's length), the
row-wise Adagrad (or SGD) step in float32, the row and accumulator written back by DMA. The ``[U, D]`` row gradients never leave VMEM; per-block partial statistics go to a
``[G, 2]`` SMEM-blocked output that XLA sums.

VMEM rows are kept as ``[X, 1, D]`` arrays so every dynamic index is on an untiled leading
dimension (a row DMA fills one whole ``(1, D)`` tile; no dynamic sublane offsets, which packed
dtypes do not support). Limits: float32 and bfloat16 storage (TPUs have no float16 VPU path);
a very hot row serialises its pairs in one block; per-row DMAs of ``D·itemsize`` bytes are
latency-bound below ~512 bytes (``C`` gathers in flight amortise it).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from recscale.kernels.embedding_update.reference import RowClip, Segments, clip_scale

BLOCK_ROWS = 64
"""``BU``: distinct rows per grid step."""
CHUNK_PAIRS = 64
"""``C``: gradient-row gathers in flight per chunk (double-buffered)."""

# DMA semaphores: separate ones per stream, so that each wait counts one stream's copies.
_ROW_IN, _ACC_IN, _ROW_OUT, _ACC_OUT, _META, _GRAD0 = range(6)
_NUM_SEMS = _GRAD0 + 2


def _kernel(
    nd_ref,
    lr_ref,
    meta_ref,
    bag_hbm,
    seg_hbm,
    grad_hbm,
    table_hbm,
    *refs,
    adagrad: bool,
    eps: float,
    clip: RowClip | None,
    dim: int,
    bu: int,
    chunk: int,
):
    if adagrad:
        acc_hbm, table_out, acc_out, stats_ref, *scratch = refs
    else:
        table_out, stats_ref, *scratch = refs
        acc_hbm = acc_out = None
    g_b1d, rows_b1d, acc_b, g_s2c1d, bag_s2c, seg_s2c, sems = scratch
    u0 = pl.program_id(0) * bu
    nrows = jnp.clip(nd_ref[0] - u0, 0, bu)
    row_ref, start_ref, end_ref = meta_ref.at[0], meta_ref.at[1], meta_ref.at[2]
    stats_ref[0, 0] = jnp.float32(0)
    stats_ref[0, 1] = jnp.float32(0)

    def row_copy(j, into_vmem: bool):
        r = row_ref[j]
        if into_vmem:
            return pltpu.make_async_copy(
                table_hbm.at[pl.ds(r, 1)], rows_b1d.at[j], sems.at[_ROW_IN]
            )
        return pltpu.make_async_copy(rows_b1d.at[j], table_out.at[pl.ds(r, 1)], sems.at[_ROW_OUT])

    def acc_copy(j, into_smem: bool):
        r = row_ref[j]
        if into_smem:
            return pltpu.make_async_copy(
                acc_hbm.at[pl.ds(r, 1)], acc_b.at[pl.ds(j, 1)], sems.at[_ACC_IN]
            )
        return pltpu.make_async_copy(
            acc_b.at[pl.ds(j, 1)], acc_out.at[pl.ds(r, 1)], sems.at[_ACC_OUT]
        )

    def for_rows(body):
        jax.lax.fori_loop(0, nrows, lambda j, c: (body(j), c)[1], 0)

    @pl.when(nrows > 0)
    def _block():
        # (1) The block's table rows and accumulators: in flight while the gradients gather.
        def start_reads(j):
            row_copy(j, True).start()
            if adagrad:
                acc_copy(j, True).start()

        for_rows(start_reads)
        g_b1d[...] = jnp.zeros(g_b1d.shape, jnp.float32)

        # (2) The block's pairs [lo, hi), C at a time, gathers double-buffered.
        lo = start_ref[0]
        hi = end_ref[nrows - 1]
        num_chunks = (hi - lo + chunk - 1) // chunk

        def grad_copy(slot, i, bag):
            return pltpu.make_async_copy(
                grad_hbm.at[pl.ds(bag, 1)], g_s2c1d.at[slot, i], sems.at[_GRAD0 + slot]
            )

        def fetch(c, slot):
            base = lo + c * chunk
            for src, dst in ((bag_hbm, bag_s2c), (seg_hbm, seg_s2c)):
                cp = pltpu.make_async_copy(src.at[pl.ds(base, chunk)], dst.at[slot], sems.at[_META])
                cp.start()
                cp.wait()
            n = jnp.minimum(chunk, hi - base)
            jax.lax.fori_loop(
                0, n, lambda i, c_: (grad_copy(slot, i, bag_s2c[slot, i]).start(), c_)[1], 0
            )

        fetch(0, 0)

        def consume(c, carry):
            slot = c % 2

            @pl.when(c + 1 < num_chunks)
            def _prefetch():
                fetch(c + 1, 1 - slot)

            # A shared semaphore says how many bytes arrived, not which rows: wait for the
            # whole chunk before reading any of it.
            n = jnp.minimum(chunk, hi - lo - c * chunk)
            jax.lax.fori_loop(0, n, lambda i, c_: (grad_copy(slot, i, 0).wait(), c_)[1], 0)

            def add_pair(i, c_):
                j = seg_s2c[slot, i] - u0
                g_b1d[j] = g_b1d[j] + g_s2c1d[slot, i]
                return c_

            return jax.lax.fori_loop(0, n, add_pair, carry)

        jax.lax.fori_loop(0, num_chunks, consume, 0)

        # (3) The optimizer, row by row (each row one (1, D) vector), written back by DMA.
        for_rows(lambda j: row_copy(j, True).wait())
        if adagrad:
            for_rows(lambda j: acc_copy(j, True).wait())
        lr = lr_ref[0]

        def step(j, carry):
            usq_11, gsq_11 = carry
            g_1d = g_b1d[j]
            t_1d = rows_b1d[j].astype(jnp.float32)
            sq_11 = jnp.sum(g_1d * g_1d, axis=1, keepdims=True)
            gsq_11 = gsq_11 + sq_11  # the statistic: before the L2 and the clip
            if clip is not None:  # reference.clip_rows (every row here is touched)
                if clip.row_l2:
                    g_1d = g_1d + clip.row_l2 * t_1d
                sq_11 = jnp.sum(g_1d * g_1d, axis=1, keepdims=True)
                if clip.ratio > 0:
                    count_11 = jnp.full((1, 1), end_ref[j] - start_ref[j], jnp.int32)
                    w_sq_11 = jnp.sum(t_1d * t_1d, axis=1, keepdims=True)
                    scale_11 = clip_scale(sq_11, w_sq_11, count_11, clip.ratio, clip.min_norm)
                    g_1d = g_1d * scale_11
                    sq_11 = jnp.sum(g_1d * g_1d, axis=1, keepdims=True)
            if adagrad:
                a_11 = jnp.full((1, 1), acc_b[j], jnp.float32) + sq_11 / jnp.float32(dim)
                touched_11 = jnp.max(jnp.abs(g_1d), axis=1, keepdims=True) > 0
                denom_11 = jnp.where(touched_11, jnp.sqrt(a_11) + jnp.float32(eps), 1.0)
                upd_1d = -(jnp.where(touched_11, g_1d / denom_11, 0.0) * lr)
                acc_b[j] = a_11[0, 0]
                acc_copy(j, False).start()
            else:
                upd_1d = -(g_1d * lr)
            rows_b1d[j] = (t_1d + upd_1d).astype(rows_b1d.dtype)
            row_copy(j, False).start()
            return usq_11 + jnp.sum(upd_1d * upd_1d, axis=1, keepdims=True), gsq_11

        zero_11 = jnp.zeros((1, 1), jnp.float32)
        usq_11, gsq_11 = jax.lax.fori_loop(0, nrows, step, (zero_11, zero_11))
        for_rows(lambda j: row_copy(j, False).wait())
        if adagrad:
            for_rows(lambda j: acc_copy(j, False).wait())
        stats_ref[0, 0] = usq_11[0, 0]
        stats_ref[0, 1] = gsq_11[0, 0]


def update(
    table: jax.Array,
    acc: jax.Array | None,
    seg: Segments,
    g_nd: jax.Array,
    lr: jax.Array,
    *,
    eps: float,
    interpret: Any,
    clip: RowClip | None = None,
    chunk_pairs: int = CHUNK_PAIRS,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Updates the rows of ``table [V, D]`` (and ``acc [V]``; None: SGD) that the sorted pairs
    ``seg`` touch, with the float32 bag gradients ``g [N, D]``; returns ``(table, acc, stats
    [G, 2])``, the row gradients clipped first by ``clip`` (None: not). ``seg`` must come from
    ``sorted_segments(..., row_block=BLOCK_ROWS,
    pair_pad=chunk_pairs)`` (chunks read up to ``C`` pairs past the last)."""
    v, d = table.shape
    bu = BLOCK_ROWS
    (ub,) = seg.row_u.shape
    if ub % bu:
        raise ValueError(f"segments have {ub} rows, not a multiple of the row block {bu}")
    grid = ub // bu
    adagrad = acc is not None
    # The block's (row, start, end) as one [3, BU] SMEM block (rank-1 SMEM blocks would need
    # BU a multiple of 1024; the leading grid dimension is squeezed).
    meta_g3u = jnp.stack([seg.row_u, seg.start_u, seg.end_u]).reshape(3, grid, bu)
    meta_g3u = meta_g3u.transpose(1, 0, 2)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [
        pl.BlockSpec(memory_space=pltpu.SMEM),
        pl.BlockSpec((None, 3, bu), lambda b, nd: (b, 0, 0), memory_space=pltpu.SMEM),
        hbm,
        hbm,
        hbm,
        hbm,
    ]
    args = [
        seg.num_distinct,
        jnp.reshape(lr, (1,)).astype(jnp.float32),
        meta_g3u,
        seg.bag_p,
        seg.seg_p,
        g_nd,
        table,
    ]
    out_shape = [jax.ShapeDtypeStruct(table.shape, table.dtype)]
    out_specs = [hbm]
    aliases = {6: 0}  # operand indices count the scalar prefetch
    if adagrad:
        in_specs.append(hbm)
        args.append(acc)
        out_shape.append(jax.ShapeDtypeStruct(acc.shape, acc.dtype))
        out_specs.append(hbm)
        aliases[7] = 1
    out_shape.append(jax.ShapeDtypeStruct((grid, 1, 2), jnp.float32))
    out_specs.append(pl.BlockSpec((None, 1, 2), lambda b, nd: (b, 0, 0), memory_space=pltpu.SMEM))
    scratch = [
        pltpu.VMEM((bu, 1, d), jnp.float32),  # row gradients
        pltpu.VMEM((bu, 1, d), table.dtype),  # table rows
        pltpu.SMEM((bu,), jnp.float32),  # accumulators
        pltpu.VMEM((2, chunk_pairs, 1, d), jnp.float32),  # gathered gradient rows
        pltpu.SMEM((2, chunk_pairs), jnp.int32),  # bags of the chunk's pairs
        pltpu.SMEM((2, chunk_pairs), jnp.int32),  # their distinct rows
        pltpu.SemaphoreType.DMA((_NUM_SEMS,)),
    ]
    kernel = functools.partial(
        _kernel, adagrad=adagrad, eps=eps, clip=clip, dim=d, bu=bu, chunk=chunk_pairs
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(grid,),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        name="embedding_update",
    )(*args)
    if adagrad:
        return outs[0], outs[1], outs[2].reshape(grid, 2)
    return outs[0], None, outs[1].reshape(grid, 2)
