"""Learning-rate schedules and learning-rate-vs-batch-size rules.

Step convention (optax's): a schedule is evaluated at the optimizer's update count *before* it is
incremented, so the first update uses ``schedule(0)``. With warmup, ``schedule(0) == 0`` (the
first update is a no-op for SGD-like optimizers), ``schedule(warmup_steps) == peak`` and
``schedule(total_steps) == end_fraction * peak``; past ``total_steps`` the value stays at the end.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["config_schedule", "learning_rate_schedule", "lr_for_batch_size"]


def learning_rate_schedule(
    peak: float | jax.Array,
    *,
    warmup_steps: int | jax.Array,
    decay: Literal["constant", "cosine", "linear"],
    total_steps: int | jax.Array,
    end_fraction: float = 0.0,
) -> optax.Schedule:
    """Linear warmup from 0 to ``peak``, then constant, cosine or linear decay.

    ``peak``, ``warmup_steps`` and ``total_steps`` may be traced values (arguments of a jitted
    step), so that runs differing only in them (a sweep's budgets, seeds and learning rates)
    share one compiled train step; they are validated when they are plain numbers. The formulas
    are optax's (``linear_schedule`` warmup joined with ``cosine_decay_schedule`` /
    ``linear_schedule``), written in jnp so they accept traced arguments.

    Args:
      peak: Peak learning rate, reached at ``warmup_steps``.
      warmup_steps: Length of the linear warmup (0 = start at ``peak``).
      decay: ``constant`` keeps ``peak`` after warmup (``total_steps``/``end_fraction`` unused);
        ``cosine``/``linear`` decay from ``peak`` at ``warmup_steps`` to ``end_fraction * peak`` at
        ``total_steps`` and stay there.
      total_steps: Total training steps.
      end_fraction: Final learning rate as a fraction of ``peak`` (cosine/linear).

    Returns:
      An ``optax.Schedule`` (step -> float32 learning rate), jittable.

    Raises:
      ValueError: on a non-positive peak, negative steps, an unknown decay, or a decaying schedule
        whose ``total_steps`` does not exceed ``warmup_steps`` (checked on plain numbers).
    """
    if decay not in ("constant", "cosine", "linear"):
        raise ValueError(f"unknown decay {decay!r}; expected constant, cosine or linear")
    if not 0.0 <= end_fraction <= 1.0:
        raise ValueError(f"end_fraction must be in [0, 1], got {end_fraction}")
    if _concrete(peak) and peak <= 0:
        raise ValueError(f"peak learning rate must be > 0, got {peak}")
    if _concrete(warmup_steps) and warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if decay != "constant" and _concrete(warmup_steps) and _concrete(total_steps):
        if total_steps - warmup_steps <= 0:
            raise ValueError(
                f"{decay} decay needs total_steps ({total_steps}) > warmup_steps ({warmup_steps})"
            )

    def schedule(count: jax.Array) -> jax.Array:
        t = jnp.asarray(count).astype(jnp.float32)
        p = jnp.asarray(peak, jnp.float32)
        w = jnp.asarray(warmup_steps, jnp.float32)
        if decay == "constant":
            after = p
        else:
            span = jnp.maximum(jnp.asarray(total_steps, jnp.float32) - w, 1.0)
            x = jnp.clip(t - w, 0.0, span)
            if decay == "cosine":
                cos = 0.5 * (1.0 + jnp.cos(jnp.pi * x / span))
                after = p * ((1.0 - end_fraction) * cos + end_fraction)
            else:
                end = p * end_fraction
                after = (p - end) * (1.0 - x / span) + end
        # Warmup: optax.linear_schedule(0, peak, w); no warmup (w = 0) selects ``after`` always.
        warm = p - p * (1.0 - jnp.clip(t, 0.0, w) / jnp.maximum(w, 1.0))
        return jnp.where(t < w, warm, after)

    return schedule


def config_schedule(
    cfg: Any,
    total_steps: int | jax.Array,
    *,
    peak: float | jax.Array | None = None,
    warmup_steps: int | jax.Array | None = None,
) -> optax.Schedule:
    """``learning_rate_schedule`` of an optimizer config (``learning_rate``, ``warmup_steps``,
    ``decay``, ``end_lr_fraction``: the dense and the embedding configs alike); ``peak`` /
    ``warmup_steps`` replace the config's, e.g. with traced values
    (``recscale.train.experiment.schedule_args``)."""
    return learning_rate_schedule(
        cfg.learning_rate if peak is None else peak,
        warmup_steps=cfg.warmup_steps if warmup_steps is None else warmup_steps,
        decay=cfg.decay,
        total_steps=total_steps,
        end_fraction=cfg.end_lr_fraction,
    )


def _concrete(x: Any) -> bool:
    return isinstance(x, int | float | np.integer | np.floating)


def lr_for_batch_size(
    base_lr: float, base_batch: int, batch: int, rule: Literal["linear", "sqrt", "none"]
) -> float:
    """Scales a learning rate tuned at ``base_batch`` to ``batch``.

    ``linear``: ``base_lr * batch / base_batch`` (Goyal et al. 2017, "Accurate, large minibatch
    SGD"; for SGD-with-momentum, pair it with warmup). ``sqrt``: ``base_lr * sqrt(batch /
    base_batch)`` (keeps the update noise scale for adaptive optimizers: Adam-family, LAMB, row-wise
    Adagrad; cf. Krizhevsky 2014, You et al. 2020 "LAMB"). ``none``: ``base_lr`` unchanged.

    Raises:
      ValueError: on non-positive inputs or an unknown rule.
    """
    if base_lr <= 0 or base_batch <= 0 or batch <= 0:
        raise ValueError(
            f"base_lr, base_batch and batch must be > 0, got {base_lr}, {base_batch}, {batch}"
        )
    ratio = batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise ValueError(f"unknown rule {rule!r}; expected linear, sqrt or none")
