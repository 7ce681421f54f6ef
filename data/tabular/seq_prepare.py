"""Preparing an event log of a sequence spec (``seq_spec.py``) into per-user histories.

``python -m data.tabular.prepare SPEC`` (a spec with a ``sequence`` section), or on first use
the sequential trainers' ``--data.kind tabular``, reads every event of the spec's files with
pyarrow (``read.iter_chunks``: file, line and column in every error), parses the user, item,
time and side columns (the CTR path's parsers, ``parse.py``), and builds the histories with
``data.sequences.build_histories`` (stable sort by user then time, ties counted, the most recent
``max_len`` events kept). The whole log is held in memory while it is built (a global sort).

The prepared folder ``<root>/<name>-<fingerprint>`` (the fingerprint hashes the spec and every
file's path, size and modification time) holds only data, never read as code:

* ``events.arrow``: one row per kept event, users one after another, each oldest first:
  ``item`` (int32 id ``1..V``), ``time`` (int64 or float64; absent without a time column) and
  each side column, ``side.<name>`` (int32 ids);
* ``users.arrow``: one row per user, in the order of ``events.arrow``: ``user`` (the raw id
  as a string) and ``length`` (events);
* ``vocab/item.arrow``: the item vocabulary, raw value of id ``i`` in row ``i - 1``;
  ``vocab/side-<k>.arrow``: side column ``k``'s vocabulary (categorical ones);
* ``manifest.json`` (written last: a folder without it is unfinished) with the stats: events
  read, rejected by reason (with the first few, located), kept, ties, out of order, truncated,
  users, items, missing side values, history lengths.

:func:`split_histories` applies the spec's split (``data.sequences.leave_one_out``, or
``data.sequences.time_cutoff`` at ``valid_from`` and at ``test_from``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.sequences import Histories, build_histories, leave_one_out, time_cutoff
from data.tabular.parse import blank_is_null, parse_categorical, parse_numbers
from data.tabular.passes import DEFAULT_ROOT, atomic_write, exclusive, expand
from data.tabular.read import Reject, TabularFormatError, iter_chunks
from data.tabular.seq_spec import (
    SEQUENCE_FORMAT_VERSION,
    SequenceSpec,
    load_sequence_spec,
    parse_datetimes,
    sequence_digest,
)

MAX_REJECT_EXAMPLES = 20
"""Rejected events listed (located) in the stats; all of them are counted."""


# ----------------------------------------------------------------------------- reading


class _Columns:
    """Parsed columns of the kept events, chunk by chunk, and the rejects."""

    def __init__(self, spec: SequenceSpec):
        self.spec = spec
        self.parts: dict[str, list] = {k: [] for k in ("user", "item", "time")}
        self.parts.update({f"side:{s.name}": [] for s in spec.sequence.side})
        self.rejected: Counter = Counter()
        self.examples: list[str] = []
        self.read = 0

    def reject(self, where: Callable[[], str], column: str, reason: str, value: Any) -> None:
        """Counts a rejected event; the first few are listed with ``where()`` they are."""
        self.rejected[reason] += 1
        if len(self.examples) < MAX_REJECT_EXAMPLES:
            col = f"column {column!r}: " if column else ""
            self.examples.append(f"{where()}: {col}{reason}: {_show(value)[:80]!r}")

    def on_reject(self, r: Reject) -> None:  # a malformed row or bad bytes (``read.py``)
        self.read += 1
        self.reject(lambda: f"{r.file}: {r.where()}", r.column, r.reason, r.text)

    def add(self, chunk) -> None:
        """Parses one chunk: bad events raise (strict) or are rejected (lenient)."""
        seq, table, n = self.spec.sequence, chunk.table, chunk.table.num_rows
        self.read += n
        checks: list[tuple[np.ndarray, str, str, Any]] = []  # (bad mask, column, reason, values)

        def col(name: str) -> pa.Array:
            return table.column(name).combine_chunks()

        users = _as_text(col(seq.user))
        checks.append((_null(users), seq.user, "missing user", users))
        raw = col(seq.item)
        items, bad = parse_categorical(_text_blank_null(raw), seq.item_parse)
        checks.append((bad, seq.item, "item not an integer", raw))
        checks.append((_null(items) & ~bad, seq.item, "missing item", raw))
        times = None
        if seq.time:
            raw = col(seq.time)
            times, missing, bad = _times(raw, seq.time_parse)
            checks.append((bad, seq.time, f"time not a{_an(seq.time_parse)}", raw))
            checks.append((missing & ~bad, seq.time, "missing time", raw))
        side = {}
        for s in seq.side:
            raw = col(s.source)
            if s.kind == "categorical":
                vals, bad = parse_categorical(_text_blank_null(raw), s.parse)
                checks.append((bad, s.source, f"{s.name}: not an integer", raw))
            elif s.source == seq.time and times is not None:
                vals = (times, _null(raw))  # the parsed time (datetimes in microseconds)
            else:
                x, missing, bad = parse_numbers(raw)
                checks.append((bad, s.source, f"{s.name}: not a number", raw))
                vals = (x, missing)
            side[s.name] = vals

        first = np.full(n, len(checks))  # index of each row's first failed check
        for k, (bad, *_) in reversed(list(enumerate(checks))):
            first[bad] = k
        rows = np.flatnonzero(first < len(checks))
        if rows.size and self.spec.strict:
            r = int(rows[0])
            _, column, reason, values = checks[first[r]]
            raise TabularFormatError(
                f"{chunk.file}: {chunk.locate(chunk.first_row + r)}: column {column!r}: "
                f"{reason}: {_show(values[r])!r}"
            )
        for r in rows.tolist():
            _, column, reason, values = checks[first[r]]
            where = lambda r=r: f"{chunk.file}: {chunk.locate(chunk.first_row + r)}"  # noqa: E731
            self.reject(where, column, reason, values[r])
        keep = first == len(checks)
        mask = pa.array(keep)
        self.parts["user"].append(users.filter(mask))
        self.parts["item"].append(items.filter(mask))
        if times is not None:
            self.parts["time"].append(times[keep])
        for name, vals in side.items():
            v = vals.filter(mask) if isinstance(vals, pa.Array) else (vals[0][keep], vals[1][keep])
            self.parts[f"side:{name}"].append(v)


def _an(kind: str) -> str:
    return {"int": "n integer", "float": " number", "datetime": "n ISO 8601 datetime"}[kind]


def _show(value: Any) -> str:
    value = value.as_py() if hasattr(value, "as_py") else value
    return "" if value is None else str(value)


def _as_text(arr: pa.Array) -> pa.Array:
    """Ids as trimmed strings, blank ones missing."""
    return _text_blank_null(pc.utf8_trim_whitespace(pc.cast(arr, pa.string())))


def _text_blank_null(arr: pa.Array) -> pa.Array:
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return blank_is_null(arr)
    return arr


def _null(arr: pa.Array) -> np.ndarray:
    return arr.is_null().to_numpy(zero_copy_only=False)


def _times(arr: pa.Array, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times, missing mask, bad mask): int64 for ``int``, float64 for ``float``, int64
    microseconds since the epoch for ``datetime``."""
    text = _text_blank_null(arr)
    missing = _null(text)
    if kind == "datetime":
        values, bad = parse_datetimes(text)
        return values, missing, bad
    if kind == "int":
        ids, bad = parse_categorical(text, "int")
        return pc.fill_null(ids, 0).to_numpy(zero_copy_only=False).astype(np.int64), missing, bad
    values, missing, bad = parse_numbers(text)
    return values, missing, bad


def _ranks(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """int64 rank of each value among the sorted distinct values (no nulls), and those."""
    uniq = pc.unique(arr)
    uniq = uniq.take(pc.array_sort_indices(uniq))
    return pc.index_in(arr, value_set=uniq).to_numpy(zero_copy_only=False).astype(np.int64), uniq


def _concat(parts: list) -> pa.Array:
    return pa.chunked_array(parts).combine_chunks() if parts else pa.array([], pa.string())


def read_histories(spec: SequenceSpec) -> tuple[Histories, dict[str, pa.Array], dict[str, Any]]:
    """The histories of ``spec``'s files, the side columns' vocabularies, and the stats
    (module docstring). User ids are the raw strings; item ids ``1..V`` by sorted raw item.

    Raises:
      TabularFormatError: bad input (strict), a missing file or column, no event left.
    """
    files = expand(spec, spec.train, "train file")
    cols = _Columns(spec)
    for path in files:
        for chunk in iter_chunks(
            path, spec.format, spec.needed_columns(), strict=spec.strict, on_reject=cols.on_reject
        ):
            cols.add(chunk)
    seq = spec.sequence
    users = _concat(cols.parts["user"])
    if not len(users):
        reasons = dict(cols.rejected) or "none"
        raise TabularFormatError(f"{', '.join(files)}: no events (rejected: {reasons})")
    user_code, user_names = _ranks(users)
    item_code, item_names = _ranks(_concat(cols.parts["item"]))
    times = np.concatenate(cols.parts["time"]) if seq.time else None
    side, vocabs, side_missing = {}, {}, {}
    for s in seq.side:
        parts = cols.parts[f"side:{s.name}"]
        if s.kind == "categorical":
            vals = _concat(parts)
            present = vals.drop_null()
            _, names = _ranks(present) if len(present) else (None, present)
            ids = pc.fill_null(pc.add(pc.index_in(vals, value_set=names), 1), 0)
            side[s.name] = ids.to_numpy(zero_copy_only=False).astype(np.int32)
            vocabs[s.name] = names
        else:
            x = np.concatenate([p[0] for p in parts])
            missing = np.concatenate([p[1] for p in parts])
            ids = 1 + np.searchsorted(np.asarray(s.boundaries), x, side="right")
            side[s.name] = np.where(missing, 0, ids).astype(np.int32)
        side_missing[s.name] = int((side[s.name] == 0).sum())
    hist = build_histories(user_code, item_code, times, side=side, max_len=seq.max_len)
    hist = dataclasses.replace(
        hist,
        user_raw=user_names.take(pa.array(hist.user_raw)).to_numpy(zero_copy_only=False),
        item_raw=item_names.take(pa.array(hist.item_raw)).to_numpy(zero_copy_only=False),
    )
    c = hist.counters
    lengths = hist.lengths()
    stats = {
        "files": files,
        "events_read": cols.read,
        "rejected": dict(cols.rejected),
        "reject_examples": cols.examples,
        "events_kept": c.events_kept,
        "ties": c.ties,
        "out_of_order": _out_of_order(user_code, times),
        "truncated_events": c.truncated_events,
        "truncated_users": c.truncated_users,
        "users": hist.num_users,
        "items": hist.n_items,
        "side_missing": side_missing,
        "history_length": {
            "median": float(np.median(lengths)),
            "p95": float(np.percentile(lengths, 95)),
            "max": int(lengths.max()),
        },
    }
    return hist, vocabs, stats


def _out_of_order(user_code: np.ndarray, times: np.ndarray | None) -> int:
    """Events earlier than their user's previous event in the files' order."""
    if times is None or user_code.size < 2:
        return 0
    order = np.argsort(user_code, kind="stable")
    u, t = user_code[order], times[order]
    return int(((u[1:] == u[:-1]) & (t[1:] < t[:-1])).sum())


# ----------------------------------------------------------------------------- the folder


def _arrow_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def _read_arrow(path: str) -> pa.Table:
    with open(path, "rb") as fh:
        table = pa.ipc.open_file(pa.py_buffer(fh.read())).read_all()
    table.validate(full=True)  # offsets in bounds before anything reads them
    return table


@dataclasses.dataclass
class PreparedSequences:
    """A prepared event log: its folder, spec, histories, side vocabularies and stats."""

    folder: str
    spec: SequenceSpec
    hist: Histories
    side_vocabs: dict[str, pa.Array]
    stats: dict[str, Any]

    @classmethod
    def load(cls, folder: str, spec: SequenceSpec) -> PreparedSequences:
        """A prepared folder, checked: anything malformed is a one-line
        :class:`TabularFormatError` (delete the folder and prepare again)."""
        path = os.path.join(folder, "manifest.json")
        try:
            with open(path) as fh:
                m = json.load(fh)
            if m["format"] != SEQUENCE_FORMAT_VERSION:
                raise ValueError(f"format {m['format']!r}")
            events = _read_arrow(os.path.join(folder, "events.arrow"))
            users = _read_arrow(os.path.join(folder, "users.arrow"))
            items = _read_arrow(os.path.join(folder, "vocab", "item.arrow")).column("item")
            seq = spec.sequence
            vocabs = {
                s.name: _read_arrow(os.path.join(folder, "vocab", f"side-{k}.arrow"))
                .column("value")
                .combine_chunks()
                for k, s in enumerate(seq.side)
                if s.kind == "categorical"
            }
            col = lambda t, n: t.column(n).to_numpy()  # noqa: E731
            lengths = col(users, "length").astype(np.int64)
            hist = Histories(
                items=col(events, "item").astype(np.int32),
                offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                user_raw=users.column("user").to_numpy(),
                item_raw=items.to_numpy(),
                times=col(events, "time") if seq.time else None,
                side={s.name: col(events, f"side.{s.name}").astype(np.int32) for s in seq.side},
            )
            stats = dict(m["stats"])
        except (OSError, KeyError, TypeError, ValueError, pa.ArrowException) as e:
            raise TabularFormatError(
                f"{path}: not a prepared event log of this version ({type(e).__name__}: "
                f"{str(e)[:200]}); delete {folder} and run prepare again"
            ) from None
        return cls(folder, spec, hist, vocabs, stats)

    def summary(self) -> str:
        """One line: the folder and what the events became."""
        s = self.stats
        return (
            f"prepared {self.folder}: {s['users']} users, {s['items']} items, "
            f"{s['events_kept']} events (read {s['events_read']}, rejected "
            f"{s['rejected'] or 0}, ties {s['ties']}, out of order {s['out_of_order']}, "
            f"truncated {s['truncated_events']})"
        )


def prepared_folder(spec: SequenceSpec, root: str = "") -> str:
    """``<root>/<name>-<fingerprint>`` (module docstring)."""
    h = hashlib.sha256(sequence_digest(spec).encode())
    for path in expand(spec, spec.train, "train file"):
        st = os.stat(path)
        h.update(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    root = os.path.abspath(os.path.expanduser(root or DEFAULT_ROOT))
    return os.path.join(root, f"{spec.name}-{h.hexdigest()[:16]}")


def prepare_sequences(spec: SequenceSpec | str, root: str = "") -> PreparedSequences:
    """Prepares ``spec``'s event log under ``root`` (default ``~/.cache/recscale/tabular``), or
    loads it if done.

    Raises:
      TabularFormatError: bad input (strict spec), naming file, line and column.
    """
    if isinstance(spec, str):
        spec = load_sequence_spec(spec)
    folder = prepared_folder(spec, root)
    if not os.path.exists(os.path.join(folder, "manifest.json")):
        os.makedirs(os.path.join(folder, "vocab"), exist_ok=True)
        with exclusive(folder):  # two processes of one run prepare it once
            if not os.path.exists(os.path.join(folder, "manifest.json")):
                _write(spec, folder)
    return PreparedSequences.load(folder, spec)


def _write(spec: SequenceSpec, folder: str) -> None:
    t0 = time.perf_counter()
    hist, vocabs, stats = read_histories(spec)
    events = {"item": hist.items}
    if hist.times is not None:
        events["time"] = hist.times
    events.update({f"side.{k}": v for k, v in hist.side.items()})
    atomic_write(os.path.join(folder, "events.arrow"), _arrow_bytes(pa.table(events)))
    users = pa.table({"user": pa.array(hist.user_raw, pa.string()), "length": hist.lengths()})
    atomic_write(os.path.join(folder, "users.arrow"), _arrow_bytes(users))
    vocab = os.path.join(folder, "vocab")
    atomic_write(os.path.join(vocab, "item.arrow"), _arrow_bytes(pa.table({"item": hist.item_raw})))
    for k, s in enumerate(spec.sequence.side):
        if s.kind == "categorical":
            table = pa.table({"value": vocabs[s.name]})
            atomic_write(os.path.join(vocab, f"side-{k}.arrow"), _arrow_bytes(table))
    stats["timing_s"] = time.perf_counter() - t0
    saved = {"spec": spec.to_dict(), "base_dir": spec.base_dir}
    atomic_write(os.path.join(folder, "spec.json"), json.dumps(saved, indent=1).encode())
    manifest = {"format": SEQUENCE_FORMAT_VERSION, "n_items": hist.n_items, "stats": stats}
    atomic_write(os.path.join(folder, "manifest.json"), json.dumps(manifest, indent=1).encode())


# ----------------------------------------------------------------------------- the split


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class SequenceSplits:
    """Training histories and, per held-out split, each evaluated user's context and target."""

    train: Histories
    """What the model trains on."""
    held_out: dict[str, tuple[Histories, np.ndarray]]
    """``valid`` / ``test`` -> (contexts [U_eval rows], int32 [U_eval] target item ids)."""
    stats: dict[str, int]
    """Users without a target, short users (the split's own counts)."""


def split_histories(spec: SequenceSpec, hist: Histories) -> SequenceSplits:
    """``hist`` split by ``spec.split`` (``seq_spec.py``), on ``data.sequences``' splits."""
    if spec.split.kind == "leave_one_out":
        s = leave_one_out(hist)
        rows = s.eval_rows()
        return SequenceSplits(
            train=s.train,
            held_out={
                "valid": (s.train.select(rows), s.valid_targets[rows]),
                "test": (s.test_context.select(rows), s.test_targets[rows]),
            },
            stats={"users_short": s.users_short},
        )
    valid = time_cutoff(hist, spec.cutoff("valid_from"))
    held = {"valid": (valid.test_context, valid.test_targets)}
    stats = {
        "valid_users_without_target": valid.users_without_target,
        "valid_users_without_context": valid.users_without_context,
    }
    if spec.split.test_from is not None:
        test = time_cutoff(hist, spec.cutoff("test_from"))
        held["test"] = (test.test_context, test.test_targets)
        stats.update(
            test_users_without_target=test.users_without_target,
            test_users_without_context=test.users_without_context,
        )
    return SequenceSplits(train=valid.train, held_out=held, stats=stats)
