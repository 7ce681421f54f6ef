"""The DLRM network.

Dimension glossary: ``B`` batch, ``N`` dense features, ``F`` sparse features, ``H`` bag slots,
``D`` embedding dim, ``P`` interaction outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from data.batch import Schema
from dlrm.config import DLRMModelConfig
from recscale import sharding
from recscale.embeddings.family_model import FamilyModel
from recscale.embeddings.layout import EngineSpec
from recscale.kernels.dot_interaction import api as dot_interaction_api
from recscale.nn import MLP


def interaction_dim(cfg: DLRMModelConfig, num_vectors: int, has_dense: bool) -> int:
    """Width of the top MLP's input for ``num_vectors`` interacting vectors."""
    if cfg.interaction == "cat":
        return num_vectors * cfg.embed_dim
    n = num_vectors
    pairs = n * (n + 1) // 2 if cfg.self_interaction else n * (n - 1) // 2
    if cfg.dot_concat == "all":
        return pairs + n * cfg.embed_dim
    return pairs + (cfg.embed_dim if has_dense else 0)


class DLRM(FamilyModel):
    def build_layers(
        self, cfg: DLRMModelConfig, schema: Schema, *, engine: EngineSpec | None, rngs: nnx.Rngs
    ) -> None:
        self.has_dense = schema.num_dense > 0
        if self.has_dense:
            self.bottom = MLP(schema.num_dense, cfg.bottom_mlp, final_relu=True, rngs=rngs)
        else:
            self.bottom = None
        num_vectors = schema.num_sparse + int(self.has_dense)
        top_in = interaction_dim(cfg, num_vectors, self.has_dense)
        self.top = MLP(
            top_in,
            cfg.top_mlp,
            final_relu=False,
            dropout=cfg.dropout,
            layer_norm=cfg.layer_norm,
            batch_norm=cfg.batch_norm,
            rngs=rngs,
        )

    def interact(self, x_bnd: jax.Array) -> jax.Array:
        """Dot: lower triangle of X·Xᵀ per example (``[B, P]``); cat: flatten."""
        if self.cfg.interaction == "cat":
            return x_bnd.reshape(x_bnd.shape[0], -1)
        return dot_interaction_api.dot_interaction(
            x_bnd, self_interaction=self.cfg.self_interaction, impl=self.kernels.dot_interaction
        )

    def __call__(
        self, dense_bn: jax.Array, ids_bfh: jax.Array, *, dropout_key: jax.Array | None = None
    ) -> jax.Array:
        """Logits ``[B]``."""
        emb_bfd = self.embeddings(ids_bfh)
        if self.has_dense:
            dense_bd = self.bottom(dense_bn)
            x_bnd = jnp.concatenate([dense_bd[:, None, :], emb_bfd], axis=1)
        else:
            x_bnd = emb_bfd
        inter_bp = self.interact(x_bnd)
        if self.cfg.interaction == "dot":
            if self.cfg.dot_concat == "all":
                inter_bp = jnp.concatenate([x_bnd.reshape(x_bnd.shape[0], -1), inter_bp], axis=1)
            elif self.has_dense:
                inter_bp = jnp.concatenate([dense_bd, inter_bp], axis=1)
        inter_bp = sharding.constrain(inter_bp, "batch", None)
        return self.top(inter_bp, dropout_key=dropout_key)[:, 0]


def build_model(cfg, schema: Schema, rngs: nnx.Rngs) -> DLRM:
    """Trainer hook: the DLRM of a DLRMConfig for a dataset schema."""
    return DLRM.from_config(cfg, schema, rngs)
