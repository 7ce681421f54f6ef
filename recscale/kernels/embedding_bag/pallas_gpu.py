"""Embedding-bag lookup as a Pallas Triton kernel (GPU): gather + pool fused in registers.

Design. A 1-D grid over blocks of ``bN`` bags. Each program keeps its ``[bN, D_pad]`` float32
accumulator in registers and walks the ``H`` bag slots: for slot ``h`` it loads the ``bN`` ids
of that slot (one strided vector load), then issues one masked vector gather of ``bN`` table rows
``[bN, D_pad]`` straight from HBM (each row a contiguous, coalesced ``D``-element read; padding
ids are masked off, so they cost no memory traffic), converts to float32 and adds. Slots are
unrolled two at a time so independent gathers are in flight per warp (Triton does not
software-pipeline these loads by itself), and many programs share an SM. After the last slot the block is divided by
the bag sizes (``mean``) and written once as ``[bN, D]``.

What is fused: the gather, the padding mask, the dtype upcast, the sum over slots and the mean.
The XLA path writes and re-reads a ``[N, D]`` float32 partial sum per slot (``H`` round trips
through HBM); this kernel reads each needed row once and writes the output once.

Grid: ``(cdiv(N, bN),)``; ``bN`` a power of two with ``bN·D_pad <= 4096`` (32 accumulator
registers per thread at 4 warps), at most 128 and at most ``N`` rounded up to a power of two.
``D`` is padded to a power of two (Triton's block shapes must be) with masked loads and stores,
so neither the table nor the output is ever padded in HBM; ragged last blocks are masked too.

Limits: ``D <= 4096`` (one row must fit a program's registers); float tables of any dtype
Triton loads (float32, bfloat16, float16). :func:`bag_pool` is the shared building block: the
int8 row-wise quantized lookup (``recscale.kernels.quantized_embedding_bag``) calls it with a
row loader that dequantizes in registers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from recscale.kernels import common

MAX_DIM = 4096
_ACC_ELEMENTS = 4096  # bN·D_pad float32 accumulator elements per program (4 warps: 32 each)
_MAX_BAGS = 128
# Slots per loop step: two gathers in flight per program on top of the accumulator keeps a
# thread near 100 registers, so several programs share an SM and hide the gather latency.
_UNROLL = 2

# load_rows(table_refs, safe_b, valid_b, cols_d, mask_bd) -> [bN, D_pad] float32, zero where
# mask_bd is False: how one slot's rows are read (and dequantized) from the table refs.
RowLoader = Callable[[Sequence, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def block_bags(num_bags: int, dim: int) -> int:
    """``bN``: bags per program, a power of two (see the module docstring)."""
    dim_pad = common.next_pow2(dim)
    return max(1, min(_ACC_ELEMENTS // dim_pad, _MAX_BAGS, common.next_pow2(num_bags)))


def unsupported(num_bags: int, num_slots: int, dim: int) -> str | None:
    """Why :func:`bag_pool` cannot run this shape (None: it can)."""
    if num_bags == 0 or num_slots == 0 or dim == 0:
        return "empty input (no bags, slots or columns)"
    if dim > MAX_DIM:
        return f"D={dim} > {MAX_DIM}: a row no longer fits one program's registers"
    return None


def load_float_rows(table_refs, safe_b, valid_b, cols_d, mask_bd) -> jax.Array:
    """Row loader of a float table: one masked ``[bN, D_pad]`` gather, upcast to float32."""
    del valid_b
    (table_ref,) = table_refs
    rows_bd = plgpu.load(table_ref.at[safe_b[:, None], cols_d[None, :]], mask=mask_bd, other=0)
    return rows_bd.astype(jnp.float32)


def _kernel(
    ids_ref,
    *refs,
    load_rows: RowLoader,
    num_bags: int,
    num_slots: int,
    num_rows: int,
    dim: int,
    dim_pad: int,
    bags: int,
    unroll: int,
    pooling: str,
) -> None:
    *table_refs, out_ref = refs
    rows_b = pl.program_id(0) * bags + jnp.arange(bags, dtype=jnp.int32)
    row_ok_b = rows_b < num_bags
    cols_d = jnp.arange(dim_pad, dtype=jnp.int32)
    # Only mask columns when D was padded: an all-true mask would hide the rows' contiguity
    # from Triton's vectorizer.
    col_ok_1d = None if dim_pad == dim else (cols_d < dim)[None, :]

    def slot(h, carry):
        acc_bd, count_b = carry
        ids_b = plgpu.load(ids_ref.at[rows_b, h], mask=row_ok_b, other=-1)
        valid_b = (ids_b >= 0) & (ids_b < num_rows)
        safe_b = jnp.where(valid_b, ids_b, 0)  # masked lanes still form in-bounds addresses
        mask_bd = valid_b[:, None] if col_ok_1d is None else valid_b[:, None] & col_ok_1d
        acc_bd = acc_bd + load_rows(table_refs, safe_b, valid_b, cols_d, mask_bd)
        return acc_bd, count_b + valid_b.astype(jnp.float32)

    def group(g, carry):
        for k in range(unroll):  # independent gathers, issued back to back
            carry = slot(g * unroll + k, carry)
        return carry

    carry = (jnp.zeros((bags, dim_pad), jnp.float32), jnp.zeros((bags,), jnp.float32))
    groups, tail = divmod(num_slots, unroll)
    if groups == 1:
        carry = group(0, carry)
    elif groups > 1:
        carry = jax.lax.fori_loop(0, groups, group, carry)
    for k in range(tail):
        carry = slot(groups * unroll + k, carry)
    acc_bd, count_b = carry
    if pooling == "mean":
        acc_bd = acc_bd / jnp.maximum(count_b, 1.0)[:, None]
    out_mask = row_ok_b[:, None] if col_ok_1d is None else row_ok_b[:, None] & col_ok_1d
    plgpu.store(out_ref.at[rows_b[:, None], cols_d[None, :]], acc_bd, mask=out_mask)


def bag_pool(
    load_rows: RowLoader,
    tables: Sequence[jax.Array],
    ids_nh: jax.Array,
    *,
    pooling: str,
    interpret: bool,
    name: str = "embedding_bag",
) -> jax.Array:
    """``[N, D]`` float32 bags pooled from the rows ``load_rows`` reads out of ``tables``.

    Args:
      load_rows: the :data:`RowLoader` (e.g. :func:`load_float_rows`).
      tables: the arrays ``load_rows`` reads (left in HBM; only gathered rows are read), the
        first ``[V, D]``: its shape is the (logical) table's.
      ids_nh: ``[N, H]`` integer ids (cast to int32); ids outside ``[0, V)`` are padding.
      pooling: ``"sum"`` or ``"mean"``.
      interpret: run the kernel in the Pallas interpreter (CPU tests).
      name: the kernel's name in profiles.
    """
    num_rows, dim = tables[0].shape
    num_bags, num_slots = ids_nh.shape
    dim_pad = common.next_pow2(dim)
    bags = block_bags(num_bags, dim)
    kernel = functools.partial(
        _kernel,
        load_rows=load_rows,
        num_bags=num_bags,
        num_slots=num_slots,
        num_rows=num_rows,
        dim=dim,
        dim_pad=dim_pad,
        bags=bags,
        unroll=_UNROLL,
        pooling=pooling,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_bags, dim), jnp.float32),
        grid=(pl.cdiv(num_bags, bags),),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=name,
    )(ids_nh.astype(jnp.int32), *tables)


def pool(
    table_vd: jax.Array, ids_nh: jax.Array, *, pooling: str = "sum", interpret: bool = False
) -> jax.Array:
    """``[N, D]`` float32: :func:`..reference.pool` as one Triton kernel (see the module)."""
    return bag_pool(load_float_rows, (table_vd,), ids_nh, pooling=pooling, interpret=interpret)
