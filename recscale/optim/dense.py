"""Optimizers of the dense (MLP, interaction) parameters: optax chains built from a config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from recscale.config import DenseOptimConfig
from recscale.optim.hessian_free import hessian_free
from recscale.optim.schedules import config_schedule

__all__ = ["default_decay_mask", "dense_optimizer"]

_DECOUPLED_DECAY = ("adamw", "lamb", "lars")


def default_decay_mask(params: Any) -> Any:
    """``True`` for leaves with ``ndim >= 2`` (kernels), ``False`` for biases and norm scales.

    The usual practice of LARS (You et al. 2017) and LAMB/BERT (You et al. 2020): no weight decay and
    no trust-ratio scaling on 1-D parameters. Works on nnx.State trees (``nnx.Variable`` is a
    pytree node, so the leaves reached here are arrays).
    """
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def dense_optimizer(
    cfg: DenseOptimConfig,
    total_steps: int | jax.Array,
    *,
    decay_mask: Any | Callable[[Any], Any] | None = default_decay_mask,
    peak: float | jax.Array | None = None,
    warmup_steps: int | jax.Array | None = None,
    cooldown: int | jax.Array | None = None,
) -> optax.GradientTransformation:
    """Builds the optax optimizer of the dense parameters.

    Families (all optax, with ``config_schedule(cfg, total_steps)`` as learning rate):

    * ``adam``: ``optax.adam(lr, b1, b2, eps)``.
    * ``adamw``: ``optax.adamw`` with decoupled ``weight_decay`` on ``decay_mask``.
    * ``sgd``: ``optax.sgd`` with heavy-ball momentum ``b1`` when ``b1 > 0``, plain SGD when
      ``b1 == 0`` (note the config default ``b1=0.9`` means momentum 0.9).
    * ``adagrad``: ``optax.adagrad(lr, initial_accumulator_value=0.1, eps)`` (optax's default
      accumulator start; ``b1``/``b2`` unused).
    * ``lamb``: ``optax.lamb(lr, b1, b2, eps, weight_decay, mask=decay_mask)``.
    * ``lars``: ``optax.lars(lr, weight_decay, momentum=b1, eps)``; weight decay and the trust
      ratio both use ``decay_mask``. Leaves outside the mask (by default biases and norm scales)
      get plain momentum SGD at the raw learning rate, as in LARS practice (MLPerf's skip list),
      so the peak LR must be stable for them too.

    When ``cfg.grad_clip_norm > 0`` the chain starts with ``optax.clip_by_global_norm``; inside
    ``combine`` that global norm is over the dense gradients only.

    Args:
      cfg: The dense optimizer config.
      total_steps: Training steps (end of the cosine/linear decay).
      decay_mask: Which leaves get weight decay (adamw, lamb, lars) and, for lars, trust-ratio
        scaling: a bool pytree, a function params -> bool pytree, or ``None`` for all leaves.
        Defaults to ``default_decay_mask`` (kernels only, no biases/norm scales).
      peak, warmup_steps, cooldown: Replace the config's learning rate, warmup and wsd cooldown
        steps (``config_schedule``).

    Raises:
      ValueError: on ``weight_decay > 0`` with a family that has no decoupled weight decay
        (adam, sgd, adagrad), or an unknown name.
    """
    if cfg.weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {cfg.weight_decay}")
    if cfg.weight_decay > 0 and cfg.name not in _DECOUPLED_DECAY:
        raise ValueError(
            f"weight_decay={cfg.weight_decay} is only applied by {_DECOUPLED_DECAY}; "
            f"{cfg.name!r} would ignore it (use adamw instead of adam)"
        )
    if cfg.grad_clip_norm < 0:
        raise ValueError(f"grad_clip_norm must be >= 0, got {cfg.grad_clip_norm}")
    lr = config_schedule(cfg, total_steps, peak=peak, warmup_steps=warmup_steps, cooldown=cooldown)
    mask = True if decay_mask is None else decay_mask
    if cfg.name == "adam":
        tx = optax.adam(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    elif cfg.name in ("adamw", "lamb"):
        tx = (optax.adamw if cfg.name == "adamw" else optax.lamb)(
            lr,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    elif cfg.name == "sgd":
        tx = optax.sgd(lr, momentum=cfg.b1 if cfg.b1 > 0 else None)
    elif cfg.name == "adagrad":
        tx = optax.adagrad(lr, eps=cfg.eps)
    elif cfg.name == "lars":
        tx = optax.lars(
            lr,
            weight_decay=cfg.weight_decay,
            weight_decay_mask=mask,
            trust_ratio_mask=mask,
            eps=cfg.eps,
            momentum=cfg.b1,
        )
    elif cfg.name == "hessian_free":  # (its config refuses schedules and clipping)
        tx = hessian_free(
            cfg.learning_rate if peak is None else peak,
            cg_iters=cfg.hf_cg_iters,
            damping=cfg.hf_damping,
            initial_radius=cfg.hf_radius,
        )
    else:
        raise ValueError(f"unknown dense optimizer {cfg.name!r}")
    if cfg.grad_clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), tx)
    return tx
