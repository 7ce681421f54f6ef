"""The Wukong network (Zhang et al., ICML 2024, "Wukong: Towards a Scaling Law for Large-Scale
Recommendation").

    X_0     = concat(dense embeddings, sparse embeddings)                      [B, E_0, D]
    X_{i+1} = LN(concat(FMB_i(X_i), LCB_i(X_i)) + residual_i(X_i))             [B, M + C, D]
    FMB(X)  = reshape(MLP(LN(flatten(X (Xᵀ Y)))))      optimized FM, Y: [E, K] [B, M, D]
    LCB(X)  = W_L X                                    W_L: [C, E]             [B, C, D]
    logit   = top MLP(flatten(X_l))                                            [B]

``residual_i`` is the identity when E == M + C and otherwise a linear map over the embedding
axis (W_R: [M + C, E]). LN is over each embedding's d values by default (``layer_norm``).

Dimension glossary: ``B`` batch, ``N`` dense features, ``F`` sparse features, ``H`` bag slots,
``D`` embedding dim (d), ``K`` FM rank (k), ``L`` layers (l), ``E`` embeddings entering a layer
(the paper's n), ``M`` FMB outputs (n_F), ``C`` LCB outputs (n_L), ``O`` = M + C embeddings
leaving a layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from data.batch import Schema
from recscale import sharding
from recscale.config import KernelConfig
from recscale.embeddings.family_model import FamilyModel
from recscale.embeddings.layout import EngineSpec
from recscale.kernels.fm_interaction import api as fm_interaction_api
from recscale.nn import MLP, LayerNorm, scan_stacked, stacked
from wukong.config import WukongModelConfig


def _glorot(rngs: nnx.Rngs, shape: tuple[int, int]) -> jax.Array:
    # Same scale as recscale.nn.Linear's kernels: N(0, 2 / (fan_in + fan_out)).
    return (2.0 / sum(shape)) ** 0.5 * jax.random.normal(rngs.params(), shape, jnp.float32)


def _fold(key: jax.Array | None, i: int) -> jax.Array | None:
    return None if key is None else jax.random.fold_in(key, i)


class FactorizationMachineBlock(nnx.Module):
    """FMB: optimized FM X (Xᵀ Y) -> flatten -> LN -> MLP -> n_F embeddings."""

    def __init__(self, num_in: int, cfg: WukongModelConfig, *, impl: str = "auto", rngs: nnx.Rngs):
        """``impl``: the FM core's kernel (``KernelConfig.fm_interaction``)."""
        self.num_in, self.num_out = num_in, cfg.n_fmb
        self.impl = nnx.static(impl)
        self.rank, self.dim = cfg.fmb_rank, cfg.embed_dim
        self.attentive = cfg.fmb_projection == "attentive"
        if self.attentive:
            self.projection = None
            self.attention = MLP(
                num_in * cfg.embed_dim,
                (*cfg.attentive_mlp, num_in * cfg.fmb_rank),
                final_relu=False,
                rngs=rngs,
            )
        else:
            self.projection = sharding.param(
                nnx.Param, _glorot(rngs, (num_in, cfg.fmb_rank)), "feature", None
            )
            self.attention = None
        self.norm = LayerNorm(num_in * cfg.fmb_rank)
        self.mlp = MLP(
            num_in * cfg.fmb_rank,
            (*(cfg.fmb_mlp_width,) * cfg.fmb_mlp_depth, cfg.n_fmb * cfg.embed_dim),
            final_relu=False,
            dropout=cfg.fmb_dropout,
            batch_norm=cfg.batch_norm,
            rngs=rngs,
        )

    def projection_y(self, x_bed: jax.Array) -> jax.Array:
        """Y: ``[E, K]`` (learned) or ``[B, E, K]`` (attentive, a function of each example's X)."""
        if not self.attentive:
            return self.projection[...]
        b = x_bed.shape[0]
        return self.attention(x_bed.reshape(b, -1)).reshape(b, self.num_in, self.rank)

    def interact(self, x_bed: jax.Array) -> jax.Array:
        """The optimized FM X (Xᵀ Y): ``[B, E, K]``, never forming the ``[B, E, E]`` X Xᵀ."""
        return fm_interaction_api.fm_interaction(x_bed, self.projection_y(x_bed), impl=self.impl)

    def __call__(self, x_bed: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        b = x_bed.shape[0]
        fm_bek = self.interact(x_bed)
        h_b_ek = self.norm(fm_bek.reshape(b, -1))
        out_b_md = self.mlp(h_b_ek, dropout_key=dropout_key)
        return out_b_md.reshape(b, self.num_out, self.dim)


class WukongLayer(nnx.Module):
    """X -> LN(concat(FMB(X), LCB(X)) + residual(X)): ``[B, E, D] -> [B, M + C, D]``."""

    def __init__(
        self,
        num_in: int,
        cfg: WukongModelConfig,
        *,
        kernels: KernelConfig | None = None,
        rngs: nnx.Rngs,
    ):
        self.num_in, self.num_out = num_in, cfg.n_fmb + cfg.n_lcb
        self.fmb = (
            FactorizationMachineBlock(
                num_in, cfg, impl=(kernels or KernelConfig()).fm_interaction, rngs=rngs
            )
            if cfg.n_fmb
            else None
        )
        # LCB weight W_L [C, E]: each output embedding is a linear recombination of the inputs.
        self.lcb = (
            sharding.param(nnx.Param, _glorot(rngs, (cfg.n_lcb, num_in)), None, "feature")
            if cfg.n_lcb
            else None
        )
        # The residual is the identity when the embedding count is unchanged, else W_R [O, E].
        self.residual = (
            sharding.param(nnx.Param, _glorot(rngs, (self.num_out, num_in)), None, "feature")
            if num_in != self.num_out
            else None
        )
        self.flat_norm = cfg.layer_norm == "flattened"
        self.norm = LayerNorm(self.num_out * cfg.embed_dim if self.flat_norm else cfg.embed_dim)

    def __call__(self, x_bed: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        parts = []
        if self.fmb is not None:
            parts.append(self.fmb(x_bed, dropout_key=dropout_key))  # [B, M, D]
        if self.lcb is not None:
            parts.append(jnp.einsum("ce,bed->bcd", self.lcb[...], x_bed))  # [B, C, D]
        y_bod = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        if self.residual is None:
            y_bod = y_bod + x_bed
        else:
            y_bod = y_bod + jnp.einsum("oe,bed->bod", self.residual[...], x_bed)
        if self.flat_norm:
            b, o, d = y_bod.shape
            y_bod = self.norm(y_bod.reshape(b, o * d)).reshape(b, o, d)
        else:
            y_bod = self.norm(y_bod)
        return sharding.constrain(y_bod, "batch", None, None)


class Wukong(FamilyModel):
    def build_layers(
        self, cfg: WukongModelConfig, schema: Schema, *, engine: EngineSpec | None, rngs: nnx.Rngs
    ) -> None:
        kernels = self.kernels
        self.num_dense_emb = cfg.dense_embeddings(schema)
        if self.num_dense_emb:
            self.dense = MLP(
                schema.num_dense,
                (*cfg.dense_mlp, self.num_dense_emb * cfg.embed_dim),
                final_relu=False,
                rngs=rngs,
            )
        else:
            self.dense = None
        num_in = schema.num_sparse + self.num_dense_emb
        layers = [WukongLayer(num_in, cfg, kernels=kernels, rngs=rngs)]
        num_in = cfg.n_fmb + cfg.n_lcb
        stack = None
        if cfg.scan_layers and cfg.num_layers > 1:
            stack = stacked(
                lambda r: WukongLayer(num_in, cfg, kernels=kernels, rngs=r),
                cfg.num_layers - 1,
                rngs,
            )
        else:
            for _ in range(cfg.num_layers - 1):
                layers.append(WukongLayer(num_in, cfg, kernels=kernels, rngs=rngs))
        self.layers = nnx.List(layers)
        self.stack = stack
        self.top = MLP(
            num_in * cfg.embed_dim,
            cfg.top_mlp,
            final_relu=False,
            dropout=cfg.dropout,
            batch_norm=cfg.batch_norm,
            rngs=rngs,
        )

    def embed(self, dense_bn: jax.Array, ids_bfh: jax.Array) -> jax.Array:
        """X_0: dense embeddings then one pooled embedding per sparse feature, ``[B, E_0, D]``."""
        emb_bfd = self.embeddings(ids_bfh)
        if self.dense is None:
            return emb_bfd
        b = dense_bn.shape[0]
        dense_bnd = self.dense(dense_bn).reshape(b, self.num_dense_emb, self.cfg.embed_dim)
        return jnp.concatenate([dense_bnd, emb_bfd], axis=1)

    def __call__(
        self, dense_bn: jax.Array, ids_bfh: jax.Array, *, dropout_key: jax.Array | None = None
    ) -> jax.Array:
        """Logits ``[B]``."""
        x_bed = sharding.constrain(self.embed(dense_bn, ids_bfh), "batch", None, None)
        for i, layer in enumerate(self.layers):
            x_bed = layer(x_bed, dropout_key=_fold(dropout_key, i))
        if self.stack is not None:  # layers 2..l, the key each would have unrolled
            x_bed = scan_stacked(
                self.stack,
                x_bed,
                lambda layer, x, i: layer(x, dropout_key=_fold(dropout_key, i)),
                first=len(self.layers),
            )
        x_b_ed = sharding.constrain(x_bed.reshape(x_bed.shape[0], -1), "batch", None)
        return self.top(x_b_ed, dropout_key=_fold(dropout_key, self.cfg.num_layers))[:, 0]


def build_model(cfg, schema: Schema, rngs: nnx.Rngs) -> Wukong:
    """Trainer hook: the Wukong of a WukongConfig for a dataset schema."""
    return Wukong.from_config(cfg, schema, rngs)
