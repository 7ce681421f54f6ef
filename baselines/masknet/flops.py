"""Analytic parameters and per-example FLOPs of ``baselines.masknet.model.MaskNet`` (no jax import).

The conventions are ``recscale.flops``'s: matmul FLOPs only, 2 per multiply-add; backward = 2 ×
forward plus the embedding-gradient scatter. Not counted: the mask's element-wise product, the
LayerNorms, ReLUs, dropout, bias adds, and the dense fields' x_j · w_j (an element-wise product,
not a matmul). Dense parameters are every parameter but the embedding tables: the dense fields'
vectors w_j, the per-field embedding LayerNorms, and the MaskBlocks, MLP and logit.
"""

from __future__ import annotations

from typing import Any

from data.batch import Schema
from recscale.flops import DenseCount, family_cost, mlp_flops, mlp_params


def aggregation_width(masked_dim: int, reduction_ratio: float) -> int:
    """A = int(r · Z), FuxiCTR's rounding; an error when it leaves no units."""
    width = int(masked_dim * reduction_ratio)
    if width < 1:
        raise ValueError(
            f"reduction_ratio={reduction_ratio} leaves int({masked_dim} * {reduction_ratio}) = "
            f"{width} units in the mask's aggregation layer"
        )
    return width


def _mask_block(in_dim: int, masked_dim: int, out_dim: int, cfg: Any) -> tuple[int, float, float]:
    """(params, mask FLOPs, masked-linear FLOPs) of one MaskBlock per example."""
    a = aggregation_width(masked_dim, cfg.reduction_ratio)
    params = mlp_params(in_dim, (a, masked_dim))  # W_1, b_1, W_2, b_2
    params += masked_dim * out_dim  # the bias-free W
    if cfg.net_layernorm:
        params += 2 * out_dim
    return params, mlp_flops(in_dim, (a, masked_dim)), 2.0 * masked_dim * out_dim


@family_cost
def masknet_cost(cfg: Any, schema: Schema) -> DenseCount:
    """Costs of ``baselines.masknet.model.MaskNet`` built from a ``MaskNetModelConfig`` ``cfg``."""
    cfg.check_data(schema)
    d = cfg.embed_dim
    f = schema.num_sparse + schema.num_dense
    i = f * d
    params = schema.num_dense * d  # the dense fields' vectors w_j
    if cfg.emb_layernorm:
        params += 2 * f * d
    if cfg.model_type == "serial":
        dims = (i, *cfg.dnn_hidden_units)
        shapes = list(zip(dims[:-1], dims[1:], strict=True))
    else:
        shapes = [(i, cfg.parallel_block_dim)] * cfg.parallel_num_blocks
    mask = hidden = 0.0
    for z, o in shapes:
        p, m, h = _mask_block(i, z, o, cfg)
        params, mask, hidden = params + p, mask + m, hidden + h
    parts = [("mask", mask), ("mask_block_linear", hidden)]
    if cfg.model_type == "serial":
        logit_in = cfg.dnn_hidden_units[-1]
    else:
        width = cfg.parallel_num_blocks * cfg.parallel_block_dim
        logit_in = width
        if cfg.dnn_hidden_units:
            params += mlp_params(width, cfg.dnn_hidden_units)
            parts.append(("mlp", mlp_flops(width, cfg.dnn_hidden_units)))
            logit_in = cfg.dnn_hidden_units[-1]
    params += mlp_params(logit_in, (1,))
    parts.append(("logit", mlp_flops(logit_in, (1,))))
    return DenseCount(params, parts, d)
