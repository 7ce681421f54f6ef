"""FinalMLP configuration (no jax import).

Field names follow FuxiCTR's ``model_zoo/FinalMLP`` (the authors' reference implementation):
``mlp1``/``mlp2`` (its ``mlp1_hidden_units``/``mlp2_hidden_units``) and their dropouts,
``mlp1_batch_norm``/``mlp2_batch_norm``, ``use_fs``, ``fs_hidden_units``,
``fs1_context``/``fs2_context`` and ``num_heads``; LayerNorm is offered besides BatchNorm.
"""

from __future__ import annotations

import dataclasses

from baselines.finalmlp.flops import finalmlp_cost
from data.roles import field
from recscale.config import ConfigError, ExperimentConfig
from recscale.model_config import TablesConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinalMLPModelConfig(TablesConfig):
    """The FinalMLP network: two gated MLP streams over x = [dense, flattened embeddings], fused
    into one logit by multi-head bilinear aggregation."""

    embed_dim: int = 10
    """Embedding dimension D of every sparse-feature table (and of the gates' context)."""
    mlp1: tuple[int, ...] = (64, 64, 64)
    """Hidden layer sizes of stream 1 (Linear -> [norm] -> ReLU -> dropout each); its last size
    is the width of o_1, the fusion's first input."""
    mlp1_dropout: float = 0.0
    """Dropout after every hidden layer of stream 1, the last included (training only)."""
    mlp1_batch_norm: bool = False
    """BatchNorm before the ReLU of every hidden layer of stream 1 (FuxiCTR's
    ``mlp1_batch_norm``; running statistics are model state, see recscale.nn.BatchNorm)."""
    mlp1_layer_norm: bool = False
    """LayerNorm instead, before the ReLU of every hidden layer of stream 1."""
    mlp2: tuple[int, ...] = (64, 64, 64)
    """Hidden layer sizes of stream 2; its last size is the width of o_2."""
    mlp2_dropout: float = 0.0
    """Dropout after every hidden layer of stream 2, the last included (training only)."""
    mlp2_batch_norm: bool = False
    """BatchNorm before the ReLU of every hidden layer of stream 2 (FuxiCTR's
    ``mlp2_batch_norm``; running statistics are model state, see recscale.nn.BatchNorm)."""
    mlp2_layer_norm: bool = False
    """LayerNorm instead, before the ReLU of every hidden layer of stream 2."""
    use_fs: bool = True
    """Stream-specific feature selection: stream k reads x ⊙ 2·sigmoid(MLP_k(context_k)) instead
    of x (False: both streams read x, the paper's DualMLP ablation)."""
    fs_hidden_units: tuple[int, ...] = (64,)
    """Hidden layer sizes (ReLU) of each gate MLP before its output layer of width I = |x|;
    empty = a single linear layer."""
    fs1_context: tuple[str, ...] = ()
    """Sparse features (schema names) whose embeddings, flattened, are stream 1's gate context.
    They are looked up in tables of the gate's own, as in FuxiCTR. Empty: a learned context
    vector of size D (FuxiCTR's ``fs1_ctx_bias``), the same for every example. Ignored when
    ``use_fs`` is False."""
    fs2_context: tuple[str, ...] = ()
    """Stream 2's gate context, as ``fs1_context``."""
    num_heads: int = 1
    """Heads of the bilinear fusion: o_1 and o_2 are split into this many equal chunks, and the
    bilinear terms o_1hᵀ W_h o_2h are summed over heads; must divide both streams' widths."""
    scan_layers: bool = field(False, identity_default=False)
    """Each stream's longest tail of equal-width hidden layers, in (column, row) pairs, as one
    stacked module run by a ``lax.scan`` (``recscale.nn.MLP(scan=True)``: each pair's weights
    gathered inside the loop under FSDP, rematerialised in the backward); the layers before it
    unrolled. Not with BatchNorm. Its parameters are stacked, so checkpoints do not carry over
    between the forms."""

    def __post_init__(self):
        if self.embed_dim < 1:
            raise ValueError(f"embed_dim must be >= 1, got {self.embed_dim}")
        for name in ("mlp1", "mlp2"):
            sizes = getattr(self, name)
            if not sizes:
                raise ValueError(f"{name} needs at least one hidden layer size")
            if any(n < 1 for n in sizes):
                raise ValueError(f"{name} sizes must be >= 1, got {sizes}")
        if any(n < 1 for n in self.fs_hidden_units):
            raise ValueError(f"fs_hidden_units must be >= 1, got {self.fs_hidden_units}")
        for k in (1, 2):
            if getattr(self, f"mlp{k}_batch_norm") and getattr(self, f"mlp{k}_layer_norm"):
                raise ValueError(f"stream {k}: choose mlp{k}_batch_norm or mlp{k}_layer_norm")
        if self.scan_layers and (self.mlp1_batch_norm or self.mlp2_batch_norm):
            raise ValueError("scan_layers: not with batch_norm (its statistics update per layer)")
        for name in ("mlp1_dropout", "mlp2_dropout"):
            rate = getattr(self, name)
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {rate}")
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        for name in ("mlp1", "mlp2"):
            width = getattr(self, name)[-1]
            if width % self.num_heads:
                raise ValueError(
                    f"num_heads={self.num_heads} must divide the output width of each stream; "
                    f"{name}[-1] = {width}"
                )
        for name in ("fs1_context", "fs2_context"):
            ctx = getattr(self, name)
            if len(set(ctx)) != len(ctx):
                raise ValueError(f"{name} names a feature twice: {ctx}")

    def check_data(self, schema) -> None:
        """Raises ``ConfigError`` naming the flag to set when this network cannot read data of
        ``schema`` (a gate context naming a feature the data does not have)."""
        if not self.use_fs:
            return
        names = [f.name for f in schema.features]
        for name in ("fs1_context", "fs2_context"):
            unknown = [c for c in getattr(self, name) if c not in names]
            if unknown:
                raise ConfigError(
                    f"model.{name} names unknown features {unknown}; known: {names}: set "
                    f"--model.{name.replace('_', '-')} to some of them (or none)"
                )

    cost = finalmlp_cost  # its own docstring: the cost of this network on a schema


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinalMLPConfig(ExperimentConfig):
    """A whole FinalMLP run: the network plus the shared data, optimizer, loop and mesh configs."""

    model: FinalMLPModelConfig = FinalMLPModelConfig()
    """The network."""
