"""Int8 row-wise quantized embedding tables (FBGEMM's format): ``quantize_rowwise``,
``dequantize_rowwise``, and the pooled lookup ``pool`` with the dequantization fused into the
gather (XLA reference, Pallas GPU and TPU kernels)."""

from recscale.kernels.quantized_embedding_bag.api import dequantize_rowwise, pool, quantize_rowwise

__all__ = ["dequantize_rowwise", "pool", "quantize_rowwise"]
