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
import json
import os
from pathlib import Path
from typing import Any

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
from recscale.embeddings.tier_store import CHUNK_ROWS, Policy, RowCache, RowStore, Tier

TIERS = ("dram", "ssd")
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


OWNER_FILE = "owner.json"
"""In a tiered run's store folder: the workdir of the run whose stores it holds."""


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
        owner: str = "",
    ):
        self.dir, self.optimizer, self.seed, self.mesh = Path(directory), optimizer, seed, mesh
        self.owner = owner  # the run's workdir, resolved: see _claim
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
        self._claim()
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

    def _claim(self) -> None:
        """Before fresh stores replace what the folder holds: the folder is this run's.

        ``owner.json`` names the run (its workdir) whose stores the folder holds. Another run's,
        or stores no run claims outside this run's own workdir (an ``embeddings.tier_dir``
        that two runs share: the second's fresh start would truncate the first's tables and
        delete its undo logs) are refused; then the folder is marked as this run's."""
        if not self.owner:
            return
        marker = self.dir / OWNER_FILE
        try:
            found = json.loads(marker.read_text()).get("workdir")
        except FileNotFoundError:
            inside = Path(self.owner) in self.dir.resolve().parents
            found = None if inside or not any(self.dir.glob("*/rows.f32")) else "no run named"
        except (OSError, ValueError, AttributeError):
            found = f"no run named (an unreadable {OWNER_FILE})"
        if found is not None and found != self.owner:
            raise ConfigError(
                f"embeddings.tier_dir {self.dir}: holds the table stores of {found}, not of "
                f"this run ({self.owner}); give each run a tier_dir of its own"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_name(f".{OWNER_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"workdir": self.owner}) + "\n")
        os.replace(tmp, marker)

    def _init_rows(self, index: int, p: _Placed, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of table ``index``'s initial value and optimizer state, drawn
        per chunk of ``CHUNK_ROWS`` rows (the same values whatever the chunking of the caller)."""
        spec = self.table_specs[p.spec.table]
        out = np.zeros((stop - start, self.stores[p.spec.table].width), np.float32)
        for a in range(start - start % CHUNK_ROWS, stop, CHUNK_ROWS):
            rng = np.random.default_rng([self.seed, index, a // CHUNK_ROWS])
            n = min(CHUNK_ROWS, p.num_rows - a)
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
