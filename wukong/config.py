"""Wukong configuration (no jax import).

Field names follow the paper's scaling knobs: ``num_layers`` (l), ``n_fmb`` (n_F), ``n_lcb``
(n_L), ``fmb_rank`` (k), the FMB MLP's ``fmb_mlp_width`` x ``fmb_mlp_depth``, ``embed_dim`` (d).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from data.roles import field
from recscale.config import ConfigError, ExperimentConfig
from recscale.flops import wukong_cost
from recscale.model_config import TablesConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class WukongModelConfig(TablesConfig):
    """The Wukong network: embedding layer, interaction stack of l Wukong layers, top MLP."""

    embed_dim: int = 16
    """Embedding dimension d of every embedding (sparse tables and dense embeddings)."""
    num_dense_embeddings: int = -1
    """Embeddings the dense features are mapped to (dense MLP output reshaped to this many x d);
    -1 = 1 when the dataset has dense features, else 0."""
    dense_mlp: tuple[int, ...] = (64,)
    """Hidden layer sizes of the dense-feature MLP (its output layer of
    ``num_dense_embeddings * embed_dim`` units is appended)."""
    num_layers: int = 2
    """l: Wukong layers in the interaction stack."""
    n_fmb: int = 8
    """n_F: embeddings produced by each layer's Factorization Machine Block (0 = no FMB)."""
    n_lcb: int = 8
    """n_L: embeddings produced by each layer's Linear Compression Block (0 = no LCB)."""
    fmb_rank: int = 8
    """k: rank of the optimized FM, X (Xᵀ Y) with Y of shape [n, k]."""
    fmb_projection: Literal["learned", "attentive"] = "learned"
    """Y of the optimized FM: ``learned`` = one [n, k] parameter; ``attentive`` = computed per
    example from X by an MLP (flatten X -> ``attentive_mlp`` -> n*k -> reshape [n, k])."""
    attentive_mlp: tuple[int, ...] = (64,)
    """Hidden layer sizes of the MLP computing an attentive Y (``fmb_projection='attentive'``)."""
    fmb_mlp_width: int = 64
    """Width of each hidden layer of the FMB MLP."""
    fmb_mlp_depth: int = 2
    """Hidden layers of the FMB MLP (its output layer of n_F * d units is appended)."""
    top_mlp: tuple[int, ...] = (64, 1)
    """Top MLP layer sizes on the flattened output of the last layer (the last must be 1)."""
    layer_norm: Literal["embedding", "flattened"] = "embedding"
    """The LN of a Wukong layer's output: ``embedding`` normalises each of the n_F + n_L
    embeddings over its d values (scale and bias of size d); ``flattened`` normalises the whole
    [(n_F + n_L) * d] layer output at once."""
    dropout: float = 0.0
    """Dropout after each hidden layer of the top MLP (training only)."""
    fmb_dropout: float = 0.0
    """Dropout after each hidden layer of the FMB MLPs (training only)."""
    batch_norm: bool = False
    """BatchNorm in each hidden layer of the FMB MLPs and the top MLP (Linear -> BatchNorm ->
    ReLU, as FuxiCTR's MLPs); the paper's LayerNorms are kept either way."""
    scan_layers: bool = field(False, identity_default=False)
    """Layers 2..l as one stacked module run by a ``lax.scan`` (each layer's weights gathered
    inside the loop under FSDP, ``sharding.gather_fsdp``; the body rematerialised in the
    backward): the same network and numbers, weights gathered and gradients reduce-scattered
    one layer at a time, the compile one layer's size. Its parameters are stacked
    (``[l - 1, ...]``, logical axis ``layers``): checkpoints do not carry over between the two
    forms. Not with ``batch_norm`` (statistics updated inside the loop)."""

    def __post_init__(self):
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp must end in 1 (the logit), got {self.top_mlp}")
        if self.embed_dim < 1:
            raise ValueError(f"embed_dim must be >= 1, got {self.embed_dim}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.n_fmb < 0 or self.n_lcb < 0 or self.n_fmb + self.n_lcb < 1:
            raise ValueError(
                f"need n_fmb, n_lcb >= 0 and n_fmb + n_lcb >= 1, got {self.n_fmb}, {self.n_lcb}"
            )
        if self.fmb_rank < 1:
            raise ValueError(f"fmb_rank must be >= 1, got {self.fmb_rank}")
        if self.fmb_mlp_depth < 0 or (self.fmb_mlp_depth and self.fmb_mlp_width < 1):
            raise ValueError(f"bad FMB MLP {self.fmb_mlp_depth} x {self.fmb_mlp_width}")
        if self.num_dense_embeddings < -1:
            raise ValueError(f"num_dense_embeddings must be >= -1, got {self.num_dense_embeddings}")
        if self.scan_layers and self.batch_norm:
            raise ValueError("scan_layers: not with batch_norm (its statistics update per layer)")
        for name in ("dropout", "fmb_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    def dense_embeddings(self, schema) -> int:
        """Dense embeddings of X_0 (``num_dense_embeddings``, -1 resolved from the schema)."""
        n = self.num_dense_embeddings
        if n == -1:
            return 1 if schema.num_dense else 0
        if n > 0 and not schema.num_dense:
            raise ConfigError(
                f"model.num_dense_embeddings={n} but the data has no dense features: set "
                "--model.num-dense-embeddings 0"
            )
        if n == 0 and schema.num_dense:
            raise ConfigError(
                f"model.num_dense_embeddings=0 would ignore the data's {schema.num_dense} dense "
                "features: set --model.num-dense-embeddings 1 (or more)"
            )
        return n

    cost = wukong_cost  # its own docstring: the cost of this network on a schema


@dataclasses.dataclass(frozen=True, kw_only=True)
class WukongConfig(ExperimentConfig):
    """A whole Wukong run: the network plus the shared data, optimizer, loop and mesh configs."""

    model: WukongModelConfig = WukongModelConfig()
    """The network."""
