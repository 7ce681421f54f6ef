"""The tier planner (``recscale.embeddings.tier_plan``): the reference simulator on hand-worked
streams, predicted hit rates against it, and placement over HBM, DRAM and SSD."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from recscale.embeddings import tier_plan

# Zipf streams: small enough for ~5 s of simulation in all, large enough that 1% of the rows
# still holds one step's ids (ROWS // 100 >= IDS).
ROWS, IDS, STEPS = 50_000, 400, 1_000


@functools.cache
def _zipf(s: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-row probabilities ~ rank^-s over a random permutation, and ``STEPS`` batches."""
    rng = np.random.default_rng(seed)
    p = rng.permutation(np.arange(1, ROWS + 1, dtype=np.float64) ** -s)
    p /= p.sum()
    cdf = np.cumsum(p)
    ids = np.searchsorted(cdf, rng.random((STEPS, IDS)) * cdf[-1], side="right")
    return p, np.minimum(ids, ROWS - 1)


# ---------------------------------------------------------------------------------------------
# The reference simulator


# Capacity 2. LRU: miss, hit, miss, miss (evicts 0), miss (evicts 1), miss (evicts 2), miss.
# LFU: 0 is used in 2 steps by step 3, so 1 goes instead, and 0 hits at step 4.
TOY = [[0], [0, 0], [1], [2], [0], [1], [2]]


@pytest.mark.parametrize(
    ("policy", "total", "steady"), [("lru", 1 / 7, 0 / 4), ("lfu", 2 / 7, 1 / 4)]
)
def test_simulator_on_a_hand_worked_stream(policy, total, steady):
    # the cache is first full at the start of step 3: the steady rate counts steps 3..6
    got = tier_plan.simulate_hit_rate(map(np.array, TOY), 2, policy, warmup=0.0)
    assert got == pytest.approx((total, steady))


def test_simulator_keeps_a_step_resident_and_refuses_more_than_fits():
    # step 1 reuses 0 and 1 and brings 2: the victim cannot be a row of the step, so it is none
    # of them; the cache holds 3 rows, so 0, 1 and 2 all hit at step 2
    got = tier_plan.simulate_hit_rate(
        [np.array([0, 1]), np.array([0, 1, 2]), np.array([2, 1, 0])], 3, "lru", warmup=0.0
    )
    assert got[0] == pytest.approx(5 / 8)
    with pytest.raises(ValueError, match="3 distinct rows > capacity 2"):
        tier_plan.simulate_hit_rate([np.array([5, 6, 7, 5])], 2)


def test_the_production_cache_hits_as_the_simulation():
    """``tier_store.RowCache`` (the trainer's) against the reference simulator: the same LRU hit rate
    (ties between rows of one step may be broken differently)."""
    from recscale.embeddings.tier_store import RowCache  # the trainer's module, imported only here

    _, batches = _zipf(1.0, seed=1)
    cache = RowCache(ROWS, 2_000)
    for b in batches[:400]:
        cache.plan(b, train=True)
    ref = tier_plan.simulate_hit_rate(batches[:400], 2_000, "lru", warmup=0.0)[0]
    assert abs(cache.hits / cache.requests - ref) < 0.005, (cache.hits / cache.requests, ref)


# ---------------------------------------------------------------------------------------------
# Predictions against the simulator


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.2])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("s", [0.8, 1.0, 1.2])
def test_predicted_hit_rates_are_within_10_percent_of_the_simulation(s, policy, fraction):
    p, batches = _zipf(s)
    capacity = int(fraction * ROWS)
    want = tier_plan.simulate_hit_rate(batches, capacity, policy, warmup=0.5)[1]
    got = tier_plan.predict_hit_rate(p, capacity, IDS, policy)
    assert abs(got - want) <= 0.1 * want, (got, want)


def test_predictions_from_sampled_integer_counts():
    """Counts as a planner gets them (a sample's bincount), not the probabilities."""
    p, batches = _zipf(0.8)
    sample = np.random.default_rng(7).choice(ROWS, 2_000_000, p=p)
    counts = np.bincount(sample, minlength=ROWS)
    for policy in ("lru", "lfu"):
        want = tier_plan.simulate_hit_rate(batches, 2_500, policy, warmup=0.5)[1]
        got = tier_plan.predict_hit_rate(counts, 2_500, IDS, policy)
        assert abs(got - want) <= 0.1 * want, (policy, got, want)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_uniform_ids_hit_in_proportion_to_the_cache(policy):
    rows, ids = 20_000, 200
    batches = np.random.default_rng(3).integers(0, rows, (600, ids))
    for capacity in (1_000, 5_000):
        got = tier_plan.predict_hit_rate(np.ones(rows), capacity, ids, policy)
        assert got == pytest.approx(capacity / rows, rel=1e-6)
        want = tier_plan.simulate_hit_rate(batches, capacity, policy, warmup=0.5)[1]
        assert abs(got - want) <= 0.1 * want, (capacity, got, want)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_edge_cases_of_the_prediction(policy):
    p, _ = _zipf(1.0)
    assert tier_plan.predict_hit_rate(p, ROWS, IDS, policy) == 1.0  # every row fits
    assert tier_plan.predict_hit_rate(p, ROWS - 1, IDS, policy) < 1.0
    zero_tail = np.where(np.arange(ROWS) < 1_000, p, 0.0)  # rows never sampled are never read
    assert tier_plan.predict_hit_rate(zero_tail, 1_000, IDS, policy) == 1.0
    assert tier_plan.predict_hit_rate(np.array([0, 7, 0]), 1, 5, policy) == 1.0  # one read row
    # hit rates grow with the cache (checked on a grid through the range of the models)
    rates = [tier_plan.predict_hit_rate(p, c, IDS, policy) for c in (500, 1_000, 5_000, 20_000)]
    assert all(a < b for a, b in zip(rates, rates[1:], strict=False))
    with pytest.raises(ValueError, match="cannot hold one step's rows"):
        tier_plan.predict_hit_rate(p, 100, IDS, policy)
    with pytest.raises(ValueError, match="all zero"):
        tier_plan.predict_hit_rate(np.zeros(10), 5, 1, policy)
    with pytest.raises(ValueError, match="unknown cache policy"):
        tier_plan.predict_hit_rate(p, 1_000, IDS, "fifo")


def test_lfu_beats_lru_on_skewed_ids():
    """A frequency-keyed cache keeps the hot rows a recency-keyed one lets the tail push out."""
    p, _ = _zipf(1.0)
    assert tier_plan.predict_hit_rate(p, 2_500, IDS, "lfu") > tier_plan.predict_hit_rate(
        p, 2_500, IDS, "lru"
    )


# ---------------------------------------------------------------------------------------------
# Placement


def _table(name, rows, s=1.0, lookups=256.0, row_bytes=132, seed=0):
    p = np.random.default_rng(seed).permutation(np.arange(1, rows + 1, dtype=np.float64) ** -s)
    return tier_plan.TierTable(
        name=name, num_rows=rows, row_bytes=row_bytes, counts=p, lookups_per_step=lookups
    )


def _predicted_hits(t, rows, policy="lru"):
    if rows >= t.num_rows:
        return 1.0 * _distinct(t)
    return tier_plan.predict_hit_rate(t.counts, rows, t.lookups_per_step, policy) * _distinct(t)


def _distinct(t):
    p = t.counts / t.counts.sum()
    return float(-np.expm1(t.lookups_per_step * np.log1p(-p)).sum())


def test_everything_in_hbm_when_it_fits():
    tables = [_table("a", 10_000), _table("b", 30_000, s=0.7)]
    plan = tier_plan.place(tables, hbm_bytes=sum(t.nbytes for t in tables), dram_bytes=0)
    assert [(t.tier, t.cache_rows, t.hit_rate) for t in plan.tables] == [
        ("hbm", 10_000, 1.0),
        ("hbm", 30_000, 1.0),
    ]
    assert plan.to_pins() == () and plan.dram_bytes == plan.ssd_bytes == 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_hottest_bytes_get_the_hbm(policy):
    # a small, heavily read table and a large, lightly read one: the small one stays whole
    hot, cold = _table("hot", 10_000, lookups=2_000.0), _table("cold", 200_000, s=0.8)
    budget = hot.nbytes + cold.nbytes // 10
    plan = tier_plan.place([cold, hot], hbm_bytes=budget, dram_bytes=10 * budget, policy=policy)
    assert plan["hot"].tier == "hbm" and plan["cold"].tier == "dram"
    assert plan.hbm_bytes <= budget and plan.hbm_bytes > 0.98 * budget  # HBM is used up
    assert plan.to_pins() == (f"cold=dram:{plan['cold'].cache_rows}",)
    want = tier_plan.predict_hit_rate(cold.counts, plan["cold"].cache_rows, 256.0, policy)
    assert plan["cold"].hit_rate == pytest.approx(want, rel=1e-9)
    # twins but for traffic: the table read 4x as often gets the bigger cache
    a, b = _table("a", 50_000, lookups=1_000.0), _table("b", 50_000, lookups=250.0, seed=1)
    plan = tier_plan.place([a, b], hbm_bytes=a.nbytes // 2, dram_bytes=a.nbytes * 2, policy=policy)
    assert plan["a"].cache_rows > plan["b"].cache_rows >= 250


def test_greedy_allocation_is_near_the_best_split():
    """Two tables, every split of the HBM on a fine grid: the greedy plan's predicted hits per
    step are within 1% of the best split's."""
    a, b = _table("a", 40_000, s=1.1, lookups=800.0), _table("b", 60_000, s=0.7, lookups=300.0)
    budget = (a.nbytes + b.nbytes) // 4
    plan = tier_plan.place([a, b], hbm_bytes=budget, dram_bytes=budget * 8)
    got = _predicted_hits(a, plan["a"].cache_rows) + _predicted_hits(b, plan["b"].cache_rows)
    total_rows = budget // a.row_bytes
    best = max(
        _predicted_hits(a, ra) + _predicted_hits(b, total_rows - ra)
        for ra in np.linspace(800, min(a.num_rows, total_rows - 300), 200).astype(int)
    )
    assert got >= 0.99 * best, (got, best)


def test_backing_copies_go_to_ssd_when_dram_is_full():
    hot, cold = _table("hot", 10_000, s=1.3), _table("cold", 100_000, s=0.6)
    budget = (hot.nbytes + cold.nbytes) // 3
    plan = tier_plan.place([hot, cold], hbm_bytes=budget, dram_bytes=hot.nbytes + cold.nbytes)
    assert plan["hot"].tier in ("hbm", "dram") and plan["cold"].tier == "dram"
    assert plan["hot"].hit_rate > plan["cold"].hit_rate
    # DRAM for the small backing copy only: the large one goes to SSD, or fails without it
    plan = tier_plan.place([hot, cold], hbm_bytes=budget, dram_bytes=hot.nbytes)
    assert plan["cold"].tier == "ssd" and plan["cold"].ssd_bytes == cold.nbytes
    assert plan.dram_bytes <= hot.nbytes
    with pytest.raises(ValueError, match="table 'cold' .* ssd_ok is False"):
        tier_plan.place([hot, cold], hbm_bytes=budget, dram_bytes=hot.nbytes, ssd_ok=False)


def test_infeasible_hbm_names_the_table():
    small, big = _table("small", 1_000, lookups=100.0), _table("big", 100_000, lookups=5_000.0)
    with pytest.raises(ValueError, match="'big' needs a device cache of at least 5,000 rows"):
        tier_plan.place([small, big], hbm_bytes=3_000 * 132, dram_bytes=10**9)


def test_render_and_pins():
    hot, cold = _table("hot", 10_000, s=1.3), _table("cold_table", 100_000, s=0.6)
    whole = _table("whole", 1_000, lookups=5_000.0)  # min cache = all rows: always in HBM
    plan = tier_plan.place([hot, cold, whole], hbm_bytes=hot.nbytes, dram_bytes=10**8)
    lines = plan.render().splitlines()
    assert lines[0].split() == [
        "name",
        "rows",
        "tier",
        "cache",
        "rows",
        "cache",
        "MiB",
        "hit",
        "backing",
        "GiB",
    ]
    assert len({len(line) for line in lines[:5]}) == 1  # fixed width
    assert lines[3].split()[:3] == ["cold_table", "100,000", "dram"]
    assert lines[4].split()[:4] == ["whole", "1,000", "hbm", "1,000"]
    pins = [(n, *rest.split(":")) for n, rest in (pin.split("=") for pin in plan.to_pins())]
    assert pins == [(t.name, t.tier, str(t.cache_rows)) for t in plan.tables if t.tier != "hbm"]
    assert [n for n, *_ in pins] == ["hot", "cold_table"]


def test_tables_are_checked():
    with pytest.raises(ValueError, match="counts has shape"):
        tier_plan.TierTable(
            name="t", num_rows=10, row_bytes=4, counts=np.ones(9), lookups_per_step=1.0
        )
    with pytest.raises(ValueError, match="must be non-empty without"):
        tier_plan.TierTable(
            name="a=b", num_rows=10, row_bytes=4, counts=np.ones(10), lookups_per_step=1.0
        )
    t = _table("t", 100)
    with pytest.raises(ValueError, match="unique"):
        tier_plan.place([t, t], hbm_bytes=10, dram_bytes=10)


def test_the_plan_cli_proposes_tiers_that_hold_an_evaluation_batch():
    """``python -m recscale.plan PRESET --tiers``: pins for the tables that do not fit, each
    cache at least an evaluation batch's expected distinct rows; one line when nothing fits."""
    import dlrm.presets  # noqa: F401, PLC0415
    import tpu_gpu_configs  # noqa: PLC0415
    from recscale.config import get_preset  # noqa: PLC0415
    from recscale.plan_tiers import plan_tiers, table_access_counts  # noqa: PLC0415

    cfg, hw = get_preset("dlrm/synthetic"), tpu_gpu_configs.get("cpu-local")
    text = plan_tiers(cfg, hw, hbm_gib=0.0005)
    pins = text.splitlines()[-1].split()
    assert pins[0] == "--embeddings.tiers" and len(pins) > 1, text
    from data.schemas import schema_of  # noqa: PLC0415

    counts = table_access_counts(cfg, schema_of(cfg.data), 1)
    scale = cfg.data.eval_batch_size / cfg.data.batch_size
    for pin in pins[1:]:
        name, rest = pin.split("=")
        c, lookups = counts[name]
        assert int(rest.split(":")[1]) >= tier_plan.expected_distinct(c, lookups * scale), pin
    assert "no tiers needed" in plan_tiers(cfg, hw, hbm_gib=1.0)
    with pytest.raises(ValueError, match="'f0'"):
        plan_tiers(cfg, hw, hbm_gib=1e-5)
