"""Embedding backward fused with the sparse SGD / row-wise Adagrad update of the touched rows
(reference in XLA, the engine's C++ CPU kernel, Pallas Triton and Mosaic TPU kernels)."""

from recscale.kernels.embedding_update.api import update

__all__ = ["update"]
