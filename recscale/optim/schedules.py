"""Learning-rate schedules and learning-rate-vs-batch-size rules.

Step convention (optax's): a schedule is evaluated at the optimizer's update count *before* it is
incremented, so the first update uses ``schedule(0)``. With warmup, ``schedule(0) == 0`` (the
first update is a no-op for SGD-like optimizers), ``schedule(warmup_steps) == peak`` and
``schedule(total_steps) == end_fraction * peak``; past ``total_steps`` the value stays at the end.

Warmup-stable-decay (``decay="wsd"``; Hägele et al. 2024, "Scaling Laws and Compute-Optimal
Training Beyond Fixed Training Durations"; MiniCPM, Hu et al. 2024) holds ``peak`` from
``warmup_steps`` to the decay start ``total_steps - cooldown_steps`` and decays over the last
``cooldown_steps`` only. Before its decay start the schedule does not depend on the run's length,
so one run of a model size serves every shorter budget: a run of budget ``B`` equals, step for
step, a longer run up to ``B``'s decay start followed by ``B``'s own cooldown
(``recscale.train.branches``).

The cooldown takes ``COOLDOWN_FRACTION`` = 20% of a run's steps with the ``1-sqrt`` shape by
default: Hägele et al. find that a cooldown of about 20% of training with ``1-sqrt`` matches or
beats a cosine schedule tuned to that length (shorter cooldowns lose a little, longer ones gain
almost nothing; ``1-sqrt`` beats ``linear`` at every length they try), and a branch's extra cost
over the stable run it starts from is its cooldown, so it should be no longer than it needs to be.
"""

from __future__ import annotations

import math
import typing
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from recscale.config_optim import COOLDOWN_FRACTION, cooldown_steps, decay_start

__all__ = [
    "COOLDOWN_FRACTION",
    "config_schedule",
    "cooldown_steps",
    "decay_start",
    "learning_rate_schedule",
    "lr_for_batch_size",
]

Decay = Literal["constant", "cosine", "linear", "wsd"]
CooldownShape = Literal["1-sqrt", "linear"]


def learning_rate_schedule(
    peak: float | jax.Array,
    *,
    warmup_steps: int | jax.Array,
    decay: Decay,
    total_steps: int | jax.Array,
    end_fraction: float = 0.0,
    cooldown: int | jax.Array = 0,
    cooldown_shape: CooldownShape = "1-sqrt",
) -> optax.Schedule:
    """Linear warmup from 0 to ``peak``, then constant, cosine, linear or warmup-stable-decay.

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
        ``total_steps`` and stay there; ``wsd`` keeps ``peak`` up to ``total_steps -
        cooldown`` and decays from there to ``end_fraction * peak`` at ``total_steps``.
      total_steps: Total training steps.
      end_fraction: Final learning rate as a fraction of ``peak`` (cosine/linear/wsd).
      cooldown: ``wsd``: the cooldown's steps (``cooldown_steps``), >= 1.
      cooldown_shape: ``wsd``: ``1-sqrt`` (``1 - sqrt(x)`` of the cooldown's progress ``x``,
        Hägele et al. 2024) or ``linear`` (``1 - x``).

    Returns:
      An ``optax.Schedule`` (step -> float32 learning rate), jittable.

    Raises:
      ValueError: on a non-positive peak, negative steps, an unknown decay, or a decaying schedule
        whose ``total_steps`` does not exceed ``warmup_steps`` (checked on plain numbers).
    """
    if decay not in typing.get_args(Decay):
        raise ValueError(f"unknown decay {decay!r}; expected constant, cosine, linear or wsd")
    if cooldown_shape not in typing.get_args(CooldownShape):
        raise ValueError(f"unknown cooldown shape {cooldown_shape!r}; expected 1-sqrt or linear")
    if not 0.0 <= end_fraction <= 1.0:
        raise ValueError(f"end_fraction must be in [0, 1], got {end_fraction}")
    if _concrete(peak) and peak <= 0:
        raise ValueError(f"peak learning rate must be > 0, got {peak}")
    if _concrete(warmup_steps) and warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if decay == "wsd" and _concrete(cooldown) and _concrete(total_steps) and total_steps > 0:
        if not 1 <= cooldown <= total_steps:
            raise ValueError(f"wsd cooldown must be in [1, {total_steps}], got {cooldown}")
        if _concrete(warmup_steps) and total_steps - cooldown < warmup_steps:
            raise ValueError(
                f"wsd decay starts at step {total_steps - cooldown}, inside the warmup "
                f"({warmup_steps} steps): shorten the warmup or the cooldown"
            )
    elif decay in ("cosine", "linear") and _concrete(warmup_steps) and _concrete(total_steps):
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
        elif decay == "wsd":
            n = jnp.asarray(total_steps, jnp.float32)
            c = jnp.maximum(jnp.asarray(cooldown, jnp.float32), 1.0)
            x = jnp.clip(t - (n - c), 0.0, c) / c  # the cooldown's progress, 0 to 1
            left = 1.0 - jnp.sqrt(x) if cooldown_shape == "1-sqrt" else 1.0 - x
            end = p * end_fraction
            # Exactly ``peak`` before the decay start, whatever the run's length: the stable
            # phase of every budget is the same computation (``recscale.train.branches``).
            after = jnp.where(t < n - c, p, (p - end) * left + end)
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
    cooldown: int | jax.Array | None = None,
) -> optax.Schedule:
    """``learning_rate_schedule`` of an optimizer config (``learning_rate``, ``warmup_steps``,
    ``decay``, ``end_lr_fraction``, ``cooldown_fraction``, ``cooldown_shape``: the dense and the
    embedding configs alike); ``peak`` / ``warmup_steps`` / ``cooldown`` replace the config's,
    e.g. with traced values (``recscale.train.experiment.schedule_args``). Without ``cooldown``,
    a ``wsd`` schedule's is ``cooldown_steps(total_steps, cfg.cooldown_fraction)``, which needs a
    plain ``total_steps``."""
    if cfg.decay == "wsd" and cooldown is None:
        if not _concrete(total_steps):
            raise ValueError("a wsd schedule of traced total_steps needs its cooldown steps")
        cooldown = cooldown_steps(int(total_steps), cfg.cooldown_fraction)
    return learning_rate_schedule(
        cfg.learning_rate if peak is None else peak,
        warmup_steps=cfg.warmup_steps if warmup_steps is None else warmup_steps,
        decay=cfg.decay,
        total_steps=total_steps,
        end_fraction=cfg.end_lr_fraction,
        cooldown=0 if cooldown is None else cooldown,
        cooldown_shape=cfg.cooldown_shape,
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
