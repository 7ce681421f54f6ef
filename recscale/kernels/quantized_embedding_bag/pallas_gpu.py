"""Int8 row-wise quantized embedding-bag lookup as a Pallas Triton kernel (GPU).

The float kernel's design (``recscale.kernels.embedding_bag.pallas_gpu``: a grid over blocks of
``bN`` bags, per slot one masked vector gather of ``bN`` rows, float32 accumulation in
registers, one masked ``[bN, D]`` store), built on its :func:`bag_pool`, with a row loader that
gathers the uint8 rows ``[bN, D_pad]`` plus each row's scale and bias (two ``[bN]`` gathers of
``scale_bias``) and dequantizes in registers: ``q * scale + bias``. Padding ids load scale = bias
= 0, so they add nothing. Reads a quarter of a float32 table's bytes per row (plus 8 bytes);
the float table is never materialised.

Grid and limits as the float kernel: ``(cdiv(N, bN),)``, ``D <= 4096``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from recscale.kernels.embedding_bag import pallas_gpu as float_gpu

_MAX_ELEMENTS = 2**31


def unsupported(num_bags: int, num_slots: int, num_rows: int, dim: int) -> str | None:
    """Why the kernel cannot run this shape (None: it can)."""
    # Pallas Triton switches to 64-bit offsets only for arrays over 2^32 bytes: a uint8 table of
    # 2^31..2^32 elements would address its upper rows with wrapped int32 offsets.
    if num_rows * dim >= _MAX_ELEMENTS:
        return f"V·D = {num_rows * dim} >= 2^31 uint8 elements: int32 row offsets would overflow"
    return float_gpu.unsupported(num_bags, num_slots, dim)


def load_quantized_rows(table_refs, safe_b, valid_b, cols_d, mask_bd) -> jax.Array:
    """Row loader: uint8 rows and their ``(scale, bias)``, dequantized to float32."""
    q_ref, sb_ref = table_refs
    q_bd = plgpu.load(q_ref.at[safe_b[:, None], cols_d[None, :]], mask=mask_bd, other=0)
    scale_b = plgpu.load(sb_ref.at[safe_b, 0], mask=valid_b, other=0.0)
    bias_b = plgpu.load(sb_ref.at[safe_b, 1], mask=valid_b, other=0.0)
    return q_bd.astype(jnp.float32) * scale_b[:, None] + bias_b[:, None]
