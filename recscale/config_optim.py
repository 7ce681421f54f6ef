"""The optimizer configs of a run: the dense parameters' and the tables' (``recscale.optim``
builds them). Imported from ``recscale.config``, their public home."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal

from data.roles import ARGUMENT, field

COOLDOWN_FRACTION = 0.2
"""Default share of a warmup-stable-decay run's steps spent in its cooldown (``recscale.optim.schedules``)."""


def cooldown_steps(total_steps: int, fraction: float) -> int:
    """Steps of a warmup-stable-decay cooldown: ``fraction`` of ``total_steps``, rounded to the
    nearest step, at least 1 (for a run of at least one step) and at most ``total_steps``.
    Computed on the host in Python, so that a run's decay start and the step its cooldown branch
    starts at are the same integer everywhere."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"cooldown fraction must be in (0, 1], got {fraction}")
    if total_steps <= 0:
        return 0
    return min(total_steps, max(1, math.floor(fraction * total_steps + 0.5)))


def decay_start(cfg: Any, total_steps: int) -> int:
    """The first step whose learning rate is below the stable phase's, of an optimizer config run
    for ``total_steps``: its decay start under ``wsd``, its warmup's end under ``cosine`` /
    ``linear`` (they decay from there), ``total_steps`` under ``constant``."""
    if cfg.decay == "wsd":
        return total_steps - cooldown_steps(total_steps, cfg.cooldown_fraction)
    if cfg.decay == "constant":
        return total_steps
    return min(cfg.warmup_steps, total_steps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """The learning-rate schedule of an optimizer config (``recscale.optim.schedules``): the dense
    parameters' and the tables' have the same fields, each optimizer its own values."""

    SECTION: ClassVar[str] = ""
    """The config section its errors name (``dense_optim``, ``embedding_optim``)."""

    warmup_steps: int = field(0, role=ARGUMENT)
    """Linear warmup from 0 to the peak learning rate over this many steps."""
    decay: Literal["constant", "cosine", "linear", "wsd"] = "constant"
    """Decay after warmup, down to ``end_lr_fraction * learning_rate`` at the last step:
    ``cosine`` / ``linear`` from the warmup's end; ``wsd`` (warmup-stable-decay) holds the peak
    and decays over the last ``cooldown_fraction`` of the steps only
    (``recscale.optim.schedules``), so that shorter budgets branch off one run
    (``recscale.train.branches``)."""
    end_lr_fraction: float = 0.0
    """Final learning rate as a fraction of the peak (cosine/linear/wsd decay)."""
    cooldown_fraction: float = field(0.2, role=ARGUMENT, identity_default=0.2)
    """``wsd``: share of the steps in the cooldown, rounded to a step (0.2: Hägele et al. 2024's
    near-optimal length, ``recscale.optim.schedules``)."""
    cooldown_shape: Literal["1-sqrt", "linear"] = field("1-sqrt", identity_default="1-sqrt")
    """``wsd``: the cooldown's shape, ``1 - sqrt(x)`` or ``1 - x`` of its progress ``x``."""

    def __post_init__(self):
        if self.warmup_steps < 0:
            raise ValueError(f"{self.SECTION}.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 < self.cooldown_fraction <= 1.0:
            raise ValueError(
                f"{self.SECTION}.cooldown_fraction must be in (0, 1], got {self.cooldown_fraction}"
            )
        if self.cooldown_shape not in ("1-sqrt", "linear"):
            raise ValueError(
                f"{self.SECTION}.cooldown_shape={self.cooldown_shape!r}: expected 1-sqrt or linear"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseOptimConfig(ScheduleConfig):
    """Optimizer of the dense (MLP) parameters, built with optax."""

    SECTION: ClassVar[str] = "dense_optim"

    name: Literal["adam", "adamw", "sgd", "adagrad", "lamb", "lars", "hessian_free"] = "adam"
    """Optimizer family. ``hessian_free``: truncated Newton with Steihaug-CG in a trust region
    (``recscale.optim.hessian_free``; the learning rate scales its step, 1.0 is Newton's; it
    needs the embedding engine, whose tables keep their sparse optimizer)."""
    learning_rate: float = field(1e-3, role=ARGUMENT)
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (adamw, lamb, lars)."""
    b1: float = 0.9
    """First-moment decay (adam, adamw, lamb); momentum (sgd, lars)."""
    b2: float = 0.999
    """Second-moment decay (adam, adamw, lamb)."""
    eps: float = 1e-8
    """Numerical epsilon."""
    grad_clip_norm: float = 0.0
    """Clip the dense gradients' global norm to this (0 = off)."""
    hf_cg_iters: int = field(20, identity_default=20)
    """hessian_free: CG iterations (Hessian-vector products) per step, at most."""
    hf_damping: float = field(1e-4, identity_default=1e-4)
    """hessian_free: Tikhonov damping λ of the curvature products (H + λI)."""
    hf_radius: float = field(1.0, identity_default=1.0)
    """hessian_free: the trust region's initial radius (then adapted)."""

    def __post_init__(self):
        super().__post_init__()
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.name == "hessian_free" and (
            self.grad_clip_norm > 0 or self.warmup_steps or self.decay != "constant"
        ):
            raise ValueError(
                "dense_optim.name=hessian_free: its trust region sets the step; set "
                "grad_clip_norm 0, warmup_steps 0 and decay constant"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingOptimConfig(ScheduleConfig):
    """Optimizer of the embedding tables (their own, as in DLRM and TorchRec)."""

    SECTION: ClassVar[str] = "embedding_optim"

    name: Literal["sgd", "rowwise_adagrad", "adam"] = field(
        "rowwise_adagrad", plan_input="optimizer"
    )
    """``sgd``; ``rowwise_adagrad`` (one accumulator per row, the mean of its squared grads);
    ``adam`` (dense Adam on the tables, for comparison)."""
    learning_rate: float = field(0.01, role=ARGUMENT)
    """Learning rate of the tables."""
    initial_accumulator: float = 0.0
    """Initial value of the row-wise Adagrad accumulator."""
    eps: float = 1e-8
    """Numerical epsilon of row-wise Adagrad / Adam."""
    b1: float = field(0.9, identity_default=0.9)
    """adam: first-moment decay."""
    b2: float = field(0.999, identity_default=0.999)
    """adam: second-moment decay (SASRec's recipe sets 0.98 on every parameter)."""
    l2: float = field(0.0, plan_input="l2")
    """Coupled L2 regularisation of whole tables: adds ``l2 * W`` to the gradient of every row
    every step (FuxiCTR's ``embedding_regularizer``), so every row is updated. The engine keeps
    the tables data-parallel for it (an update of a whole table is local there), as TorchRec's
    data-parallel tables take dense optimizers; ``row_l2`` is the sparse alternative."""
    row_l2: float = field(0.0, identity_default=0.0)
    """L2 of the rows a batch touches (lazy, as sparse optimizers apply it): adds
    ``row_l2 * w_j`` to each touched row's gradient, before CowClip; engine and per-table
    tables alike."""
    cowclip_ratio: float = field(0.0, identity_default=0.0)
    """CowClip (``recscale.optim.cowclip``): clips each touched row's gradient to
    ``cnt · max(r · ||w||, ζ)``, ``cnt`` its occurrences in the batch; this is ``r``
    (0: off; the paper uses 1)."""
    cowclip_min_norm: float = field(1e-5, identity_default=1e-5)
    """CowClip's ``ζ``: the threshold's floor per occurrence, for rows still near zero."""

    def __post_init__(self):
        super().__post_init__()
        for name in ("l2", "row_l2", "cowclip_ratio", "cowclip_min_norm"):
            if getattr(self, name) < 0:
                raise ValueError(f"embedding_optim.{name}={getattr(self, name)}: must be >= 0")
