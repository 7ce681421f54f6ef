"""The learned planner (``embeddings.planner=learned``): NeuroShard's search over a learned
cost model.

A device's predicted time is the learned model's time of its shard set
(``recscale.embeddings.learned_cost``: not a sum of per-table costs) plus the analytic
communication of its shards (``planner.candidates``: the calibrated bytes over the profile's
link bandwidth, the same term the analytic planner uses).

Search (NeuroShard, MLSys 2023, section 4):

* **beam search over column splits**: a state gives every table its column split ``k`` (1:
  whole columns: table-, row-wise or data-parallel; ``k > 1``: ``k`` column slices). From each
  state in the beam, the tables with a shard on the slowest device (the ``expand`` costliest
  there) are tried with their split doubled; the ``beam_width`` best states (slowest device,
  then total time) go on, until a round improves nothing or ``max_rounds`` have run.
* **greedy placement** of a state (the grid search's inner loop): tables in order of their
  predicted cost, largest first, each taking the candidate of its split (and devices: the
  least loaded that have room, as ``planner.place_devices`` picks them) that minimises the resulting
  slowest device, then the total, re-predicting the devices it touches as sets.

The device memory cap is the analytic planner's (``memory_fraction`` of the profile's memory,
tables and optimizer state); a table no state can place raises, naming it. Plans carry the
learned time of each device in the ``lookup`` term (kernels: pool, backward, update), the
communication in ``comm``, and 0 in ``compute`` (inside the learned term).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from recscale.embeddings import planner as pl
from recscale.embeddings.learned_cost import CostPredictor, shard_features
from recscale.embeddings.shard_cost import ShardWork, valid_share, work_of
from tpu_gpu_configs.profiles import HardwareProfile


@dataclasses.dataclass
class _Option:
    """A candidate with the work of each of its shards (shard ``i`` of a row split: rows
    ``[i·R, (i+1)·R)``) and their summed encodings."""

    cand: pl.Candidate
    works: list[ShardWork | None]
    """None: an empty shard (a row-wise tail on more devices than row blocks)."""
    enc: np.ndarray  # [k, K, H]
    add: np.ndarray
    """``[k, 3]``: each shard's bytes, expected lookups and padded keys (0 for an empty one):
    what it adds to its device's features."""

    @classmethod
    def of(cls, cand, works, predictor: CostPredictor, pad: int) -> _Option:
        real = [w for w in works if w is not None]
        present = [w is not None for w in works]
        enc = np.zeros((len(works), *predictor.encoding_shape))
        enc[present] = predictor.encode(np.stack([shard_features(w, pad) for w in real]))
        add = np.zeros((len(works), 3))
        add[present] = [
            [w.bytes, w.bags * w.hotness * valid_share(w), w.bags * max(pad, w.hotness)]
            for w in real
        ]
        return cls(cand, works, enc, add)


class _Devices:
    """Running per-device sums the model's device features are made of."""

    def __init__(self, n: int, encoding: tuple[int, ...], pad: int):
        self.enc = np.zeros((n, *encoding))
        self.count = np.zeros(n)
        self.bytes = np.zeros(n)
        self.lookups = np.zeros(n)
        self.keys = np.zeros(n)
        self.buffers: list[set] = [set() for _ in range(n)]
        self.mem = np.zeros(n)
        self.comm = np.zeros(n)
        self.kernel = np.zeros(n)
        self.pad = pad

    def features(self, devs, opt: _Option) -> np.ndarray:
        """Device features ``[k, G]`` of devices ``devs`` with ``opt``'s shard ``i`` added to
        ``devs[i]``, as ``learned_cost.device_features`` computes them from a whole set."""
        works = opt.works[: len(devs)]
        add = opt.add[: len(devs)]
        nbuf = np.array(
            [
                len(self.buffers[d] | ({(w.width, w.replicated)} if w else set()))
                for d, w in zip(devs, works, strict=True)
            ]
        )
        count = self.count[devs] + np.array([w is not None for w in works])
        return np.stack(
            [
                np.log2(count + 1),
                np.log2(nbuf + 1),
                np.log2(self.bytes[devs] + add[:, 0] + 1),
                np.full(len(devs), math.log2(max(self.pad, 1))),
                np.log2(self.lookups[devs] + add[:, 1] + 1),
                np.log2(self.keys[devs] + add[:, 2] + 1),
            ],
            axis=1,
        )

    def add(self, devs, opt: _Option, kernel: np.ndarray) -> None:
        add = opt.add
        for i, d in enumerate(devs):
            w = opt.works[i]
            if w is None:
                continue
            self.enc[d] += opt.enc[i]
            self.count[d] += 1
            self.bytes[d] += add[i, 0]
            self.lookups[d] += add[i, 1]
            self.keys[d] += add[i, 2]
            self.buffers[d].add((w.width, w.replicated))
        self.mem[devs] += opt.cand.shard_memory
        self.comm[devs] += opt.cand.shard_terms[1]
        self.kernel[devs] = kernel

    @property
    def time(self) -> np.ndarray:
        return self.kernel + self.comm

    def predict(self, predictor: CostPredictor, devs, opt: _Option) -> np.ndarray:
        """Kernel seconds ``[k]`` of devices ``devs`` with ``opt``'s shards added (a device
        given an empty shard keeps its time)."""
        kernel = predictor.head(self.enc[devs] + opt.enc[: len(devs)], self.features(devs, opt))
        empty = np.array([w is None for w in opt.works[: len(devs)]])
        return np.where(empty, self.kernel[devs], kernel)


def _works(t: pl.PlannerTable, c: pl.Candidate, n: int, batch: int) -> list[ShardWork | None]:
    """Shard ``i``'s work, the planner's shard ``i`` of candidate ``c`` (as
    ``shard_cost.device_work`` reads it from a plan)."""
    return [
        work_of(t, c.sharding, sh.rows, sh.cols[1] - sh.cols[0], n, batch)
        for sh in pl.shards_of(t, c, np.arange(c.n_shards))
    ]


def plan(
    tables,
    profile: HardwareProfile,
    num_devices: int,
    *,
    batch_size: int,
    predictor: CostPredictor,
    cost_model: pl.CostModel | None = None,
    memory_fraction: float = pl.MEMORY_FRACTION,
    beam_width: int = 3,
    expand: int = 3,
    max_rounds: int = 16,
) -> pl.Plan:
    """Plans ``tables`` (``planner.PlannerTable`` s) with the learned model (module docstring)."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError("table names must be unique")
    n = num_devices
    cost_model = cost_model or pl.CostModel.for_profile(profile)
    limit = profile.memory_bytes * memory_fraction
    pad = max(max(1, math.ceil(t.pooling_factor)) for t in tables)
    encoding = predictor.encoding_shape
    options: dict[str, dict[int, list[_Option]]] = {}
    for t in tables:
        by_split: dict[int, list[_Option]] = {}
        for c in pl.candidates(t, n, profile, cost_model, batch_size, n):
            k = c.n_shards if c.sharding in pl.COLUMN_TYPES else 1
            opt = _Option.of(c, _works(t, c, n, batch_size), predictor, pad)
            by_split.setdefault(k, []).append(opt)
        if not by_split:
            raise ValueError(f"table {t.name!r}: no allowed sharding type applies on {n} devices")
        options[t.name] = by_split
    # a table's standalone cost (its cheapest option alone on fresh devices): the greedy order
    alone = {}
    for t in tables:
        best = math.inf
        for opts in options[t.name].values():
            for o in opts:
                kernel = _Devices(n, encoding, pad).predict(predictor, np.arange(len(o.works)), o)
                best = min(best, float((kernel + o.cand.shard_terms[1]).sum()))
        alone[t.name] = best
    order = sorted(tables, key=lambda t: -alone[t.name])

    # the least memory each table needs, over all devices and on one: an option that leaves
    # less free memory than the tables after it need (in all, or on the freest device) is not
    # taken; a state that still cannot place a table is retried largest tables first
    least = {
        t.name: min(
            o.cand.shard_memory * o.cand.n_shards for opts in options[t.name].values() for o in opts
        )
        for t in tables
    }
    least_shard = {
        t.name: min(o.cand.shard_memory for opts in options[t.name].values() for o in opts)
        for t in tables
    }
    by_memory = sorted(tables, key=lambda t: -least[t.name])

    def greedy(state: tuple[int, ...]):
        result = _greedy(state, order)
        return result if result[0] is not None else _greedy(state, by_memory)

    def _greedy(state: tuple[int, ...], order):
        later = np.cumsum([least[t.name] for t in order][::-1])[::-1].tolist()[1:] + [0.0]
        later_shard = np.maximum.accumulate([least_shard[t.name] for t in order][::-1])[
            ::-1
        ].tolist()[1:] + [0.0]
        dev = _Devices(n, encoding, pad)
        choices = {}
        for t, need, need_one in zip(order, later, later_shard, strict=True):
            k = state[names.index(t.name)]
            best = None
            for o in options[t.name][k]:
                devs = pl.place_devices(o.cand, dev.time, dev.mem, limit, n)
                if devs is None:
                    continue
                mem = dev.mem.copy()
                mem[devs] += o.cand.shard_memory
                if n * limit - mem.sum() < need or limit - mem.min() < need_one:
                    continue
                kernel = dev.predict(predictor, devs, o)
                new = kernel + dev.comm[devs] + o.cand.shard_terms[1]
                others = np.delete(dev.time, devs)
                key = (
                    max(float(new.max()), float(others.max()) if others.size else 0.0),
                    float((new - dev.time[devs]).sum()),
                )
                if best is None or key < best[0]:
                    best = (key, o, devs, kernel)
            if best is None:
                return None, t
            _, o, devs, kernel = best
            dev.add(devs, o, kernel)
            choices[t.name] = (o, devs)
        return (float(dev.time.max()), float(dev.time.sum())), (dev, choices)

    start = tuple(1 if 1 in options[t.name] else min(options[t.name]) for t in tables)
    seen: dict[tuple, tuple] = {}

    def score(state):
        if state not in seen:
            seen[state] = greedy(state)
        return seen[state]

    key, result = score(start)
    while key is None:  # a table that fits no option at its split may fit split finer
        i = names.index(result.name)
        if 2 * start[i] not in options[result.name]:
            break
        start = start[:i] + (2 * start[i],) + start[i + 1 :]
        key, result = score(start)
    if key is None:
        t = result
        need = min(o.cand.shard_memory for opts in options[t.name].values() for o in opts)
        raise ValueError(
            f"table {t.name!r} ({t.num_rows:,} rows x {t.dim}) does not fit: its smallest shard "
            f"needs {pl.human_bytes(need)} of {pl.human_bytes(limit)} per device (add devices, shard "
            "rows, or use a smaller dtype)"
        )
    beam = [start]
    for _ in range(max_rounds):
        grown = []
        for state in beam:
            dev, choices = score(state)[1]
            slow = int(np.argmax(dev.time))
            growable = sorted(
                (
                    name
                    for name, (_, devs) in choices.items()
                    if slow in devs.tolist() and 2 * state[names.index(name)] in options[name]
                ),
                key=lambda name: -alone[name],
            )
            for name in growable[:expand]:
                i = names.index(name)
                grown.append(state[:i] + (2 * state[i],) + state[i + 1 :])
        placed = {s for s in beam + grown if score(s)[0] is not None}
        new_beam = sorted(placed, key=lambda s: score(s)[0])[:beam_width]
        if new_beam == beam:  # nothing grown beats the beam
            break
        beam = new_beam
    dev, choices = score(beam[0])[1]
    return _to_plan(tables, dev, choices, n, batch_size, cost_model, limit, predictor, pad)


def _to_plan(tables, dev: _Devices, choices, n, batch, cm, limit, predictor, pad) -> pl.Plan:
    out = []
    for t in tables:
        o, devs = choices[t.name]
        alone = _Devices(n, predictor.encoding_shape, pad)
        kernel = alone.predict(predictor, np.arange(len(devs)), o)  # each shard alone
        c = o.cand
        comm = c.shard_terms[1]
        shards = tuple(
            dataclasses.replace(
                sh, time_s=float(sec) + comm, lookup_s=float(sec), comm_s=comm, compute_s=0.0
            )
            for sh, sec in zip(pl.shards_of(t, c, np.asarray(devs)), kernel, strict=True)
        )
        out.append(pl.TablePlan(t.name, c.sharding, shards))
    out = tuple(out)
    terms = np.stack([dev.kernel, dev.comm, np.zeros(n)], axis=1)
    a2a = pl.plan_exchange_bytes(out, n, batch, cm)
    return pl.Plan(out, dev.time.copy(), dev.mem.copy(), limit, a2a, terms, planner="learned")


def side_by_side(
    tables,
    profile: HardwareProfile,
    num_devices: int,
    *,
    batch_size: int,
    cost_model: pl.CostModel,
    predictor: CostPredictor,
) -> tuple[str, dict]:
    """Both planners' plans of ``tables``, each predicted by both models (the slowest device:
    kernels plus communication): ``(rich text, data)``."""
    import io  # noqa: PLC0415
    import time  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    from recscale.embeddings import learned_cost, shard_cost  # noqa: PLC0415

    pad = max(max(1, math.ceil(t.pooling_factor)) for t in tables)
    data = {}
    for name in ("analytic", "learned"):
        t0 = time.perf_counter()
        kw = dict(batch_size=batch_size, cost_model=cost_model)
        if name == "learned":
            p = plan(tables, profile, num_devices, predictor=predictor, **kw)
        else:
            p = pl.plan(tables, profile, num_devices, **kw)
        seconds = time.perf_counter() - t0
        comm = pl.comm_by_device(p)
        sets = shard_cost.device_work(p, tables, num_devices, batch_size)
        ana = [learned_cost.analytic_device(s, profile, cost_model.lookup) for s in sets]
        lea = [predictor.seconds(s, pad) for s in sets]
        kinds: dict[str, int] = {}
        for tp in p.tables:
            kinds[tp.sharding] = kinds.get(tp.sharding, 0) + 1
        data[name] = {
            "analytic_model_s": float((np.asarray(ana) + comm).max()),
            "learned_model_s": float((np.asarray(lea) + comm).max()),
            "kinds": kinds,
            "plan_s": seconds,
        }
    t = Table(title="both planners, each plan predicted by both models (slowest device)")
    for col in ("planner", "shardings", "analytic model", "learned model", "planning"):
        t.add_column(col)
    for name, d in data.items():
        t.add_row(
            name,
            ", ".join(f"{k} {v}" for k, v in sorted(d["kinds"].items())),
            f"{d['analytic_model_s'] * 1e3:.3f} ms",
            f"{d['learned_model_s'] * 1e3:.3f} ms",
            f"{d['plan_s']:.2f} s",
        )
    buf = io.StringIO()
    Console(file=buf, width=120).print(t)
    return buf.getvalue(), data
