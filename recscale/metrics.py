"""Evaluation metrics of binary click models: AUC, logloss, normalized entropy, calibration.

``EvalAccumulator`` is a mergeable host-side (NumPy) state, so evaluation over many batches, and
over hosts, is exact: logloss, NE and calibration come from running weighted sums; AUC is exact
from the kept ``(logit, label, weight)`` triples. All metrics take **logits** (pre-sigmoid
scores); AUC is invariant to the monotone sigmoid, and computing it on logits avoids the ties
float32 sigmoid creates by saturating.

Weights: an example of weight 0 is padding and is skipped entirely; other weights scale an
example's contribution (as ``sample_weight`` does in scikit-learn).

Definitions (``w`` weights, ``y`` labels in {0, 1}, ``p = sigmoid(logit)``):

* ``logloss = sum(w * -[y log p + (1-y) log(1-p)]) / sum(w)`` in nats, computed from logits as
  ``softplus(logit) - y * logit`` (numerically stable for any logit).
* ``ne = logloss / H(mean_label)`` with ``H(q) = -(q log q + (1-q) log(1-q))``: the logloss
  normalised by that of always predicting the evaluated set's (weighted) base rate (He et al.
  2014, "Practical lessons from predicting clicks on ads at Facebook"). Lower is better, 1.0 is
  no better than the base rate. ``nan`` when every label is equal (``H = 0``: NE is undefined).
* ``calibration = mean_prediction / mean_label`` (weighted means of ``p`` and ``y``); 1.0 is
  calibrated, ``nan`` when ``mean_label == 0``.
* ``auc``: exact ROC AUC; tied scores count one half (the trapezoid over the ROC curve, as
  ``sklearn.metrics.roc_auc_score``); ``nan`` when only one class is present (the ROC curve is
  undefined; scikit-learn raises instead).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

__all__ = [
    "EvalAccumulator",
    "auc",
    "batch_loss_sums",
    "calibration",
    "logloss",
    "metrics_from_sums",
    "normalized_entropy",
]


def _as_arrays(
    logits: Any, labels: Any, weights: Any | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Flattens and validates one batch; returns float logits, float64 labels, weights or None."""
    x = np.asarray(logits)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    x = x.reshape(-1)
    y = np.asarray(labels).reshape(-1).astype(np.float64)
    if y.shape != x.shape:
        raise ValueError(f"labels have {y.size} elements, logits {x.size}")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 0 or 1")
    w = None
    if weights is not None:
        w = np.asarray(weights).reshape(-1).astype(np.float64)
        if w.shape != x.shape:
            raise ValueError(f"weights have {w.size} elements, logits {x.size}")
        if not np.all(w >= 0):
            raise ValueError("weights must be >= 0 (0 marks padding)")
    return x, y, w


def _drop_padding(
    x: np.ndarray, y: np.ndarray, w: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    if w is None:
        return x, y, None
    keep = w > 0
    if keep.all():
        return x, y, w
    return x[keep], y[keep], w[keep]


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # Two branches so exp never overflows.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _binary_entropy(q: float) -> float:
    if not 0.0 < q < 1.0:
        return 0.0
    return -(q * math.log(q) + (1.0 - q) * math.log1p(-q))


def _auc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray | None) -> float:
    """Exact weighted ROC AUC, ties counted 1/2; O(n log n)."""
    if weights is None:
        weights = np.ones_like(labels)
    pos_w = weights * labels
    neg_w = weights * (1.0 - labels)
    total_pos, total_neg = pos_w.sum(), neg_w.sum()
    if total_pos <= 0 or total_neg <= 0:
        return math.nan
    # Group equal scores; within a group every (positive, negative) pair is a tie worth 1/2.
    uniq, inv = np.unique(scores, return_inverse=True)
    pos_g = np.bincount(inv, weights=pos_w, minlength=uniq.size)
    neg_g = np.bincount(inv, weights=neg_w, minlength=uniq.size)
    neg_below_g = np.cumsum(neg_g) - neg_g  # negatives with a strictly lower score
    wins = np.sum(pos_g * (neg_below_g + 0.5 * neg_g))
    return float(wins / (total_pos * total_neg))


# ------------------------------------------------------------------------------------------------
# One-shot functions.


def auc(scores: Any, labels: Any, weights: Any | None = None) -> float:
    """Exact ROC AUC of ``scores`` (logits or probabilities) against 0/1 ``labels``.

    Equals ``sklearn.metrics.roc_auc_score(labels, scores, sample_weight=weights)``: ties count
    one half, weights scale each example's contribution to the positive/negative pair counts. Zero
    weights are padding. Returns ``nan`` with a single class present.
    """
    x, y, w = _drop_padding(*_as_arrays(scores, labels, weights))
    return _auc(x, y, w)


def logloss(logits: Any, labels: Any, weights: Any | None = None) -> float:
    """Weighted mean binary cross-entropy (nats) from logits; ``nan`` on an empty set."""
    acc = EvalAccumulator(keep_examples=False)
    acc.update(logits, labels, weights)
    return acc.result()["logloss"]


def normalized_entropy(logits: Any, labels: Any, weights: Any | None = None) -> float:
    """``logloss / H(weighted label mean)`` (He et al. 2014); ``nan`` if all labels are equal."""
    acc = EvalAccumulator(keep_examples=False)
    acc.update(logits, labels, weights)
    return acc.result()["ne"]


def calibration(logits: Any, labels: Any, weights: Any | None = None) -> float:
    """Weighted mean predicted probability over weighted mean label; ``nan`` if no positives."""
    acc = EvalAccumulator(keep_examples=False)
    acc.update(logits, labels, weights)
    return acc.result()["calibration"]


# ------------------------------------------------------------------------------------------------
# Mergeable accumulator.


@dataclasses.dataclass
class EvalAccumulator:
    """Mergeable evaluation state: weighted sums plus, for exact AUC, every example.

    Memory: with ``keep_examples`` (the default), every non-padding example's logit, label and
    weight is kept on the host (about 17 bytes per example with float32 logits, float64 weights
    and bool labels: ~170 MB for 10M examples) and sorted once in ``result`` (O(n log n)). With
    ``keep_examples=False`` only six numbers are kept and ``auc`` is ``nan``.

    Inputs may be NumPy or (fully addressable) JAX arrays of any shape; they are flattened.
    """

    keep_examples: bool = True
    """Keep (logit, label, weight) triples for exact AUC."""
    num_examples: int = 0
    """Examples with weight > 0."""
    weight_sum: float = 0.0
    loss_sum: float = 0.0
    """Sum of weight * logloss (nats)."""
    label_sum: float = 0.0
    """Sum of weight * label."""
    prediction_sum: float = 0.0
    """Sum of weight * sigmoid(logit)."""
    _logits: list[np.ndarray] = dataclasses.field(default_factory=list, repr=False)
    _labels: list[np.ndarray] = dataclasses.field(default_factory=list, repr=False)
    _weights: list[np.ndarray] = dataclasses.field(default_factory=list, repr=False)

    def update(self, logits: Any, labels: Any, weights: Any | None = None) -> None:
        """Adds a batch; examples of weight 0 (padding) are skipped."""
        x, y, w = _drop_padding(*_as_arrays(logits, labels, weights))
        x64 = x.astype(np.float64)
        w64 = np.ones_like(x64) if w is None else w
        self.num_examples += int(x.size)
        self.weight_sum += float(w64.sum())
        self.loss_sum += float(np.sum(w64 * (_softplus(x64) - y * x64)))
        self.label_sum += float(np.sum(w64 * y))
        self.prediction_sum += float(np.sum(w64 * _sigmoid(x64)))
        if self.keep_examples:
            self._logits.append(x)
            self._labels.append(y.astype(bool))
            self._weights.append(w64)

    def merge(self, other: EvalAccumulator) -> EvalAccumulator:
        """Returns a new accumulator equal to having seen both inputs (neither is modified)."""
        return EvalAccumulator(
            keep_examples=self.keep_examples and other.keep_examples,
            num_examples=self.num_examples + other.num_examples,
            weight_sum=self.weight_sum + other.weight_sum,
            loss_sum=self.loss_sum + other.loss_sum,
            label_sum=self.label_sum + other.label_sum,
            prediction_sum=self.prediction_sum + other.prediction_sum,
            _logits=self._logits + other._logits,
            _labels=self._labels + other._labels,
            _weights=self._weights + other._weights,
        )

    def result(self) -> dict[str, float]:
        """``auc, logloss, ne, calibration, mean_prediction, mean_label, num_examples,
        weight_sum`` (floats; ``nan`` where undefined, see the module docstring)."""
        if self.weight_sum > 0:
            ll = self.loss_sum / self.weight_sum
            mean_label = self.label_sum / self.weight_sum
            mean_pred = self.prediction_sum / self.weight_sum
        else:
            ll = mean_label = mean_pred = math.nan
        h = _binary_entropy(mean_label) if self.weight_sum > 0 else 0.0
        out = {
            "auc": math.nan,
            "logloss": ll,
            "ne": ll / h if h > 0 else math.nan,
            "calibration": mean_pred / mean_label if mean_label > 0 else math.nan,
            "mean_prediction": mean_pred,
            "mean_label": mean_label,
            "num_examples": self.num_examples,
            "weight_sum": self.weight_sum,
        }
        if self.keep_examples and self._logits:
            out["auc"] = _auc(
                np.concatenate(self._logits),
                np.concatenate(self._labels).astype(np.float64),
                np.concatenate(self._weights),
            )
        return out


# ------------------------------------------------------------------------------------------------
# Jittable per-batch sums for training-time logging.


def batch_loss_sums(logits: Any, labels: Any, weights: Any | None = None) -> dict[str, Any]:
    """Jittable weighted sums of one batch (jnp): ``loss_sum, weight_sum, label_sum,
    prediction_sum``. Sum them over steps/devices, then call ``metrics_from_sums``."""
    import jax  # noqa: PLC0415  (keep this module importable without jax)
    import jax.numpy as jnp  # noqa: PLC0415

    x = jnp.asarray(logits, jnp.float32).reshape(-1)
    y = jnp.asarray(labels, jnp.float32).reshape(-1)
    w = jnp.ones_like(x) if weights is None else jnp.asarray(weights, jnp.float32).reshape(-1)
    return {
        "loss_sum": jnp.sum(w * (jax.nn.softplus(x) - y * x)),
        "weight_sum": jnp.sum(w),
        "label_sum": jnp.sum(w * y),
        "prediction_sum": jnp.sum(w * jax.nn.sigmoid(x)),
    }


def metrics_from_sums(sums: dict[str, Any]) -> dict[str, float]:
    """``logloss, ne, calibration, mean_prediction, mean_label`` from ``batch_loss_sums``."""
    acc = EvalAccumulator(
        keep_examples=False,
        weight_sum=float(sums["weight_sum"]),
        loss_sum=float(sums["loss_sum"]),
        label_sum=float(sums["label_sum"]),
        prediction_sum=float(sums["prediction_sum"]),
    )
    r = acc.result()
    return {k: r[k] for k in ("logloss", "ne", "calibration", "mean_prediction", "mean_label")}
