"""Next-item losses (sequential/losses.py) against numpy on tiny cases, the sampled softmax
tending to the full one, and the negatives' samplers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data.sequences import JaggedBatch
from sequential import losses
from sequential.config import LossConfig
from sequential.layers import token_layout

R = np.random.default_rng(0)
V, D, T = 9, 4, 6
USER = R.normal(size=(T, D)).astype(np.float32)
TABLE = R.normal(size=(V + 1, D)).astype(np.float32)
TARGETS = np.array([3, 1, 9, 0, 3, 5], np.int32)  # slot 3 has no target
W = (TARGETS > 0).astype(np.float32)


def _logsumexp(x, axis):
    m = x.max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def _full_np(user, table, targets, w, tau):
    logits = user.astype(np.float64) @ table[1:].T / tau  # items 1..V
    per = _logsumexp(logits, 1) - logits[np.arange(len(targets)), np.maximum(targets, 1) - 1]
    return float((per * w).sum()), float(w.sum())


def test_full_softmax_matches_numpy():
    got = losses.full_softmax(USER, TABLE, TARGETS, W, temperature=0.5)
    np.testing.assert_allclose(got, _full_np(USER, TABLE, TARGETS, W, 0.5), rtol=1e-5)


def test_sampled_softmax_matches_numpy():
    neg = np.array([2, 3, 7, 7], np.int32)  # 3 is an accidental hit for slots 0 and 4
    c = np.log(np.array([0.5, 1.0, 2.0, 2.0], np.float32))
    got = losses.sampled_softmax(
        USER, TABLE[TARGETS], TARGETS, TABLE[neg], neg, c, W, temperature=0.5
    )
    want = 0.0
    for t in range(T):
        pos = USER[t] @ TABLE[TARGETS[t]] / 0.5
        negs = [
            USER[t] @ TABLE[j] / 0.5 - ck for j, ck in zip(neg, c, strict=True) if j != TARGETS[t]
        ]
        want += W[t] * (_logsumexp(np.array([pos, *negs]), 0) - pos)
    np.testing.assert_allclose(got, (want, W.sum()), rtol=1e-5)


def test_bce_matches_numpy():
    neg = np.array([4, 4, 2, 1, 8, 6], np.int32)
    got = losses.bce(USER, TABLE[TARGETS], TABLE[neg], W)
    pos = (USER * TABLE[TARGETS]).sum(1)
    ng = (USER * TABLE[neg]).sum(1)
    sig = 1 / (1 + np.exp(-np.concatenate([pos, ng])))
    per = -np.log(sig[:T]) - np.log(1 - sig[T:])
    np.testing.assert_allclose(got, ((per * W).sum(), W.sum()), rtol=1e-5)


def test_sampled_softmax_is_the_full_one_with_every_item_as_negative():
    """K = V negatives 1..V, uniform q: every correction is log(K / V) = 0, the target is
    dropped as an accidental hit, and what is left is the full softmax."""
    neg = np.arange(1, V + 1, dtype=np.int32)
    got = losses.sampled_softmax(
        USER, TABLE[TARGETS], TARGETS, TABLE[neg], neg, np.zeros(V, np.float32), W, temperature=0.3
    )
    np.testing.assert_allclose(got, _full_np(USER, TABLE, TARGETS, W, 0.3), rtol=1e-5)


@pytest.mark.parametrize("sampler", ["uniform", "popularity"])
def test_sampled_softmax_tends_to_the_full_one(sampler):
    """With many shared negatives, the log-Q-corrected sampled loss is within 1% of the full
    softmax; under a skewed q, the uncorrected one is far off."""
    q = np.arange(1, V + 1, dtype=np.float64) ** 2
    log_q = jnp.asarray(np.concatenate([[-np.inf], np.log(q / q.sum())]), jnp.float32)
    full = _full_np(USER, TABLE, TARGETS, W, 0.5)[0]
    out = {}
    for corrected in (True, False):
        cfg = LossConfig(num_negatives=20_000, sampler=sampler, logq_correction=corrected)
        ids, c = losses.sample_negatives(jax.random.key(3), cfg, V, log_q)
        assert ids.min() >= 1 and ids.max() <= V
        out[corrected] = float(
            losses.sampled_softmax(
                USER, TABLE[TARGETS], TARGETS, TABLE[ids], ids, c, W, temperature=0.5
            )[0]
        )
    assert abs(out[True] - full) < 0.01 * full
    assert abs(out[False] - full) > 0.5 * full


def test_popularity_sampler_needs_its_distribution():
    with pytest.raises(ValueError, match="item_log_q"):
        losses.sample_negatives(jax.random.key(0), LossConfig(sampler="popularity"), V)
    with pytest.raises(ValueError, match="kind"):
        LossConfig(kind="softmax")


def _batch(seqs, t_pad, b):
    vals = np.zeros(t_pad, np.int32)
    tg = np.zeros(t_pad, np.int32)
    lengths = [len(s) for s in seqs] + [0] * (b - len(seqs))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    for s, o in zip(seqs, offsets, strict=False):
        vals[o : o + len(s)] = s
        tg[o : o + len(s) - 1] = s[1:]
    weights = (np.asarray(lengths) > 0).astype(np.float32)
    z = np.zeros(b, np.int32)
    return JaggedBatch(vals, offsets, tg, z, weights, z - 1, {})


def test_supervision_weights():
    """Tokens with a target, in a real sequence, before position N."""
    b = _batch([[1, 2, 3, 4], [5, 6]], t_pad=8, b=3)
    sup = losses.supervision(b, max_seq_len=3)
    # seq 0: slots 0..3 (targets 2, 3, 4, 0; slot 3 past N = 3); seq 1: slots 4, 5; tail 6, 7
    np.testing.assert_array_equal(sup.weights, [1, 1, 1, 0, 1, 0, 0, 0])


def test_bce_negatives_avoid_the_sequence():
    """With 12 items and sequences holding 6 of them, a plain uniform draw would hit the
    history half the time; the redrawn negatives never do (8 tries: a miss is ~(1/2)^8 per
    slot, seeded here to none)."""
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [1, 3, 5, 7, 9, 11]]
    b = _batch(seqs, t_pad=24, b=4)

    @functools.partial(jax.jit, static_argnums=0)
    def draw(exclude):
        tokens = token_layout(jnp.asarray(b.offsets), 24, 8)
        return losses.bce_negatives(
            jax.random.key(0),
            b.values,
            b.offsets,
            jnp.asarray(b.targets),
            tokens,
            n_items=12,
            max_seq_len=8,
            exclude_history=exclude,
        )

    neg = np.asarray(draw(True))
    for s, seq in enumerate(seqs):
        assert not np.isin(neg[6 * s : 6 * s + 6], seq).any()
    plain = np.asarray(draw(False))
    assert 1 <= plain.min() and plain.max() <= 12
    assert any(np.isin(plain[6 * s : 6 * s + 6], seq).any() for s, seq in enumerate(seqs))
