"""Pooled embedding-bag lookup (sum / mean of table rows per bag): ``pool``, with an XLA
reference, the C++ CPU kernel (``cpu_ffi``), and Pallas GPU (Triton) and TPU (Mosaic) kernels."""

from recscale.kernels.embedding_bag.api import pool

__all__ = ["pool"]
