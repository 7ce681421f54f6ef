"""The DLRM network.

Dimension glossary: ``B`` batch, ``N`` dense features, ``F`` sparse features, ``H`` bag slots,
``D`` embedding dim, ``P`` interaction outputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data.batch import Schema
from dlrm.config import DLRMModelConfig
from recscale import sharding
from recscale.embeddings import EmbeddingCollection
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def lower_triangle(z_bnn: jax.Array, diagonal: bool) -> jax.Array:
    """``[B, P]``: the entries of ``z`` on and below (``diagonal``) or strictly below the
    diagonal, row by row: ``z[:, tril_indices(n, 0 or -1)]``. Static slices both ways; as a
    gather, its backward is an XLA scatter, and as slices, XLA pads and adds ``n`` copies of
    ``[B, n, n]``; this backward writes ``[B, n, n]`` once."""
    n = z_bnn.shape[1]
    off = 1 if diagonal else 0
    return jnp.concatenate([z_bnn[:, i, : i + off] for i in range(n) if i + off > 0], axis=1)


def _lower_triangle_fwd(z_bnn, diagonal):
    return lower_triangle(z_bnn, diagonal), z_bnn.shape


def _lower_triangle_bwd(diagonal, shape, g_bp):
    b, n, _ = shape
    off = 1 if diagonal else 0
    pieces, start = [], 0
    for i in range(n):  # row i of [n, n]: its k entries, then n - k zeros; one concatenation
        k = max(i + off, 0)
        if k:
            pieces.append(g_bp[:, start : start + k])
        if n - k:
            pieces.append(jnp.zeros((b, n - k), g_bp.dtype))
        start += k
    return (jnp.concatenate(pieces, axis=1).reshape(b, n, n),)


lower_triangle.defvjp(_lower_triangle_fwd, _lower_triangle_bwd)


class DLRM(nnx.Module):
    def __init__(self, cfg: DLRMModelConfig, schema: Schema, *, rngs: nnx.Rngs):
        self.cfg = nnx.static(cfg)
        self.embeddings = EmbeddingCollection.one_table_per_feature(
            schema,
            cfg.embed_dim,
            pooling=cfg.pooling,
            init=cfg.embedding_init,
            init_scale=cfg.embedding_init_scale,
            rngs=rngs,
        )
        self.has_dense = schema.num_dense > 0
        if self.has_dense:
            if not cfg.bottom_mlp:
                raise ValueError("a dataset with dense features needs a bottom_mlp")
            self.bottom = MLP(schema.num_dense, cfg.bottom_mlp, final_relu=True, rngs=rngs)
        else:
            self.bottom = None
        num_vectors = schema.num_sparse + int(self.has_dense)
        n = num_vectors
        li, lj = np.tril_indices(n, k=0 if cfg.self_interaction else -1)
        self.tril = nnx.static((tuple(int(i) for i in li), tuple(int(j) for j in lj)))
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
        z_bnn = jnp.einsum("bnd,bmd->bnm", x_bnd, x_bnd)
        return lower_triangle(z_bnn, self.cfg.self_interaction)

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
    return DLRM(cfg.model, schema, rngs=rngs)
