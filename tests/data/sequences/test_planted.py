"""The planted sequential generator (data/sequences/planted.py)."""

import dataclasses

import numpy as np
import pytest

from data.sequences.planted import EVAL_INDEX_OFFSET, PlantedConfig, PlantedSequences

SMALL = PlantedConfig(n_items=400, num_tastes=8, min_len=8, max_len=24, num_eval_users=300)


@pytest.fixture(scope="module")
def gen() -> PlantedSequences:
    return PlantedSequences(SMALL, seed=5)


def test_pure_function_of_cfg_seed_index(gen):
    idx = np.array([3, 0, 17, EVAL_INDEX_OFFSET + 2, 3])
    x, n = gen.sample(idx)
    x2, n2 = PlantedSequences(SMALL, seed=5).sample(idx[::-1])  # other batch, other order
    np.testing.assert_array_equal(x, x2[::-1])
    np.testing.assert_array_equal(n, n2[::-1])
    np.testing.assert_array_equal(x[0], x[4])
    one, _ = gen.sample(np.array([17]))
    np.testing.assert_array_equal(one[0], x[2])
    other, _ = PlantedSequences(SMALL, seed=6).sample(idx)
    assert not np.array_equal(other, x)
    assert np.all((n >= SMALL.min_len) & (n <= SMALL.max_len))
    assert np.all(x[np.arange(SMALL.max_len)[None] >= n[:, None]] == 0)
    h = gen.train_histories(10, 5)
    assert h.user_raw.tolist() == [10, 11, 12, 13, 14] and h.items.min() >= 1
    assert h.items.max() <= SMALL.n_items and h.n_items == SMALL.n_items


def test_popularity_is_zipf_skewed(gen):
    h = gen.train_histories(0, 400)
    counts = np.bincount(h.items, minlength=SMALL.n_items + 1)[1:]
    top = np.argsort(-gen.pop[1:])[:20]
    # The 20 most popular items (5% of them) draw far more than 5% of the events.
    assert counts[top].sum() / counts.sum() > 0.2
    assert np.corrcoef(np.log(gen.pop[1:]), np.log(counts + 1))[0, 1] > 0.5


def test_sampled_loss_equals_expected_entropy(gen):
    """The mean -log p(x_t | x_<t) of sampled items estimates the mean entropy of the
    predictive distributions: they agree within sampling error only if the sampler draws from
    the very distributions the scorer computes."""
    h = gen.eval_histories()
    nll = -gen.log_probs(h)
    ent = gen.entropies(h)
    d = nll - ent  # a martingale difference per position: mean 0, uncorrelated
    se = d.std() / np.sqrt(d.size)
    assert abs(d.mean()) < 4 * se, (d.mean(), se)
    assert 0.5 < ent.mean() < np.log(SMALL.n_items)
    # The check has power: a scorer without the lag part (same tables otherwise) fails it.
    wrong = PlantedSequences(dataclasses.replace(SMALL, mix=(0.4, 0.4, 0.0)), seed=5)
    np.testing.assert_array_equal(wrong.succ, gen.succ)
    d_wrong = -wrong.log_probs(h) - wrong.entropies(h)
    assert d_wrong.mean() > 8 * d_wrong.std() / np.sqrt(d_wrong.size)


def test_bayes_loss_below_baselines(gen):
    losses = gen.losses(gen.eval_histories(), gen.train_histories(0, 600))
    assert losses["taste_known"] <= losses["bayes"] + 1e-9
    assert losses["bayes"] < losses["last_item"] - 0.2
    assert losses["bayes"] < losses["bag"] - 0.2
    assert losses["bag"] < losses["unigram"] and losses["last_item"] < losses["unigram"]
    assert losses["unigram"] < losses["log_n_items"]


def test_bad_config():
    with pytest.raises(ValueError, match="lag must be >= 2"):
        PlantedConfig(lag=1)
    with pytest.raises(ValueError, match="min_len <= max_len"):
        PlantedConfig(min_len=5, max_len=4)
    with pytest.raises(ValueError, match="indices must be >= 0"):
        PlantedSequences(SMALL, 0).sample(np.array([-1]))
