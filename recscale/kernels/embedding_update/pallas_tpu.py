"""Pallas Mosaic TPU kernel: the embedding backward fused with the SGD / row-wise Adagrad update
of the touched rows, in place in HBM (FBGEMM's sorted-segment design, moved by DMAs).

Design. An XLA prologue (:func:`reference.sorted_segments`) sorts the ``P = N·H`` (row, bag)
pairs by row and gives every distinct row ``u`` its segment of sorted pairs. The grid runs over
blocks of ``BU`` consecutive distinct rows (``parallel``: blocks touch disjoint rows, so the two
TensorCores of a megacore chip split them). Memory:

- table ``[V, D]``, bag gradients ``[N, D]`` float32 and the sorted pairs' bags / segment
  indices ``[Pb]`` stay in HBM (``memory_space=ANY``); the table is aliased to the output and
  only the touched rows are read and written;
- the accumulators of the distinct rows are gathered by XLA into ``[BU]`` SMEM blocks, and the
  new ones come out the same way for XLA to scatter into ``acc [V]`` (Mosaic copies a 1-D
  array only in aligned 512-byte runs; one row's accumulator is 4 bytes anywhere);
- the number of distinct rows is the scalar prefetch (blocks past it do nothing), the block's
  rows and segment bounds come in as ``[BU]`` SMEM blocks (the whole ``[U]`` metadata would not
  fit SMEM's 1 MiB at production sizes), the learning rate as an SMEM scalar.

Per block: (1) start DMAs of its ``BU`` table rows (storage dtype);
(2) walk the block's pairs, one contiguous run ``[lo, hi)`` of the sorted order, in chunks of
``C``: a chunk's bag / segment indices are copied to SMEM, then ``C`` row DMAs gather the bags'
gradient rows into VMEM, double-buffered (chunk ``c + 1``'s gathers are in flight while chunk
``c`` is summed), each row added in float32 to its distinct row's accumulator in VMEM;
(3) per row, the row L2 and CowClip where asked (the row's count is its segment's length), the
row-wise Adagrad (or SGD) step in float32, the row written back by DMA, its new accumulator
to the SMEM output. The ``[U, D]`` row gradients never leave VMEM; per-block partial statistics
go to a ``[G, 2]`` SMEM-blocked output that XLA sums.

VMEM rows are kept as ``[X, 1, D]`` arrays so every dynamic index is on an untiled leading
dimension (a row DMA fills one whole ``(1, D)`` tile; no dynamic sublane offsets, which packed
dtypes do not support). A chunk's pair metadata is copied from a 128-aligned start
(:func:`meta_window`): Mosaic slices a 1-D array only at multiples of its tile.

Packed tables (``pack`` > 1, ``recscale.embeddings.layout``): ``[V/p, p·D]``, ``p`` rows in
each 128-lane stored row, read and written in place (unpacked, XLA would copy a narrow table
into a padded row-major layout around the call). The unit of work is the stored row: its
segment holds all its rows' pairs, each pair's bag carrying its row's lane group; the bags'
gradients come packed alike (``[N/p, p·D]``, a reshape) and each pair rotates its bag's group of
the gathered row onto its own row's group (:func:`_move_group`) and adds it; per stored
row the optimizer runs group by group (its own statistics, count and accumulator, untouched
groups exactly unchanged), then the stored row is written once (two of its rows written as
separate units would race).

Limits: float32 storage. float16 falls back (no float16 VPU path), and so does bfloat16:
Mosaic refuses the row DMA at a dynamic row of a 16-bit HBM table (found compiling with libtpu
0.0.42; interpret mode never sees it). A very hot row serialises its pairs in one block;
per-row DMAs of ``D·itemsize`` bytes are latency-bound below ~512 bytes (``C`` gathers in
flight amortise it).
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
_META_ALIGN = 128  # a 1-D int32 array's tile: where Mosaic lets a chunk's pair window start


def meta_window(chunk: int = CHUNK_PAIRS) -> int:
    """Pairs a chunk copies: its ``C`` from an aligned start up to 127 before them. The
    segments must extend this many pairs past the last (``sorted_segments(pair_pad=)``)."""
    return -(-chunk // _META_ALIGN) * _META_ALIGN + _META_ALIGN


# DMA semaphores: separate ones per stream, so that each wait counts one stream's copies.
_ROW_IN, _ROW_OUT, _META, _GRAD0 = range(4)
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
    pack: int,
):
    if adagrad:
        acc_u_ref, table_out, acc_u_out, stats_ref, *scratch = refs
    else:
        table_out, stats_ref, *scratch = refs
        acc_u_ref = acc_u_out = None
    g_b1d, rows_b1d, g_s2c1d, bag_s2c, seg_s2c, count_b, sems = scratch
    shift = pack.bit_length() - 1  # pair values are bag << shift | lane group (pack > 1)
    u0 = pl.program_id(0) * bu
    group_1d = None
    if pack > 1:  # each lane's row within its stored row (float32, as the scalars it meets)
        lane_1d = jax.lax.broadcasted_iota(jnp.int32, (1, dim * pack), 1)
        group_1d = (lane_1d >> (dim.bit_length() - 1)).astype(jnp.float32)

    def in_group(k):
        return group_1d == jnp.asarray(k, jnp.int32).astype(jnp.float32)

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

    def for_rows(body):
        jax.lax.fori_loop(0, nrows, lambda j, c: (body(j), c)[1], 0)

    @pl.when(nrows > 0)
    def _block():
        # (1) The block's table rows and accumulators: in flight while the gradients gather.
        def start_reads(j):
            row_copy(j, True).start()

        for_rows(start_reads)
        g_b1d[...] = jnp.zeros(g_b1d.shape, jnp.float32)
        if pack > 1:  # pairs per row (a stored row's segment counts all its rows' pairs)

            def zero_count(i, c):
                count_b[i] = 0
                return c

            jax.lax.fori_loop(0, nrows * pack, zero_count, 0)

        # (2) The block's pairs [lo, hi), C at a time, gathers double-buffered.
        lo = start_ref[0]
        hi = end_ref[nrows - 1]
        num_chunks = (hi - lo + chunk - 1) // chunk

        def grad_copy(slot, i, bag):
            return pltpu.make_async_copy(
                grad_hbm.at[pl.ds(bag, 1)], g_s2c1d.at[slot, i], sems.at[_GRAD0 + slot]
            )

        def window(c):
            """Chunk c's pairs start at ``base``: copied from the aligned ``base - off``
            (Mosaic slices a 1-D array only at multiples of its 128-element tile)."""
            base = lo + c * chunk
            off = base & (_META_ALIGN - 1)
            return pl.multiple_of(base - off, _META_ALIGN), off

        def fetch(c, slot):
            start, off = window(c)
            for src, dst in ((bag_hbm, bag_s2c), (seg_hbm, seg_s2c)):
                src = src.at[pl.ds(start, meta_window(chunk))]
                cp = pltpu.make_async_copy(src, dst.at[slot], sems.at[_META])
                cp.start()
                cp.wait()
            n = jnp.minimum(chunk, hi - lo - c * chunk)
            jax.lax.fori_loop(
                0,
                n,
                lambda i, c_: (
                    # the bag's stored (packed) gradient row
                    grad_copy(slot, i, bag_s2c[slot, off + i] >> (2 * shift)).start(),
                    c_,
                )[1],
                0,
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

            off = window(c)[1]

            def add_pair(i, c_):
                j = seg_s2c[slot, off + i] - u0
                g_1d = g_s2c1d[slot, i]
                if pack > 1:  # the bag's gradient, moved from its lane group to its row's
                    value = bag_s2c[slot, off + i]
                    k = value & (pack - 1)
                    g_1d = jnp.where(in_group(k), _move_group(g_1d, value >> shift, k, dim), 0.0)
                    count_b[j * pack + k] = count_b[j * pack + k] + 1
                g_b1d[j] = g_b1d[j] + g_1d
                return c_

            return jax.lax.fori_loop(0, n, add_pair, carry)

        jax.lax.fori_loop(0, num_chunks, consume, 0)

        # (3) The optimizer, row by row (each row one (1, D) vector), written back by DMA.
        for_rows(lambda j: row_copy(j, True).wait())
        lr = lr_ref[0]

        def row_update(j, k, g_1d, t_1d, count):
            """Row ``k`` of stored row ``j``: its gradient ``g`` (zero outside its lanes), the
            stored row ``t`` and its pairs ``count``. Returns (update, sq grad before clip)."""
            sq_11 = jnp.sum(g_1d * g_1d, axis=1, keepdims=True)
            gsq_11 = sq_11  # the statistic: before the L2 and the clip
            if clip is not None:  # reference.clip_rows
                if pack > 1:
                    t_1d = jnp.where(in_group(k), t_1d, 0.0)
                touched = count > 0  # (every row of an unpacked block is)
                if clip.row_l2:
                    g_1d = g_1d + jnp.where(touched, clip.row_l2, 0.0) * t_1d
                sq_11 = jnp.sum(g_1d * g_1d, axis=1, keepdims=True)
                if clip.ratio > 0:
                    count_11 = jnp.full((1, 1), count, jnp.int32)
                    w_sq_11 = jnp.sum(t_1d * t_1d, axis=1, keepdims=True)
                    scale_11 = clip_scale(sq_11, w_sq_11, count_11, clip.ratio, clip.min_norm)
                    g_1d = jnp.where(touched, g_1d * scale_11, g_1d)
                    sq_11 = jnp.sum(g_1d * g_1d, axis=1, keepdims=True)
            if adagrad:
                a_11 = jnp.full((1, 1), acc_u_ref[0, j * pack + k], jnp.float32)
                a_11 = a_11 + sq_11 / jnp.float32(dim)
                touched_11 = jnp.max(jnp.abs(g_1d), axis=1, keepdims=True) > 0
                denom_11 = jnp.where(touched_11, jnp.sqrt(a_11) + jnp.float32(eps), 1.0)
                upd_1d = -(jnp.where(touched_11, g_1d / denom_11, 0.0) * lr)
                acc_u_out[0, j * pack + k] = a_11[0, 0]
            else:
                upd_1d = -(g_1d * lr)
            return upd_1d, gsq_11

        def step(j, carry):
            usq_11, gsq_11 = carry
            g_1d = g_b1d[j]
            t_1d = rows_b1d[j].astype(jnp.float32)
            if pack == 1:
                upd_1d, sq_11 = row_update(j, 0, g_1d, t_1d, end_ref[j] - start_ref[j])
            else:  # each lane group its own row; untouched ones get exactly zero

                def group(k, c):
                    upd_1d, sq_11 = c
                    mask_1d = in_group(k)
                    u_1d, s_11 = row_update(
                        j, k, jnp.where(mask_1d, g_1d, 0.0), t_1d, count_b[j * pack + k]
                    )
                    return upd_1d + jnp.where(mask_1d, u_1d, 0.0), sq_11 + s_11

                zero = (jnp.zeros_like(g_1d), jnp.zeros((1, 1), jnp.float32))
                upd_1d, sq_11 = jax.lax.fori_loop(0, pack, group, zero)
            rows_b1d[j] = (t_1d + upd_1d).astype(rows_b1d.dtype)
            row_copy(j, False).start()
            return usq_11 + jnp.sum(upd_1d * upd_1d, axis=1, keepdims=True), gsq_11 + sq_11

        zero_11 = jnp.zeros((1, 1), jnp.float32)
        usq_11, gsq_11 = jax.lax.fori_loop(0, nrows, step, (zero_11, zero_11))
        for_rows(lambda j: row_copy(j, False).wait())
        stats_ref[0, 0] = usq_11[0, 0]
        stats_ref[0, 1] = gsq_11[0, 0]


def _move_group(g_1d: jax.Array, bag: jax.Array, k: jax.Array, width: int) -> jax.Array:
    """``g`` (a stored gradient row, ``p`` bags' gradients side by side) rotated so that bag
    ``bag``'s group lands on group ``k``: one lane rotation by ``(k - bag % p)·width``. Which
    way a rotation turns is checked, not assumed: the lanes' own indices rotate alongside, and
    where they say the other way, the opposite rotation is taken."""
    lanes = g_1d.shape[-1]
    pack = lanes // width
    src = bag & (pack - 1)
    shift = ((k - src) * width) & (lanes - 1)
    lane_1d = jax.lax.broadcasted_iota(jnp.int32, g_1d.shape, 1)
    moved = pltpu.roll(g_1d, shift, 1)
    came_from = pltpu.roll(lane_1d, shift, 1) >> (width.bit_length() - 1)
    other = pltpu.roll(g_1d, (lanes - shift) & (lanes - 1), 1)
    return jnp.where(came_from == src, moved, other)


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
    pack: int = 1,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Updates the rows of ``table [V, D]`` (and ``acc [V]``; None: SGD) that the sorted pairs
    ``seg`` touch, with the float32 bag gradients ``g [N, D]``; returns ``(table, acc, stats
    [G, 2])``, the row gradients clipped first by ``clip`` (None: not). ``seg`` must come from
    ``sorted_segments(..., row_block=BLOCK_ROWS,
    pair_pad=meta_window(chunk_pairs), pack=pack)`` (a chunk reads pairs past the last).

    ``pack`` > 1: ``table`` is stored packed, ``[V/pack, pack·D]`` (``acc`` stays ``[V]``),
    and ``g`` comes packed too, ``[N/pack, pack·D]`` (``N`` a multiple of ``pack``): each pair
    moves its bag's gradient to its row's lane group; a stored row is one unit (one read, one
    write: two of its rows updated as separate units would race), its rows stepped one group
    at a time."""
    v, d = table.shape
    if pack & (pack - 1) or d % pack or (pack > 1 and (d // pack) & (d // pack - 1)):
        raise ValueError(f"pack={pack}: a power of two, over rows of a power-of-two width")
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
        # The units' rows' accumulators, gathered by XLA into [G, 1, BU·pack] SMEM blocks and
        # their new values written back by XLA: Mosaic copies a 1-D array only in aligned
        # 512-byte runs, and a unit's accumulators are 4 or 16 bytes anywhere in acc [V].
        rows_up = seg.row_u[:, None] * pack + jnp.arange(pack, dtype=jnp.int32)
        rows_up = jnp.where(seg.row_u[:, None] < v, rows_up, acc.shape[0])
        acc_g1u = acc.at[rows_up].get(mode="fill", fill_value=0).reshape(grid, 1, bu * pack)
        unit_block = functools.partial(
            pl.BlockSpec, (None, 1, bu * pack), lambda b, nd: (b, 0, 0), memory_space=pltpu.SMEM
        )
        in_specs.append(unit_block())
        args.append(acc_g1u)
        out_shape.append(jax.ShapeDtypeStruct((grid, 1, bu * pack), jnp.float32))
        out_specs.append(unit_block())
    out_shape.append(jax.ShapeDtypeStruct((grid, 1, 2), jnp.float32))
    out_specs.append(pl.BlockSpec((None, 1, 2), lambda b, nd: (b, 0, 0), memory_space=pltpu.SMEM))
    scratch = [
        pltpu.VMEM((bu, 1, d), jnp.float32),  # row gradients
        pltpu.VMEM((bu, 1, d), table.dtype),  # table rows
        pltpu.VMEM((2, chunk_pairs, 1, d), jnp.float32),  # gathered gradient rows
        pltpu.SMEM((2, meta_window(chunk_pairs)), jnp.int32),  # bags of the chunk's pairs
        pltpu.SMEM((2, meta_window(chunk_pairs)), jnp.int32),  # their distinct rows
        pltpu.SMEM((bu * pack,), jnp.int32),  # pairs per row (packed)
        pltpu.SemaphoreType.DMA((_NUM_SEMS,)),
    ]
    kernel = functools.partial(
        _kernel,
        adagrad=adagrad,
        eps=eps,
        clip=clip,
        dim=d // pack,
        bu=bu,
        chunk=chunk_pairs,
        pack=pack,
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
        cost_estimate=_cost(seg, table, pack),
        name="embedding_update",
    )(*args)
    if adagrad:
        new_acc = acc.at[rows_up.reshape(-1)].set(outs[1].reshape(-1), mode="drop")
        return outs[0], new_acc, outs[2].reshape(grid, 2)
    return outs[0], None, outs[1].reshape(grid, 2)


def _cost(seg: Segments, table: jax.Array, pack: int) -> pl.CostEstimate:
    """What the kernel reads and writes, at most: every pair's metadata and gradient row, and
    each distinct stored row (at most one a pair) read and written with its accumulators. XLA
    cannot see into the kernel; ``recscale.hlo.hbm_bytes`` reads this."""
    (pairs,) = seg.bag_p.shape
    rows, width = table.shape
    units = min(seg.row_u.shape[0], rows)
    row_bytes = width * jnp.dtype(table.dtype).itemsize
    return pl.CostEstimate(
        flops=2 * pairs * width + 8 * units * width,
        transcendentals=units * pack,
        bytes_accessed=pairs * (8 + 4 * width) + units * (2 * row_bytes + 8 * pack),
    )
