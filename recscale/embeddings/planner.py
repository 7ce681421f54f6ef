"""Embedding sharding planner: a sharding type and placement per table, within device memory,
minimising the slowest device's estimated step time. No jax import.

Sharding types (``N`` devices, ``H`` devices per host):

* ``data_parallel``: the table on every device; lookups local; the table's (sparse) gradient is
  all-gathered every step.
* ``table_wise``: the whole table on one device; ids sent to it and pooled vectors back
  (all-to-all).
* ``column_wise``: the columns split into ``k`` slices on ``k`` devices, each a table-wise shard
  of width ``D/k``.
* ``row_wise``: rows split over all ``N`` devices; every device pools its rows for the whole
  batch, partial sums are reduce-scattered (forward) and all-gathered (backward).
* ``table_row_wise``: rows split over the ``H`` devices of one host (row-wise traffic stays on
  the fast intra-host links).
* ``table_column_wise``: column slices placed on devices as table-wise shards (``column_wise``
  with ``k`` chosen per table; the two names are kept for TorchRec users).

Cost model (per training step; ``B`` global batch, ``P`` mean ids per bag, ``D`` width of the
shard, ``b`` bytes per element, ``c`` bytes per communicated element), in the spirit of
TorchRec's ``EmbeddingPerfEstimator`` and NeuroShard's cost features. For a shard holding a
fraction ``f`` of the table's lookups:

* lookup bytes = ``f·B·P·D·b`` forward, ``2×`` that backward + update (read the gradient rows,
  read-modify-write the rows and their optimizer state);
* communication bytes: table-/column-wise: ids in (``4·B·P·f``) + pooled vectors out and their
  gradients back (``B·D·(c_f + c)``, ``c_f`` the forward exchange's bytes per element:
  ``CostModel.for_profile``); row-wise: the partial sums and their gradients
  (``2·B·D·c·(n-1)/n`` over its group of ``n``); data-parallel: all-gather of the touched
  rows' gradients (``B·P·D·c·(N-1)/N``);
* compute = ``3·f·B·P·D`` FLOPs (pool, scatter, update).

time = lookup / memory_bandwidth + comm / link bandwidth + compute / FLOP/s, each term scaled by
the ``CostModel``'s calibration factors (``CostModel.calibrated`` fits the lookup factor from
measured lookup times; ``embeddings.calibrate`` runs it at the start of training). Shards keep
the three terms (``Shard.lookup_s``, ``comm_s``, ``compute_s``) and the plan their sums per
device (``Plan.device_terms_s``), which ``Plan.render`` and ``python -m recscale.plan`` print. Row-wise load follows the id skew: with a Zipf exponent ``s`` the hottest
row alone takes ``p_0 = 1/H_{V,s}`` of the lookups, so the busiest of ``n`` row shards sees
``p_0 + (1 - p_0)/n`` of them (rows are spread by a permutation, so only single hot rows
concentrate).

Memory per shard = rows × D × b (storage) + optimizer state (row-wise Adagrad: 4 bytes per row;
Adam: 8 bytes per element; SGD: none), within ``memory_fraction`` of device memory.

Search: greedy placement, largest estimated cost first, each table taking the candidate
(sharding type and devices, shards going to the least-loaded devices that have room) that
minimises the resulting maximum device time, then total time; repeated for each cap on
column splits (1, 2, 4, 8, ...: the grid over column splits of NeuroShard) and the best plan
kept. A table that fits no candidate raises, naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import numpy as np

from tpu_gpu_configs.profiles import HardwareProfile

ShardingType = Literal[
    "data_parallel", "table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise"
]
OPTIMIZER_STATE_BYTES = {"sgd": (0, 0), "rowwise_adagrad": (4, 0), "adam": (0, 8)}
"""(bytes per row, bytes per element) of optimizer state."""
TERMS = ("lookup", "comm", "compute")
"""The terms of a shard's estimated time (``Shard.lookup_s``, ``comm_s``, ``compute_s``)."""
COLUMN_TYPES = ("column_wise", "table_column_wise")
"""Sharding types that split a table's columns."""
MEMORY_FRACTION = 0.8
"""Share of a device's memory a plan may fill (the rest: activations, the dense model)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannerTable:
    """What the planner needs to know of a table."""

    name: str
    num_rows: int
    dim: int
    bytes_per_element: int = 4
    pooling_factor: float = 1.0
    """Mean ids per example (bag size) of the features reading this table."""
    zipf_exponent: float = 0.0
    """Id-frequency skew (0 = uniform)."""
    optimizer: Literal["sgd", "rowwise_adagrad", "adam"] = "rowwise_adagrad"
    allowed: tuple[ShardingType, ...] = ()
    """Sharding types the planner may choose (empty = all); one entry pins the table by hand."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Calibration factors multiplying the analytic terms (1 = the profile's peak numbers)."""

    lookup: float = 1.0
    comm: float = 1.0
    compute: float = 1.0
    comm_bytes_per_element: int = 4
    """Bytes per exchanged element (the engine's ``comm_dtype``): 4 = float32; 2 = bf16/fp16."""
    forward_comm_bytes_per_element: int = 0
    """Bytes per element of the forward exchange (pooled outputs to their examples' devices);
    0 = ``comm_bytes_per_element``. On TPU the compiler sends it in bfloat16 when every consumer
    multiplies at default precision (DLRM's interaction, Wukong's FMB/LCB): measured in the
    compile table (BENCHMARKS.md, "Pod-scale plans"), :meth:`for_profile` sets 2 there."""
    forward_min_width: int = 0
    """Slots narrower than this keep ``comm_bytes_per_element`` forward (XLA:TPU converted
    32- and 128-wide exchanges to bfloat16 and left 16-wide ones in float32)."""

    @property
    def exchange_bytes(self) -> int:
        """Bytes per element of a pooled column exchanged forward and its gradient back."""
        fwd = self.forward_comm_bytes_per_element or self.comm_bytes_per_element
        return fwd + self.comm_bytes_per_element

    @classmethod
    def for_profile(cls, profile: HardwareProfile, comm_bytes_per_element: int = 4) -> CostModel:
        """The cost model calibrated for ``profile``'s platform (see the fields)."""
        if not profile.name.startswith("tpu-"):
            return cls(comm_bytes_per_element=comm_bytes_per_element)
        return cls(
            comm_bytes_per_element=comm_bytes_per_element,
            forward_comm_bytes_per_element=min(2, comm_bytes_per_element),
            forward_min_width=32,
        )

    def exchange_bytes_at(self, width: int) -> int:
        """:attr:`exchange_bytes` for slots ``width`` columns wide."""
        if width < self.forward_min_width:
            return 2 * self.comm_bytes_per_element
        return self.exchange_bytes

    def calibrated(self, bytes_read, seconds, profile: HardwareProfile) -> CostModel:
        """The lookup factor fitted (least squares through the origin) to measured lookup
        times ``seconds`` of lookups reading ``bytes_read``: factor = measured / peak time."""
        x = np.asarray(bytes_read, float) / profile.memory_bandwidth
        y = np.asarray(seconds, float)
        if x.size == 0 or np.any(x <= 0) or np.any(y <= 0):
            raise ValueError("calibration needs positive bytes and times")
        return dataclasses.replace(self, lookup=float(x @ y / (x @ x)))


@dataclasses.dataclass(frozen=True)
class Shard:
    device: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    memory_bytes: float
    time_s: float
    """Its estimated time per step: the sum of the three terms below."""
    lookup_s: float = 0.0
    """Reading and updating its rows (the lookup bytes over the memory bandwidth)."""
    comm_s: float = 0.0
    """Its exchanges (ids, pooled vectors, partial sums, gradients over the links)."""
    compute_s: float = 0.0
    """Pooling, scatter and update FLOPs."""


@dataclasses.dataclass(frozen=True)
class TablePlan:
    table: str
    sharding: ShardingType
    shards: tuple[Shard, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    tables: tuple[TablePlan, ...]
    device_time_s: np.ndarray
    """Estimated time per step of each device [N]."""
    device_memory_bytes: np.ndarray
    """Memory of each device's shards [N]."""
    memory_limit_bytes: float
    all_to_all_bytes: float = 0.0
    """Bytes of the engine's all-to-all buffers per step over all devices (``plan_exchange_bytes``:
    every shard's pooled outputs for the whole batch forward, their gradients backward, slots
    padded to the fullest device's count; the ids travel in an all-gather; a replicated table
    exchanges nothing)."""
    device_terms_s: np.ndarray | None = None
    """Each device's estimated time per step by term [N, 3]: lookup, communication, compute
    (summing to :attr:`device_time_s`, up to rounding)."""
    planner: str = "analytic"
    """Which planner made it (``learned``: ``recscale.embeddings.learned_planner``)."""

    @property
    def max_time_s(self) -> float:
        return float(self.device_time_s.max())

    def by_table(self) -> dict[str, TablePlan]:
        return {t.table: t for t in self.tables}

    def to_dict(self) -> dict:
        """The plan as JSON-able data: per table its sharding and shards' placement, memory
        and time terms; per device its memory and time terms (seconds and bytes)."""
        terms = self._terms()
        return {
            "tables": [
                {
                    "table": tp.table,
                    "sharding": tp.sharding,
                    "shards": [dataclasses.asdict(s) for s in tp.shards],
                }
                for tp in self.tables
            ],
            "devices": [
                {
                    "device": d,
                    "memory_bytes": float(self.device_memory_bytes[d]),
                    "time_s": float(self.device_time_s[d]),
                    **{f"{k}_s": float(terms[d, i]) for i, k in enumerate(TERMS)},
                }
                for d in range(self.device_time_s.size)
            ],
            "memory_limit_bytes": float(self.memory_limit_bytes),
            "all_to_all_bytes": float(self.all_to_all_bytes),
            "planner": self.planner,
        }

    def _terms(self) -> np.ndarray:
        if self.device_terms_s is not None:
            return self.device_terms_s
        return np.zeros((self.device_time_s.size, len(TERMS)))

    def render(self, max_rows: int = 50, max_devices: int = 16) -> str:
        """The plan as readable tables (rich): per table its placement, per device (the
        busiest ``max_devices``) its predicted step time by term and its memory."""
        import io  # noqa: PLC0415

        from rich.console import Console  # noqa: PLC0415
        from rich.table import Table  # noqa: PLC0415

        t = Table(
            title=f"embedding plan ({self.planner}): {len(self.tables)} tables on "
            f"{self.device_time_s.size} "
            f"devices, slowest device {self.max_time_s * 1e3:.3f} ms/step"
        )
        for col in ("table", "sharding", "shards", "devices", "memory/shard", "time/shard"):
            t.add_column(col)
        for tp in self.tables[:max_rows]:
            devs = sorted({s.device for s in tp.shards})
            dev_s = ",".join(map(str, devs)) if len(devs) <= 8 else f"{len(devs)} devices"
            t.add_row(
                tp.table,
                tp.sharding,
                str(len(tp.shards)),
                dev_s,
                human_bytes(max(s.memory_bytes for s in tp.shards)),
                f"{max(s.time_s for s in tp.shards) * 1e6:.1f} us",
            )
        buf = io.StringIO()
        console = Console(file=buf, width=120)
        console.print(t)
        n = self.device_time_s.size
        # the busiest devices, in device order
        shown = np.sort(np.argsort(-self.device_time_s, kind="stable")[:max_devices])
        d = Table(
            title="predicted embedding step time per device"
            + ("" if n <= max_devices else f" (the {max_devices} busiest of {n})")
        )
        for col in ("device", "lookup", "communication", "compute", "total", "memory"):
            d.add_column(col, justify="right")
        terms = self._terms()
        for dev in shown.tolist():
            d.add_row(
                str(dev),
                *(f"{x * 1e6:.1f} us" for x in terms[dev]),
                f"{self.device_time_s[dev] * 1e6:.1f} us",
                human_bytes(self.device_memory_bytes[dev]),
            )
        console.print(d)
        mem = self.device_memory_bytes
        console.print(
            f"device memory: max {human_bytes(mem.max())} of {human_bytes(self.memory_limit_bytes)}, "
            f"min {human_bytes(mem.min())}; device time: max {self.max_time_s * 1e6:.1f} us, "
            f"mean {self.device_time_s.mean() * 1e6:.1f} us"
        )
        return buf.getvalue()


def human_bytes(x: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


@dataclasses.dataclass(frozen=True)
class Candidate:
    sharding: ShardingType
    n_shards: int
    group: Literal["any", "all", "host"]
    """``any``: shards go to the least-loaded devices; ``all``: one per device; ``host``: one
    per device of the least-loaded host."""
    shard_memory: float
    shard_time: float
    shard_rows: int
    shard_cols: int
    shard_terms: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """``shard_time`` by term (``TERMS``)."""


@functools.lru_cache(maxsize=4096)
def hot_fraction(num_rows: int, s: float) -> float:
    """p_0: the hottest row's share of the lookups under Zipf(s) over ``num_rows`` rows (the
    first 10,000 terms of the harmonic sum exactly, the rest by its integral)."""
    if s <= 0:
        return 1.0 / num_rows
    head = min(num_rows, 10_000)
    h = float(np.sum(np.arange(1, head + 1, dtype=float) ** -s))
    if num_rows > head:
        a, b = head + 0.5, num_rows + 0.5
        h += math.log(b / a) if s == 1 else (b ** (1 - s) - a ** (1 - s)) / (1 - s)
    return 1.0 / h


def lookup_terms(
    lookups: float, cols: int, bytes_per_element: int, hw: HardwareProfile, cm: CostModel
) -> tuple[float, float]:
    """``(lookup seconds, compute seconds)`` of a shard serving ``lookups`` ids ``cols`` wide:
    ``3·lookups·cols`` elements read or written (pool; read the gradient rows; read-modify-write
    the rows) over the memory bandwidth, and as many FLOPs over the peak, each term times its
    calibration factor."""
    elements = 3 * lookups * cols
    return (
        elements * bytes_per_element / hw.memory_bandwidth * cm.lookup,
        elements / hw.flops * cm.compute,
    )


def comm_by_device(plan: Plan) -> np.ndarray:
    """Each device's communication seconds: its shards' ``comm_s`` summed."""
    out = np.zeros(plan.device_time_s.size)
    for tp in plan.tables:
        for sh in tp.shards:
            out[sh.device] += sh.comm_s
    return out


def candidates(
    t: PlannerTable, n: int, hw: HardwareProfile, cm: CostModel, batch: int, max_col_splits: int
) -> list[Candidate]:
    b, c = t.bytes_per_element, cm.comm_bytes_per_element
    row_b, elem_b = OPTIMIZER_STATE_BYTES[t.optimizer]
    lookups = batch * t.pooling_factor

    def memory(rows: int, cols: int) -> float:
        return rows * cols * (b + elem_b) + rows * row_b

    def cand(kind, k, group, rows: int, cols: int, frac: float, comm: float, link: float):
        """A candidate of ``k`` shards of ``rows x cols``, the busiest serving ``frac`` of the
        table's lookups and exchanging ``comm`` bytes over ``link``."""
        look, flops = lookup_terms(frac * lookups, cols, b, hw, cm)
        talk = comm / link * cm.comm
        time = look + flops + talk
        return Candidate(kind, k, group, memory(rows, cols), time, rows, cols, (look, talk, flops))

    out = []
    allowed = set(t.allowed) or set(ShardingType.__args__)
    hot = hot_fraction(t.num_rows, t.zipf_exponent)
    ici = hw.interconnect_bandwidth
    if "data_parallel" in allowed:
        comm = lookups * t.dim * c * (n - 1) / n
        # every device pools its own examples: 1/n of the batch's lookups
        out.append(cand("data_parallel", n, "all", t.num_rows, t.dim, 1 / n, comm, ici))
    if "table_wise" in allowed:
        comm = 4 * lookups + batch * t.dim * cm.exchange_bytes_at(t.dim)
        out.append(cand("table_wise", 1, "any", t.num_rows, t.dim, 1, comm, ici))
    for kind in ("column_wise", "table_column_wise"):
        if kind not in allowed:
            continue
        k = 2
        while k <= min(max_col_splits, n) and t.dim % k == 0 and t.dim // k >= 4:
            cols = t.dim // k
            comm = 4 * lookups + batch * cols * cm.exchange_bytes_at(cols)
            out.append(cand(kind, k, "any", t.num_rows, cols, 1, comm, ici))
            k *= 2
    for kind, m, group, link in (
        (
            "row_wise",
            n,
            "all",
            ici if n <= hw.devices_per_host else min(ici, hw.cross_host_bandwidth),
        ),
        ("table_row_wise", min(hw.devices_per_host, n), "host", ici),
    ):
        if kind not in allowed or m < 2:
            continue
        rows = math.ceil(t.num_rows / m)
        frac = min(1.0, hot + (1 - hot) / m)  # the busiest shard
        # the partial sums are added before any multiply: comm_dtype both ways
        comm = batch * t.dim * 2 * c * (m - 1) / m + 4 * lookups * frac
        out.append(cand(kind, m, group, rows, t.dim, frac, comm, link))
    return out


def plan(
    tables: list[PlannerTable] | tuple[PlannerTable, ...],
    profile: HardwareProfile,
    num_devices: int,
    *,
    batch_size: int,
    cost_model: CostModel = CostModel(),
    memory_fraction: float = MEMORY_FRACTION,
) -> Plan:
    """Plans ``tables`` on ``num_devices`` devices of ``profile`` (see the module docstring)."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError("table names must be unique")
    limit = profile.memory_bytes * memory_fraction
    best, error = None, None
    caps = [1]
    # Column slices are at least 4 wide, so caps beyond max(D) / 4 give the same candidates.
    while caps[-1] * 2 <= min(num_devices, max((t.dim // 4 for t in tables), default=1)):
        caps.append(caps[-1] * 2)
    for cap in caps:
        try:
            load, mem, terms, choices = _greedy(
                tables, profile, num_devices, batch_size, cost_model, limit, cap
            )
        except _NoPlacement as e:  # e.g. a table pinned to column_wise, at cap 1
            error = e
            continue
        key = (float(load.max()), float(load.sum()))
        if best is None or key < best[0]:
            best = (key, load, mem, terms, choices)
    if best is None:
        raise ValueError(str(error)) from None
    _, load, mem, terms, choices = best
    out = tuple(
        TablePlan(t.name, choices[t.name][0].sharding, shards_of(t, *choices[t.name]))
        for t in tables
    )
    a2a = plan_exchange_bytes(out, num_devices, batch_size, cost_model)
    return Plan(out, load, mem, limit, a2a, terms)


def plan_exchange_bytes(tables: tuple[TablePlan, ...], n: int, batch: int, cm: CostModel) -> float:
    """Bytes of the engine's all-to-all buffers per step, all devices, as
    ``recscale.embeddings.layout`` builds them: each device's non-empty shards of one width are
    the slots of one buffer, every device has as many slots as the fullest one (the
    all-to-all's fixed shape), and every slot exchanges its pooled outputs for the whole batch
    forward and their gradients backward. The forward exchange is at
    ``cm.forward_comm_bytes_per_element`` only in a buffer without row-wise shards: their
    partial sums are added before any multiply."""
    slots: dict[int, np.ndarray] = {}
    rowwise: set[int] = set()
    for tp in tables:
        if tp.sharding == "data_parallel":
            continue
        for sh in tp.shards:
            width = sh.cols[1] - sh.cols[0]
            if sh.rows[1] <= sh.rows[0] or width <= 0:
                continue  # the layout makes no slot of an empty shard
            np.add.at(slots.setdefault(width, np.zeros(n, np.int64)), sh.device, 1)
            if tp.sharding in ("row_wise", "table_row_wise"):
                rowwise.add(width)
    total = 0.0
    for w, per in slots.items():
        x = 2 * cm.comm_bytes_per_element if w in rowwise else cm.exchange_bytes_at(w)
        total += n * int(per.max()) * batch * w * x
    return total


class _NoPlacement(ValueError):
    pass


def round_robin(tables, profile: HardwareProfile, num_devices: int, *, batch_size: int) -> Plan:
    """The baseline: table ``i`` table-wise on device ``i mod N``, costed by the uncalibrated
    model; memory is not checked (the plan reports :func:`plan`'s default cap)."""
    cost_model, memory_fraction = CostModel(), MEMORY_FRACTION
    load = np.zeros(num_devices)
    mem = np.zeros(num_devices)
    terms = np.zeros((num_devices, len(TERMS)))
    out = []
    for i, t in enumerate(tables):
        (cand,) = candidates(
            dataclasses.replace(t, allowed=("table_wise",)),
            num_devices,
            profile,
            cost_model,
            batch_size,
            1,
        )
        d = i % num_devices
        load[d] += cand.shard_time
        mem[d] += cand.shard_memory
        terms[d] += cand.shard_terms
        out.append(TablePlan(t.name, "table_wise", shards_of(t, cand, np.array([d]))))
    return Plan(tuple(out), load, mem, profile.memory_bytes * memory_fraction, device_terms_s=terms)


def _greedy(tables, hw, n, batch, cm, limit, cap):
    load = np.zeros(n)
    mem = np.zeros(n)
    terms = np.zeros((n, len(TERMS)))
    cands = {t.name: candidates(t, n, hw, cm, batch, cap) for t in tables}
    for t in tables:
        if not cands[t.name]:
            raise _NoPlacement(f"table {t.name!r}: no allowed sharding type applies on {n} devices")
    order = sorted(tables, key=lambda t: -min(c.shard_time * c.n_shards for c in cands[t.name]))
    choices = {}
    for t in order:
        choice = None
        current = load.max()
        for c in cands[t.name]:
            devs = place_devices(c, load, mem, limit, n)
            if devs is None:
                continue
            key = (max(current, load[devs].max() + c.shard_time), c.shard_time * c.n_shards)
            if choice is None or key < choice[0]:
                choice = (key, c, devs)
        if choice is None:
            need = min(c.shard_memory for c in cands[t.name])
            raise _NoPlacement(
                f"table {t.name!r} ({t.num_rows:,} rows x {t.dim}) does not fit: its smallest "
                f"shard needs {human_bytes(need)}, the freest device has {human_bytes(limit - mem.min())} "
                f"of {human_bytes(limit)} left (add devices, shard rows, or use a smaller dtype)"
            )
        _, c, devs = choice
        load[devs] += c.shard_time
        mem[devs] += c.shard_memory
        terms[devs] += c.shard_terms
        choices[t.name] = (c, devs)
    return load, mem, terms, choices


def place_devices(c: Candidate, load, mem, limit, n) -> np.ndarray | None:
    fits = mem + c.shard_memory <= limit
    if c.group == "all":
        return np.arange(n) if fits.all() else None
    if c.group == "host":
        # Hosts are consecutive blocks of n_shards (= devices per host) devices; a remainder
        # of fewer devices than a host holds is not a host.
        host_size = c.n_shards
        whole = (n // host_size) * host_size
        host_load = load[:whole].reshape(-1, host_size).max(1)
        host_fits = fits[:whole].reshape(-1, host_size).all(1)
        if not host_fits.any():
            return None
        h = int(np.argmin(np.where(host_fits, host_load, np.inf)))
        return np.arange(h * host_size, (h + 1) * host_size)
    ok = np.flatnonzero(fits)
    if ok.size < c.n_shards:
        return None
    return (
        ok[np.argpartition(load[ok], c.n_shards - 1)[: c.n_shards]] if ok.size > c.n_shards else ok
    )


def shards_of(t: PlannerTable, c: Candidate, devs: np.ndarray) -> tuple[Shard, ...]:
    out = []
    for i, d in enumerate(devs.tolist()):
        if c.sharding in ("row_wise", "table_row_wise"):
            rows = (min(i * c.shard_rows, t.num_rows), min((i + 1) * c.shard_rows, t.num_rows))
            cols = (0, t.dim)
        elif c.sharding in ("column_wise", "table_column_wise"):
            rows, cols = (0, t.num_rows), (i * c.shard_cols, (i + 1) * c.shard_cols)
        else:
            rows, cols = (0, t.num_rows), (0, t.dim)
        out.append(Shard(int(d), rows, cols, c.shard_memory, c.shard_time, *c.shard_terms))
    return tuple(out)
