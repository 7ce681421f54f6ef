"""Analytic parameters and FLOPs **per token** of HSTU, SASRec and the bag baseline (no jax
import).

The conventions are ``recscale.flops``'s, with the token as the example: matmul FLOPs only, 2
per multiply-add; backward = 2 × forward plus the item table's gradient scatter (``D`` adds per
row a token reads); ``train_flops = forward + backward = 3 × forward + scatter``. Attention is
counted as ``recscale.flops.causal_attention_flops``: the causal half of a sequence of
``seq_len`` tokens (default ``max_seq_len``). LayerNorms, SiLU, softmax, dropout, the
embedding scale and the positional add are not counted. Sparse parameters are the item table's
``V · D`` (row 0, padding, is never read); dense parameters are every other one, the positional
embedding ``[N, D]`` included.

The loss head (``loss``, a ``LossConfig``; None: no head) adds per token: sampled softmax
``2·D·(K + 1)`` (the positive's dot and the token's row of the ``[T, D] × [D, K]`` shared
negatives), full softmax ``2·D·V``, BCE ``2·D·2``. Per-batch costs are not counted: reading the
K shared negatives (or the whole table for the full softmax) and scattering their gradients.
``embedding_bytes_read`` is per token: its input row and the loss's per-token rows (the
positive; BCE's negative too).

HSTU, per layer (``H`` heads, ``d_qk``, ``d_v``): ``f1`` ``2·D·H·(2 d_v + 2 d_qk)``, attention,
``f2`` ``2·H·d_v·D``. SASRec, per block (``d_h = D / H``, FFN width ``F``): Q, K, V ``3 · 2·D²``,
attention ``2·H·(2 d_h)·(n + 1)/2 = 2·D·(n + 1)``, FFN ``2 · 2·D·F``. The bag (``L`` hidden
layers of width ``F``): its top MLP ``2·D·F + (L - 1)·2·F² + 2·F·D``; the prefix mean of the
item rows is a sum, not counted (``recscale.flops``' embedding pooling), and it has no
positional embedding.
"""

from __future__ import annotations

from typing import Any

from recscale.flops import ModelCost, causal_attention_flops


def loss_head(loss: Any, d: int, n_items: int) -> tuple[float, int]:
    """``(forward FLOPs per token, item rows read per token)`` of a ``LossConfig``'s head."""
    if loss is None:
        return 0.0, 0
    if loss.kind == "sampled_softmax":
        return 2.0 * d * (loss.num_negatives + 1), 1
    if loss.kind == "full_softmax":
        return 2.0 * d * n_items, 0
    return 2.0 * d * 2, 2


def _assemble(
    cfg: Any, dense: int, parts: list[tuple[str, float]], loss: Any, bytes_per_param: int
) -> ModelCost:
    d = cfg.d_model
    head, rows = loss_head(loss, d, cfg.n_items)
    if loss is not None:
        parts = [*parts, ("loss_head", head)]
    forward = float(sum(f for _, f in parts))
    rows += 1  # the token's own input row
    return ModelCost(
        dense_params=dense,
        sparse_params=cfg.n_items * d,
        forward_flops=forward,
        backward_flops=2.0 * forward + rows * d,
        embedding_bytes_read=float(rows * d * bytes_per_param),
        components=tuple(parts),
    )


def hstu_cost(
    cfg: Any, *, seq_len: float | None = None, loss: Any = None, bytes_per_param: int = 4
) -> ModelCost:
    """Costs per token of ``sequential.hstu.model.HSTU`` built from an ``HSTUConfig`` ``cfg``, for
    sequences of ``seq_len`` tokens (None: ``max_seq_len``)."""
    d, h, n_layers = cfg.d_model, cfg.num_heads, cfg.num_layers
    n = float(cfg.max_seq_len if seq_len is None else seq_len)
    uvqk = h * (2 * cfg.d_v + 2 * cfg.d_qk)
    bias_rows = (h if cfg.bias_per_head else 1) if cfg.num_buckets else 0
    per_layer = d * uvqk + (h * cfg.d_v * d + d) + bias_rows * cfg.num_buckets
    dense = n_layers * per_layer + cfg.max_seq_len * d
    parts = [
        ("uvqk", n_layers * 2.0 * d * uvqk),
        ("attention", n_layers * causal_attention_flops(n, h, cfg.d_qk, cfg.d_v)),
        ("output", n_layers * 2.0 * h * cfg.d_v * d),
    ]
    return _assemble(cfg, dense, parts, loss, bytes_per_param)


def sasrec_cost(
    cfg: Any, *, seq_len: float | None = None, loss: Any = None, bytes_per_param: int = 4
) -> ModelCost:
    """Costs per token of ``sequential.sasrec.model.SASRec`` built from a ``SASRecConfig`` ``cfg``,
    for sequences of ``seq_len`` tokens (None: ``max_seq_len``)."""
    d, h, n_layers, f = cfg.d_model, cfg.num_heads, cfg.num_layers, cfg.ffn_width
    n = float(cfg.max_seq_len if seq_len is None else seq_len)
    # Q, K, V (kernels and biases), two LayerNorms, the FFN's two layers; then the final LN.
    per_block = 3 * (d * d + d) + 2 * (2 * d) + (d * f + f) + (f * d + d)
    dense = n_layers * per_block + 2 * d + cfg.max_seq_len * d
    parts = [
        ("qkv", n_layers * 3 * 2.0 * d * d),
        ("attention", n_layers * causal_attention_flops(n, h, d // h, d // h)),
        ("ffn", n_layers * 2 * 2.0 * d * f),
    ]
    return _assemble(cfg, dense, parts, loss, bytes_per_param)


def bag_cost(
    cfg: Any, *, seq_len: float | None = None, loss: Any = None, bytes_per_param: int = 4
) -> ModelCost:
    """Costs per token of ``sequential.bag.model.Bag`` built from a ``BagConfig`` ``cfg`` (the
    same for every ``seq_len``: a token's bag is a running sum)."""
    del seq_len
    d, f, n_layers = cfg.d_model, cfg.hidden_width, cfg.num_layers
    widths = [d] + [f] * n_layers + [d]
    pairs = list(zip(widths[:-1], widths[1:], strict=True))
    dense = sum(a * b + b for a, b in pairs)
    parts = [("mlp", float(sum(2.0 * a * b for a, b in pairs)))]
    return _assemble(cfg, dense, parts, loss, bytes_per_param)
