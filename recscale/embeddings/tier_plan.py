"""Tiered embedding placement: device-cache hit rates and which tables live in HBM, DRAM or SSD.

No jax import: the planner runs on a laptop from a sample of id counts.

A table that does not fit in device memory (HBM) keeps its rows (and their optimizer state) in a
slower backing tier, host DRAM or an SSD memory-mapped file, behind a device-resident software
cache of ``capacity`` rows. Each step the cache receives the step's ids for the table and
deduplicates them; a distinct row already cached at the start of the step is a hit, any other a
miss, loaded into a free slot or the slot of an evicted row. Victims are never rows of the
current step. Policies:

* ``lru``: evict the rows whose last use (step index) is oldest; rows of one step share a stamp.
* ``lfu``: evict the rows with the fewest steps in which they appeared (a global counter, +1 per
  step with the row), ties by oldest last use.

The hit rate is hits over distinct rows requested, summed over steps.

Model (``predict_hit_rate``): the independent-reference model, ``p_i = counts_i / sum(counts)``
and ``n`` draws per step, so row ``i`` is requested in a step with probability
``q_i = 1 - (1 - p_i)^n`` and ``D = sum(q_i)`` rows are distinct per step.

* LRU, Che's approximation in step time: at the start of a step the cache holds the rows used in
  the last ``T`` steps, ``T`` solving ``sum_i 1 - (1 - q_i)^T = C``; row ``i`` hits with
  probability ``1 - (1 - q_i)^T``.
* LFU, steady state: a stable set of the ``K`` most frequent rows plus ``C - K`` slots churned by
  the tail, where every tail row requested in a step needs a slot in that step:
  ``K + sum_{i > K} q_i = C``. Hits are the stable rows' requests plus the re-requests of the
  churn slots' rows (tail rows drawn in proportion to ``q``: ``(C - K) sum q^2 / sum q`` over the
  tail).

Both are steady-state rates: cold misses (a row's first load) are excluded, so a cache at least
as large as the rows with nonzero count predicts 1. Against ``simulate_hit_rate`` on Zipf ids
(exponents 0.8-1.2, caches of 1-20% of the rows) LRU is within 2%. LFU is the limit of a long
run: counters start at zero, so rows near the cache's boundary are misranked for a while and
10^3 steps hit up to ~4% less than predicted (the gap halves each time the run doubles).

Placement (``place``) follows the storage hierarchy of ZionEX-style training with storage-class
memory: every table whole in HBM if all fit; otherwise each table gets the smallest cache that
holds one step's rows, and the rest of HBM goes, chunk by chunk, to whichever table gains the
most predicted hits per step per byte (a cache that reaches its whole table makes it an ``hbm``
table). Cached tables are backed by DRAM while it lasts, densest backing traffic first, then SSD.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np

Policy = Literal["lru", "lfu"]
Tier = Literal["hbm", "dram", "ssd"]
POLICIES = ("lru", "lfu")
MiB = 2**20
GiB = 2**30


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}; expected one of {POLICIES}")


# ---------------------------------------------------------------------------------------------
# Reference simulator


def simulate_hit_rate(
    batches: Iterable[np.ndarray],
    capacity: int,
    policy: Policy = "lru",
    *,
    warmup: float = 0.25,
) -> tuple[float, float]:
    """Exact simulation of the device cache; the reference the predictions are checked against.

    Args:
      batches: one 1-D array of non-negative row ids per step.
      capacity: rows the cache holds.
      policy: ``"lru"`` or ``"lfu"`` (module docstring).
      warmup: fraction of the steps left out of the steady-state rate, which also leaves out
        every step before the cache first filled (those steps' misses are cold misses).

    Returns:
      (hit rate over all steps, steady-state hit rate). The steady-state rate is NaN when no step
      is left after the warm-up.

    Raises:
      ValueError: a step has more distinct rows than ``capacity`` (they cannot all be resident).
    """
    _check_policy(policy)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    slot_row = np.full(capacity, -1, np.int64)  # row id held by each slot, -1 = free
    row_slot = np.full(0, -1, np.int64)  # slot of each row, -1 = not cached
    last_use = np.full(0, -1, np.int64)
    uses = np.zeros(0, np.int64)  # steps in which the row appeared (the LFU counter)
    free = capacity
    hits, requests, full_at_start = [], [], []
    for step, batch in enumerate(batches):
        ids = np.unique(np.asarray(batch, np.int64).ravel())
        if ids.size and ids[0] < 0:
            raise ValueError(f"step {step}: negative row id {ids[0]}")
        if ids.size > capacity:
            raise ValueError(f"step {step} has {ids.size} distinct rows > capacity {capacity}")
        if ids.size and ids[-1] >= row_slot.size:  # grow the per-row state to the largest id
            grow = max(int(ids[-1]) + 1, 2 * row_slot.size) - row_slot.size
            row_slot = np.concatenate([row_slot, np.full(grow, -1, np.int64)])
            last_use = np.concatenate([last_use, np.full(grow, -1, np.int64)])
            uses = np.concatenate([uses, np.zeros(grow, np.int64)])
        full_at_start.append(free == 0)
        hit = row_slot[ids] >= 0
        hits.append(int(hit.sum()))
        requests.append(int(ids.size))
        last_use[ids] = step  # before choosing victims: rows of this step are then never chosen
        uses[ids] += 1
        missed = ids[~hit]
        if missed.size == 0:
            continue
        slots = np.flatnonzero(slot_row < 0)[: missed.size] if free else np.empty(0, np.int64)
        need = missed.size - slots.size
        if need:  # evict: fewer candidates than need is impossible (this step's rows <= capacity)
            rows = slot_row
            key = last_use[rows]
            if policy == "lfu":  # fewest uses, then oldest last use (steps < 2**32)
                key = (uses[rows] << 32) + key
            key[(rows < 0) | (last_use[rows] == step)] = np.iinfo(np.int64).max  # free or in use
            victims = np.argpartition(key, need - 1)[:need]
            row_slot[slot_row[victims]] = -1
            slots = np.concatenate([slots, victims])
        slot_row[slots] = missed
        row_slot[missed] = slots
        free -= min(free, missed.size)
    hits_s, req_s, full_s = np.array(hits), np.array(requests), np.array(full_at_start, bool)
    total = hits_s.sum() / max(req_s.sum(), 1)
    # a cache that never fills evicts nothing: only the warm-up fraction is left out
    first_full = int(np.argmax(full_s)) if full_s.any() else 0
    start = max(first_full, math.ceil(warmup * len(full_s)))
    steady = hits_s[start:].sum() / req_s[start:].sum() if req_s[start:].sum() else math.nan
    return float(total), float(steady)


# ---------------------------------------------------------------------------------------------
# Prediction


_EXACT_BELOW = 2**16
_BINS_PER_OCTAVE = 256


def _group_counts(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nonzero counts grouped (descending): each group's mean count and its number of rows.

    Rows with equal counts are interchangeable in both models, so the models run over groups,
    which keeps 10^8-row tables at ~10^4 groups and the grouping linear-time (no sort). Integer
    counts below 2^16 (a sample's long tail: 1, 2, ...) are grouped exactly by a bincount; other
    values into geometric bins 2^(1/256) wide (relative width 0.27%; each bin keeps its mean, so
    the total is exact and the groups are in the order of the counts). On Zipf tables of 10^5 to
    10^7 rows this moves the predicted hit rates by < 1e-6 (relative) against bins 16x finer,
    while every model evaluation costs a few thousand groups, whatever the table's size.
    """
    counts = np.asarray(counts).ravel()
    if counts.size == 0:
        raise ValueError("counts is empty")
    if np.issubdtype(counts.dtype, np.integer):
        if counts.min() < 0:
            raise ValueError("counts must be non-negative")
        exact = counts < _EXACT_BELOW
        small = counts if exact.all() else counts[exact]
        m_small = np.bincount(small)
        v = np.flatnonzero(m_small[1:]) + 1
        values, mult = v.astype(np.float64), m_small[v].astype(np.float64)
        rest = None if exact.all() else counts[~exact].astype(np.float64)
    else:
        rest = counts.astype(np.float64)
        if not np.isfinite(rest).all() or rest.min() < 0:
            raise ValueError("counts must be finite and non-negative")
        rest = rest[rest > 0]
        values, mult = np.zeros(0), np.zeros(0)
    if rest is not None and rest.size:
        key = np.floor(np.log2(rest) * _BINS_PER_OCTAVE).astype(np.int64)
        key -= key.min()
        m_bin = np.bincount(key).astype(np.float64)
        sum_bin = np.bincount(key, weights=rest)
        used = m_bin > 0
        values = np.concatenate([values, sum_bin[used] / m_bin[used]])
        mult = np.concatenate([mult, m_bin[used]])
    if values.size == 0:
        raise ValueError("counts are all zero: no access to model")
    order = np.argsort(-values, kind="stable")
    return values[order], mult[order]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class _Profile:
    """A table's per-step request probabilities, grouped by equal counts (most frequent first)."""

    q: np.ndarray
    """Probability that a row of the group is requested in a step."""
    log1m_q: np.ndarray
    """log(1 - q), kept exact for rows with tiny q."""
    mult: np.ndarray
    """Rows in the group."""

    @classmethod
    def from_counts(cls, counts: np.ndarray, lookups_per_step: float) -> _Profile:
        if not lookups_per_step > 0:
            raise ValueError(f"lookups_per_step must be > 0, got {lookups_per_step}")
        values, mult = _group_counts(counts)
        p = values / float(np.dot(values, mult))
        # clipped: q = 1 - e^-700 is 1 in float64, and -inf (a table of one read row, p = 1)
        # would make 0 * -inf in the slope
        with np.errstate(divide="ignore"):
            log1m_q = np.maximum(lookups_per_step * np.log1p(-np.minimum(p, 1.0)), -700.0)
        return cls(q=-np.expm1(log1m_q), log1m_q=log1m_q, mult=mult)

    @property
    def nonzero_rows(self) -> float:
        return float(self.mult.sum())

    @property
    def distinct_per_step(self) -> float:
        """Expected distinct rows requested per step."""
        return float(np.dot(self.mult, self.q))

    def hit_rate(self, capacity: float, policy: Policy) -> float:
        _check_policy(policy)
        d = self.distinct_per_step
        if capacity >= self.nonzero_rows:
            return 1.0
        if capacity < d:
            raise ValueError(
                f"capacity {capacity:g} < {d:.4g} expected distinct rows per step: "
                "the cache cannot hold one step's rows"
            )
        if policy == "lru":
            return self._lru(capacity) / d
        return self._lfu(capacity) / d

    def _lru(self, capacity: float) -> float:
        """Expected hits per step under Che's approximation."""

        def occupancy(t: float) -> float:  # distinct rows used in the last t steps
            return float(np.dot(self.mult, -np.expm1(t * self.log1m_q)))

        # Safeguarded Newton on u = log T: occupancy is increasing in u, and the bracket
        # [lo, hi] shrinks every iteration, so this converges like bisection at worst.
        lo, hi = 0.0, 1.0  # occupancy(e^0) = D <= capacity
        while occupancy(math.exp(hi)) < capacity:
            lo, hi = hi, 2.0 * hi
            if hi > 200:  # T > e^200 steps: the cache holds every row worth holding
                return self.distinct_per_step
        u = 0.5 * (lo + hi)
        for _ in range(100):
            t = math.exp(u)
            held = -np.expm1(t * self.log1m_q)  # P(used in the last t steps), exact when tiny
            err = float(np.dot(self.mult, held)) - capacity
            if abs(err) <= 1e-10 * capacity or hi - lo < 1e-12:
                break
            lo, hi = (u, hi) if err < 0 else (lo, u)
            slope = t * float(np.dot(self.mult * (1.0 - held), -self.log1m_q))
            u = u - err / slope if slope > 0 else 0.5 * (lo + hi)
            if not lo < u < hi:
                u = 0.5 * (lo + hi)
        t = math.exp(u)
        return float(np.dot(self.mult * self.q, -np.expm1(t * self.log1m_q)))

    def _lfu(self, capacity: float) -> float:
        """Expected hits per step: the stable top ``K`` rows plus re-requests of churned slots."""
        mq, mq2 = self.mult * self.q, self.mult * self.q**2
        rows_before = np.concatenate([[0.0], np.cumsum(self.mult)])  # rows in groups < j
        head_q = np.concatenate([[0.0], np.cumsum(mq)])
        head_q2 = np.concatenate([[0.0], np.cumsum(mq2)])
        tail_q, tail_q2 = head_q[-1] - head_q, head_q2[-1] - head_q2
        need = rows_before + tail_q  # slots used with the stable set = groups < j, increasing
        j = int(np.searchsorted(need, capacity, side="right")) - 1  # stable set ends in group j
        j = min(j, self.q.size - 1)
        # part x of group j joins the stable set: each of its rows adds 1 - q slots
        x = min((capacity - need[j]) / max(1.0 - self.q[j], 1e-300), self.mult[j])
        k = rows_before[j] + x
        stable = head_q[j] + x * self.q[j]
        t1, t2 = tail_q[j] - x * self.q[j], tail_q2[j] - x * self.q[j] ** 2
        churn = (capacity - k) * t2 / t1 if t1 > 0 else 0.0
        return float(stable + churn)


def predict_hit_rate(
    counts: np.ndarray, capacity: float, lookups_per_step: float, policy: Policy = "lru"
) -> float:
    """Predicted steady-state hit rate of a ``capacity``-row device cache (module docstring).

    Args:
      counts: per-row access counts from a sample of the data (any non-negative numbers; rows
        with count 0 are taken never to be read).
      capacity: rows the cache holds.
      lookups_per_step: ids of this table per step (batch size x bag size).
      policy: ``"lru"`` or ``"lfu"``.

    Returns:
      Hits over distinct rows requested, cold misses excluded: 1.0 once ``capacity`` covers every
      row with a nonzero count.

    Raises:
      ValueError: ``capacity`` is below the expected distinct rows of one step, or bad counts.
    """
    return _Profile.from_counts(counts, lookups_per_step).hit_rate(capacity, policy)


def expected_distinct(counts: np.ndarray, lookups: float) -> float:
    """Expected distinct rows among ``lookups`` ids drawn as ``counts`` says."""
    return _Profile.from_counts(counts, lookups).distinct_per_step


# ---------------------------------------------------------------------------------------------
# Placement


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)  # eq=False: counts is an array
class TierTable:
    """What the tier planner needs to know of a table."""

    name: str
    num_rows: int
    row_bytes: int
    """Bytes of one row including its optimizer state."""
    counts: np.ndarray
    """Per-row access counts from a sample of the data, shape ``(num_rows,)``."""
    lookups_per_step: float
    """Ids of this table per step (batch size x bag size)."""
    min_rows: int = 0
    """Rows the cache must hold whatever the hit rates say, e.g. an evaluation batch's
    distinct rows (:func:`expected_distinct` of its ids, with a margin)."""

    def __post_init__(self):
        if not self.name or any(c in self.name for c in "=:,"):
            raise ValueError(f"table name {self.name!r} must be non-empty without '=', ':' or ','")
        if self.num_rows < 1 or self.row_bytes < 1:
            raise ValueError(
                f"table {self.name!r}: num_rows and row_bytes must be >= 1, "
                f"got {self.num_rows} and {self.row_bytes}"
            )
        if not self.lookups_per_step > 0:
            raise ValueError(f"table {self.name!r}: lookups_per_step must be > 0")
        if np.shape(self.counts) != (self.num_rows,):
            raise ValueError(
                f"table {self.name!r}: counts has shape {np.shape(self.counts)}, "
                f"expected ({self.num_rows},)"
            )

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def min_cache_rows(self) -> int:
        """A cache must hold one step's distinct rows (at most all rows or all of the ids)
        and ``min_rows``."""
        return min(self.num_rows, max(math.ceil(self.lookups_per_step), self.min_rows))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierAssignment:
    """Where one table lives and how well its cache is predicted to do."""

    name: str
    num_rows: int
    row_bytes: int
    tier: Tier
    """``hbm``: the whole table on device; ``dram``/``ssd``: the backing tier of a device cache."""
    cache_rows: int
    """Rows resident on device (``num_rows`` for an ``hbm`` table)."""
    hit_rate: float
    """Predicted steady-state hit rate (1 for an ``hbm`` table)."""
    distinct_per_step: float
    """Expected distinct rows the table reads per step."""
    hbm_bytes: int
    dram_bytes: int
    ssd_bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierPlan:
    """A tier and device-cache size for every table (``place``)."""

    tables: tuple[TierAssignment, ...]
    policy: Policy
    hbm_budget_bytes: int
    dram_budget_bytes: int

    def __getitem__(self, name: str) -> TierAssignment:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def hbm_bytes(self) -> int:
        return sum(t.hbm_bytes for t in self.tables)

    @property
    def dram_bytes(self) -> int:
        return sum(t.dram_bytes for t in self.tables)

    @property
    def ssd_bytes(self) -> int:
        return sum(t.ssd_bytes for t in self.tables)

    def to_pins(self) -> tuple[str, ...]:
        """``"name=tier:cache_rows"`` for each cached table: the ``embeddings.tiers`` format."""
        return tuple(f"{t.name}={t.tier}:{t.cache_rows}" for t in self.tables if t.tier != "hbm")

    def render(self) -> str:
        """A fixed-width text table, one line per table and a total line."""
        w = max([4, *(len(t.name) for t in self.tables)])
        head = (
            f"{'name':<{w}}  {'rows':>13}  {'tier':<4}  {'cache rows':>13}  {'cache MiB':>10}  "
            f"{'hit':>6}  {'backing GiB':>11}"
        )
        lines = [head, "-" * len(head)]
        for t in self.tables:
            lines.append(
                f"{t.name:<{w}}  {t.num_rows:>13,}  {t.tier:<4}  {t.cache_rows:>13,}  "
                f"{t.hbm_bytes / MiB:>10,.1f}  {t.hit_rate:>6.1%}  "
                f"{(t.dram_bytes + t.ssd_bytes) / GiB:>11,.2f}"
            )
        lines.append(
            f"{'total':<{w}}  {'':>13}  {'':<4}  {'':>13}  {self.hbm_bytes / MiB:>10,.1f}  "
            f"{'':>6}  {(self.dram_bytes + self.ssd_bytes) / GiB:>11,.2f}"
        )
        lines.append(
            f"policy {self.policy}; HBM {self.hbm_bytes / GiB:,.2f} of "
            f"{self.hbm_budget_bytes / GiB:,.2f} GiB, DRAM {self.dram_bytes / GiB:,.2f} of "
            f"{self.dram_budget_bytes / GiB:,.2f} GiB, SSD {self.ssd_bytes / GiB:,.2f} GiB"
        )
        return "\n".join(lines)


def place(
    tables: Sequence[TierTable],
    *,
    hbm_bytes: int,
    dram_bytes: int,
    policy: Policy = "lru",
    ssd_ok: bool = True,
    chunks: int = 256,
) -> TierPlan:
    """Choose each table's tier and device-cache size (module docstring).

    Args:
      tables: the tables to place (names unique).
      hbm_bytes: device memory for embedding rows (whole tables and caches).
      dram_bytes: host memory for the backing copies of cached tables.
      policy: the cache policy the hit rates are predicted for.
      ssd_ok: whether a backing copy may go to SSD when DRAM is full.
      chunks: HBM is handed out in pieces of ``hbm_bytes / chunks``.

    Returns:
      The plan, tables in the given order.

    Raises:
      ValueError: the minimum caches (one step's ids each) do not fit in HBM, or a backing copy
        fits neither DRAM nor (with ``ssd_ok=False``) SSD; the message names the table.
    """
    _check_policy(policy)
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be unique, got {names}")
    if sum(t.nbytes for t in tables) <= hbm_bytes:
        return TierPlan(
            tables=tuple(_assignment(t, "hbm", t.num_rows, 1.0, None) for t in tables),
            policy=policy,
            hbm_budget_bytes=hbm_bytes,
            dram_budget_bytes=dram_bytes,
        )

    profiles = [_profile(t) for t in tables]

    def hits(k: int, rows: int) -> float:  # predicted hits per step with a cache of `rows`
        if rows >= tables[k].num_rows:
            return profiles[k].distinct_per_step
        return profiles[k].hit_rate(rows, policy) * profiles[k].distinct_per_step

    # Every table first gets the cache that holds one step's rows.
    cache = [t.min_cache_rows for t in tables]
    left = hbm_bytes
    for t, rows in zip(tables, cache, strict=True):
        left -= rows * t.row_bytes
        if left < 0:
            raise ValueError(
                f"table {t.name!r} needs a device cache of at least {rows:,} rows "
                f"({rows * t.row_bytes / MiB:,.1f} MiB, one step's ids), but the minimum caches "
                f"of the tables up to it exceed the {hbm_bytes / MiB:,.1f} MiB of HBM"
            )

    # Greedy marginal gain: the next chunk goes to the most predicted hits per step per byte.
    chunk = max(hbm_bytes // chunks, 1)
    cur = [hits(k, cache[k]) for k in range(len(tables))]

    def offer(k: int, budget: int) -> tuple[float, int, int, float] | None:
        t = tables[k]
        rows = min(max(chunk // t.row_bytes, 1), t.num_rows - cache[k], budget // t.row_bytes)
        if rows <= 0:
            return None
        h = hits(k, cache[k] + rows)
        gain = (h - cur[k]) / (rows * t.row_bytes)
        return (-gain, k, rows, h) if gain > 0 else None

    heap = [o for k in range(len(tables)) if (o := offer(k, left)) is not None]
    heapq.heapify(heap)
    while heap:
        _, k, rows, h = heapq.heappop(heap)
        cost = rows * tables[k].row_bytes
        if cost > left:  # the budget shrank since this offer was made: re-offer what is left
            if (o := offer(k, left)) is not None:
                heapq.heappush(heap, o)
            continue
        cache[k] += rows
        cur[k] = h
        left -= cost
        if (o := offer(k, left)) is not None:
            heapq.heappush(heap, o)

    # HBM left once no chunk gains (caches cover every sampled row): finish the tables it can,
    # smallest remainder first, so rows outside the sample are on device too.
    for k in sorted(
        range(len(tables)), key=lambda k: (tables[k].num_rows - cache[k]) * tables[k].row_bytes
    ):
        rest = (tables[k].num_rows - cache[k]) * tables[k].row_bytes
        if 0 < rest <= left:
            cache[k] = tables[k].num_rows
            left -= rest

    # Backing tiers: DRAM first-fit, densest backing traffic (misses per step per byte) first.
    cached = [k for k in range(len(tables)) if cache[k] < tables[k].num_rows]
    rate = {k: cur[k] / profiles[k].distinct_per_step for k in cached}
    order = sorted(
        cached, key=lambda k: -(1 - rate[k]) * profiles[k].distinct_per_step / tables[k].num_rows
    )
    tier: dict[int, Tier] = {}
    dram_left = dram_bytes
    for k in order:
        t = tables[k]
        if t.nbytes <= dram_left:
            tier[k] = "dram"
            dram_left -= t.nbytes
        elif ssd_ok:
            tier[k] = "ssd"
        else:
            raise ValueError(
                f"table {t.name!r} ({t.nbytes / GiB:,.2f} GiB) does not fit in the "
                f"{dram_left / GiB:,.2f} GiB of DRAM left and ssd_ok is False"
            )
    out = []
    for k, t in enumerate(tables):
        if k in tier:
            out.append(_assignment(t, tier[k], cache[k], rate[k], profiles[k]))
        else:
            out.append(_assignment(t, "hbm", t.num_rows, 1.0, profiles[k]))
    return TierPlan(
        tables=tuple(out), policy=policy, hbm_budget_bytes=hbm_bytes, dram_budget_bytes=dram_bytes
    )


def _profile(t: TierTable) -> _Profile:
    try:
        return _Profile.from_counts(t.counts, t.lookups_per_step)
    except ValueError as e:
        raise ValueError(f"table {t.name!r}: {e}") from None


def _assignment(
    t: TierTable, tier: Tier, cache_rows: int, hit_rate: float, profile: _Profile | None
) -> TierAssignment:
    if profile is None:
        profile = _profile(t)
    return TierAssignment(
        name=t.name,
        num_rows=t.num_rows,
        row_bytes=t.row_bytes,
        tier=tier,
        cache_rows=cache_rows,
        hit_rate=hit_rate,
        distinct_per_step=profile.distinct_per_step,
        hbm_bytes=cache_rows * t.row_bytes,
        dram_bytes=t.nbytes if tier == "dram" else 0,
        ssd_bytes=t.nbytes if tier == "ssd" else 0,
    )
