"""The FinalMLP network (Mao et al., AAAI 2023, "FinalMLP: An Enhanced Two-Stream MLP Model
for CTR Prediction"), following FuxiCTR's ``model_zoo/FinalMLP`` (the authors' code).

    x      = concat(dense, flatten(sparse embeddings))                          [B, I]
    g_k    = 2 · sigmoid(MLP_fs,k(c_k))      c_k: context embeddings or a learned vector
    o_k    = MLP_k(x ⊙ g_k)                  k = 1, 2 (x itself when use_fs is False)
    logit  = w_1ᵀ o_1 + b_1 + w_2ᵀ o_2 + b_2 + Σ_h o_1hᵀ W_h o_2h           [B]

Feature selection (the paper's "stream-specific feature gating"): each stream has its own gate
MLP (ReLU hidden layers, sigmoid output of width I, times 2 so that a fresh gate is about 1).
Its context c_k is the flattened embeddings of the features named in ``fs{k}_context``, looked
up in tables of the gate's own (FuxiCTR builds a separate ``FeatureEmbedding`` for them), or,
when none is named, a learned vector of size D initialised to zero (FuxiCTR's ``fs{k}_ctx_bias``),
which is the same for every example, so its gate is computed once per batch.

Fusion (the paper's multi-head bilinear fusion, FuxiCTR's ``InteractionAggregation`` with
``output_dim=1``): o_1 and o_2 are split into K contiguous chunks o_1h, o_2h; the bilinear terms
o_1hᵀ W_h o_2h are summed over heads, while the linear terms read the whole vectors (the paper's
per-head w_1hᵀ o_1h summed over heads is the same thing), and the two biases (one per linear
layer, zero-initialised) are added once, not per head. W_h is stored as ``[K, X/K, Y/K]``, the
row-major view of FuxiCTR's ``w_xy`` of ``[K · X/K · Y/K, 1]``, with its Xavier-normal std.

Streams are FuxiCTR's ``MLP_Block`` with no output layer: every hidden layer, the last
included, is Linear -> [BatchNorm] -> ReLU -> dropout (LayerNorm may replace BatchNorm). As in
recscale.nn, a call with a ``dropout_key`` is a training call: dropout on, BatchNorm on the
batch's statistics (updating its running ones).

Dimension glossary: ``B`` batch, ``N`` dense features, ``F`` sparse features, ``H`` bag slots,
``D`` embedding dim, ``I`` width of x (N + F * D), ``C`` context features of a gate, ``X`` and
``Y`` widths of o_1 and o_2, ``K`` fusion heads (head-split shapes ``[B, K, X/K]`` are written
``bkx``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from baselines.finalmlp.config import FinalMLPModelConfig
from data.batch import Schema
from recscale import sharding
from recscale.embeddings import EmbeddingCollection
from recscale.embeddings.family_model import FamilyModel
from recscale.embeddings.layout import EngineSpec
from recscale.nn import MLP


class Stream(nnx.Module):
    """Linear -> [BatchNorm | LayerNorm] -> ReLU -> dropout for every hidden layer, the last
    included."""

    def __init__(
        self,
        in_dim: int,
        sizes: tuple[int, ...],
        *,
        dropout: float,
        batch_norm: bool = False,
        layer_norm: bool = False,
        scan: bool = False,
        rngs: nnx.Rngs,
    ):
        # final_relu: every layer, the last included, is normalised, activated and dropped out.
        self.mlp = MLP(
            in_dim,
            sizes,
            final_relu=True,
            dropout=dropout,
            batch_norm=batch_norm,
            layer_norm=layer_norm,
            scan=scan,
            rngs=rngs,
        )

    def __call__(self, x_bi: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        """``[B, sizes[-1]]``; training mode (dropout, BatchNorm on batch statistics) when a
        ``dropout_key`` is passed."""
        return sharding.constrain(self.mlp(x_bi, dropout_key=dropout_key), "batch", None)


class FeatureGate(nnx.Module):
    """One stream's feature selection gate: ``2 · sigmoid(MLP(context))``, ``[B, I]``."""

    def __init__(
        self,
        out_dim: int,
        schema: Schema,
        context: tuple[str, ...],
        cfg: FinalMLPModelConfig,
        *,
        engine: EngineSpec | None = None,
        rngs: nnx.Rngs,
    ):
        d = cfg.embed_dim
        names = [f.name for f in schema.features]
        unknown = [c for c in context if c not in names]
        if unknown:
            raise ValueError(f"gate context names unknown features {unknown}; known: {names}")
        index = tuple(names.index(c) for c in context)
        self.context_index = nnx.static(index)
        if context:
            sub = Schema(dense_names=(), features=tuple(schema.features[i] for i in index))
            self.context = EmbeddingCollection.for_model(cfg, sub, rngs=rngs, engine=engine)
            self.context_vector = None
        else:
            self.context = None
            self.context_vector = sharding.param(nnx.Param, jnp.zeros((d,), jnp.float32), "embed")
        self.mlp = MLP(
            d * max(1, len(context)), (*cfg.fs_hidden_units, out_dim), final_relu=False, rngs=rngs
        )

    def __call__(self, ids_bfh: jax.Array) -> jax.Array:
        b = ids_bfh.shape[0]
        if self.context is not None:
            ctx_bcd = self.context(ids_bfh[:, list(self.context_index)])
            return 2.0 * jax.nn.sigmoid(self.mlp(ctx_bcd.reshape(b, -1)))
        # A learned context is the same for every example: one gate row, broadcast.
        gate_1i = 2.0 * jax.nn.sigmoid(self.mlp(self.context_vector[...][None, :]))
        return jnp.broadcast_to(gate_1i, (b, gate_1i.shape[1]))


class InteractionAggregation(nnx.Module):
    """Multi-head bilinear fusion of ``o_1`` [B, X] and ``o_2`` [B, Y] into a logit [B]."""

    def __init__(self, x_dim: int, y_dim: int, num_heads: int, *, rngs: nnx.Rngs):
        if x_dim % num_heads or y_dim % num_heads:
            raise ValueError(
                f"num_heads={num_heads} must divide both stream widths, got {x_dim} and {y_dim}"
            )
        self.num_heads = num_heads
        kx, ky = x_dim // num_heads, y_dim // num_heads

        def normal(std: float, shape: tuple[int, ...]) -> jax.Array:
            return std * jax.random.normal(rngs.params(), shape, jnp.float32)

        # FuxiCTR: Xavier-normal kernels (std sqrt(2 / (fan_in + fan_out))), zero biases.
        self.x_kernel = sharding.param(
            nnx.Param, normal((2.0 / (x_dim + 1)) ** 0.5, (x_dim, 1)), None, None
        )
        self.x_bias = sharding.param(nnx.Param, jnp.zeros((1,), jnp.float32), None)
        self.y_kernel = sharding.param(
            nnx.Param, normal((2.0 / (y_dim + 1)) ** 0.5, (y_dim, 1)), None, None
        )
        self.y_bias = sharding.param(nnx.Param, jnp.zeros((1,), jnp.float32), None)
        # w_xy of [K · X/K · Y/K, 1]: fan_in 1, fan_out K · X/K · Y/K.
        std_xy = (2.0 / (num_heads * kx * ky + 1)) ** 0.5
        self.xy_kernel = sharding.param(
            nnx.Param, normal(std_xy, (num_heads, kx, ky)), None, None, None
        )

    def __call__(self, o1_bx: jax.Array, o2_by: jax.Array) -> jax.Array:
        b, k = o1_bx.shape[0], self.num_heads
        linear_b1 = (o1_bx @ self.x_kernel[...] + self.x_bias[...]) + (
            o2_by @ self.y_kernel[...] + self.y_bias[...]
        )
        o1_bkx = o1_bx.reshape(b, k, -1)  # contiguous chunks, as torch's view(-1, K, X/K)
        o2_bky = o2_by.reshape(b, k, -1)
        t_bky = jnp.einsum("bkx,kxy->bky", o1_bkx, self.xy_kernel[...])
        bilinear_b = jnp.einsum("bky,bky->b", t_bky, o2_bky)  # summed over heads
        return linear_b1[:, 0] + bilinear_b


class FinalMLP(FamilyModel):
    def build_layers(
        self, cfg: FinalMLPModelConfig, schema: Schema, *, engine: EngineSpec | None, rngs: nnx.Rngs
    ) -> None:
        self.in_dim = schema.num_dense + schema.num_sparse * cfg.embed_dim
        if cfg.use_fs:
            self.fs1 = FeatureGate(
                self.in_dim, schema, cfg.fs1_context, cfg, engine=engine, rngs=rngs
            )
            self.fs2 = FeatureGate(
                self.in_dim, schema, cfg.fs2_context, cfg, engine=engine, rngs=rngs
            )
        else:
            self.fs1 = self.fs2 = None
        self.mlp1, self.mlp2 = (
            Stream(
                self.in_dim,
                sizes,
                dropout=p,
                batch_norm=bn,
                layer_norm=ln,
                scan=cfg.scan_layers,
                rngs=rngs,
            )
            for sizes, p, bn, ln in (
                (cfg.mlp1, cfg.mlp1_dropout, cfg.mlp1_batch_norm, cfg.mlp1_layer_norm),
                (cfg.mlp2, cfg.mlp2_dropout, cfg.mlp2_batch_norm, cfg.mlp2_layer_norm),
            )
        )
        self.fusion = InteractionAggregation(cfg.mlp1[-1], cfg.mlp2[-1], cfg.num_heads, rngs=rngs)

    def embed(self, dense_bn: jax.Array, ids_bfh: jax.Array) -> jax.Array:
        """x: the dense features as they are, then the flattened sparse embeddings, ``[B, I]``."""
        emb_bfd = self.embeddings(ids_bfh)
        parts = [emb_bfd.reshape(emb_bfd.shape[0], -1)]
        if dense_bn.shape[-1]:
            parts.insert(0, dense_bn.astype(emb_bfd.dtype))
        x_bi = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        return sharding.constrain(x_bi, "batch", None)

    def gates(self, ids_bfh: jax.Array) -> tuple[jax.Array, jax.Array] | None:
        """The two streams' gates ``2 · sigmoid(...)``, each ``[B, I]`` (None without use_fs)."""
        if self.fs1 is None:
            return None
        return self.fs1(ids_bfh), self.fs2(ids_bfh)

    def streams(
        self, x_bi: jax.Array, ids_bfh: jax.Array, dropout_key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """o_1 ``[B, X]`` and o_2 ``[B, Y]``: each stream's MLP of its gated copy of x."""
        gates = self.gates(ids_bfh)
        x1_bi, x2_bi = (x_bi, x_bi) if gates is None else (x_bi * gates[0], x_bi * gates[1])
        k1, k2 = (
            (None, None)
            if dropout_key is None
            else (jax.random.fold_in(dropout_key, 1), jax.random.fold_in(dropout_key, 2))
        )
        return self.mlp1(x1_bi, dropout_key=k1), self.mlp2(x2_bi, dropout_key=k2)

    def __call__(
        self, dense_bn: jax.Array, ids_bfh: jax.Array, *, dropout_key: jax.Array | None = None
    ) -> jax.Array:
        """Logits ``[B]``."""
        x_bi = self.embed(dense_bn, ids_bfh)
        o1_bx, o2_by = self.streams(x_bi, ids_bfh, dropout_key)
        return self.fusion(o1_bx, o2_by)


def build_model(cfg, schema: Schema, rngs: nnx.Rngs) -> FinalMLP:
    """Trainer hook: the FinalMLP of a FinalMLPConfig for a dataset schema."""
    return FinalMLP.from_config(cfg, schema, rngs)
