"""What one device's embedding work costs: a shard set described, and measured with the engine's
own kernels.

A device holding shards of a plan does, every step, what ``recscale.embeddings.lookup`` and
``recscale.embeddings.update`` do inside their ``shard_map``: per buffer (its shards of one
width, stacked; replicated ones apart) one embedding-bag call pooling every slot's bags, and one
fused backward + row-wise update call over the same keys. A slot's keys are the batch's ids
that fall in its rows, the rest ``R`` ("none"), padded to the model's widest bag
(``pad_hotness``), as the engine pads ``ids_bfh``. :func:`measure` times exactly those calls
(the kernels ``kernels.embedding_bag`` / ``kernels.embedding_update`` choose on this backend:
the C++ kernels on CPU, the Pallas kernels on GPU/TPU), jitted once, buffers donated.

Ids follow Zipf(``zipf``) over the table's rows, rank ``r`` at row ``(r - 1)·a mod V`` (``a``
odd and coprime to ``V``): the hottest row is row 0, so a row-wise table's first shard is its
busiest, as the planner assumes. No jax import at module level (the planners use this).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import numpy as np

from recscale.embeddings import planner

KINDS = ("table_wise", "column_wise", "row_wise", "data_parallel")
"""How a shard came to be (the planner's hybrids map onto these: ``table_row_wise`` is
row-wise over a host, ``table_column_wise`` column-wise)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardWork:
    """One shard's share of a device's step."""

    table_rows: int
    """Rows of the whole table (its ids are drawn over these)."""
    rows: int
    """Rows stored on this device (row-wise: a range; otherwise the table's)."""
    row_start: int = 0
    width: int
    """Columns stored (a column-wise shard's slice)."""
    bags: int
    """Bags this device pools from the shard: the global batch, or its share of it for a
    data-parallel table."""
    hotness: int
    """Ids per bag of the features reading the table."""
    zipf: float = 0.0
    kind: str = "table_wise"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"shard kind {self.kind!r}: expected one of {KINDS}")
        if not 0 <= self.row_start < self.row_start + self.rows <= self.table_rows:
            raise ValueError(f"shard rows [{self.row_start}, +{self.rows}) of {self.table_rows}")
        if min(self.width, self.bags, self.hotness) < 1 or not self.zipf >= 0:
            raise ValueError(
                f"shard width {self.width}, bags {self.bags}, ids per bag {self.hotness} must be "
                f">= 1 and skew {self.zipf} >= 0"
            )

    @property
    def replicated(self) -> bool:
        return self.kind == "data_parallel"

    @property
    def bytes(self) -> int:
        return self.rows * self.width * 4


def valid_share(s: ShardWork) -> float:
    """Expected share of the table's ids that land in the shard's rows: its rows' share, plus
    the hottest row's excess when it holds row 0."""
    uniform = s.rows / s.table_rows
    if s.row_start > 0 or s.rows >= s.table_rows:
        return min(1.0, uniform)
    return min(1.0, uniform + planner.hot_fraction(s.table_rows, s.zipf) * (1 - uniform))


@functools.lru_cache(maxsize=8192)
def distinct_share(table_rows: int, zipf: float, draws: int) -> float:
    """Expected distinct rows over ``draws`` ids (the rows an update writes), as a share of
    the draws: ``sum_r 1 - (1 - p_r)^draws`` over the ranks (the first 2^16 exactly, the tail
    by blocks of equal probability)."""
    if draws <= 0:
        return 1.0
    head = min(table_rows, 1 << 16)
    r = np.arange(1, head + 1, dtype=float)
    h = 1.0 / planner.hot_fraction(table_rows, zipf)
    p = r**-zipf / h
    expected = float(np.sum(-np.expm1(draws * np.log1p(-np.minimum(p, 1 - 1e-12)))))
    if table_rows > head:  # the tail: 256 blocks, each of rows with about equal probability
        edges = np.unique(np.geomspace(head + 1, table_rows + 1, 257).astype(np.int64))
        mid = np.sqrt(edges[:-1] * edges[1:].astype(float))
        pt = mid**-zipf / h
        expected += float(np.sum((edges[1:] - edges[:-1]) * -np.expm1(draws * np.log1p(-pt))))
    return min(1.0, expected / draws)


def zipf_ids(table_rows: int, zipf: float, shape, rng: np.random.Generator) -> np.ndarray:
    """int64 ids of ``shape`` drawn as the module docstring says: ranks exactly Zipf over the
    first ``HEAD`` ranks, by the inverse CDF of the continuous power law beyond (the planner's
    harmonic sum is split the same way)."""
    v = table_rows
    u = rng.random(shape)
    if zipf <= 0:
        rank = np.floor(u * v).astype(np.int64)
    else:
        cdf = _head_cdf(v, zipf)
        rank = np.searchsorted(cdf, u, side="right").astype(np.int64)
        tail = rank >= cdf.size  # beyond the head: continuous on [head + 0.5, V + 0.5)
        if tail.any():
            a, b = cdf.size + 0.5, v + 0.5
            w = (u[tail] - cdf[-1]) / max(1 - cdf[-1], 1e-300)
            if abs(zipf - 1) < 1e-9:
                x = a * (b / a) ** w
            else:
                e = 1 - zipf
                x = (a**e + w * (b**e - a**e)) ** (1 / e)
            rank[tail] = np.floor(x + 0.5).astype(np.int64) - 1
    rank = np.clip(rank, 0, v - 1)
    return (rank * _coprime_multiplier(v)) % v


HEAD = 10_000
"""Ranks drawn exactly (``planner.hot_fraction``'s exact head)."""


@functools.lru_cache(maxsize=256)
def _head_cdf(table_rows: int, zipf: float) -> np.ndarray:
    """Cumulative probabilities of the first ``HEAD`` ranks under Zipf(``zipf``)."""
    r = np.arange(1, min(table_rows, HEAD) + 1, dtype=float)
    return np.cumsum(r**-zipf * planner.hot_fraction(table_rows, zipf))


@functools.lru_cache(maxsize=4096)
def _coprime_multiplier(v: int) -> int:
    a = (int(v * 0.6180339887) | 1) or 1
    while math.gcd(a, v) != 1:
        a += 2
    return a


def _groups(shards: list[ShardWork]) -> dict[tuple[int, bool], list[ShardWork]]:
    """Shards by buffer, as ``recscale.embeddings.layout`` stacks them: (width, replicated)."""
    out: dict[tuple[int, bool], list[ShardWork]] = {}
    for s in shards:
        out.setdefault((s.width, s.replicated), []).append(s)
    return dict(sorted(out.items()))


def device_inputs(shards: list[ShardWork], pad_hotness: int, seed: int = 0):
    """Per buffer: ``(rows R, keys [S·B, H] int32, width)`` as the engine forms them (ids
    outside a slot's rows are ``R``)."""
    rng = np.random.default_rng(seed)
    out = []
    for (width, _), group in _groups(shards).items():
        total = -(-sum(s.rows for s in group) // 8) * 8
        keys, off = [], 0
        bags = max(s.bags for s in group)
        for s in group:
            k = np.full((bags, pad_hotness), total, np.int64)
            ids = zipf_ids(s.table_rows, s.zipf, (s.bags, s.hotness), rng)
            local = ids - s.row_start
            ok = (local >= 0) & (local < s.rows)
            k[: s.bags, : s.hotness] = np.where(ok, off + local, total)
            keys.append(k)
            off += s.rows
        out.append((total, np.concatenate(keys).astype(np.int32), width))
    return out


def measure(
    shards: list[ShardWork],
    *,
    pad_hotness: int = 0,
    repeats: int = 5,
    seed: int = 0,
    bag_impl: str = "auto",
    update_impl: str = "auto",
) -> float:
    """Median seconds of one device's step over ``shards`` (pool + fused backward/update of
    every buffer, row-wise Adagrad), after a compiling call."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from recscale.kernels.embedding_bag import api as bag_api  # noqa: PLC0415
    from recscale.kernels.embedding_update import api as update_api  # noqa: PLC0415

    pad = max(pad_hotness, max(s.hotness for s in shards))
    parts = device_inputs(shards, pad, seed)
    rng = np.random.default_rng(seed + 1)
    bufs = [jnp.zeros((r, w), jnp.float32) for r, _, w in parts]
    accs = [jnp.zeros((r,), jnp.float32) for r, _, _ in parts]
    keys = [jnp.asarray(k) for _, k, _ in parts]
    grads = [
        jnp.asarray(rng.standard_normal((k.shape[0], w), np.float32) * 1e-3) for _, k, w in parts
    ]

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(bufs, accs, keys, grads):
        outs, new_b, new_a = [], [], []
        for buf, acc, k, g in zip(bufs, accs, keys, grads, strict=True):
            pooled = bag_api.pool(buf, k, impl=bag_impl)
            outs.append(pooled)
            # the gradient depends on the pooled outputs, as in a train step: without that XLA
            # copies the whole buffer to order the pool's read before the update's in-place write
            g = g + 0.0 * pooled
            b, a, _ = update_api.update(buf, acc, k, g, 0.01, impl=update_impl)
            new_b.append(b)
            new_a.append(a)
        return new_b, new_a, outs

    bufs, accs, outs = step(bufs, accs, keys, grads)
    jax.block_until_ready(outs)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bufs, accs, outs = step(bufs, accs, keys, grads)
        jax.block_until_ready((bufs, accs, outs))
        runs.append(time.perf_counter() - t0)
    return float(np.median(runs))


KIND_OF = {
    # the planner's sharding types as the work they make
    "table_wise": "table_wise",
    "column_wise": "column_wise",
    "table_column_wise": "column_wise",
    "row_wise": "row_wise",
    "table_row_wise": "row_wise",
    "data_parallel": "data_parallel",
}


def work_of(
    t, sharding: str, rows: tuple[int, int], width: int, num_devices: int, batch_size: int
) -> ShardWork | None:
    """The work of a shard of table ``t`` (a ``planner.PlannerTable``) over ``rows`` and
    ``width`` columns: a data-parallel table pools ``B / N`` bags on every device, every other
    shard the whole batch's; None for an empty shard (the engine makes no slot of it)."""
    if rows[1] <= rows[0] or width <= 0:
        return None
    kind = KIND_OF[sharding]
    return ShardWork(
        table_rows=t.num_rows,
        rows=rows[1] - rows[0],
        row_start=rows[0],
        width=width,
        bags=max(1, batch_size // num_devices) if kind == "data_parallel" else batch_size,
        hotness=max(1, math.ceil(t.pooling_factor)),
        zipf=t.zipf_exponent,
        kind=kind,
    )


def device_work(plan, tables, num_devices: int, batch_size: int) -> list[list[ShardWork]]:
    """Per device, the :class:`ShardWork` of its shards under ``plan`` (a ``planner.Plan`` of
    ``tables``, ``planner.PlannerTable`` s)."""
    by_name = {t.name: t for t in tables}
    out: list[list[ShardWork]] = [[] for _ in range(num_devices)]
    for tp in plan.tables:
        t = by_name[tp.table]
        for sh in tp.shards:
            w = work_of(t, tp.sharding, sh.rows, sh.cols[1] - sh.cols[0], num_devices, batch_size)
            if w is not None:
                out[sh.device].append(w)
    return out
