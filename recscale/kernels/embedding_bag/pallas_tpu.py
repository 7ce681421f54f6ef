"""Embedding-bag lookup as a Pallas Mosaic TPU kernel: row gathers by DMA, pooled in VMEM.

Design. The table stays in HBM (``memory_space=pl.ANY``); nothing but the rows a block needs
is read. A 1-D grid over blocks of ``bN`` bags; per block the pipeline brings the block's ids
``[bN, H]`` into SMEM (scalars that address the DMAs) and, a second copy, into VMEM (vectors for
the padding mask). The kernel then

1. walks the ``bN·H`` ids in SMEM and, for each valid one, starts a DMA of table row ``ids[b, h]``
   (``[1, D]``) into slot ``[h, b]`` of a VMEM scratch ``[H, bN, D]`` (the table's dtype).
   Padding ids start nothing, so they cost no HBM traffic. All of a block's DMAs (thousands at
   production shapes) are in flight together on one DMA semaphore: a row gather is latency-bound,
   and the DMA engines overlap them;
2. waits for each started DMA (same walk, same descriptors);
3. sums the ``H`` slot planes ``[bN, D]`` in float32, masking padding slots with the VMEM ids
   (slots without a DMA hold stale data, never read unmasked), divides by the bag sizes for
   ``mean``, and stores the ``[bN, D]`` float32 output block, which the pipeline writes back while
   the next block runs.

As jax's paged-attention kernels gather KV pages: scalar ids in SMEM, one ``make_async_copy`` per
page (here per row) from an HBM ref into VMEM. What is fused: gather, mask, upcast, sum and mean;
XLA instead writes and re-reads an ``[N, D]`` float32 partial sum per slot.

Grid: ``(cdiv(N, bN),)``, "parallel" (megacore chips split it). ``bN``: a multiple of the
sublane tile of the scratch dtype (8 rows of 32-bit, 16 of 16-bit, 32 of 8-bit), at most 256,
shrunk so the row scratch fits :data:`VMEM_BUDGET` and the double-buffered SMEM ids (rows padded
to 128 words) fit :data:`SMEM_BUDGET`. ``D`` is the full row (the blocks' last dim equals the
array's, so any ``D`` is legal; ``D`` a multiple of 128 uses the lanes fully). Ids are padded
to a whole number of blocks with ``V`` (padding); the ragged last output block is clipped by
the pipeline.

Packed rows (``pack`` > 1). XLA:TPU lays a narrow ``[V, 32]`` table out column-major
(``{0,1:T(8,128)}``, no padding), while a kernel reading it by DMA needs it row-major, which pads
each row to 128 lanes: XLA would copy the whole table, 4x its size, before every call. The engine
therefore stores narrow buffers packed (``recscale.embeddings.layout``): ``[V/p, p·D]``, ``p =
128 / D`` rows side by side in each 128-lane row, which XLA keeps row-major and unpadded. The
kernel DMAs stored row ``id >> log2(p)`` (the 128 lanes, ``p`` rows), sums each slot into the
lane group ``id % p`` of a ``[bN, p·D]`` accumulator (a select, as the padding mask), and folds
the groups onto the first ``D`` lanes at the end (``p - 1`` lane rotations). The VMEM scratch is
the same size as unpacked (a ``D``-wide row occupies 128 lanes there too); HBM reads are 128
lanes per id instead of ``D``: the same DMA granule.

Limits: float32 tables. float16 falls back (TPUs have no float16 vector unit), and so does
bfloat16: a row DMA into slot ``[h, b]`` of a 16-bit scratch is at a dynamic sublane offset,
which Mosaic refuses for packed dtypes (found compiling with libtpu 0.0.42; interpret mode never
sees it); the update kernel's ``[X, 1, D]`` rows avoid it, at a relayout the pooled sum here
would pay. The per-block scratch must fit VMEM (``H·8·D·itemsize`` at the smallest block), SMEM
of 1 MiB (TPU v4 and later). The blocks do not overlap one block's DMA waits with the next
block's issue (the ids of the next block are not in SMEM yet); with ``bN·H`` DMAs per block the
bubble is one DMA latency per block. :func:`bag_pool` is the shared building block: the int8
row-wise quantized lookup gathers its uint8 rows and ``(scale, bias)`` rows through it and
dequantizes in VMEM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from recscale.kernels import common

VMEM_BUDGET = 8 * 1024 * 1024
"""Bytes of VMEM for the gathered-row scratch (the default scoped VMEM limit is 16 MiB or more;
the rest holds the double-buffered output and id blocks)."""
SMEM_BUDGET = 256 * 1024
"""Bytes of SMEM for the double-buffered ids blocks (SMEM is 1 MiB on TPU v4 and later)."""
_MAX_BAGS = 256
_STATIC_SLOTS = 32  # unroll the slot walk up to this many slots; a fori_loop beyond

# combine(bufs, h) -> [bN, D] float32: slot h's rows from the gathered-row scratches
# (bufs[t]: [H, bN, w_t] in table t's dtype), e.g. an upcast or a dequantization.
Combine = Callable[[Sequence, jax.Array], jax.Array]


def _sublanes(dtype) -> int:
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def block_bags(num_bags: int, num_slots: int, tables: Sequence[jax.ShapeDtypeStruct]) -> int:
    """``bN`` for these tables (0: no block fits; see the module docstring)."""
    sub = max(_sublanes(t.dtype) for t in tables)
    row_bytes = sum(common.round_up(t.shape[1], 128) * jnp.dtype(t.dtype).itemsize for t in tables)
    bags = min(_MAX_BAGS, common.round_up(num_bags, sub))
    bags = min(bags, VMEM_BUDGET // max(1, num_slots * row_bytes))
    bags = min(bags, SMEM_BUDGET // (2 * 4 * common.round_up(num_slots, 128)))
    return bags // sub * sub


def unsupported(
    num_bags: int, num_slots: int, tables: Sequence[jax.ShapeDtypeStruct]
) -> str | None:
    """Why :func:`bag_pool` cannot run this shape (None: it can)."""
    if num_bags == 0 or num_slots == 0 or any(t.shape[1] == 0 for t in tables):
        return "empty input (no bags, slots or columns)"
    if any(jnp.dtype(t.dtype) == jnp.float16 for t in tables):
        return "float16 tables: TPUs have no float16 vector support (use bfloat16)"
    if any(jnp.dtype(t.dtype) == jnp.bfloat16 for t in tables):
        return (
            "bfloat16 tables: Mosaic refuses a row DMA to a dynamic sublane of a 16-bit scratch "
            "(libtpu 0.0.42: 'offsets along tiled dimensions must be aligned to tiles')"
        )
    if block_bags(num_bags, num_slots, tables) == 0:
        return (
            f"H={num_slots} slots of rows {[t.shape[1] for t in tables]} do not fit the VMEM/SMEM "
            "budget even at the smallest block of bags"
        )
    return None


def combine_float(bufs, h) -> jax.Array:
    """Combine of a float table: the slot's rows upcast to float32."""
    return bufs[0][h].astype(jnp.float32)


def _kernel(
    ids_smem,
    ids_vmem,
    *refs,
    combine: Combine,
    num_tables: int,
    num_slots: int,
    num_rows: int,
    bags: int,
    pooling: str,
    pack: int,
) -> None:
    tables_hbm = refs[:num_tables]
    out_ref = refs[num_tables]
    bufs = refs[num_tables + 1 : 2 * num_tables + 1]
    sem = refs[2 * num_tables + 1]

    def for_each_row(action):
        """``action(copy)`` for the DMA of every valid id of the block, in one fixed order."""

        def one(b, h):
            row = ids_smem[b, h]

            @pl.when((row >= 0) & (row < num_rows))
            def _():
                stored = row >> _log2(pack)  # the stored row holding row ``row``
                for table_hbm, buf in zip(tables_hbm, bufs, strict=True):
                    src = table_hbm.at[pl.ds(stored, 1)]
                    action(pltpu.make_async_copy(src, buf.at[h, pl.ds(b, 1)], sem))

        def bag(b, carry):
            if num_slots <= _STATIC_SLOTS:
                for h in range(num_slots):
                    one(b, h)
            else:
                jax.lax.fori_loop(0, num_slots, lambda h, c: (one(b, h), c)[1], 0)
            return carry

        jax.lax.fori_loop(0, bags, bag, 0)

    for_each_row(lambda copy: copy.start())
    for_each_row(lambda copy: copy.wait())

    ids_bh = ids_vmem[...]
    valid_bh = jnp.where((ids_bh >= 0) & (ids_bh < num_rows), 1.0, 0.0).astype(jnp.float32)
    lane_bh = jax.lax.broadcasted_iota(jnp.int32, ids_bh.shape, 1)
    bags_, width = out_ref.shape
    stored_width = width * pack
    # Packed rows: each id's row is lane group ``id % pack`` of its stored row (groups of
    # ``width`` lanes); the slots are summed in the stored width, each id into its own group.
    if pack > 1:
        group_bh = (ids_bh & (pack - 1)).astype(jnp.float32)
        lane_1s = jax.lax.broadcasted_iota(jnp.int32, (1, stored_width), 1)
        group_1s = (lane_1s >> _log2(width)).astype(jnp.float32)

    def column(x_bh, h):
        """Column h of ``x`` as ``[bN, 1]`` (a lane reduction works for a dynamic h)."""
        return jnp.sum(jnp.where(lane_bh == h, x_bh, 0.0), axis=1, keepdims=True)

    def slot(h, acc_bs):
        keep = column(valid_bh, h) > 0.5
        if pack > 1:
            keep = keep & (group_1s == column(group_bh, h))
        return acc_bs + jnp.where(keep, combine(bufs, h), 0.0)

    acc_bs = jax.lax.fori_loop(0, num_slots, slot, jnp.zeros((bags_, stored_width), jnp.float32))
    if pack > 1:
        # Fold the groups onto the first: lane rotations by every other group's offset (the
        # set of offsets is the same whichever way a rotation turns).
        folded = acc_bs
        for k in range(1, pack):
            folded = folded + pltpu.roll(acc_bs, stored_width - k * width, 1)
        acc_bs = folded[:, :width]
    if pooling == "mean":
        acc_bs = acc_bs / jnp.maximum(jnp.sum(valid_bh, axis=1, keepdims=True), 1.0)
    out_ref[...] = acc_bs


def _log2(x: int) -> int:
    return x.bit_length() - 1


def bag_pool(
    combine: Combine,
    tables: Sequence[jax.Array],
    ids_nh: jax.Array,
    *,
    pooling: str,
    interpret,
    name: str = "embedding_bag",
    pack: int = 1,
) -> jax.Array:
    """``[N, D]`` float32 bags pooled from rows gathered out of ``tables`` by DMA.

    Args:
      combine: the :data:`Combine` (e.g. :func:`combine_float`).
      tables: ``[V, w_t]`` arrays left in HBM; row ``ids[n, h]`` of every one is gathered. The
        first one's ``w_t`` is the output's ``D``.
      ids_nh: ``[N, H]`` integer ids (cast to int32); ids outside ``[0, V)`` are padding.
      pooling: ``"sum"`` or ``"mean"``.
      interpret: ``False`` on TPU, or ``pltpu.InterpretParams`` (CPU tests).
      name: the kernel's name in profiles.
      pack: rows per stored row (a power of two; 1: unpacked). A packed table ``[V/pack,
        pack·D]`` holds row ``r`` in lanes ``[(r % pack)·D, (r % pack + 1)·D)`` of stored row
        ``r // pack`` (the row-major ``[V, D]`` reshaped: ``recscale.embeddings.layout``
        packs narrow buffers so); ids stay row ids, the output ``[N, D]``.
    """
    if pack & (pack - 1) or tables[0].shape[1] % pack:
        raise ValueError(f"pack={pack} must be a power of two dividing the stored width")
    stored_rows, stored_width = tables[0].shape
    num_rows, dim = stored_rows * pack, stored_width // pack
    if pack > 1 and dim & (dim - 1):
        raise ValueError(f"a packed row's width must be a power of two, got {dim}")
    ids_nh = ids_nh.astype(jnp.int32)
    num_bags, num_slots = ids_nh.shape
    bags = block_bags(num_bags, num_slots, tables)
    num_blocks = pl.cdiv(num_bags, bags)
    if num_blocks * bags != num_bags:  # pad the ids (not the output): padding starts no DMA
        pad = ((0, num_blocks * bags - num_bags), (0, 0))
        ids_nh = jnp.pad(ids_nh, pad, constant_values=num_rows)
    kernel = functools.partial(
        _kernel,
        combine=combine,
        num_tables=len(tables),
        num_slots=num_slots,
        num_rows=num_rows,
        bags=bags,
        pooling=pooling,
        pack=pack,
    )
    ids_spec = functools.partial(pl.BlockSpec, (bags, num_slots), lambda i: (i, 0))
    row_bytes = sum(t.shape[1] * jnp.dtype(t.dtype).itemsize for t in tables)  # stored rows
    cost = pl.CostEstimate(
        flops=2 * num_bags * num_slots * dim,
        transcendentals=0,
        bytes_accessed=num_bags * num_slots * (row_bytes + 8) + num_bags * dim * 4,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_bags, dim), jnp.float32),
        grid=(num_blocks,),
        in_specs=[
            ids_spec(memory_space=pltpu.SMEM),
            ids_spec(),
            *[pl.BlockSpec(memory_space=pl.ANY) for _ in tables],
        ],
        out_specs=pl.BlockSpec((bags, dim), lambda i: (i, 0)),
        scratch_shapes=[
            *[pltpu.VMEM((num_slots, bags, t.shape[1]), t.dtype) for t in tables],
            pltpu.SemaphoreType.DMA,
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=cost,
        interpret=interpret,
        name=name,
    )(ids_nh, ids_nh, *tables)


def pool(
    table_vd: jax.Array, ids_nh: jax.Array, *, pooling: str = "sum", interpret=False, pack: int = 1
):
    """``[N, D]`` float32: :func:`..reference.pool` as one Mosaic TPU kernel (see the module;
    ``pack``: :func:`bag_pool`'s packed table)."""
    return bag_pool(
        combine_float, (table_vd,), ids_nh, pooling=pooling, interpret=interpret, pack=pack
    )
