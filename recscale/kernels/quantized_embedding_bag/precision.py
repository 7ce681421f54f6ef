"""Embedding tables in serving precisions, and their pooled lookup (issue 20): the lookup an
exported model runs (``recscale.serving.export``), kept with the kernels so that the embedding
collection (``EmbeddingCollection.to_serving``) uses it from below the serving code.

A table ``[V, D]`` is stored as a small dict of arrays per precision:

* ``float32``, ``bfloat16``, ``float16``: ``{"w": [V, D]}`` in that dtype; rows are gathered
  in it and pooled in float32.
* ``int8`` (FBGEMM's 8-bit row-wise format): ``{"q": uint8 [V, D], "scale_bias": float32
  [V, 2]}``, per row ``bias = min``, ``scale = (max - min) / 255`` (1 when the row is constant),
  ``q = round((x - bias) / scale)``; ``x~ = q scale + bias``, within ``scale / 2`` of ``x``.
* ``int4`` (FBGEMM's 4-bit row-wise format, with float32 scale and bias): the same with 15
  levels, two codes per byte, ``{"q": uint8 [V, ceil(D / 2)], "scale_bias": float32 [V, 2]}``;
  column ``2j`` in the low nibble of byte ``j``, column ``2j + 1`` in the high one.

:func:`pool` gathers a bag's rows, dequantises only those (never the whole table) and sums
them in float32, as the training reference does (``recscale.kernels.embedding_bag.reference``:
ids outside ``[0, V)`` are padding; ``mean`` divides by the number of valid ids, at least 1).
Everything is plain ``jnp``, so a model with these tables exports to StableHLO for any backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recscale.kernels.embedding_bag import reference as float_reference
from recscale.kernels.quantized_embedding_bag import reference as int8_reference

PRECISIONS = ("float32", "bfloat16", "float16", "int8", "int4")
FLOATS = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
LEVELS = {"int8": 255, "int4": 15}


def check(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    return precision


def quantize(table_vd: jax.Array | np.ndarray, precision: str) -> dict[str, jax.Array]:
    """``table_vd`` ``[V, D]`` (float) in ``precision`` (see the module docstring)."""
    check(precision)
    x = jnp.asarray(table_vd, jnp.float32)
    if precision in FLOATS:
        return {"w": x.astype(FLOATS[precision])}
    if precision == "int8":
        q, sb = int8_reference.quantize_rowwise(x)
        return {"q": q, "scale_bias": sb}
    bias = jnp.min(x, axis=1, keepdims=True)
    rng = jnp.max(x, axis=1, keepdims=True) - bias
    scale = jnp.where(rng > 0, rng * (1.0 / LEVELS["int4"]), 1.0)  # as XLA computes int8's
    codes = jnp.clip(jnp.round((x - bias) / scale), 0, LEVELS["int4"]).astype(jnp.uint8)
    if codes.shape[1] % 2:
        codes = jnp.pad(codes, ((0, 0), (0, 1)))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return {"q": packed.astype(jnp.uint8), "scale_bias": jnp.concatenate([scale, bias], axis=1)}


def rows(entry: dict[str, jax.Array], precision: str, ids_n: jax.Array, dim: int) -> jax.Array:
    """Float32 ``[N, dim]``: rows ``ids_n`` of a table (ids clipped into range; callers mask
    padding)."""
    if precision in FLOATS:
        return jnp.take(entry["w"], ids_n, axis=0, mode="clip").astype(jnp.float32)
    q = jnp.take(entry["q"], ids_n, axis=0, mode="clip")
    sb = jnp.take(entry["scale_bias"], ids_n, axis=0, mode="clip")
    if precision == "int4":
        q = jnp.stack([q & 0x0F, q >> 4], axis=-1).reshape(q.shape[0], -1)[:, :dim]
    return int8_reference.dequantize_rows(q, sb)  # q scale + bias, either width


def dequantize(entry: dict[str, jax.Array], precision: str, dim: int) -> jax.Array:
    """The whole table ``[V, dim]`` in float32 (for tests and accuracy accounting)."""
    v = (entry["w"] if precision in FLOATS else entry["q"]).shape[0]
    return rows(entry, precision, jnp.arange(v), dim)


def pool(
    entry: dict[str, jax.Array],
    precision: str,
    ids_nh: jax.Array,
    *,
    dim: int,
    pooling: str = "sum",
) -> jax.Array:
    """``[N, dim]`` float32: the bags' rows, dequantised, summed (or averaged) over valid ids."""
    num_rows = (entry["w"] if precision in FLOATS else entry["q"]).shape[0]
    ids_nh = jnp.asarray(ids_nh)
    n, h = ids_nh.shape
    valid_hn = float_reference.valid_ids(ids_nh, num_rows).T
    ids_hn = ids_nh.T

    def one(j):
        return jnp.where(valid_hn[j][:, None], rows(entry, precision, ids_hn[j], dim), 0.0)

    out = float_reference.slot_loop(h, one, jnp.zeros((n, dim), jnp.float32))
    if pooling == "mean":
        out = out / float_reference.bag_counts(ids_nh, num_rows)
    return out


def nbytes(entry: dict[str, jax.Array]) -> int:
    """Bytes the table takes in this precision (scales and biases included)."""
    return int(sum(np.dtype(a.dtype).itemsize * int(np.prod(a.shape)) for a in entry.values()))
