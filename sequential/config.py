"""Configurations of the sequential recommenders (HSTU, SASRec, the bag baseline) and their
next-item losses (no jax import).

A sweep sizes a network from its config alone: ``cfg.cost(...)`` (``sequential.flops``) gives
parameters and FLOPs per token without building it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from sequential.flops import bag_cost, hstu_cost, sasrec_cost


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeqModelConfig:
    """What HSTU and SASRec share: the item table, the width, the depth and the input."""

    n_items: int
    """V: item ids ``1..V``; the item table has ``V + 1`` rows, row 0 (padding) never read."""
    d_model: int = 50
    """D: the width of the residual stream, of the item embeddings and of the user embeddings."""
    num_layers: int = 2
    """L: HSTU layers / SASRec blocks."""
    num_heads: int = 1
    """H: attention heads."""
    max_seq_len: int = 200
    """N: positions of the learned positional embedding; a sequence's tokens past ``N`` are
    dropped (zero output, weight 0 in the losses: cut histories to ``N`` before packing)."""
    dropout: float = 0.0
    """Dropout rate (training calls only, those given a ``dropout_key``)."""
    embedding_init_scale: float = 0.02
    """Std of the item table's normal init (generative-recommenders' item embeddings)."""

    def __post_init__(self):
        for name in ("n_items", "d_model", "num_layers", "num_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HSTUConfig(SeqModelConfig):
    """HSTU (Zhai et al., ICML 2024), the research form of generative-recommenders
    (``sequential/hstu/model.py``)."""

    d_qk: int = 25
    """Query/key width per head."""
    d_v: int = 25
    """Value (and U) width per head."""
    alpha: float = 1.0
    """Scale of ``q·k`` inside the SiLU (1: the research form; the production STU uses
    ``1/sqrt(d_qk)``)."""
    num_buckets: int = 32
    """Buckets of the relative-position bias table (0: no bias)."""
    bias_per_head: bool = False
    """One bias row per head (else one shared by all heads, as the research form)."""
    contextual_seq_len: int = 0
    """The kernel's contextual prefix: the first ``c`` tokens of every sequence (0: none)."""
    max_attn_len: int = 0
    """The kernel's local attention window (0: none)."""

    def __post_init__(self):
        super().__post_init__()
        if self.d_qk < 1 or self.d_v < 1:
            raise ValueError("HSTUConfig.d_qk and d_v must be >= 1")
        if self.num_buckets < 0 or self.contextual_seq_len < 0 or self.max_attn_len < 0:
            raise ValueError("HSTUConfig.num_buckets, contextual_seq_len, max_attn_len >= 0")

    cost = hstu_cost  # its own docstring: parameters and FLOPs per token


@dataclasses.dataclass(frozen=True, kw_only=True)
class SASRecConfig(SeqModelConfig):
    """SASRec (Kang & McAuley, ICDM 2018), as its official code (``sequential/sasrec/model.py``)."""

    ffn_dim: int = 0
    """Hidden width of the point-wise feed-forward network (0: ``d_model``, the paper's)."""

    def __post_init__(self):
        super().__post_init__()
        if self.d_model % self.num_heads:
            raise ValueError(
                f"SASRecConfig.d_model = {self.d_model} must be divisible by num_heads = "
                f"{self.num_heads}"
            )
        if self.ffn_dim < 0:
            raise ValueError("SASRecConfig.ffn_dim must be >= 0")

    @property
    def ffn_width(self) -> int:
        return self.ffn_dim or self.d_model

    cost = sasrec_cost  # its own docstring: parameters and FLOPs per token


@dataclasses.dataclass(frozen=True, kw_only=True)
class BagConfig(SeqModelConfig):
    """A DLRM-style baseline that sees the history as a bag (``sequential/bag/model.py``): the
    mean of the items so far, through a top MLP of ``num_layers`` hidden layers. No order, no
    positions; ``num_heads`` is unused."""

    mlp_width: int = 0
    """Hidden width of the top MLP (0: ``4 · d_model``, a transformer FFN's)."""

    def __post_init__(self):
        super().__post_init__()
        if self.mlp_width < 0:
            raise ValueError("BagConfig.mlp_width must be >= 0")

    @property
    def hidden_width(self) -> int:
        return self.mlp_width or 4 * self.d_model

    cost = bag_cost  # its own docstring: parameters and FLOPs per token


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """A next-item loss over every position of every history (``sequential/losses.py``).

    Defaults are HSTU's retrieval setup (generative-recommenders' ``*-sampled-softmax-*-final.gin``:
    128 shared negatives, L2-normalised embeddings, temperature 0.05); SASRec's original loss is
    ``LossConfig(kind="bce", l2_norm=False, temperature=1.0)``."""

    kind: Literal["sampled_softmax", "full_softmax", "bce"] = "sampled_softmax"
    """``sampled_softmax``: the positive against ``num_negatives`` negatives shared by the
    batch; ``full_softmax``: against every item; ``bce``: SASRec's binary cross-entropy with one
    negative per position."""
    num_negatives: int = 128
    """K: shared negatives of the sampled softmax."""
    sampler: Literal["uniform", "popularity"] = "uniform"
    """How the sampled softmax draws negatives: uniform over ``1..V`` or from the item
    distribution ``q`` passed to the loss (with replacement)."""
    logq_correction: bool = True
    """Subtract ``log(K q(j))`` from negative j's logit: the sampled partition function then
    estimates the full one without bias (False: generative-recommenders' uncorrected form)."""
    temperature: float = 0.05
    """Logits are similarities divided by this."""
    l2_norm: bool = True
    """L2-normalise user and item embeddings before scoring (cosine similarities)."""
    l2_eps: float = 1e-6
    """Norms are clamped below at this."""
    bce_exclude_history: bool = True
    """BCE: draw each position's negative among items not in its sequence (SASRec's
    ``random_neq`` over the user's training items); False: uniform over ``1..V``."""

    def __post_init__(self):
        if self.kind not in ("sampled_softmax", "full_softmax", "bce"):
            raise ValueError(f"LossConfig.kind: unknown {self.kind!r}")
        if self.sampler not in ("uniform", "popularity"):
            raise ValueError(f"LossConfig.sampler: unknown {self.sampler!r}")
        if self.num_negatives < 1:
            raise ValueError("LossConfig.num_negatives must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"LossConfig.temperature must be > 0, got {self.temperature}")
