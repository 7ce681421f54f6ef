"""The planner's measured inputs: each table's id skew and the lookup calibration.

**Skew** (``embeddings.measure_skew = K``): the ids of the first ``K`` training batches are
counted per table and a Zipf exponent ``s`` (``P(rank r) ~ r^-s``, ranks from 1) is fitted to
the counts by maximum likelihood over the **head**, the ranks whose rows were seen at least
``MIN_COUNT`` times (the tail of a sample is mostly rows seen once or never, whose order says
nothing). The ranks come from one half of the sample (the even examples) and the counts from
the other (the odd ones), then the other way round, and the two fits are averaged: ranking and
counting on the same ids makes the counts fall with rank even on uniform data (the rows that
drew high counts by chance rank first), which reads 0.19 on uniform ids of a 1,000-row table
(16,000 ids), where the cross-fit reads 0.009. Within the head the likelihood of the counts
``y_r`` is that of ``P(r | r <= k) = r^-s / H_{k,s}``, maximised where the model's mean log rank
equals the sample's (one monotone equation, solved by bisection). A table whose halves have
fewer than ``MIN_RANKS`` head ranks shows no skew the sample can measure and gets 0: its
hottest row takes so small a share of the lookups that a row-wise shard's load does not notice.
On numpy Zipf samples (20 seeds) the fit reads 1.105 +- 0.002 for s = 1.1 (1,000 rows, 64,000
ids), 0.809 +- 0.006 for s = 0.8 (10^6 rows, 10^5 ids) and 0.004 +- 0.004 on uniform ids (10^5
rows, 10^6 ids); it overestimates weak skew over large tables (0.35 +- 0.07 for s = 0.3 over
10^6 rows, 10^6 ids), where the hottest row's share is under 10^-4 either way, against the
``1/n`` of each of ``n`` row-wise shards.

**Calibration** (``embeddings.calibrate``): the run's embedding-bag kernel
(``kernels.embedding_bag``, the one the engine's lookups call) pools bags of ``HOTNESS``
uniformly drawn ids from a ``TABLE_BYTES`` table of the run's storage dtype and embedding
width, at a few lookup counts, on this process's first device; ``CostModel.calibrated`` fits
the planner's lookup factor (measured time over the profile's peak-bandwidth time) to them.
Only the forward pool is timed: the factor scales the planner's whole lookup term, so the
backward's reads and the update's read-modify-write are taken to run as efficiently. A call's
fixed cost counts too (the fit goes through the origin), which small lookups pay on CPU.

:func:`resolve` does both when asked, before config.json is written: the values go into the
config (``zipf_exponents``, ``cost_lookup_factor``, and the profile the factor is relative to),
so evaluation and resume rebuild the same plan, and a resumed run keeps the values its
config.json recorded instead of measuring again. Every process measures the same global
batches; the values of process 0 are broadcast, so all plan alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from recscale import config as config_lib
from recscale.embeddings import learned_cost, planner
from recscale.embeddings.layout import DTYPES, default_profile
from tpu_gpu_configs.profiles import get_profile

MIN_COUNT = 10
"""A rank is in the head when its row has at least this many ids in the ranking half."""
MIN_RANKS = 8
"""Fewer head ranks than this in either half: no measurable skew (0)."""
TABLE_BYTES = 128 << 20
"""Size of the table the calibration reads (beyond the last-level caches of H100 / H200)."""
HOTNESS = 4
"""Ids per bag in the calibration."""
LOOKUPS = (1 << 14, 1 << 16, 1 << 18)
"""Ids pooled per timed call."""


# ------------------------------------------------------------------------------------------------
# Skew.


def sampled_ids(data_cfg: Any, batches: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per table, the valid ids of the first ``batches`` global training batches: those of the
    even examples and those of the odd ones (features sharing a table pooled)."""
    from data.builders import make_source  # noqa: PLC0415 (reads the data when called)

    source = make_source(data_cfg)
    names = [f.table_name for f in source.schema.features]
    parts: dict[str, tuple[list, list]] = {t: ([], []) for t in names}
    for step in range(batches):
        ids_bfh = source.train_batch(step).ids_bfh
        for i, t in enumerate(names):
            for half in (0, 1):
                ids = ids_bfh[half::2, i].ravel()
                parts[t][half].append(ids[ids >= 0])
    empty = np.zeros(0, np.int32)
    return {
        t: (np.concatenate(a or [empty]), np.concatenate(b or [empty]))
        for t, (a, b) in parts.items()
    }


@dataclasses.dataclass(frozen=True)
class ZipfFit:
    exponent: float
    """The fitted ``s`` (0: no measurable skew)."""
    stderr: float
    """Its standard error from the likelihood's curvature (0 when not fitted)."""
    head: int
    """Ranks fitted (the smaller head of the two halves)."""


def fit_zipf(ids_a: np.ndarray, ids_b: np.ndarray) -> ZipfFit:
    """The Zipf exponent of one table's ids, ranked on one half and counted on the other, both
    ways (see the module docstring)."""
    heads = [_head(ids_a, ids_b), _head(ids_b, ids_a)]
    k = min(h.size for h in heads)
    if k < MIN_RANKS:
        return ZipfFit(0.0, 0.0, k)
    fits = [_mle(h) for h in heads]
    s = sum(f[0] for f in fits) / 2
    # two independent halves: the mean's variance is a quarter of the sum of theirs
    se = math.sqrt(sum(f[1] ** 2 for f in fits)) / 2
    return ZipfFit(s, se, k)


def _head(rank_ids: np.ndarray, count_ids: np.ndarray) -> np.ndarray:
    """Counts in ``count_ids`` of the rows ``rank_ids`` saw at least ``MIN_COUNT`` times, in
    the order of their counts there (most first; ties by row)."""
    rows, n = np.unique(rank_ids, return_counts=True)
    keep = n >= MIN_COUNT
    rows, n = rows[keep], n[keep]
    rows = rows[np.lexsort((rows, -n))]
    other, m = np.unique(count_ids, return_counts=True)
    if other.size == 0:
        return np.zeros(rows.size)
    pos = np.minimum(np.searchsorted(other, rows), other.size - 1)
    return np.where(other[pos] == rows, m[pos], 0).astype(np.float64)


def _mle(y: np.ndarray) -> tuple[float, float]:
    """``(s, standard error)`` maximising the likelihood of counts ``y`` at ranks 1..k under
    ``P(r) = r^-s / H_{k,s}``: the ``s`` whose mean log rank is the counts'."""
    total = y.sum()
    if total == 0:
        return 0.0, 0.0
    log_r = np.log(np.arange(1, y.size + 1, dtype=np.float64))
    target = float(y @ log_r) / total

    def moments(s: float) -> tuple[float, float]:
        w = np.exp(-s * log_r)
        w /= w.sum()
        mean = float(w @ log_r)
        return mean, float(w @ (log_r - mean) ** 2)

    lo, hi = 0.0, 20.0  # the mean log rank falls as s grows
    if moments(lo)[0] <= target:
        s = 0.0
    elif moments(hi)[0] >= target:
        s = hi
    else:
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if moments(mid)[0] > target else (lo, mid)
        s = (lo + hi) / 2
    var = moments(s)[1]
    return s, (1 / math.sqrt(total * var) if var > 0 else 0.0)


def measure_skew(data_cfg: Any, batches: int) -> dict[str, ZipfFit]:
    """Each table's fitted Zipf exponent over the first ``batches`` training batches."""
    return {t: fit_zipf(a, b) for t, (a, b) in sampled_ids(data_cfg, batches).items()}


# ------------------------------------------------------------------------------------------------
# Calibration.


@dataclasses.dataclass(frozen=True)
class Calibration:
    factor: float
    """The planner's lookup factor (measured time over the profile's peak-bandwidth time)."""
    profile: str
    lookups: tuple[int, ...]
    bytes_read: tuple[float, ...]
    seconds: tuple[float, ...]
    """Median time of each timed call."""

    def describe(self, impl: str, device_kind: str) -> str:
        peak = get_profile(self.profile).memory_bandwidth
        runs = ", ".join(
            f"{n:,} ids {t * 1e3:.3g} ms ({b / t / 1e9:.3g} GB/s)"
            for n, b, t in zip(self.lookups, self.bytes_read, self.seconds, strict=True)
        )
        return (
            f"embeddings.calibrate: embedding_bag ({impl}) on {device_kind}: {runs}; lookup "
            f"factor {self.factor:.3g} against {self.profile}'s {peak / 1e9:.4g} GB/s peak"
        )


def time_lookups(
    impl: str,
    storage_dtype: str,
    dim: int,
    *,
    table_bytes: int = TABLE_BYTES,
    lookups: tuple[int, ...] = LOOKUPS,
    hotness: int = HOTNESS,
    repeats: int = 5,
) -> tuple[list[float], list[float]]:
    """``(bytes read, seconds)`` of the embedding-bag kernel ``impl`` pooling ``n`` uniform ids
    (bags of ``hotness``) for each ``n`` of ``lookups``, from a ``table_bytes`` table on this
    process's first device: the median of ``repeats`` timed calls after a compiling one."""
    from recscale.kernels.embedding_bag import api as bag_api  # noqa: PLC0415

    dtype = DTYPES[storage_dtype]
    itemsize = jnp.dtype(dtype).itemsize
    rows = max(1024, table_bytes // (dim * itemsize))
    device = jax.local_devices()[0]
    table = jax.device_put(jnp.zeros((rows, dim), dtype), device)
    pool = jax.jit(functools.partial(bag_api.pool, impl=impl))
    rng = np.random.default_rng(0)
    bytes_read, seconds = [], []
    for n in lookups:
        ids = jax.device_put(rng.integers(0, rows, (n // hotness, hotness), np.int32), device)
        pool(table, ids).block_until_ready()
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            pool(table, ids).block_until_ready()
            runs.append(time.perf_counter() - t0)
        bytes_read.append(float(n // hotness * hotness * dim * itemsize))
        seconds.append(float(np.median(runs)))
    return bytes_read, seconds


def calibrate_lookups(cfg: Any, profile: str) -> Calibration:
    """The lookup factor of ``cfg``'s embedding-bag kernel on this device against ``profile``."""
    e = cfg.embeddings
    bytes_read, seconds = time_lookups(
        cfg.kernels.embedding_bag, e.storage_dtype, cfg.model.embed_dim
    )
    cm = planner.CostModel().calibrated(bytes_read, seconds, get_profile(profile))
    return Calibration(cm.lookup, profile, LOOKUPS, tuple(bytes_read), tuple(seconds))


# ------------------------------------------------------------------------------------------------
# Into the run's config.


def resolve(cfg: Any, workdir: str | Path | None = None, *, calibrate: bool = True) -> Any:
    """``cfg`` with the measurements it asks for filled in (see the module docstring): tables
    missing from ``embeddings.zipf_exponents`` when ``measure_skew`` is set, and
    ``cost_lookup_factor`` (with ``profile``) when ``embeddings.calibrate`` is set and it is 0
    (and ``calibrate`` allows: not when planning for another machine). A run resumed in
    ``workdir`` (its config.json and checkpoints there) takes the recorded values."""
    e = cfg.embeddings
    if e.sharding != "off" and e.planner == "learned" and not e.cost_model_digest:
        cfg = _with_model_digest(cfg)
        e = cfg.embeddings
    wants_skew = e.sharding != "off" and e.measure_skew > 0
    wants_factor = calibrate and e.sharding != "off" and e.calibrate and not e.cost_lookup_factor
    if not (wants_skew or wants_factor):
        return cfg
    saved = _resumed_embeddings(cfg, workdir)
    if wants_skew:
        given = dict(item.split("=", 1) for item in e.zipf_exponents)
        if saved is not None and saved.zipf_exponents:
            skew = dict(item.split("=", 1) for item in saved.zipf_exponents)
        else:
            skew = _measured_skew(cfg.data, e.measure_skew, given)
        items = tuple(f"{t}={v}" for t, v in {**skew, **given}.items())
        e = dataclasses.replace(e, zipf_exponents=items)
    if wants_factor and saved is not None and saved.cost_lookup_factor:
        e = dataclasses.replace(
            e, cost_lookup_factor=saved.cost_lookup_factor, profile=saved.profile
        )
    elif wants_factor:
        cal = calibrate_lookups(cfg, e.profile or default_profile())
        (factor,) = _broadcast([cal.factor])
        _print(cal.describe(cfg.kernels.embedding_bag, jax.local_devices()[0].device_kind))
        e = dataclasses.replace(e, cost_lookup_factor=float(f"{factor:.3g}"), profile=cal.profile)
    return dataclasses.replace(cfg, embeddings=e)


def _with_model_digest(cfg: Any) -> Any:
    """``cfg`` with the learned planner's model digest recorded (the model of the profile the
    run plans for), so a resume with a changed model file refuses instead of re-planning."""
    e = cfg.embeddings
    path = learned_cost.model_path(e.profile or default_profile(), e.cost_model_path)
    if not path.is_file():  # planning says why, naming the file
        return cfg
    e = dataclasses.replace(e, cost_model_digest=learned_cost.file_digest(path))
    return dataclasses.replace(cfg, embeddings=e)


def _measured_skew(data_cfg: Any, batches: int, given: dict[str, str]) -> dict[str, str]:
    """``{table: exponent}`` measured (process 0's), printed."""
    fits = measure_skew(data_cfg, batches)
    names = sorted(fits)
    values = _broadcast([fits[t].exponent for t in names])
    out = {t: f"{round(v, 3):g}" for t, v in zip(names, values, strict=True)}

    def shown(t: str) -> str:
        f = fits[t]
        if t in given:
            return f"{t} {out[t]} (given: {given[t]})"
        if f.head < MIN_RANKS:
            return f"{t} 0 (too few repeated ids to fit)"
        return f"{t} {out[t]} +- {f.stderr:.2g} ({f.head} ranks)"

    _print(
        f"embeddings.measure_skew: Zipf exponents over {batches} batches: "
        + ", ".join(map(shown, names))
    )
    return out


def _resumed_embeddings(cfg: Any, workdir: str | Path | None) -> Any:
    """The embeddings config recorded by the run being resumed in ``workdir`` (None: a new
    run: no config.json, or no checkpoint to resume)."""
    if workdir is None:
        return None
    path = Path(workdir) / "config.json"
    ckpts = Path(workdir) / "checkpoints"
    if not path.is_file() or not (
        ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())
    ):
        return None
    return config_lib.load_json(type(cfg), path).embeddings


def _broadcast(values: list[float]) -> list[float]:
    """Process 0's ``values`` on every process (timings differ between hosts)."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils  # noqa: PLC0415

    out = multihost_utils.broadcast_one_to_all(np.asarray(values, np.float32))
    return [float(v) for v in np.asarray(out)]


def _print(text: str) -> None:
    if jax.process_index() == 0:
        print(text, file=sys.stderr)
