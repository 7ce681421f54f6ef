"""``python -m recscale.plan PRESET --hardware NAME --tiers``: which tables stay in device
memory and which get a cache over host DRAM or SSD (``recscale.embeddings.tier_plan.place``),
from the tables' access counts."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import tpu_gpu_configs
from data.schemas import schema_of
from recscale.embeddings import engine, plan_inputs
from recscale.embeddings.planner import OPTIMIZER_STATE_BYTES
from tpu_gpu_configs.profiles import get_profile


def table_access_counts(cfg: Any, schema: Any, sample_batches: int) -> dict[str, tuple]:
    """Per table ``(counts, lookups per step)``: synthetic data from its Zipf law (exact
    probabilities by rank: hit rates do not depend on which row has which rank); other data
    from the ids of ``sample_batches`` training batches (``plan_inputs.sampled_ids``)."""
    batch = cfg.data.batch_size
    if cfg.data.kind == "synthetic":
        syn = cfg.data.synthetic
        out = {}
        for f in schema.features:
            h = f.max_hotness
            mean_bag = h if syn.pooling == "fixed" else (h + 1) / 2
            ranks = np.arange(f.vocab_size, dtype=np.float64)
            out[f.table_name] = (np.power(ranks + 1.0, -syn.zipf_exponent), batch * mean_bag)
        return out
    rows = {f.table_name: f.vocab_size for f in schema.features}
    out = {}
    for t, halves in plan_inputs.sampled_ids(cfg.data, sample_batches).items():
        ids = np.concatenate(halves)
        out[t] = (np.bincount(ids, minlength=rows[t]), ids.size / sample_batches)
    return out


def plan_tiers(
    cfg: Any,
    hw: tpu_gpu_configs.LaunchPreset,
    *,
    hbm_gib: float = 0.0,
    dram_gib: float = 64.0,
    policy: str = "lru",
    sample_batches: int = 64,
) -> str:
    """The tier planner's placement (``recscale.embeddings.tier_plan.place``) of ``cfg``'s
    tables on ``hw``: device memory ``hbm_gib`` (0: the hardware's, all devices), host RAM
    ``dram_gib``; returns the rendered plan and the ``--embeddings.tiers`` it asks for."""
    from recscale.embeddings import tier_plan  # noqa: PLC0415

    schema = schema_of(cfg.data)
    dim = cfg.model.embed_dim
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.embeddings.storage_dtype]
    per_row, per_element = OPTIMIZER_STATE_BYTES[cfg.embedding_optim.name]
    row_bytes = dim * (itemsize + per_element) + per_row
    access = table_access_counts(cfg, schema, sample_batches)
    # a cache must also hold an evaluation batch's distinct rows (expected, plus 10% and 4 sd
    # of a Poisson count: the trainer stops with a clear error on a batch that does not fit)
    scale = cfg.data.eval_batch_size / cfg.data.batch_size
    tables = []
    for t, (c, lookups) in access.items():
        d = tier_plan.expected_distinct(c, lookups * scale) if scale > 1 else 0.0
        tables.append(
            tier_plan.TierTable(
                name=t,
                num_rows=len(c),
                row_bytes=row_bytes,
                counts=c,
                lookups_per_step=lookups,
                min_rows=math.ceil(1.1 * d + 4 * math.sqrt(d)),
            )
        )
    devices = hw.num_hosts * hw.devices_per_host
    hbm = (
        hbm_gib * 2**30
        if hbm_gib
        else get_profile(hw.profile or engine.default_profile()).memory_bytes * devices
    )
    plan = tier_plan.place(
        tables, hbm_bytes=int(hbm), dram_bytes=int(dram_gib * 2**30), policy=policy
    )
    pins = plan.to_pins()
    return plan.render() + (
        f"\n--embeddings.tiers {' '.join(pins)}"
        + (" --embeddings.tier-policy lfu" if policy == "lfu" else "")
        if pins
        else "\nevery table fits in device memory: no tiers needed"
    )
