"""Histories from an event log (data/sequences/histories.py) and their splits (splits.py)."""

import numpy as np
import pyarrow as pa
import pytest

from data.sequences.histories import (
    HistoryCounters,
    HistoryError,
    build_histories,
    histories_from_arrow,
)
from data.sequences.splits import leave_one_out, time_cutoff


def _as_lists(hist):
    return {
        u: hist.item_raw[hist.user_items(r) - 1].tolist()
        for r, u in enumerate(hist.user_raw.tolist())
    }


def test_sort_by_user_then_time_ties_in_input_order_and_counted():
    users = np.array([2, 1, 2, 1, 2, 1, 2])
    items = np.array([10, 11, 12, 13, 14, 15, 16])
    times = np.array([5, 3, 1, 3, 5, 2, 5])
    h = build_histories(users, items, times)
    # user 1: t=2 (15), t=3 (11, 13: a tie, input order); user 2: t=1 (12), t=5 (10, 14, 16).
    assert _as_lists(h) == {1: [15, 11, 13], 2: [12, 10, 14, 16]}
    assert h.counters.ties == 1 + 2
    assert h.times.tolist() == [2, 3, 3, 1, 5, 5, 5]
    assert h.items.dtype == np.int32 and h.offsets.dtype == np.int64
    assert h.offsets.tolist() == [0, 3, 7]
    assert h.item_raw.tolist() == [10, 11, 12, 13, 14, 15, 16]  # id i is item_raw[i - 1]
    assert h.items.min() == 1  # 0 is padding


def test_truncation_keeps_most_recent_and_counts():
    users = np.array([1] * 5 + [2] * 2 + [3] * 4)
    items = np.arange(11)
    times = np.arange(11)[::-1]  # input order is newest first
    h = build_histories(users, items, times, max_len=3)
    assert _as_lists(h) == {1: [2, 1, 0], 2: [6, 5], 3: [9, 8, 7]}
    c = h.counters
    assert (c.truncated_events, c.truncated_users, c.events_kept) == (3, 2, 8)
    assert c.events_read == c.events_kept + c.truncated_events + sum(c.rejected.values())


def test_rejects_counted_by_reason_and_users_all_rejected():
    users = np.array([1, 1, 2, 2, 3, 3], dtype=np.int64)
    items = np.array([7, 8, 9, 7, 99, 98])
    times = np.array([1.0, np.nan, 2.0, 3.0, 1.0, 2.0])
    h = build_histories(users, items, times, item_vocab=np.array([7, 8, 9]))
    c = h.counters
    assert c.rejected == {"missing time": 1, "unknown item": 2}
    assert c.users_all_rejected == 1  # user 3: both items unknown
    assert _as_lists(h) == {1: [7], 2: [9, 7]}
    assert h.n_items == 3 and h.user_items(1).tolist() == [3, 1]
    assert h.encode_items(np.array([9, 5, 7])).tolist() == [3, 0, 1]  # 0: not in the vocabulary


def test_side_columns_follow_their_events():
    users = np.array(["b", "a", "b", "a"])
    items = np.array(["x", "y", "z", "x"])
    h = build_histories(
        users, items, np.array([2, 9, 1, 4]), side={"action": np.array([0, 1, 2, 3], np.int8)}
    )
    assert h.user_raw.tolist() == ["a", "b"]
    assert _as_lists(h) == {"a": ["x", "y"], "b": ["z", "x"]}
    assert h.side["action"].tolist() == [3, 1, 2, 0]


def test_arrow_nulls_are_rejected_with_their_column():
    table = pa.table(
        {
            "user": pa.array([1, 1, None, 2, 2], pa.int64()),
            "item": pa.array(["p", None, "q", "q", "p"]),
            "time": pa.array([1, 2, 3, None, 5], pa.int64()),
            "action": pa.array([0, 1, 2, 3, None], pa.int32()),
        }
    )
    h = histories_from_arrow(table, side=("action",))
    assert h.counters.rejected == {
        "missing user": 1,
        "missing item": 1,
        "missing time": 1,
        "missing action": 1,
    }
    assert _as_lists(h) == {1: ["p"]}
    assert h.counters.users_all_rejected == 1  # user 2
    with pytest.raises(HistoryError, match="no column 'ts'"):
        histories_from_arrow(table, time="ts")


def test_counters_must_account_for_every_event():
    with pytest.raises(HistoryError, match="5 events read but 4 accounted"):
        HistoryCounters(events_read=5, events_kept=3, truncated_events=1)


def test_select_and_take():
    h = build_histories(np.array([1, 1, 2, 3, 3, 3]), np.arange(6), np.arange(6))
    s = h.select(np.array([2, 0]))
    assert _as_lists(s) == {3: [3, 4, 5], 1: [0, 1]}
    assert s.times.tolist() == [3, 4, 5, 0, 1]
    t = h.take(h.items % 2 == 0)  # item ids 2, 4, 6 = raw 1, 3, 5; user 2 (raw 2) is left empty
    assert _as_lists(t) == {1: [1], 3: [3, 5]}


def test_leave_one_out_matches_sasrec_rule():
    users = np.repeat([1, 2, 3, 4], [1, 2, 3, 5])
    h = build_histories(users, np.arange(11) + 1, None)
    s = leave_one_out(h)
    raw = lambda a: [int(h.item_raw[i - 1]) if i else 0 for i in a]  # noqa: E731
    assert _as_lists(s.train) == {1: [1], 2: [2, 3], 3: [4], 4: [7, 8, 9]}
    assert raw(s.valid_targets) == [0, 0, 5, 10]
    assert raw(s.test_targets) == [0, 0, 6, 11]
    assert _as_lists(s.test_context) == {1: [1], 2: [2, 3], 3: [4, 5], 4: [7, 8, 9, 10]}
    assert s.users_short == 2 and s.eval_rows().tolist() == [2, 3]


def test_time_cutoff():
    users = np.array([1, 1, 1, 2, 2, 3, 3, 4])
    times = np.array([1, 5, 7, 2, 3, 8, 9, 5])
    h = build_histories(users, np.arange(8) + 100, times)
    s = time_cutoff(h, 5)
    # user 1: context [100], target 101 (t=5, at the cutoff); user 2: nothing after (train
    # only); user 3: nothing before (dropped, counted); user 4: only a target (dropped).
    assert _as_lists(s.train) == {1: [100], 2: [103, 104]}
    assert _as_lists(s.test_context) == {1: [100]}
    assert [int(h.item_raw[i - 1]) for i in s.test_targets] == [101]
    assert s.test_target_times.tolist() == [5]
    assert (s.users_without_target, s.users_without_context) == (1, 2)
    with pytest.raises(HistoryError, match="no times"):
        time_cutoff(build_histories(users, times, None), 5)
