"""The tier planner (``recscale.embeddings.tier_plan``): predicted hit rates against the
reference simulation and the production cache, and placement over HBM, DRAM and SSD."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from recscale.embeddings import tier_plan
from recscale.embeddings.tiers import RowCache

ROWS, IDS, STEPS = 20_000, 500, 400


def _zipf(s: float, seed: int = 0):
    """Per-row probabilities ~ rank^-s over a random permutation, and a stream of batches."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, ROWS + 1, dtype=np.float64) ** -s
    p = rng.permutation(p / p.sum())
    return p, [rng.choice(ROWS, IDS, p=p) for _ in range(STEPS)]


@pytest.mark.parametrize("s", [0.8, 1.0, 1.2])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_predicted_hit_rates_are_within_10_percent_of_the_simulation(s, policy):
    p, batches = _zipf(s)
    for capacity in (1_000, 4_000):
        want = tier_plan.simulate_hit_rate(batches, capacity, policy, warmup=0.5)[1]
        got = tier_plan.predict_hit_rate(p, capacity, IDS, policy)
        assert abs(got - want) <= 0.1 * want, (capacity, got, want)


def test_the_production_cache_hits_as_the_simulation():
    """``tiers.RowCache`` (the trainer's) and the planner's reference simulator: the same LRU
    hit rate (ties between rows of one step may be broken differently)."""
    _, batches = _zipf(1.0, seed=1)
    cache = RowCache(ROWS, 2_000)
    for b in batches:
        cache.plan(b, train=True)
    ref = tier_plan.simulate_hit_rate(batches, 2_000, "lru", warmup=0.0)[0]
    assert abs(cache.hits / cache.requests - ref) < 0.005, (cache.hits / cache.requests, ref)


def test_edge_cases_of_the_prediction():
    p = np.ones(1000)
    assert tier_plan.predict_hit_rate(p, 1000, 100) == 1.0  # every row fits
    # uniform ids: a cache of a fifth of the rows hits about a fifth of them
    assert abs(tier_plan.predict_hit_rate(p, 200, 20) - 0.2) < 0.02
    with pytest.raises(ValueError, match="cannot hold one step's rows"):
        tier_plan.predict_hit_rate(p, 10, 100)


def _table(name, rows, s=1.0, lookups=256.0, row_bytes=132):
    p = np.arange(1, rows + 1, dtype=np.float64) ** -s
    return tier_plan.TierTable(name=name, num_rows=rows, row_bytes=row_bytes, counts=p,
                               lookups_per_step=lookups)  # fmt: skip


def test_placement_over_hbm_dram_and_ssd():
    hot, cold = _table("hot", 10_000, s=1.3), _table("cold", 100_000, s=0.6)
    everything = hot.nbytes + cold.nbytes
    place = functools.partial(tier_plan.place, chunks=32)  # HBM in 32 pieces: seconds, not minutes
    plan = place([hot, cold], hbm_bytes=everything, dram_bytes=0)
    assert [t.tier for t in plan.tables] == ["hbm", "hbm"] and plan.to_pins() == ()
    # a third of the bytes in HBM: both cached, the skewed table hits far more often
    plan = place([hot, cold], hbm_bytes=everything // 3, dram_bytes=everything)
    assert plan.hbm_bytes <= everything // 3
    assert {t.tier for t in plan.tables} <= {"dram", "hbm"}
    assert plan["hot"].hit_rate > plan["cold"].hit_rate
    for t in plan.tables:  # the caches' predictions are the predictor's
        if t.tier != "hbm":
            src = hot if t.name == "hot" else cold
            want = tier_plan.predict_hit_rate(src.counts, t.cache_rows, src.lookups_per_step)
            assert t.hit_rate == pytest.approx(want, rel=1e-3)  # place interpolates a curve
    pins = dict(x.split("=") for x in plan.to_pins())
    assert all(v.split(":")[0] in ("dram", "ssd") for v in pins.values())
    # DRAM for one backing copy only: the other goes to SSD, or fails without it
    plan = place([hot, cold], hbm_bytes=everything // 3, dram_bytes=hot.nbytes)
    assert "ssd" in {t.tier for t in plan.tables}
    with pytest.raises(ValueError, match="'cold'"):
        place([hot, cold], hbm_bytes=everything // 3, dram_bytes=hot.nbytes, ssd_ok=False)
    # not even one step's rows fit: the message names the table
    with pytest.raises(ValueError, match="'hot'"):
        place([hot, cold], hbm_bytes=1000, dram_bytes=everything)
    assert "hit" in plan.render() and "cold" in plan.render()
