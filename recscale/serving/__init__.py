"""Inference (issue 20): the exported artifact (``export``; its tables in the serving precisions
of ``recscale.kernels.quantized_embedding_bag.precision``) and its jax-only loader
(``runtime``)."""
