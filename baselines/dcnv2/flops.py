"""Analytic parameters and per-example FLOPs of ``baselines.dcnv2.model.DCNv2`` (no jax import).

The conventions are ``recscale.flops``'s: matmul FLOPs only, 2 per multiply-add; backward = 2 ×
forward plus the embedding-gradient scatter. A full-rank cross layer is one ``[I, I]`` matmul
(``2·I²``), a low-rank one two (``x V`` then ``(x V) U``: ``4·I·R``); the ``x_0 ⊙ (·) + x_l``
is element-wise and not counted.
"""

from __future__ import annotations

from typing import Any

from data.batch import Schema
from recscale.flops import DenseCount, family_cost, mlp_flops, mlp_params


@family_cost
def dcnv2_cost(cfg: Any, schema: Schema) -> DenseCount:
    """Costs of ``baselines.dcnv2.model.DCNv2`` built from a ``DCNv2ModelConfig`` ``cfg``."""
    d = cfg.embed_dim
    params, parts = 0, []
    num_dense = schema.num_dense
    cfg.check_data(schema)
    if cfg.dense_mlp:
        params += mlp_params(schema.num_dense, cfg.dense_mlp)
        parts.append(("dense_mlp", mlp_flops(schema.num_dense, cfg.dense_mlp)))
        num_dense = cfg.dense_mlp[-1]
    i = num_dense + schema.num_sparse * d
    r = cfg.cross_rank
    per_layer = (2 * i * r + i, 4.0 * i * r) if r else (i * i + i, 2.0 * i * i)
    params += cfg.num_cross_layers * per_layer[0]
    parts.append(("cross", cfg.num_cross_layers * per_layer[1]))
    deep_out = 0
    if cfg.deep_mlp:
        params += mlp_params(i, cfg.deep_mlp, batch_norm=cfg.batch_norm, final_relu=True)
        parts.append(("deep_mlp", mlp_flops(i, cfg.deep_mlp)))
        deep_out = cfg.deep_mlp[-1]
    if cfg.structure == "stacked":
        logit_in = deep_out or i
    else:
        logit_in = (i if cfg.num_cross_layers else 0) + deep_out
    params += mlp_params(logit_in, (1,))
    parts.append(("logit", mlp_flops(logit_in, (1,))))
    return DenseCount(params, parts, d)
