"""Inference (issue 20): the exported artifact (``export``, its folder ``artifact``; its tables
in the serving precisions of ``recscale.kernels.quantized_embedding_bag.precision``), its
jax-only loaders (``runtime`` for CTR models, ``next_item`` for next-item models) and the HTTP
server (``server``, ``batcher``)."""
