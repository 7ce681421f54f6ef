"""DCNv2 configuration (no jax import).

Field names follow the paper: ``num_cross_layers`` (L_c), ``cross_rank`` (r of the low-rank
cross layer W = U Vᵀ), ``structure`` (stacked or parallel), the deep network ``deep_mlp``,
``embed_dim`` (e).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from baselines.dcnv2.flops import dcnv2_cost
from data.roles import field
from recscale.config import ConfigError, ExperimentConfig
from recscale.model_config import TablesConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class DCNv2ModelConfig(TablesConfig):
    """The DCNv2 network: x_0 = [dense, flattened embeddings], cross network, deep MLP, logit."""

    embed_dim: int = 16
    """Embedding dimension e of every sparse-feature table."""
    dense_mlp: tuple[int, ...] = ()
    """Layer sizes of an optional MLP on the dense features before they join x_0; empty (the
    paper's choice) concatenates the dense features to the embeddings as they are."""
    num_cross_layers: int = 3
    """L_c: cross layers x_{l+1} = x_0 ⊙ (W_l x_l + b_l) + x_l."""
    cross_rank: int = 0
    """r: 0 = full-rank W_l ([n, n]); r > 0 = low-rank W_l = U_l V_lᵀ with U_l, V_l of [n, r]."""
    structure: Literal["stacked", "parallel"] = "parallel"
    """``stacked``: x_0 -> cross network -> deep MLP -> logit; ``parallel``: cross network and
    deep MLP both read x_0 and the logit reads their concatenated outputs."""
    deep_mlp: tuple[int, ...] = (400, 400, 400)
    """Hidden layer sizes of the deep network (ReLU after each); empty = cross network only."""
    dropout: float = 0.0
    """Dropout after each hidden layer of the deep network (training only)."""
    batch_norm: bool = False
    """BatchNorm in each hidden layer of the deep network (FuxiCTR's ``batch_norm``)."""
    scan_layers: bool = field(False, identity_default=False)
    """The cross layers as one stacked module run by a ``lax.scan`` (``recscale.nn.stacked``:
    layer-wise FSDP, a one-layer compile): the same network and numbers; its parameters are
    stacked (``[L_c, ...]``), so checkpoints do not carry over between the two forms."""

    def __post_init__(self):
        if self.embed_dim < 1:
            raise ValueError(f"embed_dim must be >= 1, got {self.embed_dim}")
        if self.num_cross_layers < 0:
            raise ValueError(f"num_cross_layers must be >= 0, got {self.num_cross_layers}")
        if self.cross_rank < 0:
            raise ValueError(f"cross_rank must be >= 0, got {self.cross_rank}")
        if not self.num_cross_layers and not self.deep_mlp:
            raise ValueError("need num_cross_layers >= 1 or a non-empty deep_mlp")
        if any(n < 1 for n in (*self.deep_mlp, *self.dense_mlp)):
            raise ValueError(f"MLP sizes must be >= 1, got {self.deep_mlp}, {self.dense_mlp}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def check_data(self, schema) -> None:
        """Raises ``ConfigError`` naming the flag to set when this network cannot read data of
        ``schema`` (a dense MLP without dense features)."""
        if self.dense_mlp and not schema.num_dense:
            raise ConfigError(
                f"model.dense_mlp={self.dense_mlp} but the data has no dense features: set "
                "--model.dense-mlp with no sizes"
            )

    cost = dcnv2_cost  # its own docstring: the cost of this network on a schema


@dataclasses.dataclass(frozen=True, kw_only=True)
class DCNv2Config(ExperimentConfig):
    """A whole DCNv2 run: the network plus the shared data, optimizer, loop and mesh configs."""

    model: DCNv2ModelConfig = DCNv2ModelConfig()
    """The network."""
