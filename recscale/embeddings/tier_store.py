"""The host side of tiered tables (``recscale.embeddings.tiers``): the backing
:class:`RowStore` (a table's rows and optimizer state in one file, undo-logged per checkpoint)
and the :class:`RowCache` directory that maps a table's ids to device cache slots (LRU or LFU).
The module docstring of ``recscale.embeddings.tiers`` describes the design; this module needs
no device.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from pathlib import Path
from typing import Literal

import numpy as np

from data.batch import PAD_ID
from recscale.config import ConfigError

Tier = Literal["dram", "ssd"]
Policy = Literal["lru", "lfu"]
_MAGIC = 0x52435449  # "RCTI": one undo record
_HEADER = struct.Struct("<qq")  # magic, row count
CHUNK_ROWS = 1 << 16  # rows per chunk when creating or scanning a store


# ------------------------------------------------------------------------------------------------
# The backing store.


class RowStore:
    """A table's rows and their optimizer state, ``[V, width]`` float32, in the file
    ``directory/rows.f32``: memory-mapped (``ssd``) or held in RAM and written to the file at
    :meth:`sync` (``dram``); undo-logged per checkpoint (module docstring)."""

    def __init__(self, directory: Path, num_rows: int, width: int, tier: Tier):
        self.dir, self.num_rows, self.width, self.tier = Path(directory), num_rows, width, tier
        self.path = self.dir / "rows.f32"
        self.row_bytes = 4 * width
        self.bytes_read = self.bytes_written = 0  # between the tier and the cache
        self._log_fd: int | None = None
        self._logged = np.zeros(0, bool)
        self._dirty = np.zeros(0, bool)  # dram: rows changed since the last sync
        self._mm: np.memmap | None = None
        self._ram: np.ndarray | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def create(self, init_rows) -> None:
        """A fresh store: ``init_rows(start, stop) -> [stop - start, width]`` fills it chunk by
        chunk (never the whole table in memory); its undo log starts at step 0."""
        self.close()
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in self.dir.glob("undo.*.log"):
            p.unlink()
        for p in self.dir.glob("cache.*.npz"):
            p.unlink()
        with open(self.path, "wb") as f:
            f.truncate(self.num_rows * self.row_bytes)
        mm = np.memmap(self.path, np.float32, "r+", shape=(self.num_rows, self.width))
        for a in range(0, self.num_rows, CHUNK_ROWS):
            b = min(a + CHUNK_ROWS, self.num_rows)
            mm[a:b] = init_rows(a, b)
        mm.flush()
        del mm
        self._open()
        self._new_log(0)

    def _open(self) -> None:
        if not self.path.is_file() or self.path.stat().st_size != self.num_rows * self.row_bytes:
            raise FileNotFoundError(
                f"tier store {self.path}: missing or not {self.num_rows} rows x {self.width} "
                "float32 (created by a run of another table size?)"
            )
        self._mm = np.memmap(self.path, np.float32, "r+", shape=(self.num_rows, self.width))
        if self.tier == "ssd":
            # Rows are read at random: the kernel's read-around of every fault (128 KiB) would
            # read 1,000 rows for one and fill the page cache with them.
            self._mm._mmap.madvise(mmap.MADV_RANDOM)
        if self.tier == "dram":
            self._ram = np.array(self._mm)
            self._dirty = np.zeros(self.num_rows, bool)
        self._logged = np.zeros(self.num_rows, bool)

    def close(self) -> None:
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None
        if self._mm is not None:
            self._mm.flush()
        self._mm = self._ram = None

    # -- rows ---------------------------------------------------------------------------------

    def read(self, rows: np.ndarray) -> np.ndarray:
        """``[len(rows), width]`` (rows sorted by the caller: sequential reads on an SSD)."""
        self.bytes_read += len(rows) * self.row_bytes
        src = self._ram if self._ram is not None else self._mm
        return src[rows]

    def write(self, rows: np.ndarray, values: np.ndarray) -> None:
        self.bytes_written += len(rows) * self.row_bytes
        if self._ram is not None:
            self._ram[rows] = values
            self._dirty[rows] = True
        else:
            self._write_file(rows, values)

    def _write_file(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Rows into the file, each logged (its old bytes appended to the undo log) before
        its first overwrite since the last checkpoint."""
        first = rows[~self._logged[rows]]
        for a in range(0, len(first), CHUNK_ROWS):  # records of bounded size
            r = first[a : a + CHUNK_ROWS]
            old = np.asarray(self._mm[r], np.float32)
            record = (
                _HEADER.pack(_MAGIC, len(r))
                + r.astype("<i8").tobytes()
                + old.astype("<f4").tobytes()
            )
            view = memoryview(record)
            while view:  # os.write may write less than asked (2 GiB cap, signals, full disk)
                view = view[os.write(self._log_fd, view) :]
            self._logged[r] = True
        self._mm[rows] = values

    def prefetch(self, rows: np.ndarray) -> None:
        """Reads ``rows`` ahead into the page cache (``ssd``; a background thread's work:
        ``pread`` releases the interpreter lock)."""
        if self.tier != "ssd" or not len(rows):
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for r in np.sort(rows):
                os.pread(fd, self.row_bytes, int(r) * self.row_bytes)
        finally:
            os.close(fd)

    # -- checkpoints --------------------------------------------------------------------------

    def sync(self, step: int) -> None:
        """The file holds every row as of now (``dram``: its changed rows written, logged);
        synced to disk; the undo log of ``step`` starts."""
        if self._ram is not None:
            rows = np.flatnonzero(self._dirty)
            for a in range(0, len(rows), CHUNK_ROWS):
                r = rows[a : a + CHUNK_ROWS]
                self._write_file(r, self._ram[r])
            self._dirty[:] = False
        self._mm.flush()
        os.fsync(self._log_fd)
        self._new_log(step)

    def _new_log(self, step: int) -> None:
        if self._log_fd is not None:
            os.close(self._log_fd)
        path = self.dir / f"undo.{step}.log"
        self._log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._logged[:] = False
        _fsync_dir(self.dir)

    def logs(self) -> list[int]:
        return sorted(int(p.name.split(".")[1]) for p in self.dir.glob("undo.*.log"))

    def restore(self, step: int) -> None:
        """Puts every row back to its value at checkpoint ``step`` (module docstring)."""
        self.close()
        steps = self.logs()
        if step not in steps:
            raise FileNotFoundError(
                f"tier store {self.dir}: no undo log for step {step} (logs: {steps}); the "
                "store can go back only to a checkpoint taken since it was created"
            )
        mm = np.memmap(self.path, np.float32, "r+", shape=(self.num_rows, self.width))
        for s in reversed([s for s in steps if s >= step]):
            for rows, old in _records(self.dir / f"undo.{s}.log", self.width):
                mm[rows] = old
            mm.flush()
            if s > step:
                (self.dir / f"undo.{s}.log").unlink()
        del mm
        self._open()
        self._new_log(step)

    def prune(self, oldest: int) -> None:
        """Deletes the logs of steps before ``oldest`` (no checkpoint can go back to them)."""
        for s in self.logs():
            if s < oldest:
                (self.dir / f"undo.{s}.log").unlink()


def _records(path: Path, width: int):
    """The complete ``(rows, old values)`` records of an undo log (a torn tail is dropped:
    its write never reached the file, which is written only after its record)."""
    for rows, old, _ in parse_records(path.read_bytes(), width):
        yield rows, old


def parse_records(data: bytes, width: int):
    """``(rows, old values, end offset)`` of each complete undo record in ``data`` (bytes of
    an undo log from a record's start), stopping at a torn or foreign tail."""
    at = 0
    while at + _HEADER.size <= len(data):
        magic, n = _HEADER.unpack_from(data, at)
        end = at + _HEADER.size + 8 * n + 4 * n * width
        if magic != _MAGIC or end > len(data):
            break
        rows = np.frombuffer(data, "<i8", n, at + _HEADER.size)
        old = np.frombuffer(data, "<f4", n * width, at + _HEADER.size + 8 * n).reshape(n, width)
        yield rows, old, end
        at = end


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------
# The cache's directory and policy (host side).


@dataclasses.dataclass
class StepPlan:
    """What one batch needs done to the cache of one table."""

    slot_ids: np.ndarray
    """The batch's ids rewritten to cache slots (padding kept)."""
    load_slots: np.ndarray
    load_rows: np.ndarray
    """Missed rows, to be read from the store into these slots."""
    evict_slots: np.ndarray
    evict_rows: np.ndarray
    """Evicted rows updated since they were loaded: their values go back to the store."""


class RowCache:
    """The directory of a ``capacity``-row cache over ``num_rows`` rows: which row each slot
    holds, and which slot each row is in (``int32`` per row: 4 bytes against a row's
    ``4 (w + state)``), with LRU or LFU eviction."""

    def __init__(self, num_rows: int, capacity: int, policy: Policy = "lru", name: str = ""):
        if policy not in ("lru", "lfu"):
            raise ValueError(f"cache policy {policy!r}: expected lru or lfu")
        self.name, self.num_rows, self.capacity, self.policy = name, num_rows, capacity, policy
        self.slot_of = np.full(num_rows, -1, np.int32)
        self.row_of = np.full(capacity, -1, np.int64)
        self.stamp = np.full(capacity, -1, np.int64)  # step of the last use
        self.dirty = np.zeros(capacity, bool)  # updated since loaded
        self.freq = np.zeros(num_rows if policy == "lfu" else 0, np.int32)  # steps seen
        self.used = 0  # slots ever filled (filled in order)
        self.clock = 0
        self.requests = self.hits = self.evictions = 0
        # LRU: (slot, stamp) in order of use; an entry is live while the slot's stamp is still
        # its stamp, so victims are the live entries at the front (no scan of the whole cache)
        self._q = np.zeros((1024, 2), np.int64)
        self._head = self._tail = 0

    def plan(self, ids: np.ndarray, *, train: bool) -> StepPlan:
        """Places the distinct rows of ``ids`` (any shape; ``PAD_ID`` padding) in the cache."""
        valid = ids != PAD_ID
        flat = ids[valid]
        if len(flat) and (flat.min() < 0 or flat.max() >= self.num_rows):
            bad = flat[(flat < 0) | (flat >= self.num_rows)][0]
            raise ValueError(f"tiered table {self.name!r}: id {bad} outside [0, {self.num_rows})")
        u, inv = np.unique(flat, return_inverse=True)
        t = self.clock
        self.clock += 1
        slots = self.slot_of[u]
        hit = slots >= 0
        self.stamp[slots[hit]] = t
        if self.policy == "lfu":
            self.freq[u] += 1
        miss = u[~hit]
        take = min(len(miss), self.capacity - self.used)
        target = np.arange(self.used, self.used + take, dtype=np.int64)
        self.used += take
        self.stamp[target] = t  # not victims of this batch either
        rest = len(miss) - take
        evict_slots = np.zeros(0, np.int64)
        evict_rows = np.zeros(0, np.int64)
        if rest:
            if rest > self.used - int(hit.sum()) - take:  # the slots this batch does not use
                raise ConfigError(
                    f"tiered table {self.name!r}: a batch reads {len(u)} distinct rows, more "
                    f"than its cache of {self.capacity} rows holds (raise its cache rows)"
                )
            if self.policy == "lru":
                victims = self._oldest(rest)
            else:  # least frequent first, the least recent among equals
                f = self.freq[np.maximum(self.row_of, 0)].astype(np.int64)
                key = np.where(self.stamp < t, (f << 32) | self.stamp, np.iinfo(np.int64).max)
                victims = np.argpartition(key, rest - 1)[:rest]
            victims.sort()
            vrows = self.row_of[victims]
            self.slot_of[vrows] = -1
            self.evictions += rest
            wb = self.dirty[victims]
            evict_slots, evict_rows = victims[wb], vrows[wb]
            target = np.concatenate([target, victims])
        self.slot_of[miss] = target
        self.row_of[target] = miss
        self.stamp[target] = t
        self.dirty[target] = False
        slots = self.slot_of[u]
        if self.policy == "lru":
            self._push(slots, t)
        if train:
            self.dirty[slots] = True
        out = ids.copy()
        out[valid] = slots[inv]
        self.requests += len(u)
        self.hits += int(hit.sum())
        return StepPlan(out, target, miss, evict_slots, evict_rows)

    def _push(self, slots: np.ndarray, t: int) -> None:
        """Appends ``(slot, t)`` entries to the use queue (amortised: the live part moves to
        the front, dead entries dropped, and the buffer doubles only when that is not room)."""
        if self._tail + len(slots) > len(self._q):
            q = self._q[self._head : self._tail]
            q = q[self.stamp[q[:, 0]] == q[:, 1]]
            size = len(self._q)
            while len(q) + len(slots) > size // 2:
                size *= 2
            self._q = np.zeros((size, 2), np.int64)
            self._q[: len(q)] = q
            self._head, self._tail = 0, len(q)
        self._q[self._tail : self._tail + len(slots), 0] = slots
        self._q[self._tail : self._tail + len(slots), 1] = t
        self._tail += len(slots)

    def _oldest(self, k: int) -> np.ndarray:
        """The ``k`` least recently used slots, taken off the front of the use queue."""
        out, n = [], 0
        while n < k:
            chunk = self._q[self._head : min(self._head + max(2 * (k - n), 1024), self._tail)]
            live = chunk[self.stamp[chunk[:, 0]] == chunk[:, 1], 0]
            if n + len(live) >= k:  # stop right after the k-th live entry
                last = np.flatnonzero(self.stamp[chunk[:, 0]] == chunk[:, 1])[k - n - 1]
                self._head += last + 1
                out.append(live[: k - n])
                n = k
            else:
                self._head += len(chunk)
                out.append(live)
                n += len(live)
        return np.concatenate(out)

    def dirty_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, rows)`` of every cached row updated since it was loaded."""
        s = np.flatnonzero(self.dirty[: self.used])
        return s, self.row_of[s]

    def state(self) -> dict[str, np.ndarray]:
        out = {
            "row_of": self.row_of,
            "stamp": self.stamp,
            "dirty": self.dirty,
            "scalars": np.array([self.used, self.clock, self.requests, self.hits, self.evictions]),
        }
        if self.policy == "lfu":
            out["freq"] = self.freq
        else:
            out["queue"] = self._q[self._head : self._tail]
        return out

    def load(self, st: dict[str, np.ndarray]) -> None:
        self.row_of, self.stamp = st["row_of"].copy(), st["stamp"].copy()
        self.dirty = st["dirty"].copy()
        self.used, self.clock, self.requests, self.hits, self.evictions = (
            int(x) for x in st["scalars"]
        )
        if self.policy == "lfu":
            self.freq = st["freq"].copy()
        else:
            q = st["queue"]
            self._q = np.zeros((max(1024, 2 * len(q)), 2), np.int64)
            self._q[: len(q)] = q
            self._head, self._tail = 0, len(q)
        self.slot_of[:] = -1
        held = self.row_of >= 0
        self.slot_of[self.row_of[held]] = np.flatnonzero(held)
