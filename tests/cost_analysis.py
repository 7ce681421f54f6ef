"""XLA's own count of a model's forward FLOPs, to check the analytic ones of ``recscale.flops``
(a test helper: ``tests/recscale/test_flops.py`` and the baselines' model tests).

``recscale.flops`` is pure Python (sweeps size runs without jax); this module compiles the real
model and asks XLA (``Compiled.cost_analysis()``), which counts every operation, matmuls and
element-wise alike: so XLA's count is an upper bound of the matmul-only analytic one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from data.batch import Schema


def xla_forward_flops(model: nnx.Module, schema: Schema, batch: int) -> float:
    """FLOPs XLA counts for one evaluation-mode forward of ``model`` on a ``batch`` of zeros."""
    graphdef, state = nnx.split(model)
    dense = jnp.zeros((batch, schema.num_dense), jnp.float32)
    ids = jnp.zeros((batch, schema.num_sparse, schema.max_hotness), jnp.int32)
    fn = jax.jit(lambda s, d, i: nnx.merge(graphdef, s)(d, i))
    analysis = fn.lower(state, dense, ids).compile().cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per computation
        analysis = analysis[0]
    return float(analysis["flops"])
