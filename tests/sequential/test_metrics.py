"""Ranking metrics (sequential/metrics.py) against brute-force numpy on tiny cases, ties
included (small integer embeddings make many exact ties), and SASRec's sampled negatives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from data.sequences import Histories, JaggedBatch
from sequential import metrics
from sequential.config import SASRecConfig
from sequential.sasrec.model import SASRec

R = np.random.default_rng(0)
V, D, B, M = 13, 3, 12, 4
TABLE = R.integers(-1, 2, size=(V + 1, D)).astype(np.float32)  # values -1, 0, 1: ties galore
USER = R.integers(-2, 3, size=(B, D)).astype(np.float32)
TARGET = R.integers(1, V + 1, size=B).astype(np.int32)
HISTORY = R.integers(0, V + 1, size=(B, M)).astype(np.int32)  # 0: no item
HISTORY[0] = [TARGET[0], 2, 0, 0]  # a target in its own history: excluded, a miss
HISTORY[1] = [5, 5, 7, 0]  # a repeated item


def _rank_np(user, table, target, history):
    """1 + #{j in 1..V, j != y, j not in history : s_j >= s_y}, inf if y is in history."""
    out = np.zeros(len(target))
    for b in range(len(target)):
        s = table @ user[b]
        excl = set() if history is None else set(history[b].tolist())
        if target[b] in excl:
            out[b] = np.inf
            continue
        out[b] = 1 + sum(
            s[j] >= s[target[b]] for j in range(1, V + 1) if j != target[b] and j not in excl
        )
    return out


@pytest.mark.parametrize("chunk", [4, 1000])  # 4 does not divide V + 1 = 14: a shifted last chunk
@pytest.mark.parametrize("exclude", [True, False])
def test_full_rank_matches_brute_force(chunk, exclude):
    hist = HISTORY if exclude else None
    got = metrics.rank_full(
        USER, TABLE, TARGET, None if hist is None else jnp.asarray(hist), l2_norm=False, chunk=chunk
    )
    np.testing.assert_array_equal(got, _rank_np(USER, TABLE, TARGET, hist))
    assert (np.asarray(got)[0] == np.inf) == exclude


def test_full_rank_with_l2_normalised_items():
    table = R.normal(size=(V + 1, D)).astype(np.float32)
    got = metrics.rank_full(USER, table, TARGET, None, l2_norm=True, chunk=5)
    unit = table / np.linalg.norm(table, axis=1, keepdims=True)
    np.testing.assert_array_equal(got, _rank_np(USER, unit, TARGET, None))


def test_metric_sums_and_finalize():
    rank = jnp.asarray([1.0, 3.0, 10.0, 11.0, np.inf, 2.0])
    valid = jnp.asarray([True, True, True, True, True, False])
    got = metrics.finalize(metrics.metric_sums(rank, valid, ks=(1, 10)))
    r = np.array([1.0, 3.0, 10.0, 11.0, np.inf])
    want = {
        "hr@1": np.mean(r <= 1),
        "hr@10": np.mean(r <= 10),
        "ndcg@1": np.mean(np.where(r <= 1, 1 / np.log2(np.minimum(r, 1e9) + 1), 0)),
        "ndcg@10": np.mean(np.where(r <= 10, 1 / np.log2(np.minimum(r, 1e9) + 1), 0)),
        "mrr": np.mean(1 / r),
        "count": 5.0,
    }
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)


def test_sampled_rank_counts_ties_against_the_target():
    cand = np.zeros((2, 4, D), np.float32)
    cand[0, 0] = [1, 0, 0]  # target
    cand[0, 1:] = [[1, 0, 0], [2, 0, 0], [0, 0, 0]]  # a tie, a better one, a worse one
    cand[1, 0] = [3, 0, 0]
    user = np.array([[1, 0, 0], [1, 0, 0]], np.float32)
    np.testing.assert_array_equal(metrics.rank_sampled(user, cand), [3.0, 1.0])


def _rated() -> Histories:
    items = np.array([1, 2, 3, 4, 5, 6, 7, 2, 9, 1], np.int32)
    return Histories(
        items=items,
        offsets=np.array([0, 3, 9, 10], np.int64),
        user_raw=np.arange(3),
        item_raw=np.arange(1, 11),
    )


def test_sasrec_negatives():
    """Uniform over items the user has not rated, never the target, deterministic per (seed,
    user row) whatever the batch holds; a padding row gets zeros."""
    hist = _rated()
    rows = np.array([1, 0, 2, -1])
    targets = np.array([10, 4, 3, 0])
    neg = metrics.sasrec_negatives(hist, rows, targets, seed=7)
    assert neg.shape == (4, 100) and neg.dtype == np.int32
    assert (neg[3] == 0).all()
    for i, row in enumerate(rows[:3]):
        seen = set(hist.items[hist.offsets[row] : hist.offsets[row + 1]].tolist())
        allowed = set(range(1, 11)) - seen - {int(targets[i])}
        assert set(neg[i].tolist()) <= allowed
        assert len(set(neg[i].tolist())) == len(allowed)  # 100 draws cover a handful of items
    again = metrics.sasrec_negatives(hist, rows[[2, 0]], targets[[2, 0]], seed=7)
    np.testing.assert_array_equal(again, neg[[2, 0]])
    assert (metrics.sasrec_negatives(hist, rows, targets, seed=8) != neg).any()
    full = Histories(
        items=np.arange(1, 10, dtype=np.int32),
        offsets=np.array([0, 9], np.int64),
        user_raw=np.arange(1),
        item_raw=np.arange(1, 11),
    )
    with pytest.raises(ValueError, match="rated every one"):  # items 1..9, target 10
        metrics.sasrec_negatives(full, np.array([0]), np.array([10]), seed=0)


def test_model_metrics_match_numpy():
    """full_metrics and sampled_metrics of a small SASRec: its queries are the last tokens,
    ranked as the brute force ranks them."""
    cfg = SASRecConfig(n_items=V, d_model=4, num_layers=1, max_seq_len=4)
    model = SASRec(cfg, rngs=nnx.Rngs(0))
    seqs = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]  # the second is longer than N: its query is pos 3
    final = [4, 9, 9]
    t_pad, b = 12, 4
    vals, tg = np.zeros(t_pad, np.int32), np.zeros(t_pad, np.int32)
    offsets = np.array([0, 3, 8, 9, 9], np.int32)
    for s, o, y in zip(seqs, offsets, final, strict=False):
        vals[o : o + len(s)] = s
        tg[o + len(s) - 1] = y
    tg[6] = 8  # sequence 1's slot at position N - 1 carries the target of its query
    batch = JaggedBatch(
        vals,
        offsets,
        tg,
        np.zeros(b, np.int32),
        np.array([1, 1, 1, 0], np.float32),
        np.array([0, 1, 2, -1], np.int32),
        {},
    )
    negs = np.array([[5, 6, 7], [1, 2, 3], [1, 2, 3], [0, 0, 0]], np.int32)
    graphdef, state = nnx.split(model)

    @jax.jit  # one program: the model's ops one by one would each compile
    def run(state):
        m = nnx.merge(graphdef, state)
        full = metrics.full_metrics(m, batch, ks=(5,), chunk=5)
        sampled = metrics.sampled_metrics(m, batch, negs, ks=(2,))
        return m(batch.values, batch.offsets), m.item_table(), full, sampled

    user, table, full, sampled = run(state)
    user, table = np.asarray(user)[[2, 6, 8]], np.asarray(table)
    unit = table / np.linalg.norm(table, axis=1, keepdims=True)
    history = np.array([[1, 2, 3, 0], [4, 5, 6, 7], [9, 0, 0, 0]], np.int32)
    rank = _rank_np(user, unit, np.array([4, 8, 9]), history)
    assert rank[2] == np.inf  # the target 9 is in its own history
    got = metrics.finalize(full)
    np.testing.assert_allclose(got["mrr"], np.mean(1 / rank), rtol=1e-6)
    np.testing.assert_allclose(got["hr@5"], np.mean(rank <= 5), rtol=1e-6)
    assert got["count"] == 3

    got = metrics.finalize(sampled)
    cand = np.concatenate([[[4], [8], [9]], negs[:3]], axis=1)
    s = np.einsum("bd,bsd->bs", user, table[cand])
    srank = 1 + (s[:, 1:] >= s[:, :1]).sum(1)
    np.testing.assert_allclose(got["mrr"], np.mean(1 / srank), rtol=1e-6)
    np.testing.assert_allclose(got["ndcg@2"], np.mean((srank <= 2) / np.log2(srank + 1)))
