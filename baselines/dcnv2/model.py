"""The DCNv2 network (Wang et al., WWW 2021, "DCN V2: Improved Deep & Cross Network and
Practical Lessons for Web-scale Learning to Rank Systems").

    x_0     = concat(dense, flatten(sparse embeddings))                    [B, I]
    x_{l+1} = x_0 ⊙ (x_l W_l + b_l) + x_l       W_l: [I, I] or V_l U_lᵀ   [B, I]
    stacked:  logit = w · deep(x_{L_c}) + b
    parallel: logit = w · concat(x_{L_c}, deep(x_0)) + b

The paper writes the cross layer for column vectors (W x); here rows are examples, so it is
x W. The low-rank W = U Vᵀ (U, V: [I, R]) becomes x V Uᵀ, stored as ``v`` [I, R] and ``u``
[R, I]. The dense features enter x_0 as they are (the paper), or through ``dense_mlp``.

Dimension glossary: ``B`` batch, ``N`` dense features, ``F`` sparse features, ``H`` bag slots,
``D`` embedding dim, ``I`` width of x_0 (N' + F * D, N' = N or the dense MLP's output), ``R``
cross rank, ``L`` cross layers, ``M`` deep MLP output width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from baselines.dcnv2.config import DCNv2ModelConfig
from data.batch import Schema
from recscale import sharding
from recscale.embeddings.family_model import FamilyModel
from recscale.embeddings.layout import EngineSpec
from recscale.nn import MLP, Linear, scan_stacked, stacked


def _glorot(rngs: nnx.Rngs, shape: tuple[int, int]) -> jax.Array:
    # Same scale as recscale.nn.Linear's kernels: N(0, 2 / (fan_in + fan_out)).
    return (2.0 / sum(shape)) ** 0.5 * jax.random.normal(rngs.params(), shape, jnp.float32)


def _fold(key: jax.Array | None, i: int) -> jax.Array | None:
    return None if key is None else jax.random.fold_in(key, i)


class CrossLayer(nnx.Module):
    """x_0 ⊙ (x_l W + b) + x_l, with W full ``[I, I]`` or low-rank ``v @ u`` (``rank`` > 0)."""

    def __init__(self, dim: int, rank: int = 0, *, rngs: nnx.Rngs):
        self.rank = rank
        if rank:
            self.kernel = None
            self.v = sharding.param(nnx.Param, _glorot(rngs, (dim, rank)), None, None)
            self.u = sharding.param(nnx.Param, _glorot(rngs, (rank, dim)), None, "mlp")
        else:
            self.kernel = sharding.param(nnx.Param, _glorot(rngs, (dim, dim)), None, "mlp")
            self.v = self.u = None
        # Zero bias as in the reference implementation: a fresh layer is x_0 ⊙ x_l W + x_l.
        self.bias = sharding.param(nnx.Param, jnp.zeros((dim,), jnp.float32), "mlp")

    def __call__(self, x0_bi: jax.Array, x_bi: jax.Array) -> jax.Array:
        if self.kernel is not None:
            xw_bi = x_bi @ self.kernel[...]
        else:
            xw_bi = (x_bi @ self.v[...]) @ self.u[...]  # [B, R] then [B, I]: never forms W
        return x0_bi * (xw_bi + self.bias[...]) + x_bi


class DCNv2(FamilyModel):
    def build_layers(
        self, cfg: DCNv2ModelConfig, schema: Schema, *, engine: EngineSpec | None, rngs: nnx.Rngs
    ) -> None:
        if cfg.dense_mlp:
            self.dense = MLP(schema.num_dense, cfg.dense_mlp, final_relu=False, rngs=rngs)
            num_dense = cfg.dense_mlp[-1]
        else:
            self.dense = None
            num_dense = schema.num_dense
        self.in_dim = num_dense + schema.num_sparse * cfg.embed_dim
        if cfg.scan_layers and cfg.num_cross_layers:
            self.cross = stacked(
                lambda r: CrossLayer(self.in_dim, cfg.cross_rank, rngs=r),
                cfg.num_cross_layers,
                rngs,
            )
        else:
            self.cross = nnx.List(
                [
                    CrossLayer(self.in_dim, cfg.cross_rank, rngs=rngs)
                    for _ in range(cfg.num_cross_layers)
                ]
            )
        self.stacked = cfg.structure == "stacked"
        # Dropout after every hidden layer, the last included (its output feeds the logit), so
        # the deep network is an MLP with a final ReLU plus one more dropout applied here.
        self.deep = (
            MLP(
                self.in_dim,
                cfg.deep_mlp,
                final_relu=True,
                dropout=cfg.dropout,
                batch_norm=cfg.batch_norm,
                rngs=rngs,
            )
            if cfg.deep_mlp
            else None
        )
        deep_out = cfg.deep_mlp[-1] if cfg.deep_mlp else 0
        if self.stacked:
            logit_in = deep_out or self.in_dim
        else:
            logit_in = (self.in_dim if cfg.num_cross_layers else 0) + deep_out
        self.logit = Linear(logit_in, 1, rngs=rngs)

    def embed(self, dense_bn: jax.Array, ids_bfh: jax.Array) -> jax.Array:
        """x_0: dense features (or their MLP) then the flattened sparse embeddings, ``[B, I]``."""
        emb_bfd = self.embeddings(ids_bfh)
        b = emb_bfd.shape[0]
        parts = [emb_bfd.reshape(b, -1)]
        if self.dense is not None:
            parts.insert(0, self.dense(dense_bn))
        elif dense_bn.shape[-1]:
            parts.insert(0, dense_bn.astype(emb_bfd.dtype))
        return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

    def cross_network(self, x0_bi: jax.Array) -> jax.Array:
        """x_{L_c} after every cross layer, ``[B, I]``."""

        def step(layer, x_bi, _):
            return sharding.constrain(layer(x0_bi, x_bi), "batch", None)

        if isinstance(self.cross, CrossLayer):  # scan_layers: one stacked module
            return scan_stacked(self.cross, x0_bi, step)
        x_bi = x0_bi
        for i, layer in enumerate(self.cross):
            x_bi = step(layer, x_bi, i)
        return x_bi

    def deep_network(self, x_bi: jax.Array, dropout_key: jax.Array | None) -> jax.Array:
        """The deep MLP with dropout after each hidden layer, ``[B, M]``."""
        h_bm = self.deep(x_bi, dropout_key=dropout_key)  # final ReLU: every layer drops
        return sharding.constrain(h_bm, "batch", None)

    def __call__(
        self, dense_bn: jax.Array, ids_bfh: jax.Array, *, dropout_key: jax.Array | None = None
    ) -> jax.Array:
        """Logits ``[B]``."""
        x0_bi = sharding.constrain(self.embed(dense_bn, ids_bfh), "batch", None)
        if self.stacked:
            h = self.cross_network(x0_bi)
            if self.deep is not None:
                h = self.deep_network(h, dropout_key)
        else:
            parts = []
            if self.cross:
                parts.append(self.cross_network(x0_bi))
            if self.deep is not None:
                parts.append(self.deep_network(x0_bi, dropout_key))
            h = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        return self.logit(h)[:, 0]


def build_model(cfg, schema: Schema, rngs: nnx.Rngs) -> DCNv2:
    """Trainer hook: the DCNv2 of a DCNv2Config for a dataset schema."""
    return DCNv2.from_config(cfg, schema, rngs)
