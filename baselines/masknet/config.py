"""MaskNet configuration (no jax import).

Field names follow FuxiCTR's MaskNet (``model_type``, ``dnn_hidden_units``, ``parallel_num_blocks``,
``parallel_block_dim``, ``reduction_ratio``, ``emb_layernorm``, ``net_layernorm``,
``net_dropout``), so a BARS / FuxiCTR tuned config reads across field by field; ``embed_dim`` is
the paper's embedding size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from baselines.masknet.flops import masknet_cost
from data.roles import field
from recscale.config import ConfigError, ExperimentConfig
from recscale.model_config import TablesConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskNetModelConfig(TablesConfig):
    """The MaskNet network: field embeddings, MaskBlocks (serial or parallel), logit."""

    embed_dim: int = 10
    """Embedding dimension of every field: each sparse feature's table, and each dense feature's
    learned vector (a dense feature x_j enters as the field x_j · w_j, FuxiCTR's numeric
    embedding)."""
    model_type: Literal["serial", "parallel"] = "serial"
    """``serial``: a stack of MaskBlocks, the first on the feature embeddings, each next one on the
    previous block's output, then the logit; ``parallel``: ``parallel_num_blocks`` MaskBlocks all
    on the feature embeddings, concatenated, then an MLP and the logit."""
    dnn_hidden_units: tuple[int, ...] = (400, 400, 400)
    """``serial``: the output width of each MaskBlock (one block per entry, so at least one);
    ``parallel``: the hidden layer sizes of the MLP on the concatenated blocks (empty = the logit
    reads the concatenation directly)."""
    parallel_num_blocks: int = 1
    """``parallel`` only: number of MaskBlocks side by side on the feature embeddings."""
    parallel_block_dim: int = 64
    """``parallel`` only: output width of each of those MaskBlocks."""
    reduction_ratio: float = 1.0
    """r of the instance-guided mask: its hidden (aggregation) layer has int(r · Z) units, Z the
    width of the layer it masks (the paper's t / z; FuxiCTR's int(hidden_dim * reduction_ratio))."""
    emb_layernorm: bool = True
    """LayerNorm each field's embedding (own scale and bias per field) before the first MaskBlocks
    mask it; the mask itself always reads the raw embeddings."""
    net_layernorm: bool = True
    """LayerNorm after each MaskBlock's (bias-free) linear layer, before its ReLU."""
    net_dropout: float = 0.0
    """Dropout after every MaskBlock's ReLU and after each hidden layer of the parallel MLP
    (training only)."""
    scan_layers: bool = field(False, identity_default=False)
    """The MaskBlocks that share a shape as one stacked module run by a ``lax.scan``
    (``recscale.nn.stacked``: each block's weights gathered inside the loop under FSDP,
    rematerialised in the backward): a serial MaskNet's blocks 2..L (so its
    ``dnn_hidden_units`` must all be equal), a parallel one's ``parallel_num_blocks``. Its
    parameters are stacked (``[L, ...]``), so checkpoints do not carry over between the forms."""

    def __post_init__(self):
        if self.embed_dim < 1:
            raise ValueError(f"embed_dim must be >= 1, got {self.embed_dim}")
        if self.model_type not in ("serial", "parallel"):
            raise ValueError(f"model_type must be 'serial' or 'parallel', got {self.model_type!r}")
        if any(n < 1 for n in self.dnn_hidden_units):
            raise ValueError(f"dnn_hidden_units must be >= 1, got {self.dnn_hidden_units}")
        if self.model_type == "serial" and not self.dnn_hidden_units:
            raise ValueError(
                "a serial MaskNet needs at least one MaskBlock: dnn_hidden_units is empty"
            )
        if self.parallel_num_blocks < 1:
            raise ValueError(f"parallel_num_blocks must be >= 1, got {self.parallel_num_blocks}")
        if self.parallel_block_dim < 1:
            raise ValueError(f"parallel_block_dim must be >= 1, got {self.parallel_block_dim}")
        if not self.reduction_ratio > 0:
            raise ValueError(f"reduction_ratio must be > 0, got {self.reduction_ratio}")
        if self.scan_layers and self.model_type == "serial":
            if len(set(self.dnn_hidden_units)) != 1:
                raise ValueError(
                    "scan_layers: a serial MaskNet's blocks 2..L are stacked, so its "
                    f"dnn_hidden_units must be equal, got {self.dnn_hidden_units}"
                )
        if not 0.0 <= self.net_dropout < 1.0:
            raise ValueError(f"net_dropout must be in [0, 1), got {self.net_dropout}")

    def masked_dims(self, schema) -> tuple[int, ...]:
        """Z of each MaskBlock: the width of the layer it masks (the feature embeddings, F · D,
        or in a serial MaskNet the block before)."""
        in_dim = (schema.num_sparse + schema.num_dense) * self.embed_dim
        if self.model_type == "serial":
            return (in_dim, *self.dnn_hidden_units[:-1])
        return (in_dim,) * self.parallel_num_blocks

    def check_data(self, schema) -> None:
        """Raises ``ConfigError`` naming the flag to set when this network cannot be built for
        ``schema`` (a reduction ratio that leaves a mask no units)."""
        z = min(self.masked_dims(schema))
        if int(z * self.reduction_ratio) < 1:
            raise ConfigError(
                f"model.reduction_ratio={self.reduction_ratio} leaves int({z} * "
                f"{self.reduction_ratio}) = 0 units in a mask's aggregation layer: set "
                f"--model.reduction-ratio {math.ceil(1e4 / z) / 1e4:g} or more"
            )

    cost = masknet_cost  # its own docstring: the cost of this network on a schema


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskNetConfig(ExperimentConfig):
    """A whole MaskNet run: the network plus the shared data, optimizer, loop and mesh configs."""

    model: MaskNetModelConfig = MaskNetModelConfig()
    """The network."""
