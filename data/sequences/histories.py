"""Per-user ordered interaction histories, stored jagged, built from an event log.

Shapes (dimension glossary): ``U`` users (each with at least one event), ``T`` events in all,
``V`` items (``n_items``).

Layout of :class:`Histories`:
  * ``items`` int32 [T]: every user's events, oldest first, users one after another. Item ids are
    ``1..V`` (the position in ``item_raw`` plus one); 0 is reserved for padding and never
    appears here.
  * ``offsets`` int64 [U + 1]: user ``u``'s events are ``items[offsets[u]:offsets[u + 1]]``;
    ``offsets[0] == 0``, ``offsets[U] == T``, strictly increasing (no empty history).
  * ``times`` [T] (int64 or float64, or ``None``) and ``side`` (name -> [T] array): per-event
    columns aligned with ``items`` (e.g. the action type).
  * ``user_raw`` [U]: the raw user ids, in the order of the histories (ascending raw id when
    built by :func:`build_histories`). ``item_raw`` [V]: the vocabulary; raw id ``item_raw[i]``
    is item id ``i + 1``.

Building (:func:`build_histories`): events are sorted stably by (user, time), so events of a
user with equal times keep their input order; each such event (one that ties with the one
before it) is counted in ``ties``, since its order is the log's and not the clock's. Only the
most recent ``max_len`` events of a user are kept (the rest counted in ``truncated_events``).
Every event read is kept, truncated or rejected, and each reject is counted under its reason:
``missing <column>`` (a null, or a NaN time) or ``unknown item`` (not in a fixed vocabulary).
A user all of whose events are rejected has no history (histories are never empty) and is
counted in ``users_all_rejected``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np


class HistoryError(ValueError):
    """Histories or an event log that break the layout; the message names the field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HistoryCounters:
    """What happened to every event read: ``events_read == events_kept + truncated_events +
    sum(rejected.values())``."""

    events_read: int = 0
    """Rows of the event log."""
    events_kept: int = 0
    """Events in the histories (``T``)."""
    ties: int = 0
    """Kept or truncated events whose (user, time) equals the previous event's: ordered by input
    position, not by time."""
    truncated_events: int = 0
    """Events dropped because a user had more than ``max_len`` (the oldest go)."""
    truncated_users: int = 0
    """Users who lost events to ``max_len``."""
    rejected: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Rejected events by reason (``missing user``, ``missing time``, ``unknown item``, ...)."""
    users_all_rejected: int = 0
    """Users (with a non-missing id) whose every event was rejected: absent from the histories."""

    def __post_init__(self):
        accounted = self.events_kept + self.truncated_events + sum(self.rejected.values())
        if accounted != self.events_read:
            raise HistoryError(
                f"HistoryCounters: {self.events_read} events read but {accounted} accounted for "
                "(kept + truncated + rejected)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Histories:
    """Jagged per-user histories (see the module docstring for the layout)."""

    items: np.ndarray
    """int32 [T]: item ids in ``1..V``, each user's oldest first."""
    offsets: np.ndarray
    """int64 [U + 1]: user ``u`` owns ``items[offsets[u]:offsets[u + 1]]``."""
    user_raw: np.ndarray
    """[U] raw user ids, one per history."""
    item_raw: np.ndarray
    """[V] the vocabulary: item id ``i`` is raw item ``item_raw[i - 1]``."""
    times: np.ndarray | None = None
    """[T] event times aligned with ``items`` (None when the source has none)."""
    side: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    """Per-event side columns, each [T] aligned with ``items``."""
    counters: HistoryCounters = dataclasses.field(default_factory=HistoryCounters)
    """How the histories were built from the log."""

    def __post_init__(self):
        t, u = self.items.shape[0], self.user_raw.shape[0]
        if self.items.dtype != np.int32 or self.items.ndim != 1:
            raise HistoryError(f"Histories.items must be int32 [T], got {self.items.dtype}")
        if self.offsets.dtype != np.int64 or self.offsets.shape != (u + 1,):
            raise HistoryError(
                f"Histories.offsets must be int64 [U + 1] = [{u + 1}], got "
                f"{self.offsets.dtype} {self.offsets.shape}"
            )
        if self.offsets[0] != 0 or self.offsets[-1] != t:
            raise HistoryError(
                f"Histories.offsets must run from 0 to T = {t}, got "
                f"{int(self.offsets[0])}..{int(self.offsets[-1])}"
            )
        if u and (np.diff(self.offsets) <= 0).any():
            bad = int(np.flatnonzero(np.diff(self.offsets) <= 0)[0])
            raise HistoryError(f"Histories: user row {bad} ({self.user_raw[bad]!r}) is empty")
        if t and (self.items.min() < 1 or self.items.max() > self.n_items):
            pos = int(np.flatnonzero((self.items < 1) | (self.items > self.n_items))[0])
            raise HistoryError(
                f"Histories.items[{pos}] = {int(self.items[pos])} is outside 1..{self.n_items}"
            )
        for name, col in [("times", self.times), *self.side.items()]:
            if col is not None and col.shape != (t,):
                raise HistoryError(f"Histories column {name!r} has shape {col.shape}, not [{t}]")

    @property
    def num_users(self) -> int:
        return int(self.user_raw.shape[0])

    @property
    def num_events(self) -> int:
        return int(self.items.shape[0])

    @property
    def n_items(self) -> int:
        """V: item ids are ``1..V``."""
        return int(self.item_raw.shape[0])

    def encode_items(self, raw: np.ndarray) -> np.ndarray:
        """int32 ids (``1..V``) of raw item ids ``raw``; 0 for a raw id not in the vocabulary."""
        raw = np.asarray(raw)
        if self.n_items == 0:
            return np.zeros(raw.shape, np.int32)
        order = np.argsort(self.item_raw, kind="stable")
        pos = np.minimum(np.searchsorted(self.item_raw[order], raw), self.n_items - 1)
        hit = self.item_raw[order][pos] == raw
        return np.where(hit, order[pos] + 1, 0).astype(np.int32)

    def lengths(self) -> np.ndarray:
        """int64 [U]: events per user."""
        return np.diff(self.offsets)

    def row_of_event(self) -> np.ndarray:
        """int64 [T]: the user row of every event."""
        return np.repeat(np.arange(self.num_users), self.lengths())

    def user_items(self, row: int) -> np.ndarray:
        """int32 [L]: user row ``row``'s item ids, oldest first."""
        return self.items[self.offsets[row] : self.offsets[row + 1]]

    def take(self, keep: np.ndarray, *, counters: HistoryCounters | None = None) -> Histories:
        """The histories that keep the events where the bool [T] mask ``keep`` is set (users left
        with none are dropped); vocabulary unchanged."""
        if keep.shape != (self.num_events,) or keep.dtype != np.bool_:
            raise HistoryError(f"take: keep must be bool [{self.num_events}], got {keep.shape}")
        rows = self.row_of_event()[keep]
        n = np.bincount(rows, minlength=self.num_users)
        users = n > 0
        return dataclasses.replace(
            self,
            items=self.items[keep],
            offsets=np.concatenate([[0], np.cumsum(n[users])]).astype(np.int64),
            user_raw=self.user_raw[users],
            times=None if self.times is None else self.times[keep],
            side={k: v[keep] for k, v in self.side.items()},
            counters=self.counters if counters is None else counters,
        )

    def select(self, rows: np.ndarray) -> Histories:
        """The histories of user rows ``rows`` (int [R], in that order; repeats allowed)."""
        rows = np.asarray(rows, np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_users):
            raise HistoryError(f"select: user rows must be in [0, {self.num_users})")
        n = self.lengths()[rows]
        starts = self.offsets[rows]
        idx = np.repeat(starts - np.concatenate([[0], np.cumsum(n)[:-1]]), n) + np.arange(n.sum())
        return dataclasses.replace(
            self,
            items=self.items[idx],
            offsets=np.concatenate([[0], np.cumsum(n)]).astype(np.int64),
            user_raw=self.user_raw[rows],
            times=None if self.times is None else self.times[idx],
            side={k: v[idx] for k, v in self.side.items()},
        )


def last_per_user(lengths: np.ndarray, keep_last: np.ndarray | int) -> np.ndarray:
    """bool [sum(lengths)]: within each consecutive segment of ``lengths[u]`` events, whether an
    event is among the segment's last ``keep_last[u]``."""
    lengths = np.asarray(lengths, np.int64)
    ends = np.cumsum(lengths)
    pos_from_end = np.repeat(ends, lengths) - np.arange(ends[-1] if ends.size else 0) - 1
    return pos_from_end < np.repeat(np.broadcast_to(keep_last, lengths.shape), lengths)


def _missing(values: np.ndarray) -> np.ndarray:
    """bool mask of missing entries: NaN in a float column, None in an object column."""
    if values.dtype.kind == "f":
        return np.isnan(values)
    if values.dtype == object:
        return np.array([v is None for v in values.tolist()], bool)
    return np.zeros(values.shape, bool)


def build_histories(
    users: np.ndarray,
    items: np.ndarray,
    times: np.ndarray | None,
    *,
    side: Mapping[str, np.ndarray] | None = None,
    missing: Mapping[str, np.ndarray] | None = None,
    max_len: int | None = None,
    item_vocab: np.ndarray | None = None,
) -> Histories:
    """Histories from an event log of ``N`` rows (see the module docstring for the rules).

    Args:
        users: [N] raw user ids (integers or strings).
        items: [N] raw item ids (integers or strings).
        times: [N] event times (int or float; NaN is missing), or None: input order is time.
        side: per-event columns, each [N], carried along with the items.
        missing: bool [N] masks of missing values per column name (``user``, ``item``,
            ``time`` or a side column), e.g. a pyarrow column's nulls; NaN times and None in
            object columns are found without one.
        max_len: keep each user's most recent ``max_len`` events (None: all).
        item_vocab: a fixed vocabulary ([V] raw ids, unique): an event whose item is not in it
            is rejected (``unknown item``). None: the sorted distinct items of the kept events.
    """
    users, items = np.asarray(users), np.asarray(items)
    n = users.shape[0]
    side = {k: np.asarray(v) for k, v in (side or {}).items()}
    columns = {"user": users, "item": items, **side}
    if times is not None:
        times = np.asarray(times)
        if times.dtype.kind not in "iuf":
            raise HistoryError(f"build_histories: times must be numeric, got {times.dtype}")
        columns["time"] = times
    for name, col in columns.items():
        if col.shape != (n,):
            raise HistoryError(f"build_histories: column {name!r} has shape {col.shape}, not [{n}]")
    if max_len is not None and max_len < 1:
        raise HistoryError(f"build_histories: max_len must be >= 1 or None, got {max_len}")
    missing = dict(missing or {})
    for name in missing:
        if name not in columns:
            raise HistoryError(f"build_histories: missing mask for unknown column {name!r}")

    ok = np.ones(n, bool)
    rejected: dict[str, int] = {}
    # The order of the checks decides the reason of an event with several problems: user, item,
    # time, then side columns, then the vocabulary.
    for name in ("user", "item", "time", *side):
        if name not in columns:
            continue
        bad = _missing(columns[name])
        if name in missing:
            bad = bad | np.asarray(missing[name], bool)
        bad &= ok
        if bad.any():
            rejected[f"missing {name}"] = int(bad.sum())
            ok &= ~bad
    if item_vocab is not None:
        vocab = np.asarray(item_vocab)
        if vocab.ndim != 1 or np.unique(vocab).shape[0] != vocab.shape[0]:
            raise HistoryError("build_histories: item_vocab must be a 1-D array of unique ids")
        order = np.argsort(vocab, kind="stable")
        cand = items[ok]
        pos = np.minimum(np.searchsorted(vocab[order], cand), max(vocab.shape[0] - 1, 0))
        hit = vocab[order][pos] == cand if vocab.shape[0] else np.zeros(cand.shape, bool)
        unknown = np.zeros(n, bool)
        unknown[ok] = ~hit
        if unknown.any():
            rejected["unknown item"] = int(unknown.sum())
        ok &= ~unknown
        item_ids_ok = order[pos[hit]].astype(np.int64) + 1
    else:
        vocab, item_ids_ok = np.unique(items[ok], return_inverse=True)
        item_ids_ok = item_ids_ok.astype(np.int64) + 1

    present_users = np.unique(users[~_missing(users) & ~np.asarray(missing.get("user", False))])
    idx = np.flatnonzero(ok)
    user_raw, user_code = np.unique(users[idx], return_inverse=True)
    # Stable sort by (user, time); input position breaks ties (lexsort's last key is primary).
    keys = (user_code,) if times is None else (times[idx], user_code)
    order = np.lexsort(keys)
    idx, user_code, item_ids = idx[order], user_code[order], item_ids_ok[order]
    ties = 0
    if times is not None and idx.size:
        t_sorted = times[idx]
        ties = int(((user_code[1:] == user_code[:-1]) & (t_sorted[1:] == t_sorted[:-1])).sum())
    lengths = np.bincount(user_code, minlength=user_raw.shape[0]).astype(np.int64)
    keep = np.ones(idx.shape[0], bool)
    if max_len is not None:
        keep = last_per_user(lengths, max_len)
    kept_len = np.minimum(lengths, max_len) if max_len is not None else lengths
    counters = HistoryCounters(
        events_read=n,
        events_kept=int(keep.sum()),
        ties=ties,
        truncated_events=int((~keep).sum()),
        truncated_users=int((kept_len < lengths).sum()),
        rejected=rejected,
        users_all_rejected=int(present_users.shape[0] - user_raw.shape[0]),
    )
    sel = idx[keep]
    return Histories(
        items=item_ids[keep].astype(np.int32),
        offsets=np.concatenate([[0], np.cumsum(kept_len)]).astype(np.int64),
        user_raw=user_raw,
        item_raw=vocab,
        times=None if times is None else times[sel],
        side={k: v[sel] for k, v in side.items()},
        counters=counters,
    )


def histories_from_arrow(
    table,
    *,
    user: str = "user",
    item: str = "item",
    time: str | None = "time",
    side: Sequence[str] = (),
    max_len: int | None = None,
    item_vocab: np.ndarray | None = None,
) -> Histories:
    """:func:`build_histories` over the columns of a ``pyarrow.Table`` (nulls are missing)."""
    names = {"user": user, "item": item, **({"time": time} if time else {})}
    names.update({s: s for s in side})
    for role, col in names.items():
        if col not in table.column_names:
            raise HistoryError(
                f"histories_from_arrow: no column {col!r} ({role}); the table has "
                f"{table.column_names}"
            )
    import pyarrow as pa  # the one function that needs it; callers of the rest need not

    arrays, missing = {}, {}
    for role, col in names.items():
        chunked = table.column(col)
        if pa.types.is_timestamp(chunked.type) or pa.types.is_date(chunked.type):
            chunked = chunked.cast(pa.int64())
        missing[role] = chunked.is_null().to_numpy(zero_copy_only=False)
        if chunked.null_count:
            # to_numpy would turn an int column with nulls into floats (or objects): fill the
            # nulls (rejected by the mask anyway) with a value of the column's own type.
            fill = "" if pa.types.is_string(chunked.type) else 0
            chunked = chunked.fill_null(pa.scalar(fill).cast(chunked.type))
        arrays[role] = chunked.to_numpy()
    return build_histories(
        arrays["user"],
        arrays["item"],
        arrays.get("time"),
        side={s: arrays[s] for s in side},
        missing=missing,
        max_len=max_len,
        item_vocab=item_vocab,
    )
