"""Analytic parameters, FLOPs and embedding traffic of FinalMLP per example (no jax import).

The conventions are ``recscale.flops``'s (matmul FLOPs only, 2 per multiply-add; backward =
2 × forward + the embedding gradient scatter; sparse parameters are logical rows × dim). What is
particular to FinalMLP:

* A gate whose context is features has tables of its own (as in FuxiCTR): they are sparse
  parameters, their rows are read and their gradients scattered like the main tables'.
* A gate whose context is the learned vector is the same for every example, and the model
  computes it once per batch; its FLOPs, amortised over the batch, are counted as 0 per example
  (XLA's count includes them once per batch, a small share at usual batch sizes).
* The fusion counts ``2·(X + Y)`` for its linear terms, ``2·X·Y/K`` for ``o_1h W_h`` over all
  heads and ``2·Y`` for the products with ``o_2h``.
* The gating products ``x ⊙ g``, sigmoids, norms and dropout are elementwise: not counted;
  BatchNorm's running statistics are state, not parameters.

``tests/baselines/test_finalmlp_model.py`` checks the dense parameters against the model's nnx
parameters and the forward FLOPs against XLA's ``cost_analysis()``.
"""

from __future__ import annotations

from typing import Any

from data.batch import Schema
from recscale.flops import DenseCount, family_cost, mlp_flops, mlp_params


def _context_index(schema: Schema, context: tuple[str, ...]) -> list[int]:
    names = [f.name for f in schema.features]
    return [names.index(c) for c in context]


@family_cost
def finalmlp_cost(cfg: Any, schema: Schema) -> DenseCount:
    """Costs of ``baselines.finalmlp.model.FinalMLP`` built from a ``FinalMLPModelConfig``
    ``cfg`` (or a whole ``FinalMLPConfig``, whose ``model`` is used) for ``schema``."""
    cfg = getattr(cfg, "model", cfg)
    cfg.check_data(schema)
    d = cfg.embed_dim
    i = schema.num_dense + schema.num_sparse * d
    params, parts = 0, []

    # Gates: context tables count as extra features for the sparse parameters and traffic.
    extra: list[int] = []
    gate_flops = 0.0
    if cfg.use_fs:
        for context in (cfg.fs1_context, cfg.fs2_context):
            index = _context_index(schema, context)
            sizes = (*cfg.fs_hidden_units, i)
            params += mlp_params(d * max(1, len(index)), sizes)
            if index:
                gate_flops += mlp_flops(d * len(index), sizes)
                extra += index
            else:
                params += d  # the learned context vector
    parts.append(("fs_gates", gate_flops))

    for k, sizes in ((1, cfg.mlp1), (2, cfg.mlp2)):
        # Every layer of a stream is followed by a ReLU, so every layer has its norm.
        bn, ln = getattr(cfg, f"mlp{k}_batch_norm"), getattr(cfg, f"mlp{k}_layer_norm")
        params += mlp_params(i, sizes, batch_norm=bn, layer_norm=ln, final_relu=True)
    parts.append(("mlp1", mlp_flops(i, cfg.mlp1)))
    parts.append(("mlp2", mlp_flops(i, cfg.mlp2)))

    x, y, h = cfg.mlp1[-1], cfg.mlp2[-1], cfg.num_heads
    if x % h or y % h:
        raise ValueError(f"num_heads={h} must divide both stream widths, got {x} and {y}")
    params += (x + 1) + (y + 1) + h * (x // h) * (y // h)
    parts.append(("fusion", 2.0 * (x + y) + 2.0 * x * y / h + 2.0 * y))

    # The gates' tables read the same ids as the main tables of those features.
    return DenseCount(params, parts, d, reread=tuple(extra))
