"""Int8 row-wise quantized embedding tables and their pooled lookup, in plain jnp: the spec,
the oracle and the XLA fallback.

Dimension glossary: ``V`` table rows, ``D`` embedding dim, ``N`` bags, ``H`` bag slots.

Quantization (FBGEMM's 8-bit row-wise format, scale and bias in float32), per row ``v``::

    bias[v]  = min_d x[v, d]
    scale[v] = (max_d x[v, d] - bias[v]) / 255          (1.0 when max == min)
    q[v, d]  = round((x[v, d] - bias[v]) / scale[v])     as uint8, in [0, 255]
    x~[v, d] = q[v, d] * scale[v] + bias[v]              (dequantized; |x~ - x| <= scale / 2)

``scale_bias [V, 2]`` holds ``(scale, bias)`` per row.

Lookup: as ``recscale.kernels.embedding_bag.reference.pool`` on the dequantized table, with the
dequantization fused into the gather: per bag slot, the ``[N, D]`` uint8 rows and their
``[N, 2]`` scales and biases are gathered and dequantized, and the float table ``[V, D]`` is
never materialised. Ids outside ``[0, V)`` are padding; sums accumulate in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from recscale.kernels.embedding_bag import reference as float_reference


def quantize_rowwise(table_vd: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(q [V, D] uint8, scale_bias [V, 2] float32)``: FBGEMM-style 8-bit row-wise
    quantization of a float table (computed in float32)."""
    x_vd = table_vd.astype(jnp.float32)
    bias_v1 = jnp.min(x_vd, axis=1, keepdims=True)
    range_v1 = jnp.max(x_vd, axis=1, keepdims=True) - bias_v1
    scale_v1 = jnp.where(range_v1 > 0, range_v1 / 255.0, 1.0)
    q_vd = jnp.clip(jnp.round((x_vd - bias_v1) / scale_v1), 0, 255).astype(jnp.uint8)
    return q_vd, jnp.concatenate([scale_v1, bias_v1], axis=1)


def dequantize_rows(q_nd: jax.Array, scale_bias_n2: jax.Array) -> jax.Array:
    """``[N, D]`` float32 = ``q * scale + bias`` for gathered rows and their ``(scale, bias)``."""
    return q_nd.astype(jnp.float32) * scale_bias_n2[:, 0:1] + scale_bias_n2[:, 1:2]


def dequantize_rowwise(q_vd: jax.Array, scale_bias_v2: jax.Array) -> jax.Array:
    """``[V, D]`` float32 = ``q * scale + bias`` (the whole table; for tests and export)."""
    return dequantize_rows(q_vd, scale_bias_v2)


def pool(
    q_vd: jax.Array, scale_bias_v2: jax.Array, ids_nh: jax.Array, *, pooling: str = "sum"
) -> jax.Array:
    """``[N, D]`` float32: pooled dequantized rows ``q[ids[n, h]] * scale + bias`` over the valid
    slots (sum, or mean over ``max(number of valid ids, 1)``).

    One gather per slot of the uint8 rows and of their ``(scale, bias)``, dequantized as
    ``[N, D]`` and added (a ``fori_loop`` over slots, as the float reference).
    """
    num_rows, dim = q_vd.shape
    n, h = ids_nh.shape
    valid_hn = float_reference.valid_ids(ids_nh, num_rows).T
    ids_hn = ids_nh.T

    def one(j):
        q_nd = jnp.take(q_vd, ids_hn[j], axis=0, mode="clip")
        sb_n2 = jnp.take(scale_bias_v2, ids_hn[j], axis=0, mode="clip")
        return jnp.where(valid_hn[j][:, None], dequantize_rows(q_nd, sb_n2), 0.0)

    out_nd = float_reference.slot_loop(h, one, jnp.zeros((n, dim), jnp.float32))
    if pooling == "mean":
        out_nd = out_nd / float_reference.bag_counts(ids_nh, num_rows)
    return out_nd
