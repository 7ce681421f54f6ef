"""Token-budget packing into fixed-shape jagged batches (data/sequences/jagged.py)."""

import dataclasses

import numpy as np
import pytest

from data.sequences.histories import build_histories
from data.sequences.jagged import JaggedBatch, PackConfig, Packer

CFG = PackConfig(token_budget=50, max_sequences=6, block_size=16)


@pytest.fixture(scope="module")
def hist():
    r = np.random.default_rng(0)
    lengths = r.integers(1, 30, size=40)
    lengths[[3, 17]] = (70, 51)  # longer than the budget: cut to the most recent 50
    users = np.repeat(np.arange(40), lengths)
    n = users.shape[0]
    return build_histories(
        users,
        r.integers(1, 200, size=n),
        np.arange(n),
        side={"action": r.integers(0, 4, size=n).astype(np.int8)},
    )


def _check_batch(b: JaggedBatch, hist, cfg: PackConfig) -> list[tuple[int, list[int]]]:
    """Asserts the layout invariants; returns (user row, packed items) per real sequence."""
    bsz, t_pad = cfg.max_sequences, cfg.max_tokens_padded
    assert b.values.shape == b.targets.shape == (t_pad,) and t_pad % cfg.block_size == 0
    assert b.offsets.shape == (bsz + 1,) and b.offsets.dtype == np.int32
    assert b.values.dtype == b.targets.dtype == np.int32
    assert b.weights.shape == b.num_targets.shape == b.user_rows.shape == (bsz,)
    assert b.side["action"].shape == (t_pad,)
    real = int(b.weights.sum())
    t = b.num_tokens
    assert t <= cfg.token_budget  # budget respected
    assert np.all(np.diff(b.offsets) >= 0) and b.offsets[0] == 0
    assert np.all(np.diff(b.offsets[: real + 1]) > 0)  # real sequences are not empty
    assert np.all(b.offsets[real:] == t)  # padding sequences: empty, at the end
    assert np.all(b.weights[:real] == 1) and np.all(b.weights[real:] == 0)
    assert np.all(b.user_rows[real:] == -1) and np.all(b.num_targets[real:] == 0)
    assert np.all(b.values[:t] > 0) and np.all(b.values[t:] == 0)  # padding only at the tail
    assert np.all(b.targets[t:] == 0) and np.all(b.side["action"][t:] == 0)
    out = []
    for s in range(real):
        row = int(b.user_rows[s])
        seq = b.values[b.offsets[s] : b.offsets[s + 1]]
        full = hist.user_items(row)
        np.testing.assert_array_equal(seq, full[-seq.shape[0] :])  # the most recent events
        assert seq.shape[0] == min(full.shape[0], cfg.token_budget)
        tg = b.targets[b.offsets[s] : b.offsets[s + 1]]
        np.testing.assert_array_equal(tg[:-1], seq[1:])  # next item
        assert tg[-1] == 0 and b.num_targets[s] == seq.shape[0] - 1
        act = hist.side["action"][hist.offsets[row + 1] - seq.shape[0] : hist.offsets[row + 1]]
        np.testing.assert_array_equal(b.side["action"][b.offsets[s] : b.offsets[s + 1]], act)
        out.append((row, seq.tolist()))
    return out


def test_every_user_once_per_epoch_never_split(hist):
    packer = Packer(hist, CFG, seed=3)
    assert (packer.truncated_users, packer.truncated_events) == (2, 20 + 1)
    for epoch in range(2):
        seen = []
        for b in packer.epoch_batches(epoch):
            seen += [row for row, _ in _check_batch(b, hist, CFG)]
        assert sorted(seen) == list(range(hist.num_users))  # every user once, whole
    order0, order1 = packer.epoch_order(0), packer.epoch_order(1)
    assert not np.array_equal(order0, order1)  # a new order each epoch


def test_greedy_cut_is_tight(hist):
    """A batch ends only when the next user would break the budget or B."""
    packer = Packer(hist, CFG, seed=1)
    order, cuts = packer.epoch_plan(0)
    for k in range(len(cuts) - 2):
        rows = order[cuts[k] : cuts[k + 1]]
        nxt = order[cuts[k + 1]]
        tokens = packer.lengths[rows].sum()
        assert rows.shape[0] == CFG.max_sequences or tokens + packer.lengths[nxt] > 50


def test_same_seed_and_step_same_batch_resume(hist):
    a, b = Packer(hist, CFG, seed=7), Packer(hist, CFG, seed=7)
    straight = [x for _, x in zip(range(30), a.batches(0), strict=False)]  # crosses epochs
    assert a.num_batches(0) < 30
    for step in (0, 5, a.num_batches(0), 29):
        resumed = b.batch(step)
        for f, x, y in zip(JaggedBatch._fields, straight[step], resumed, strict=True):
            if f == "side":
                np.testing.assert_array_equal(x["action"], y["action"])
            else:
                np.testing.assert_array_equal(x, y, err_msg=f)
    resumed_iter = next(iter(Packer(hist, CFG, seed=7).batches(12)))
    np.testing.assert_array_equal(resumed_iter.values, straight[12].values)
    other = Packer(hist, CFG, seed=8).batch(0)
    assert not np.array_equal(other.user_rows, straight[0].user_rows)


def test_final_targets_and_eval_mode(hist):
    final = (np.arange(hist.num_users) % 5).astype(np.int32)  # 0 = none
    cfg = dataclasses.replace(CFG, shuffle=False, pad_tokens="block")
    train = Packer(hist, cfg, final_targets=final, side=())
    b = train.batch_at(0, 0)
    assert b.values.shape[0] % cfg.block_size == 0 and b.values.shape[0] - b.num_tokens < 16
    assert b.user_rows[0] == 0 and b.side == {}
    for s in range(int(b.weights.sum())):
        last = b.offsets[s + 1] - 1
        assert b.targets[last] == final[b.user_rows[s]]
        n = b.offsets[s + 1] - b.offsets[s]
        assert b.num_targets[s] == n - 1 + (final[b.user_rows[s]] > 0)
    ev = Packer(hist, cfg, final_targets=final, targets="final", side=("time",))
    rows = []
    for b in ev.epoch_batches(0):
        real = int(b.weights.sum())
        is_last = np.zeros(b.values.shape[0], bool)
        is_last[b.offsets[1 : real + 1] - 1] = True
        assert np.all(b.targets[~is_last] == 0)
        np.testing.assert_array_equal(b.targets[is_last], final[b.user_rows[:real]])
        np.testing.assert_array_equal(b.num_targets[:real], final[b.user_rows[:real]] > 0)
        assert b.side["time"].shape == b.values.shape
        rows += b.user_rows[:real].tolist()
    assert rows == list(range(hist.num_users))  # no shuffle: row order


def test_bad_arguments(hist):
    with pytest.raises(ValueError, match="token_budget must be >= 1"):
        PackConfig(token_budget=0)
    with pytest.raises(ValueError, match="final_targets has shape"):
        Packer(hist, CFG, final_targets=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="no side column 'rating'"):
        Packer(hist, CFG, side=("rating",))
    with pytest.raises(ValueError, match="needs final_targets"):
        Packer(hist, CFG, targets="final")
