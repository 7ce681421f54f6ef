"""DLRM configuration (no jax import)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from recscale.config import ConfigError, ExperimentConfig
from recscale.flops import dlrm_cost
from recscale.model_config import TablesConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class DLRMModelConfig(TablesConfig):
    """The DLRM network."""

    embed_dim: int = 16
    """Embedding dimension D of every table."""
    bottom_mlp: tuple[int, ...] = (64, 16)
    """Bottom MLP layer sizes after the dense input (the last must equal embed_dim)."""
    top_mlp: tuple[int, ...] = (64, 1)
    """Top MLP layer sizes (the last must be 1: the logit)."""
    interaction: Literal["dot", "cat"] = "dot"
    """``dot``: pairwise dot products of the F(+1) vectors; ``cat``: concatenate them."""
    self_interaction: bool = False
    """Dot interaction: include each vector's dot with itself (the diagonal)."""
    dot_concat: Literal["dense", "all"] = "dense"
    """What the dot products are concatenated with before the top MLP: ``dense`` = the bottom
    MLP's output (facebookresearch/dlrm); ``all`` = every interacting vector, flattened
    (FuxiCTR/BARS, whose published Frappe and Criteo DLRM numbers use it)."""
    dropout: float = 0.0
    """Dropout rate after each hidden layer of the top MLP (training only)."""
    layer_norm: bool = False
    """LayerNorm in each hidden layer of the top MLP (Linear -> LayerNorm -> ReLU)."""
    batch_norm: bool = False
    """BatchNorm in each hidden layer of the top MLP (Linear -> BatchNorm -> ReLU), FuxiCTR's
    ``batch_norm``; running statistics are model state, checkpointed with the parameters."""

    def __post_init__(self):
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp must end in 1 (the logit), got {self.top_mlp}")
        if self.bottom_mlp and self.bottom_mlp[-1] != self.embed_dim:
            raise ValueError(
                f"bottom_mlp[-1] must equal embed_dim (the dense vector joins the embeddings), got "
                f"{self.bottom_mlp[-1]} vs {self.embed_dim}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.layer_norm and self.batch_norm:
            raise ValueError("choose layer_norm or batch_norm, not both")

    def check_data(self, schema) -> None:
        """Raises ``ConfigError`` naming the flag to set when this network cannot read data of
        ``schema`` (dense features without a bottom MLP)."""
        if schema.num_dense and not self.bottom_mlp:
            raise ConfigError(
                f"the data has {schema.num_dense} dense feature(s) ({', '.join(schema.dense_names)}"
                f") but model.bottom_mlp is empty: set --model.bottom-mlp 64 {self.embed_dim} "
                f"(any sizes ending in model.embed_dim = {self.embed_dim})"
            )

    cost = dlrm_cost  # its own docstring: the cost of this network on a schema


@dataclasses.dataclass(frozen=True, kw_only=True)
class DLRMConfig(ExperimentConfig):
    """A whole DLRM run: the network plus the shared data, optimizer, loop and mesh configs."""

    model: DLRMModelConfig = DLRMModelConfig()
    """The network."""
