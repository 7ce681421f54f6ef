"""The gradient noise scale (McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of
Large-Batch Training"): ``B_simple = tr(Σ) / |G|²``, the batch size above which a larger batch
stops buying proportionally fewer steps, estimated from gradients the run computes anyway.

With the squared norms of the batch-mean gradient at two batch sizes, ``|G_small|²`` at
``B_small`` and ``|G_big|²`` at ``B_big`` (their expectations are ``|G|² + tr(Σ)/B``), the paper's
Appendix A gives unbiased estimates of both terms:

    |G|²   ≈ (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small)
    tr(Σ) ≈ (|G_small|² - |G_big|²) / (1/B_small - 1/B_big)

Here the small batches are ``k`` micro-batches of the step's batch (``|G_small|²`` averaged over
them) and the big one the whole batch, each a gradient of the batch-mean loss. Their ratio is
biased, so, as the paper does, both estimates are averaged over steps (an exponential moving
average, :class:`NoiseScale`) before dividing. Dense parameters and embedding tables are
measured apart: ``recscale.train.steps.make_gradient_sq_norms``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax


def estimates(small_sq: Any, big_sq: Any, b_small: float, b_big: float) -> tuple[Any, Any]:
    """Unbiased ``(|G|², tr(Σ))`` from the squared gradient norms at two batch sizes."""
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


def micro_batch_sq_norms(sq_norms: Callable[[Any], dict], batch: Any, k: int) -> tuple[dict, dict]:
    """``(mean over k micro-batches of sq_norms(micro-batch), sq_norms(batch))``: ``batch`` a
    pytree of arrays with the examples on axis 0 (divisible by ``k``), ``sq_norms`` a function
    of a batch giving a dict of squared gradient norms."""
    n = jax.tree.leaves(batch)[0].shape[0]
    if k < 2 or n % k:
        raise ValueError(f"noise scale: {k} micro-batches must be >= 2 and divide the batch {n}")
    m = n // k
    parts = [sq_norms(jax.tree.map(lambda x, i=i: x[i * m : (i + 1) * m], batch)) for i in range(k)]
    small = jax.tree.map(lambda *xs: sum(xs) / k, *parts)
    return small, sq_norms(batch)


@dataclasses.dataclass
class NoiseScale:
    """Exponential moving averages of ``|G|²`` and ``tr(Σ)`` per part, and their ratio."""

    decay: float = 0.9
    g2: dict = dataclasses.field(default_factory=dict)
    trace: dict = dataclasses.field(default_factory=dict)

    def update(self, small: dict, big: dict, b_small: float, b_big: float) -> dict[str, float]:
        """Folds one measurement in; returns ``{part: B_simple, part/g2: .., part/trace: ..}``
        from the averages (``B_simple`` is NaN while the averaged ``|G|²`` is not positive), and
        this measurement's own unbiased ``part/g2_now`` and ``part/trace_now``, for analyses that
        pool measurements their own way (``sweeps.batch_analysis``: those taken near a target)."""
        out = {}
        for part in sorted(big):
            g2, tr = estimates(float(small[part]), float(big[part]), b_small, b_big)
            a = self.decay
            self.g2[part] = g2 if part not in self.g2 else a * self.g2[part] + (1 - a) * g2
            self.trace[part] = tr if part not in self.trace else a * self.trace[part] + (1 - a) * tr
            g, t = self.g2[part], self.trace[part]
            out[part] = t / g if g > 0 else float("nan")
            out[f"{part}/g2"], out[f"{part}/trace"] = g, t
            out[f"{part}/g2_now"], out[f"{part}/trace_now"] = g2, tr
        return out
