"""A sweep's results as a table (``sweeps.analyze`` fits it): its rows flattened into a
DataFrame, what a sweep of stable runs and branches cost, and the grids the fits refuse."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pandas as pd

from sweeps.store import read_results

log = logging.getLogger("sweeps.analyze")


def load_results(sweep_dir: str | Path, *, all_rows: bool = False) -> pd.DataFrame:
    """The sweep's results as a DataFrame, one row per trial, metrics flattened
    (``final_logloss``, ``best_auc``, ...). Rows of trials not in the sweep's current
    ``sweep.json`` (an older code version or spec) are dropped unless ``all_rows``."""
    root = Path(sweep_dir)
    res = read_results(root / "results.jsonl")
    if res.truncated:
        log.warning("%s: skipped a truncated last line (its trial will be re-run)", root)
    rows = []
    for r in res.rows:
        flat = {k: v for k, v in r.items() if k not in ("final", "best", "config", "versions")}
        for which in ("final", "best"):
            for k, v in (r.get(which) or {}).items():
                if k not in ("split",):
                    flat[f"{which}_{k}"] = v
        flat["versions"] = json.dumps(r.get("versions"), sort_keys=True)
        flat["config"] = json.dumps(r.get("config"), sort_keys=True)
        rows.append(flat)
    df = pd.DataFrame(rows)
    sweep_json = root / "sweep.json"
    if not all_rows and sweep_json.exists() and len(df):
        current = set(json.loads(sweep_json.read_text())["trial_ids"])
        stale = ~df["trial_id"].isin(current)
        if stale.any():
            log.warning(
                "%d result rows belong to other versions of the sweep; not analysed",
                int(stale.sum()),
            )
            df = df[~stale]
    return df.reset_index(drop=True)


def learning_rate_search(df: pd.DataFrame) -> str:
    """Why ``df`` is not a grid this analysis fits (empty: it is): a cell (family, rung, budget)
    with runs of one seed at several learning rates, a search (``SweepSpec.lr_multipliers``),
    which the fits would average as if they were seeds."""
    if df.empty or "learning_rate" not in df:
        return ""
    keys = ["family", "rung", "budget", "seed"]
    rates = df.groupby(keys)["learning_rate"].nunique()
    if (rates <= 1).all():
        return ""
    family, rung, budget, seed = rates[rates > 1].index[0]
    return (
        f"{family} {rung} at budget {budget:.3g}, seed {seed}, ran at "
        f"{int(rates.max())} learning rates: a learning-rate search, which these fits would "
        "average as seeds; compare its rates per cell, or make each rate a family (``@lr`` "
        "variants, as sweeps.specs.study_lr)"
    )


def branch_cost(df: pd.DataFrame) -> dict[str, Any]:
    """What a sweep of stable runs and cooldown branches (``SweepSpec.branches``) cost against
    what its points stand for: the training FLOPs of its points (each a whole run of its
    budget) and those it ran (a branch's own steps only), and the summed trial wall time."""
    branch = df["branch_of"].notna()
    points, ran = float(df["compute"].sum()), float(df["own_compute"].sum())
    return {
        "runs": int((~branch).sum()),
        "branches": int(branch.sum()),
        "points_compute": points,
        "run_compute": ran,
        "points_per_run_compute": points / ran,
        "wall_time_s": float(df["wall_time_s"].sum()),
    }
