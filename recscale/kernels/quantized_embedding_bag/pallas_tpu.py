"""Int8 row-wise quantized embedding-bag lookup as a Pallas Mosaic TPU kernel.

The float kernel's design (``recscale.kernels.embedding_bag.pallas_tpu``: table in HBM, a block
of ``bN`` bags' ids in SMEM, one DMA per valid id into a VMEM scratch, all of a block's DMAs in
flight together, float32 sum of the ``H`` slot planes into the ``[bN, D]`` output block), built
on its :func:`bag_pool` with two gathered tables: the uint8 rows ``q`` (``[H, bN, D]`` uint8
scratch) and their ``(scale, bias)`` rows (``[H, bN, 2]`` float32 scratch, one 8-byte DMA per
id). Each slot plane is dequantized in VMEM/vregs (``q * scale + bias``, uint8 widened through
int32, which Mosaic converts to float32) before it is masked and added; the float table is
never materialised.

Grid and limits as the float kernel; ``bN`` is a multiple of 32 (the uint8 sublane tile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from recscale.kernels.embedding_bag import pallas_tpu as float_tpu


def _tables(num_rows: int, dim: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    return (
        jax.ShapeDtypeStruct((num_rows, dim), jnp.uint8),
        jax.ShapeDtypeStruct((num_rows, 2), jnp.float32),
    )


def unsupported(num_bags: int, num_slots: int, num_rows: int, dim: int) -> str | None:
    """Why the kernel cannot run this shape (None: it can)."""
    return float_tpu.unsupported(num_bags, num_slots, _tables(num_rows, dim))


def combine_quantized(bufs, h) -> jax.Array:
    """Slot ``h``'s uint8 rows dequantized with their ``(scale, bias)``: ``[bN, D]`` float32."""
    q_bd = bufs[0][h].astype(jnp.int32).astype(jnp.float32)  # Mosaic has no uint8 -> float
    sb_b2 = bufs[1][h]
    return q_bd * sb_b2[:, 0:1] + sb_b2[:, 1:2]
