"""Analytic parameter, FLOP and embedding-traffic accounting per example (no jax import).

Pure Python functions of (model config, Schema), so sweeps and planners can size a run without
building the model. ``tests/recscale/test_flops.py`` checks the parameter counts against the real
models' nnx parameters and the forward FLOPs against XLA's ``cost_analysis()``.

Conventions (what is counted, and how):

* **FLOPs are matmul/einsum FLOPs only, 2 per multiply-add** (the MLPerf and Wukong-paper
  convention). Bias adds, activations, LayerNorms, dropout, the embedding pooling sums and the
  final reshapes/concats are not counted; XLA's count of the same forward is therefore a little
  higher (see the test for the measured gap).
* **Count what XLA executes, not the minimum.** DLRM's dot interaction is the einsum
  ``X·Xᵀ`` over all n×n pairs (``2·n·n·d`` per example) although only the lower triangle is kept.
  Wukong's optimized FM is two einsums, ``XᵀY`` (d×E×k) and ``X·(XᵀY)`` (E×d×k), ``2·E·d·k``
  each; its attentive variant adds the MLP that computes Y.
* **Backward = 2 × forward for all dense compute** (each matmul has an input-gradient and a
  weight-gradient matmul of the same size; the parameter-free interaction einsums have two
  operand gradients of the same size), **plus the embeddings' backward, counted as the scatter
  of each pooled gradient into its rows**: ``hotness · d`` adds (1 FLOP each) per feature.
  Optimizer updates are not counted. ``train_flops = forward_flops + backward_flops``.
* **Attention is counted over the causal half of a sequence's own length**
  (:func:`causal_attention_flops`, for the sequential models of ``sequential/``), an exception
  to the rule above: their XLA paths form every pair of the padded sequence.
* **Sparse parameters are logical rows × dim**: ``vocab_size · embed_dim`` per table, excluding
  the padding rows the tables are stored with (``sharding.padded_rows``), which are never read.
  Dense parameters are every other parameter (MLP kernels and biases, LayerNorm scales and
  biases, FM projections, LCB and residual weights).
* **Embedding bytes read per example** = Σ_features (rows pooled per example) · d · bytes per
  element, where rows pooled is the feature's ``max_hotness`` (an upper bound: every bag full)
  unless a mean pooling factor is given (``mean_hotness``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from data.batch import Schema


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelCost:
    """Parameters and per-example costs of one model on one schema (see the module docstring)."""

    dense_params: int
    """Every parameter that is not an embedding table (MLPs, LayerNorms, FM/LCB/residual)."""
    sparse_params: int
    """Embedding table parameters: logical rows × dim (padding rows excluded)."""
    forward_flops: float
    """Forward matmul FLOPs per example, 2 per multiply-add."""
    backward_flops: float
    """Backward FLOPs per example: 2 × forward (dense) + the embedding gradient scatter."""
    embedding_bytes_read: float
    """Embedding bytes read per example in the forward pass."""
    components: tuple[tuple[str, float], ...] = ()
    """Forward FLOPs per example by part, ``(name, flops)``; they sum to ``forward_flops``."""

    @property
    def params(self) -> int:
        return self.dense_params + self.sparse_params

    @property
    def train_flops(self) -> float:
        """Forward + backward FLOPs per example."""
        return self.forward_flops + self.backward_flops


def mlp_params(
    in_dim: int,
    sizes: Sequence[int],
    *,
    layer_norm: bool = False,
    batch_norm: bool = False,
    final_relu: bool = False,
) -> int:
    """Parameters of ``recscale.nn.MLP``: kernels, biases, and the scale and bias of a LayerNorm
    or BatchNorm per layer followed by a ReLU (BatchNorm's running statistics are state, not
    parameters)."""
    dims = (in_dim, *sizes)
    n = sum(a * b + b for a, b in zip(dims[:-1], dims[1:], strict=True))
    if layer_norm or batch_norm:
        n += sum(2 * b for b in (sizes if final_relu else sizes[:-1]))
    return n


def mlp_flops(in_dim: int, sizes: Sequence[int]) -> float:
    """Forward matmul FLOPs of ``recscale.nn.MLP`` per example (2 per multiply-add)."""
    dims = (in_dim, *sizes)
    return float(sum(2 * a * b for a, b in zip(dims[:-1], dims[1:], strict=True)))


def causal_attention_flops(seq_len: float, heads: int, d_qk: int, d_v: int) -> float:
    """Forward FLOPs per token of causal self-attention within a sequence of ``seq_len``
    tokens, 2 per multiply-add: the scores ``q·k`` and the weighted sum of values over the
    ``(n + 1) / 2`` keys a token sees on average, i.e. ``2 · H · (d_qk + d_v) · (n + 1) / 2``.

    **The causal half, of the sequence's own length** (``n(n+1)/2`` query-key pairs of its
    ``n²``), the convention of the scaling literature for decoder attention and what the block
    kernels execute up to their block granularity; an exception to this module's "count what
    XLA executes": the XLA paths (``hstu_attention``'s reference, SASRec's padded attention)
    form every pair of the sequence padded to ``N``, ``2N / (n + 1)`` times as many. Softmax or
    SiLU, masks, biases and scales are not counted. For a batch of jagged lengths, the per-token
    mean is ``Σ_b n_b · f(n_b) / Σ_b n_b`` (``f`` this function)."""
    return 2.0 * heads * (d_qk + d_v) * (seq_len + 1.0) / 2.0


def _hotness(schema: Schema, mean_hotness: float | Sequence[float] | None) -> list[float]:
    if mean_hotness is None:
        return [float(f.max_hotness) for f in schema.features]
    if isinstance(mean_hotness, (int, float)):
        return [float(mean_hotness)] * schema.num_sparse
    if len(mean_hotness) != schema.num_sparse:
        raise ValueError(
            f"mean_hotness has {len(mean_hotness)} entries for {schema.num_sparse} features"
        )
    return [float(h) for h in mean_hotness]


def _embedding_costs(
    schema: Schema, dim: int, mean_hotness: float | Sequence[float] | None, bytes_per_param: int
) -> tuple[int, float, float]:
    """(sparse params, bytes read per example, backward scatter FLOPs per example)."""
    rows = sum({f.table_name: f.vocab_size for f in schema.features}.values())  # shared once
    pooled = sum(_hotness(schema, mean_hotness))
    return rows * dim, pooled * dim * bytes_per_param, pooled * dim


def assemble_cost(
    dense_params: int,
    components: list[tuple[str, float]],
    schema: Schema,
    dim: int,
    mean_hotness: float | Sequence[float] | None,
    bytes_per_param: int,
) -> ModelCost:
    sparse, bytes_read, scatter = _embedding_costs(schema, dim, mean_hotness, bytes_per_param)
    forward = float(sum(f for _, f in components))
    return ModelCost(
        dense_params=dense_params,
        sparse_params=sparse,
        forward_flops=forward,
        backward_flops=2.0 * forward + scatter,
        embedding_bytes_read=bytes_read,
        components=tuple(components),
    )


@dataclasses.dataclass(frozen=True)
class DenseCount:
    """What a family's counting function adds up for one network on one schema."""

    params: int
    """Dense parameters (every parameter but the embedding tables)."""
    components: list[tuple[str, float]]
    """Forward FLOPs per example by part, ``(name, flops)``."""
    dim: int
    """The embedding dimension of its tables."""
    reread: tuple[int, ...] = ()
    """Features whose ids a second table of the model reads again (FinalMLP's gate contexts):
    each adds a table of that feature's rows, its reads and its gradient scatter."""


def family_cost(count: Callable[[Any, Schema], DenseCount]) -> Callable[..., ModelCost]:
    """A family's cost function, ``(cfg, schema, *, mean_hotness=None, bytes_per_param=4) ->
    ModelCost``, from ``count(cfg, schema)``, its network's dense parameters and FLOPs; the
    embedding tables' share (``assemble_cost``) is added here, once for every family."""

    def cost(
        cfg: Any,
        schema: Schema,
        *,
        mean_hotness: float | Sequence[float] | None = None,
        bytes_per_param: int = 4,
    ) -> ModelCost:
        counted = count(cfg, schema)
        if counted.reread:
            extra = counted.reread
            features = schema.features + tuple(
                dataclasses.replace(schema.features[f], name=f"fs/{n}/{schema.features[f].name}")
                for n, f in enumerate(extra)
            )
            if mean_hotness is not None and not isinstance(mean_hotness, (int, float)):
                if len(mean_hotness) != schema.num_sparse:
                    raise ValueError(
                        f"mean_hotness has {len(mean_hotness)} entries for {schema.num_sparse} "
                        "features"
                    )
                mean_hotness = [*mean_hotness, *(mean_hotness[f] for f in extra)]
            schema = Schema(dense_names=schema.dense_names, features=features)
        return assemble_cost(
            counted.params, counted.components, schema, counted.dim, mean_hotness, bytes_per_param
        )

    cost.__name__, cost.__qualname__ = count.__name__, count.__qualname__
    cost.__doc__, cost.__module__ = count.__doc__, count.__module__
    return cost


@family_cost
def dlrm_cost(cfg: Any, schema: Schema) -> DenseCount:
    """Costs of ``dlrm.model.DLRM`` built from a ``DLRMModelConfig`` ``cfg`` for ``schema``."""
    d = cfg.embed_dim
    has_dense = schema.num_dense > 0
    params, parts = 0, []
    cfg.check_data(schema)
    if has_dense:
        params += mlp_params(schema.num_dense, cfg.bottom_mlp)
        parts.append(("bottom_mlp", mlp_flops(schema.num_dense, cfg.bottom_mlp)))
    n = schema.num_sparse + int(has_dense)
    if cfg.interaction == "cat":
        top_in = n * d
    else:
        # The einsum X·Xᵀ forms all n×n dots; only the lower triangle feeds the top MLP.
        parts.append(("interaction", 2.0 * n * n * d))
        pairs = n * (n + 1) // 2 if cfg.self_interaction else n * (n - 1) // 2
        top_in = pairs + (n * d if cfg.dot_concat == "all" else (d if has_dense else 0))
    params += mlp_params(top_in, cfg.top_mlp, layer_norm=cfg.layer_norm, batch_norm=cfg.batch_norm)
    parts.append(("top_mlp", mlp_flops(top_in, cfg.top_mlp)))
    return DenseCount(params, parts, d)


@family_cost
def wukong_cost(cfg: Any, schema: Schema) -> DenseCount:
    """Costs of ``wukong.model.Wukong`` built from a ``WukongModelConfig`` ``cfg`` for ``schema``."""
    d, k = cfg.embed_dim, cfg.fmb_rank
    m, c = cfg.n_fmb, cfg.n_lcb
    o = m + c
    params, parts = 0, []
    nde = cfg.dense_embeddings(schema)
    if nde:
        sizes = (*cfg.dense_mlp, nde * d)
        params += mlp_params(schema.num_dense, sizes)
        parts.append(("dense_mlp", mlp_flops(schema.num_dense, sizes)))
    e = schema.num_sparse + nde
    fm = mlp_ = lcb = res = 0.0
    for _ in range(cfg.num_layers):
        if m:
            if cfg.fmb_projection == "attentive":
                att = (*cfg.attentive_mlp, e * k)
                params += mlp_params(e * d, att)
                fm += mlp_flops(e * d, att)
            else:
                params += e * k  # Y [E, K]
            fm += 2.0 * (2 * e * d * k)  # XᵀY then X·(XᵀY)
            params += 2 * e * k  # LN over the flattened [E·K]
            fmb = (*(cfg.fmb_mlp_width,) * cfg.fmb_mlp_depth, m * d)
            params += mlp_params(e * k, fmb, batch_norm=cfg.batch_norm)
            mlp_ += mlp_flops(e * k, fmb)
        if c:
            params += c * e
            lcb += 2.0 * c * e * d
        if e != o:
            params += o * e
            res += 2.0 * o * e * d
        params += 2 * (o * d if cfg.layer_norm == "flattened" else d)
        e = o
    parts += [("fmb_interaction", fm), ("fmb_mlp", mlp_), ("lcb", lcb), ("residual", res)]
    params += mlp_params(e * d, cfg.top_mlp, batch_norm=cfg.batch_norm)
    parts.append(("top_mlp", mlp_flops(e * d, cfg.top_mlp)))
    return DenseCount(params, parts, d)


def model_cost(cfg: Any, schema: Schema, **options: Any) -> ModelCost:
    """Costs of a whole run's model: ``cfg.model.cost(schema, **options)``.

    Every model config of the project (DLRM, Wukong, the baselines) has a ``cost`` method that
    calls its family's counting function, so ``recscale`` never imports a model package.
    ``options`` are the cost function's (:func:`family_cost`): ``mean_hotness``,
    ``bytes_per_param``.
    """
    cost = getattr(cfg.model, "cost", None)
    if cost is None:
        raise TypeError(f"no cost model for {type(cfg.model).__name__}: it has no cost() method")
    return cost(schema, **options)


def table(costs: dict[str, ModelCost]) -> str:
    """A plain-text table of named costs (params in millions, FLOPs in MFLOP per example)."""
    lines = [
        f"{'model':<26}{'dense M':>10}{'sparse M':>12}{'fwd MFLOP':>12}{'train MFLOP':>13}{'emb KB':>9}"
    ]
    for name, cst in costs.items():
        lines.append(
            f"{name:<26}{cst.dense_params / 1e6:>10.3f}{cst.sparse_params / 1e6:>12.1f}"
            f"{cst.forward_flops / 1e6:>12.3f}{cst.train_flops / 1e6:>13.3f}"
            f"{cst.embedding_bytes_read / 1e3:>9.2f}"
        )
    return "\n".join(lines)
