"""Metrics against scikit-learn and hand calculations; mergeability; padding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score

from recscale.metrics import (
    EvalAccumulator,
    auc,
    batch_loss_sums,
    calibration,
    logloss,
    metrics_from_sums,
    normalized_entropy,
)


def _data(n=5000, seed=0, ties=True, weighted=True):
    rng = np.random.default_rng(seed)
    labels = (rng.random(n) < 0.3).astype(np.float32)
    logits = (rng.normal(size=n) + 1.5 * labels).astype(np.float32)
    if ties:  # few distinct scores: many ties within and across classes
        logits = np.round(logits * 4) / 4
    weights = rng.uniform(0.1, 3.0, size=n).astype(np.float32) if weighted else None
    return logits, labels, weights


def _sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


@pytest.mark.parametrize("ties", [True, False])
@pytest.mark.parametrize("weighted", [True, False])
def test_auc_matches_sklearn(ties, weighted):
    logits, labels, weights = _data(ties=ties, weighted=weighted)
    assert ties == (np.unique(logits).size < 100)
    want = roc_auc_score(labels, _sigmoid(logits), sample_weight=weights)
    assert auc(logits, labels, weights) == pytest.approx(want, abs=1e-6)
    assert auc(_sigmoid(logits), labels, weights) == pytest.approx(want, abs=1e-6)


def test_auc_hand_cases():
    assert auc([0.1, 0.9], [0, 1]) == 1.0
    assert auc([0.9, 0.1], [0, 1]) == 0.0
    assert auc([0.5, 0.5], [0, 1]) == 0.5
    # Positive weight 3 above the negative, weight 1 below it: 3/4.
    assert auc([0.2, 0.5, 0.9], [1, 0, 1], [1.0, 1.0, 3.0]) == pytest.approx(0.75)
    assert math.isnan(auc([0.1, 0.2], [1, 1]))


def test_logloss_matches_sklearn():
    logits, labels, weights = _data(ties=False)
    for w in (None, weights):
        want = log_loss(labels, _sigmoid(logits), sample_weight=w)
        assert logloss(logits, labels, w) == pytest.approx(want, abs=1e-6)


def test_logloss_is_stable_for_extreme_logits():
    got = logloss([-1000.0, 1000.0, 1000.0, -1000.0], [0, 1, 0, 1])
    assert got == pytest.approx(500.0)  # two perfect (0), two wrong by 1000 nats each


def test_ne_and_calibration_hand_calculation():
    logits = np.log(np.array([0.2, 0.5, 0.8, 0.4]) / (1 - np.array([0.2, 0.5, 0.8, 0.4])))
    labels = np.array([0, 1, 1, 0])
    weights = np.array([1.0, 2.0, 1.0, 0.0])  # last example is padding
    ll = -(math.log(0.8) + 2 * math.log(0.5) + math.log(0.8)) / 4
    p = 3 / 4
    h = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert logloss(logits, labels, weights) == pytest.approx(ll, rel=1e-12)
    assert normalized_entropy(logits, labels, weights) == pytest.approx(ll / h, rel=1e-12)
    assert calibration(logits, labels, weights) == pytest.approx(((0.2 + 1.0 + 0.8) / 4) / p)


def test_single_class_gives_nan():
    r = EvalAccumulator()
    r.update(np.array([0.3, -1.0]), np.array([0, 0]))
    out = r.result()
    assert math.isnan(out["auc"]) and math.isnan(out["ne"]) and math.isnan(out["calibration"])
    assert out["logloss"] > 0 and out["num_examples"] == 2


def test_empty_accumulator():
    out = EvalAccumulator().result()
    assert out["num_examples"] == 0
    assert all(math.isnan(out[k]) for k in ("auc", "logloss", "ne", "calibration"))


def test_merge_of_split_batches_equals_one_shot():
    logits, labels, weights = _data(n=3001)
    one = EvalAccumulator()
    one.update(logits, labels, weights)
    parts = []
    for sl in np.array_split(np.arange(logits.size), 7):
        acc = EvalAccumulator()
        acc.update(logits[sl], labels[sl], weights[sl])
        parts.append(acc)
    merged = parts[0]
    for p in parts[1:]:
        merged = merged.merge(p)
    want, got = one.result(), merged.result()
    assert got["num_examples"] == want["num_examples"] == logits.size
    for k in ("auc", "logloss", "ne", "calibration", "mean_prediction", "mean_label"):
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-12), k
    assert parts[0].result()["num_examples"] == parts[0].num_examples  # merge did not mutate


def test_padding_is_ignored():
    logits, labels, weights = _data(n=1000)
    clean = EvalAccumulator()
    clean.update(logits, labels, weights)
    padded = EvalAccumulator()
    pad_logits = np.concatenate([logits, np.full(24, 50.0, np.float32)]).reshape(8, -1)
    pad_labels = np.concatenate([labels, np.zeros(24, np.float32)]).reshape(8, -1)
    pad_weights = np.concatenate([weights, np.zeros(24, np.float32)]).reshape(8, -1)
    padded.update(jnp.asarray(pad_logits), jnp.asarray(pad_labels), jnp.asarray(pad_weights))
    assert padded.result() == clean.result()
    assert padded.result()["num_examples"] == 1000


def test_update_rejects_bad_inputs():
    acc = EvalAccumulator()
    with pytest.raises(ValueError, match="0 or 1"):
        acc.update(np.zeros(3), np.array([0, 0.5, 1]))
    with pytest.raises(ValueError, match="elements"):
        acc.update(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match=">= 0"):
        acc.update(np.zeros(2), np.zeros(2), np.array([1.0, -1.0]))


def test_without_examples_only_sums():
    logits, labels, weights = _data(n=500)
    acc = EvalAccumulator(keep_examples=False)
    acc.update(logits, labels, weights)
    out = acc.result()
    assert math.isnan(out["auc"])
    assert out["logloss"] == pytest.approx(logloss(logits, labels, weights), rel=1e-12)


def test_batch_loss_sums_jitted_match_accumulator():
    logits, labels, weights = _data(n=2048)
    sums = jax.jit(batch_loss_sums)(logits, labels, weights)
    got = metrics_from_sums(sums)
    acc = EvalAccumulator(keep_examples=False)
    acc.update(logits, labels, weights)
    want = acc.result()
    for k in ("logloss", "ne", "calibration", "mean_prediction", "mean_label"):
        assert got[k] == pytest.approx(want[k], rel=1e-5), k
    unweighted = metrics_from_sums(batch_loss_sums(logits, labels))
    assert unweighted["logloss"] == pytest.approx(logloss(logits, labels), rel=1e-5)
