"""Tables beyond device memory: a device-resident cache of hot rows over a host-DRAM or SSD tier.

ZionEX and the storage-class-memory work keep production tables in a hierarchy: the hot rows in
device memory (HBM), the rest in host DRAM or on SSD. Here a **tiered table** is, to the model
and the engine, an ordinary table of ``cache_rows`` rows (its cache, laid out and updated by the
engine like any other); the whole table lives in a :class:`RowStore`, and a :class:`RowCache`
on the host maps the table's ids to cache slots, batch by batch:

1. the batch's distinct ids are looked up in the cache's directory; misses get free slots or
   the slots of evicted rows (LRU or LFU, never a row of this batch);
2. one jitted :meth:`TieredTables.prepare` call per step gathers the evicted rows that were
   updated since they were loaded (with their optimizer state) from the device and writes the
   missed rows (read from the store) into their slots; the batch's ids are rewritten to slots;
3. the evicted rows' values reach the store one step later (when the device has them: the host
   never waits on the step it just dispatched), and always before a row is read again;
4. a background thread reads the next batch's rows that the cache lacks ahead of time (an SSD
   tier's page cache is warm when the step needs them).

Every row's value and optimizer state are the same bits whichever tier holds it, so a tiered
run equals the all-in-memory run bitwise (``tests/recscale/test_tiers.py``).

**Stores and checkpoints.** A store is one file of ``[V, w + state]`` float32 rows: the row
and its optimizer state (row-wise Adagrad's accumulator, lazy Adam's moments). The ``ssd``
tier memory-maps it (the process holds only the pages it touches; the kernel evicts them under
memory pressure); the ``dram`` tier holds a copy in RAM and writes it to the file at
checkpoints. A checkpoint at step ``k`` (:meth:`TieredTables.checkpoint`) writes every updated
cached row back, syncs the file and starts an **undo log** ``undo.<k>.log``: before a row of
the file is first overwritten after step ``k``, its old bytes are appended to that log. Restoring
step ``k`` applies the logs of steps ``>= k`` newest first, which puts every row back to its
value at ``k`` (a kill in the middle of a write-back loses nothing: a row is logged, in full,
before it is written, so a torn last record belongs to a write that never happened). The cache's
directory is saved beside (``cache.<k>.npz``), so a resumed run continues bitwise, hit rates
included. Logs older than the oldest kept checkpoint are deleted. Crash-consistent against
process kills; against power loss the log would also need an ``fsync`` per write (it gets one
per checkpoint).

Hand-written: no maintained Python library offers a row cache over a memory-mapped table with
write-back and undo logging (TorchRec's and FBGEMM's UVM caches are CUDA-only and keep the
backing table in host memory).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import mmap
import os
import struct
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from data.batch import PAD_ID, Batch, Schema
from recscale import sharding
from recscale.config import ConfigError
from recscale.embeddings import engine
from recscale.embeddings.planner import OPTIMIZER_STATE_BYTES

Tier = Literal["dram", "ssd"]
Policy = Literal["lru", "lfu"]
TIERS = ("dram", "ssd")
_MAGIC = 0x52435449  # "RCTI": one undo record
_HEADER = struct.Struct("<qq")  # magic, row count
_CHUNK = 1 << 16  # rows per chunk when creating or scanning a store
_AXIS = sharding.DATA_AXIS
_UINT = {2: jnp.uint16, 4: jnp.uint32}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierSpec:
    """One tiered table: its backing tier and its device cache's rows."""

    table: str
    tier: Tier
    cache_rows: int


def parse_tiers(pins: tuple[str, ...]) -> dict[str, TierSpec]:
    """``("C1=ssd:65536", ...)`` (``embeddings.tiers``) as ``{table: TierSpec}``."""
    out = {}
    for item in pins:
        name, _, rest = item.partition("=")
        tier, _, rows = rest.partition(":")
        if not name or tier not in TIERS or not rows.isdigit() or int(rows) < 1:
            raise ConfigError(
                f"embeddings.tiers entry {item!r}: expected TABLE=TIER:CACHE_ROWS, TIER one of "
                f"{TIERS}, CACHE_ROWS a positive integer (e.g. C1=ssd:65536)"
            )
        if name in out:
            raise ConfigError(f"embeddings.tiers names table {name!r} twice")
        out[name] = TierSpec(table=name, tier=tier, cache_rows=int(rows))
    return out


def model_schema(schema: Schema, specs: dict[str, TierSpec]) -> Schema:
    """The schema the model is built from: a tiered table has its cache's rows (the ids the
    model sees are cache slots)."""
    names = {f.table_name for f in schema.features}
    unknown = sorted(set(specs) - names)
    if unknown:
        raise ConfigError(
            f"embeddings.tiers names unknown tables {unknown}; known: {sorted(names)}"
        )
    feats = []
    for f in schema.features:
        s = specs.get(f.table_name)
        if s is not None and s.cache_rows < f.vocab_size:
            f = dataclasses.replace(f, vocab_size=s.cache_rows)
        feats.append(f)
    return dataclasses.replace(schema, features=tuple(feats))


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
        for a in range(0, self.num_rows, _CHUNK):
            b = min(a + _CHUNK, self.num_rows)
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
        for a in range(0, len(first), _CHUNK):  # records of bounded size
            r = first[a : a + _CHUNK]
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
            for a in range(0, len(rows), _CHUNK):
                r = rows[a : a + _CHUNK]
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


# ------------------------------------------------------------------------------------------------
# The tiered tables of a model's engine, on the device.


@dataclasses.dataclass(frozen=True)
class _Placed:
    """Where a tiered table's cache slots live in the train state."""

    spec: TierSpec
    feature: int  # along the batch's F axis
    hotness: int
    num_rows: int  # V of the whole table
    dim: int
    opt_path: str  # the engine buffer's path in params, its key in opt_state["embedding"]
    opt_names: tuple[str, ...]  # "acc" | "m", "v"
    pos: np.ndarray  # [C]: the buffer row holding each slot
    buffer_rows: int  # rows of the whole buffer
    block_rows: int  # R: rows per device block (0: replicated buffer)


def state_width(optimizer: str, dim: int) -> int:
    """float32 words of a row's optimizer state (the planner's bytes, ``OPTIMIZER_STATE_BYTES``)."""
    per_row, per_element = OPTIMIZER_STATE_BYTES[optimizer]
    return (per_row + per_element * dim) // 4


class TieredTables:
    """The tiered tables of one model: stores, caches and the device-side swap of rows.

    ``prepare(state, batch, train=)`` before every step (and evaluation batch);
    ``checkpoint(state, step)`` before the trainer's checkpoint of ``step``;
    ``restore(step)`` after restoring it; ``create()`` for a fresh run."""

    def __init__(
        self,
        model: Any,
        schema: Schema,
        specs: dict[str, TierSpec],
        directory: Path,
        *,
        optimizer: str,
        initial_accumulator: float,
        seed: int,
        mesh,
        policy: Policy = "lru",
        state_sharding: Any = None,
    ):
        self.dir, self.optimizer, self.seed, self.mesh = Path(directory), optimizer, seed, mesh
        self.initial_accumulator = initial_accumulator
        colls = engine.engine_collections(model)
        if not colls:
            raise ConfigError("embeddings.tiers needs the embedding engine (embeddings.sharding)")
        feature_index = {f.name: i for i, f in enumerate(schema.features)}
        vocab = {f.table_name: f.vocab_size for f in schema.features}
        self.placed: list[_Placed] = []
        self.table_specs = {}
        for ck, coll in colls.items():
            for fi, fs in enumerate(coll.feature_specs):
                spec = specs.get(fs.table)
                if spec is None:
                    continue
                t = next(t for t in coll.table_specs if t.name == fs.table)
                if fs.table in self.table_specs:  # its cache remaps one feature's ids
                    raise ConfigError(
                        f"tiered table {fs.table!r} is read by several features; a tiered "
                        "table must have one (drop it from embeddings.tiers)"
                    )
                self.table_specs[fs.table] = t
                self.placed.append(
                    self._place(ck, coll, fi, fs, spec, t, feature_index, vocab[fs.table])
                )
        missing = sorted(set(specs) - {p.spec.table for p in self.placed})
        if missing:
            raise ConfigError(f"embeddings.tiers: tables {missing} are not in the engine")
        self.caches = {
            p.spec.table: RowCache(p.num_rows, p.spec.cache_rows, policy, p.spec.table)
            for p in self.placed
        }
        self.stores = {
            p.spec.table: RowStore(
                self.dir / p.spec.table,
                p.num_rows,
                p.dim + state_width(optimizer, p.dim),
                p.spec.tier,
            )
            for p in self.placed
        }
        self.pending: list[tuple[str, np.ndarray, Any, int]] = []  # write-backs in flight
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tier-prefetch")
        self._prefetching: concurrent.futures.Future | None = None
        self._gather = jax.jit(self._gather_fn)
        self._scatter = jax.jit(self._scatter_fn, donate_argnums=(0,), out_shardings=state_sharding)
        self._window = {t: [0, 0] for t in self.caches}  # requests, hits since the last stats()

    def _place(self, ck, coll, fi, fs, spec, t, feature_index, num_rows) -> _Placed:
        lay = coll.layout
        pieces = []
        for bl in lay.buffers:
            for d in range(len(bl.feature)):
                for s in range(len(bl.feature[d])):
                    if bl.feature[d][s] == fi and bl.row_count[d][s]:
                        pieces.append((bl, d, s))
        if not pieces or any(bl.width != t.dim for bl, _, _ in pieces):
            raise ConfigError(
                f"tiered table {t.name!r}: its cache must be placed whole rows at a time "
                "(table_wise, row_wise or data_parallel), not column-split; pin it with "
                f"embeddings.per_table={t.name}=row_wise"
            )
        if len({bl.key for bl, _, _ in pieces}) != 1:
            raise ConfigError(f"tiered table {t.name!r}: its rows span several engine buffers")
        bl = pieces[0][0]
        pos = np.full(t.num_rows, -1, np.int64)
        for _, d, s in pieces:
            r0, n = bl.row_start[d][s], bl.row_count[d][s]
            base = (0 if bl.replicated else d * bl.rows) + bl.offset[d][s]
            pos[r0 : r0 + n] = base + np.arange(n)
        blocks = 1 if bl.replicated else lay.num_devices
        names = {"sgd": (), "rowwise_adagrad": ("acc",), "adam": ("m", "v")}[self.optimizer]
        path = "/".join(p for p in (ck, "buffers", bl.key) if p)
        return _Placed(
            spec=dataclasses.replace(spec, cache_rows=t.num_rows),
            feature=feature_index[fs.name],
            hotness=fs.max_hotness,
            num_rows=num_rows,
            dim=t.dim,
            opt_path=path,
            opt_names=names,
            pos=pos,
            buffer_rows=blocks * bl.rows,
            block_rows=0 if bl.replicated else bl.rows,
        )

    # -- the device side ----------------------------------------------------------------------

    def _arrays(self, state, p: _Placed) -> list:
        """The buffer and optimizer-state arrays holding table ``p``'s cache."""
        flat = dict(nnx.to_flat_state(state.params))
        var = next(v for k, v in flat.items() if "/".join(map(str, k)) == p.opt_path)
        return [var[...]] + [state.opt_state["embedding"][p.opt_path][k][...] for k in p.opt_names]

    def _gather_fn(self, state, gather: dict) -> dict:
        """Per table: the rows at buffer rows ``gather`` with their optimizer state,
        ``[M, width + state]`` float32 (index ``buffer_rows``: zeros)."""
        old = {}
        for p in self.placed:
            got = _gather_rows(p, self.mesh, self._arrays(state, p), gather[p.spec.table])
            old[p.spec.table] = jnp.concatenate(
                [g.astype(jnp.float32).reshape(g.shape[0], -1) for g in got], axis=1
            )
        return old

    def _scatter_fn(self, state, scatter: dict, values: dict):
        """Per table: ``values`` written at buffer rows ``scatter`` (index ``buffer_rows``:
        nothing), in place (a program of its own: XLA:CPU copies a buffer that one program
        both gathers from and scatters into, 15 ms for 33 MB)."""
        flat = dict(nnx.to_flat_state(state.params))
        key = {"/".join(map(str, k)): k for k in flat}
        emb_opt = {k: dict(v) for k, v in state.opt_state["embedding"].items()}
        for p in self.placed:
            t, var = p.spec.table, flat[key[p.opt_path]]
            arrays = [var[...]] + [emb_opt[p.opt_path][k][...] for k in p.opt_names]
            v = values[t]
            parts = [v[:, : p.dim]]
            if p.opt_names == ("acc",):
                parts.append(v[:, p.dim])
            elif p.opt_names:
                parts += [v[:, p.dim : 2 * p.dim], v[:, 2 * p.dim :]]
            new = _scatter_rows(p, self.mesh, arrays, scatter[t], parts)
            flat[key[p.opt_path]] = var.replace(new[0])
            for k, a in zip(p.opt_names, new[1:], strict=True):
                emb_opt[p.opt_path][k] = emb_opt[p.opt_path][k].replace(a)
        params = nnx.from_flat_state(flat)
        opt_state = {**state.opt_state, "embedding": emb_opt}
        return dataclasses.replace(state, params=params, opt_state=opt_state)

    def _run_swap(self, state, gathers, scatters):
        """``gathers``/``scatters``: per table ``(buffer rows, ...)``; pads them to one
        power-of-two length (a few compiled shapes, not one per step), reads the gathered rows
        out, then writes the scattered ones: ``(state, {table: rows read})``. The read is
        dispatched first, so it sees the rows before the write (which waits for it)."""
        n = max([len(g) for g in gathers.values()] + [len(s[0]) for s in scatters.values()])
        m = max(256, 1 << max(n - 1, 0).bit_length())
        g_pad, s_pad, v_pad = {}, {}, {}
        for p in self.placed:
            t = p.spec.table
            g = np.full(m, p.buffer_rows, np.int32)
            g[: len(gathers[t])] = gathers[t]
            rows, vals = scatters[t]
            s = np.full(m, p.buffer_rows, np.int32)
            s[: len(rows)] = rows
            v = np.zeros((m, self.stores[t].width), np.float32)
            v[: len(rows)] = vals
            g_pad[t], s_pad[t], v_pad[t] = g, s, v
        old = None
        if any(len(g) for g in gathers.values()):
            old = self._gather(state, g_pad)
        if any(len(s[0]) for s in scatters.values()):
            state = self._scatter(state, s_pad, v_pad)
        return state, old

    # -- the host side ------------------------------------------------------------------------

    def prepare(self, state, batch: Batch, *, train: bool):
        """The batch's tiered ids placed in the caches (missed rows loaded, evicted rows on
        their way back to the stores): ``(state, batch with the ids rewritten to slots)``."""
        self._drain()
        ids = np.array(batch.ids_bfh, copy=True)
        gathers, scatters, evicted = {}, {}, {}
        for p in self.placed:
            t = p.spec.table
            plan = self.caches[t].plan(ids[:, p.feature], train=train)
            ids[:, p.feature] = plan.slot_ids
            vals = self.stores[t].read(plan.load_rows)  # sorted: np.unique's order
            gathers[t] = p.pos[plan.evict_slots]
            scatters[t] = (p.pos[plan.load_slots], vals)
            evicted[t] = plan.evict_rows
        state, old = self._run_swap(state, gathers, scatters)
        for t, rows in evicted.items():
            if len(rows):
                self.pending.append((t, rows, old[t]))
        return state, batch._replace(ids_bfh=ids)

    def _drain(self) -> None:
        """Evicted rows into their stores (their values are on the host by now, or soon)."""
        for t, rows, old in self.pending:
            self.stores[t].write(rows, np.asarray(old)[: len(rows)])
        self.pending = []

    def lookahead(self, batches):
        """``batches`` (``(index, Batch)`` pairs), one ahead: while a batch trains, the rows of
        the next that the caches lack are read into the page cache on a background thread."""
        it = iter(batches)
        nxt = next(it, None)
        while nxt is not None:
            cur, nxt = nxt, next(it, None)
            if nxt is not None and any(s.tier == "ssd" for s in self.stores.values()):
                self._prefetch(nxt[1])
            yield cur

    def _prefetch(self, batch: Batch) -> None:
        if self._prefetching is not None:
            self._prefetching.result()
        wanted = {}
        for p in self.placed:
            ids = batch.ids_bfh[:, p.feature]
            u = np.unique(ids[ids != PAD_ID])
            u = u[(u >= 0) & (u < p.num_rows)]
            # a racy read of the directory: it only decides which pages to warm
            wanted[p.spec.table] = u[self.caches[p.spec.table].slot_of[u] < 0]

        def work():
            for t, rows in wanted.items():
                self.stores[t].prefetch(rows)

        self._prefetching = self._pool.submit(work)

    # -- checkpoints --------------------------------------------------------------------------

    def create(self, initial: dict[str, np.ndarray] | None = None) -> None:
        """Fresh stores, filled with the tables' initial rows (drawn here, or ``initial``'s
        ``[V, width + state]`` arrays); empty caches."""
        self.pending = []
        for i, p in enumerate(self.placed):
            t = p.spec.table
            if initial is not None and t in initial:
                init = lambda a, b, x=initial[t]: x[a:b]  # noqa: E731
            else:
                init = functools.partial(self._init_rows, i, p)
            self.stores[t].create(init)
            c = self.caches[t]
            self.caches[t] = RowCache(c.num_rows, c.capacity, c.policy, c.name)
            self._save_cache(t, 0)

    def _init_rows(self, index: int, p: _Placed, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of table ``index``'s initial value and optimizer state, drawn
        per chunk of ``_CHUNK`` rows (the same values whatever the chunking of the caller)."""
        spec = self.table_specs[p.spec.table]
        out = np.zeros((stop - start, self.stores[p.spec.table].width), np.float32)
        for a in range(start - start % _CHUNK, stop, _CHUNK):
            rng = np.random.default_rng([self.seed, index, a // _CHUNK])
            n = min(_CHUNK, p.num_rows - a)
            if spec.init == "uniform_sqrt_rows":
                bound = 1.0 / np.sqrt(p.num_rows)
                rows = rng.uniform(-bound, bound, (n, p.dim)).astype(np.float32)
            else:
                rows = (spec.init_scale * rng.standard_normal((n, p.dim))).astype(np.float32)
            lo, hi = max(a, start), min(a + n, stop)
            out[lo - start : hi - start, : p.dim] = rows[lo - a : hi - a]
        if p.opt_names == ("acc",):
            out[:, p.dim] = self.initial_accumulator
        return out

    def checkpoint(self, state, step: int):
        """Before the trainer's checkpoint of ``step``: every updated cached row written back,
        the stores synced (their undo logs of ``step`` begun), the directories saved. Returns
        the state (the same values)."""
        self._drain()
        gathers, scatters, rows = {}, {}, {}
        for p in self.placed:
            t = p.spec.table
            slots, rows[t] = self.caches[t].dirty_slots()
            gathers[t] = p.pos[slots]
            scatters[t] = (np.zeros(0, np.int64), np.zeros((0, self.stores[t].width)))
            self.caches[t].dirty[slots] = False
        state, old = self._run_swap(state, gathers, scatters)
        for p in self.placed:
            t = p.spec.table
            if len(rows[t]):
                self.stores[t].write(rows[t], np.asarray(old[t])[: len(rows[t])])
            self.stores[t].sync(step)
            self._save_cache(t, step)
        return state

    def _save_cache(self, table: str, step: int) -> None:
        path = self.dir / table / f"cache.{step}.npz"
        tmp = path.with_suffix(".tmp.npz")
        with open(tmp, "wb") as f:
            np.savez(f, **self.caches[table].state())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def restore(self, step: int) -> None:
        """After the trainer restored checkpoint ``step``: the stores and the caches'
        directories as they were then (write-backs of the abandoned steps dropped)."""
        self.pending = []
        if self._prefetching is not None:
            self._prefetching.result()
        for p in self.placed:
            t = p.spec.table
            path = self.dir / t / f"cache.{step}.npz"
            if not path.is_file():
                raise FileNotFoundError(
                    f"tiered table {t!r}: {path} is missing (the cache "
                    f"directory of checkpoint step {step})"
                )
            self.stores[t].restore(step)
            with np.load(path) as z:
                self.caches[t].load(dict(z))
            for q in (self.dir / t).glob("cache.*.npz"):
                if int(q.name.split(".")[1]) > step:
                    q.unlink()

    def prune(self, oldest: int) -> None:
        """Forgets what only checkpoints before ``oldest`` would need."""
        for p in self.placed:
            t = p.spec.table
            self.stores[t].prune(oldest)
            for q in (self.dir / t).glob("cache.*.npz"):
                if int(q.name.split(".")[1]) < oldest:
                    q.unlink()

    def close(self) -> None:
        self._drain()
        if self._prefetching is not None:
            self._prefetching.result()
        self._pool.shutdown()
        for s in self.stores.values():
            s.close()

    # -- reporting ----------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Per table: the hit rate since the last call and in all, and MiB read from and
        written to its tier (row and optimizer state) in all."""
        out = {}
        for t, c in self.caches.items():
            w = self._window[t]
            req, hits = c.requests - w[0], c.hits - w[1]
            w[:] = [c.requests, c.hits]
            s = self.stores[t]
            out[f"tier/{t}/hit_rate"] = hits / req if req else float("nan")
            out[f"tier/{t}/hit_rate_total"] = c.hits / c.requests if c.requests else float("nan")
            out[f"tier/{t}/{s.tier}_read_mib"] = s.bytes_read / 2**20
            out[f"tier/{t}/{s.tier}_written_mib"] = s.bytes_written / 2**20
        return out


def _local(p: _Placed, rows):
    """``rows`` as indices into this device's block (rows of other blocks: the block's
    length, out of range), for buffer rows split over the mesh's data axis in blocks of
    ``p.block_rows`` (0: one replicated block)."""
    if not p.block_rows:
        return rows
    n = p.block_rows
    local = rows - jax.lax.axis_index(_AXIS) * n
    return jnp.where((local >= 0) & (local < n), local, n)


def _gather_rows(p: _Placed, mesh, arrays: list, rows) -> list:
    """``[a[rows] for a in arrays]`` (out-of-range rows: zeros); each device reads its own
    block and the results are summed over devices (every row is in one block)."""

    def body(rows, *arrs):
        local = _local(p, rows)
        got = [a.at[local].get(mode="fill", fill_value=0) for a in arrs]
        if not p.block_rows:
            return got
        # Summed as bit patterns: every row is in one block (the others add zero bits), so the
        # values come back exact, -0.0 included (a float sum would give +0.0).
        bits = [jax.lax.bitcast_convert_type(g, _UINT[g.dtype.itemsize]) for g in got]
        return [
            jax.lax.bitcast_convert_type(jax.lax.psum(b, _AXIS), g.dtype)
            for b, g in zip(bits, got, strict=True)
        ]

    if not p.block_rows:
        return body(rows, *arrays)
    spec = [P(_AXIS, *([None] * (a.ndim - 1))) for a in arrays]
    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(), *spec), out_specs=[P()] * len(arrays), check_vma=False
    )(rows, *arrays)


def _scatter_rows(p: _Placed, mesh, arrays: list, rows, values: list) -> list:
    """``arrays`` with ``values`` at ``rows`` (out-of-range rows: dropped), each device
    writing its own block."""

    def body(rows, *arrs_vals):
        arrs, vals = arrs_vals[: len(arrays)], arrs_vals[len(arrays) :]
        local = _local(p, rows)
        return [
            a.at[local].set(v.astype(a.dtype), mode="drop") for a, v in zip(arrs, vals, strict=True)
        ]

    if not p.block_rows:
        return body(rows, *arrays, *values)
    spec = [P(_AXIS, *([None] * (a.ndim - 1))) for a in arrays]
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), *spec, *([P()] * len(values))),
        out_specs=spec,
        check_vma=False,
    )(rows, *arrays, *values)
