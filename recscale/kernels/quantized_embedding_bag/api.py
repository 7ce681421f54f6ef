"""Int8 row-wise quantized embedding-bag lookup: the functions models call.

:func:`quantize_rowwise` / :func:`dequantize_rowwise` convert a float table to FBGEMM's 8-bit
row-wise format and back (plain jnp, :mod:`.reference`). :func:`pool` picks an implementation
(``xla``: :mod:`.reference`; ``pallas_gpu``: :mod:`.pallas_gpu`; ``pallas_tpu``:
:mod:`.pallas_tpu`; ``auto``: the Pallas kernel of the default backend once
verified on that hardware (``common.HARDWARE_VERIFIED``), else XLA) and falls back
to the reference, counted in ``common.FALLBACKS``, when the chosen kernel does not support the
call. Inference only: no VJP (a uint8 table has no gradient).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from recscale.kernels import common
from recscale.kernels.embedding_bag import pallas_gpu as float_gpu
from recscale.kernels.embedding_bag import pallas_tpu as float_tpu
from recscale.kernels.embedding_bag.api import check_ids
from recscale.kernels.quantized_embedding_bag import pallas_gpu, pallas_tpu, reference

OP = "quantized_embedding_bag"
# The float embedding-bag kernels, each with the quantized module's row reader: (bag_pool, rows).
_KERNELS = {
    "pallas_gpu": (float_gpu.bag_pool, pallas_gpu.load_quantized_rows),
    "pallas_tpu": (float_tpu.bag_pool, pallas_tpu.combine_quantized),
}


def _check_table(q: jax.Array, scale_bias: jax.Array) -> None:
    if q.ndim != 2 or jnp.dtype(q.dtype) != jnp.uint8:
        raise ValueError(
            f"{OP}: q must be a [V, D] uint8 table (see quantize_rowwise), got {q.dtype} {q.shape}"
        )
    if scale_bias.shape != (q.shape[0], 2):
        raise ValueError(
            f"{OP}: scale_bias must be [V, 2] = (scale, bias) per row, V={q.shape[0]}; got shape "
            f"{scale_bias.shape}"
        )
    if jnp.dtype(scale_bias.dtype) != jnp.float32:
        raise ValueError(f"{OP}: scale_bias must be float32, got {scale_bias.dtype}")


def quantize_rowwise(table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """FBGEMM-style 8-bit row-wise quantization: per row, bias = min, scale = (max - min) / 255
    (1.0 when max == min), q = round((x - bias) / scale) as uint8; returns (q [V, D] uint8,
    scale_bias [V, 2] float32)."""
    if table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.floating):
        raise ValueError(f"{OP}: table must be a float [V, D], got {table.dtype} {table.shape}")
    return reference.quantize_rowwise(table)


def dequantize_rowwise(q: jax.Array, scale_bias: jax.Array) -> jax.Array:
    """[V, D] float32 = q * scale + bias."""
    _check_table(q, scale_bias)
    return reference.dequantize_rowwise(q, scale_bias)


def _choose(q: jax.Array, ids: jax.Array, impl: str) -> str:
    n, h = ids.shape
    v, d = q.shape
    unsupported = {
        "pallas_gpu": pallas_gpu.unsupported(n, h, v, d),
        "pallas_tpu": pallas_tpu.unsupported(n, h, v, d),
    }
    return common.resolve(OP, impl, unsupported)


def pool(
    q: jax.Array,
    scale_bias: jax.Array,
    ids: jax.Array,
    *,
    pooling: str = "sum",
    impl: str = "auto",
    interpret: Any = None,
) -> jax.Array:
    """[N, D] float32: pooled dequantized rows, dequantize fused into the gather (the float
    table is never materialised). Inference only (no VJP). Same padding rules as embedding_bag.

    Args:
      q: ``[V, D]`` uint8 table, scale_bias: ``[V, 2]`` float32 ``(scale, bias)`` per row (as
        :func:`quantize_rowwise` returns them).
      ids: ``[N, H]`` integer ids; ids outside ``[0, V)`` are padding.
      pooling: ``"sum"`` or ``"mean"`` (divides by ``max(number of valid ids, 1)``).
      impl: ``"auto"``, ``"xla"``, ``"pallas_gpu"`` or ``"pallas_tpu"``.
      interpret: the Pallas ``interpret=`` (None: ``common.interpret_for(impl)``).
    """
    _check_table(q, scale_bias)
    check_ids(OP, ids, pooling)
    ids = jnp.asarray(ids, jnp.int32)
    impl = _choose(q, ids, impl)
    if impl == "xla":
        return reference.pool(q, scale_bias, ids, pooling=pooling)
    bag_pool, rows = _KERNELS[impl]
    if interpret is None:
        interpret = common.interpret_for(impl)
    return bag_pool(rows, (q, scale_bias), ids, pooling=pooling, interpret=interpret, name=OP)
