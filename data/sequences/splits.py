"""Train / validation / test splits of :class:`~data.sequences.histories.Histories`.

Shapes: ``U`` users of the input, ``U_test`` users with a test target. A target is an item id
in ``1..V``; 0 means "no target" (the padding id, never an item).

* :func:`leave_one_out` (SASRec's ``data_partition``, ``util.py`` of github:kang205/SASRec): a
  user with fewer than ``min_events`` (3) events keeps them all for training and has no
  validation or test target; otherwise the last event is the test target, the one before it the
  validation target, and the rest train. The validation context is the train history; the test
  context is the train history plus the validation item. Every user keeps their row.
* :func:`time_cutoff`: a global clock split. Events strictly before ``cutoff`` train; a user's
  first event at or after it is their test target, with their events before the cutoff as its
  context. Users without an event at or after the cutoff have no target, users without one
  before it have no context (both counted; the latter are dropped from the test set, since a
  history is never empty).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from data.sequences.histories import Histories, HistoryError, last_per_user


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class LeaveOneOut:
    """A leave-one-out split; every field's user axis is the input's ``U`` rows, in order."""

    train: Histories
    """All but the last two events of eligible users; all events of short users."""
    test_context: Histories
    """All but the last event of eligible users (train + the validation item); all events of
    short users."""
    valid_targets: np.ndarray
    """int32 [U]: the second-to-last item, 0 for a short user."""
    test_targets: np.ndarray
    """int32 [U]: the last item, 0 for a short user."""
    users_short: int
    """Users with fewer than ``min_events`` events (train only, no targets)."""

    def eval_rows(self) -> np.ndarray:
        """int64 [U_eval]: the user rows that have validation and test targets."""
        return np.flatnonzero(self.test_targets > 0)


def leave_one_out(hist: Histories, *, min_events: int = 3) -> LeaveOneOut:
    """Leave-one-out split (module docstring); ``min_events >= 3`` so train is never empty."""
    if min_events < 3:
        raise HistoryError(f"leave_one_out: min_events must be >= 3, got {min_events}")
    lengths = hist.lengths()
    eligible = lengths >= min_events
    ends = hist.offsets[1:]
    valid = np.where(eligible, hist.items[np.where(eligible, ends - 2, 0)], 0).astype(np.int32)
    test = np.where(eligible, hist.items[ends - 1], 0).astype(np.int32)
    held = eligible.astype(np.int64)
    return LeaveOneOut(
        train=hist.take(~last_per_user(lengths, 2 * held)),
        test_context=hist.take(~last_per_user(lengths, held)),
        valid_targets=valid,
        test_targets=test,
        users_short=int((~eligible).sum()),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TimeCutoff:
    """A global time split (module docstring)."""

    train: Histories
    """Events with ``time < cutoff``; users with none are absent."""
    test_context: Histories
    """[U_test] rows: the pre-cutoff events of users who have both those and a later event."""
    test_targets: np.ndarray
    """int32 [U_test]: each such user's first item at or after the cutoff."""
    test_target_times: np.ndarray
    """[U_test]: the time of that item."""
    users_without_target: int
    """Users with no event at or after the cutoff (train only)."""
    users_without_context: int
    """Users whose every event is at or after the cutoff (no train history, no test example)."""


def time_cutoff(hist: Histories, cutoff) -> TimeCutoff:
    """Split ``hist`` (which needs ``times``) at ``cutoff`` (module docstring)."""
    if hist.times is None:
        raise HistoryError("time_cutoff: the histories have no times (built without a time column)")
    before = hist.times < cutoff
    rows = hist.row_of_event()
    n_before = np.bincount(rows[before], minlength=hist.num_users)
    lengths = hist.lengths()
    has_target = n_before < lengths
    has_context = n_before > 0
    # Within a user events are in time order, so the pre-cutoff ones are a prefix and the target
    # is the event right after it.
    test_rows = np.flatnonzero(has_target & has_context)
    pos = hist.offsets[test_rows] + n_before[test_rows]
    train = hist.take(before)
    # Row r of ``train`` is input row train_rows[r]; the test users' rows in ``train``:
    train_rows = np.flatnonzero(has_context)
    return TimeCutoff(
        train=train,
        test_context=train.select(np.searchsorted(train_rows, test_rows)),
        test_targets=hist.items[pos].astype(np.int32),
        test_target_times=hist.times[pos],
        users_without_target=int((~has_target).sum()),
        users_without_context=int((~has_context).sum()),
    )
