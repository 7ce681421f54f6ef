"""SASRec's text format: one ``user item`` line per interaction (github:kang205/SASRec).

The files of that repository (``data/Video.txt``, ``Beauty.txt``, ``Steam.txt``, ``ml-1m.txt``)
hold one interaction per line, ``<user> <item>``, both 1-based integers separated by one space;
each user's lines are contiguous and already in time order (the repository's
``DataProcessing.py`` sorts each user's reviews by time before writing). There are no times, so
the order of a user's lines is their order.

:func:`read_sasrec` is strict: a blank line, a line without exactly two fields, a field that is
not a decimal integer >= 1, a separator other than one space, and a user whose lines are not
contiguous (their history would be out of order) are each a :class:`SasrecFormatError` naming
the file and the line. Item ids are kept as they are (the vocabulary is ``1..max item``, as
SASRec's ``itemnum``), so item ``i`` of the file is item id ``i`` of the histories.

:func:`data_partition` reproduces SASRec's ``util.data_partition`` exactly: the same
``[user_train, user_valid, user_test, usernum, itemnum]`` (dicts from user id to item lists;
``usernum``/``itemnum`` the largest ids), via :func:`data.sequences.splits.leave_one_out`.

Statistics of ``data/Video.txt`` ("Amazon Games" in the paper), measured by
``tests/data/sequences/test_sasrec.py`` on the repository's snapshot: 31,013 users, 23,715 items,
287,107 actions, 9.258 actions per user, 12.107 per item; 112 users have fewer than 3 actions.
The paper (Kang & McAuley, ICDM 2018, Table II, "Dataset statistics (after preprocessing)")
gives for Amazon Games: 31,013 users, 23,715 items, avg. actions /user 9.3, avg. actions /item
12.1, 0.3M actions, i.e. the same within its rounding (:data:`PAPER_GAMES`). Those figures are
quoted from the paper as remembered; the search corpora available when this was written held
the paper's abstract but not the table's text, so they were not checked against a copy.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from data.sequences.histories import Histories, build_histories
from data.sequences.splits import leave_one_out

PAPER_GAMES = {
    "users": 31013,
    "items": 23715,
    "avg_actions_per_user": 9.3,
    "avg_actions_per_item": 12.1,
    "actions": 0.3e6,
}
"""Table II of the SASRec paper, row "Amazon Games" (the repository's ``Video.txt``); rounded
as printed (avg. actions to 0.1, actions to 0.1M)."""

_LINE = re.compile(rb"([0-9]+) ([0-9]+)[ \t\r]*")
_FILE = re.compile(rb"(?:[0-9]+ [0-9]+[ \t\r]*\n)*")
_DIGITS = re.compile(rb"[0-9]+")


class SasrecFormatError(ValueError):
    """A malformed SASRec file; the message names the file and the line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SasrecStats:
    """Counts of one SASRec file."""

    users: int
    """Distinct users."""
    items: int
    """Distinct items."""
    actions: int
    """Lines (interactions)."""
    usernum: int
    """Largest user id (SASRec's ``usernum``)."""
    itemnum: int
    """Largest item id (SASRec's ``itemnum``)."""
    users_short: int
    """Users with fewer than 3 actions (train only in ``data_partition``)."""

    @property
    def avg_actions_per_user(self) -> float:
        return self.actions / self.users

    @property
    def avg_actions_per_item(self) -> float:
        return self.actions / self.items


def _bad_line(name: str, number: int, line: bytes) -> SasrecFormatError:
    """The error of a line that does not match ``<int> <int>``: says what is wrong with it."""
    shown = line.decode("utf-8", "replace")[:80]
    fields = line.split()
    if not fields:
        why = "blank line"
    elif len(fields) != 2:
        why = f"expected 2 fields 'user item', got {len(fields)}"
    elif bad := [f for f in fields if not _DIGITS.fullmatch(f)]:
        why = f"field {bad[0].decode('utf-8', 'replace')!r} is not a non-negative integer"
    else:
        why = "fields must be separated by one space (SASRec splits on ' ')"
    return SasrecFormatError(f"{name}: line {number}: {why}: {shown!r}")


def parse_sasrec(data: bytes, *, name: str) -> tuple[np.ndarray, np.ndarray]:
    """int64 [N] users and items of the file contents ``data``; ``name`` names it in errors."""
    body = data if data.endswith(b"\n") or not data else data + b"\n"
    if _FILE.fullmatch(body):
        # Fast path: the whole file has the right form (one C-level regex scan), so the
        # whitespace-separated fields alternate user, item.
        pairs = np.array(body.split(), dtype=np.int64).reshape(-1, 2)
        users, items = pairs[:, 0].copy(), pairs[:, 1].copy()
    else:  # find the first bad line, to name it
        for k, line in enumerate(body.split(b"\n")[:-1]):
            if _LINE.fullmatch(line) is None:
                raise _bad_line(name, k + 1, line)
        raise AssertionError("unreachable: some line must fail to match")
    for what, ids in (("user", users), ("item", items)):
        if ids.size and ids.min() < 1:
            k = int(np.argmin(ids))
            raise SasrecFormatError(
                f"{name}: line {k + 1}: {what} id 0; ids are 1-based (0 is the padding id)"
            )
    # Each user's lines contiguous: the first line of each run of one user must be the user's
    # first line in the file.
    starts = np.flatnonzero(np.concatenate([[True], users[1:] != users[:-1]])) if users.size else []
    run_users = users[starts]
    _, first_run = np.unique(run_users, return_index=True)
    if first_run.shape[0] != run_users.shape[0]:
        seen = np.zeros(run_users.shape[0], bool)
        seen[first_run] = True
        r = int(np.flatnonzero(~seen)[0])
        prev = int(np.flatnonzero(run_users[:r] == run_users[r])[-1])
        prev_end = int(starts[prev + 1])  # 1-based number of the earlier run's last line
        raise SasrecFormatError(
            f"{name}: line {int(starts[r]) + 1}: user {int(run_users[r])} reappears after other "
            f"users (their lines ended at line {prev_end}): each user's lines must be "
            "contiguous and in time order"
        )
    return users, items


def read_sasrec(source: str | os.PathLike | bytes, *, name: str | None = None) -> Histories:
    """The histories of a SASRec file (a path, or its contents as bytes with a ``name``).

    Users are ordered by id; item ids are the file's (vocabulary ``1..max item``); no times.
    """
    if isinstance(source, bytes):
        data, name = source, name or "<bytes>"
    else:
        with open(source, "rb") as f:
            data = f.read()
        name = name or os.fspath(source)
    users, items = parse_sasrec(data, name=name)
    itemnum = int(items.max()) if items.size else 0
    return build_histories(users, items, None, item_vocab=np.arange(1, itemnum + 1))


def sasrec_stats(hist: Histories) -> SasrecStats:
    """Users, items and actions of histories read by :func:`read_sasrec`."""
    lengths = hist.lengths()
    return SasrecStats(
        users=hist.num_users,
        items=int(np.unique(hist.items).shape[0]),
        actions=hist.num_events,
        usernum=int(hist.user_raw.max()) if hist.num_users else 0,
        itemnum=hist.n_items,
        users_short=int((lengths < 3).sum()),
    )


def data_partition(hist: Histories) -> list:
    """SASRec's ``data_partition`` of histories read by :func:`read_sasrec`:
    ``[user_train, user_valid, user_test, usernum, itemnum]``, dicts from user id to lists of
    item ids (empty lists for the validation and test items of users with < 3 actions)."""
    split = leave_one_out(hist)
    user_train, user_valid, user_test = {}, {}, {}
    users = hist.user_raw.tolist()
    train_items = np.split(split.train.items, split.train.offsets[1:-1])
    for row, user in enumerate(users):
        user_train[user] = train_items[row].tolist()
        v, t = int(split.valid_targets[row]), int(split.test_targets[row])
        user_valid[user] = [v] if v else []
        user_test[user] = [t] if t else []
    stats = sasrec_stats(hist)
    return [user_train, user_valid, user_test, stats.usernum, stats.itemnum]
