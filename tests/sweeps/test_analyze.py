"""``python -m sweeps.analyze`` on a sweep directory with known scaling laws."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest

from sweeps import analyze
from sweeps.store import SweepStore

# Per family: L = c + a (C/C0)^-b at its best size; other sizes are worse by a known
# parabola in log10(FLOPs/example) around an optimum that grows with the budget.
LAWS = {"wukong": (0.30, 0.25, 0.40), "dlrm": (0.25, 0.15, 0.45)}
BUDGETS = np.geomspace(1e10, 1e12, 5)


def _opt_size(budget):
    return 1e4 * (budget / 1e10) ** 0.5


def make_sweep(root, *, diverged=True, noise=0.002, seed=0):
    rng = np.random.default_rng(seed)
    store = SweepStore(root)
    ids = []
    for fam, (a, b, c) in LAWS.items():
        for bi, budget in enumerate(BUDGETS):
            for ri, size in enumerate(_opt_size(budget) * np.array([0.25, 1.0, 4.0])):
                y = (
                    c
                    + a * (budget / BUDGETS[0]) ** -b
                    + 0.02 * np.log10(size / _opt_size(budget)) ** 2
                )
                y *= np.exp(rng.normal(0, noise))
                tid = f"{fam}-{bi}-{ri}"
                ids.append(tid)
                store.append_result({
                    "trial_id": tid, "status": "SUCCESS", "family": fam, "rung": f"r{ri}",
                    "rung_index": ri, "budget": float(budget), "compute": float(budget),
                    "flops_per_example": float(size), "steps": 100, "params_dense": 10,
                    "wall_time_s": 1.0, "final": {"logloss": float(y), "auc": 0.7, "step": 100},
                    "best": {"logloss": float(y), "auc": 0.7, "step": 100}, "config": {},
                    "versions": {}, "diverged_at_step": None,
                })  # fmt: skip
    if diverged:
        ids.append("boom")
        store.append_result({
            "trial_id": "boom", "status": "DIVERGED", "family": "dlrm", "rung": "r9",
            "rung_index": 9, "budget": float(BUDGETS[-1]), "compute": float(BUDGETS[-1]),
            "flops_per_example": 1e9, "steps": 100, "params_dense": 10, "wall_time_s": 1.0,
            "final": None, "best": None, "config": {}, "versions": {}, "diverged_at_step": 7,
            "error": "FloatingPointError: non-finite training loss nan at step 7",
        })  # fmt: skip
    (root / "sweep.json").write_text(json.dumps({"name": "t", "metric": "logloss",
                                                 "trial_ids": ids}))  # fmt: skip
    return store


def test_analyze_cli_recovers_laws_writes_plots_and_exports(tmp_path, caplog):
    make_sweep(tmp_path)
    with caplog.at_level(logging.WARNING, logger="sweeps.analyze"):
        out = analyze.main([str(tmp_path), "--parquet", "--n-boot", "300"])
    # DIVERGED is excluded from fits, and the reason is logged.
    assert "excluded from fits: trial boom" in caplog.text and "step 7" in caplog.text
    assert [e["trial_id"] for e in out["excluded"]] == ["boom"]
    for fam, (_a, b, c) in LAWS.items():
        d = out["families"][fam]
        assert len(d["frontier"]) == 5
        lo, hi = d["law"]["intervals"]["b"]
        assert lo < b < hi, (fam, d["law"])
        assert abs(d["law"]["b"] - b) < 0.05 and abs(d["law"]["c"] - c) < 0.02
        assert abs(d["holdout"]["rel_error"]) < 0.01
        # IsoFLOP: the optimum at each budget is recovered (the middle size), interior.
        for iso in d["isoflop"]:
            assert iso["interior"]
            assert iso["size_opt"] == pytest.approx(_opt_size(iso["budget"]), rel=0.15)
        assert d["optimal_size_law"]["alpha"] == pytest.approx(0.5, abs=0.05)
    for name in ("scaling.png", "isoflop.png", "results.csv", "results.parquet", "analysis.json"):
        assert (tmp_path / name).stat().st_size > 1000 or name == "analysis.json"
    df = pd.read_parquet(tmp_path / "results.parquet")
    assert len(df) == 31 and set(df["status"]) == {"SUCCESS", "DIVERGED"}
    assert json.loads((tmp_path / "analysis.json").read_text())["families"].keys() == LAWS.keys()


def test_results_of_other_sweep_versions_are_not_analysed(tmp_path, caplog):
    make_sweep(tmp_path, diverged=False)
    SweepStore(tmp_path).append_result({"trial_id": "old", "status": "SUCCESS", "family": "dlrm"})
    with caplog.at_level(logging.WARNING, logger="sweeps.analyze"):
        df = analyze.load_results(tmp_path)
    assert "old" not in set(df["trial_id"]) and len(df) == 30
    assert "1 result rows belong to other versions" in caplog.text
    assert len(analyze.load_results(tmp_path, all_rows=True)) == 31


def test_truncated_results_line_is_reported_not_fatal(tmp_path, caplog):
    make_sweep(tmp_path, diverged=False)
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"trial_id": "half')
    with caplog.at_level(logging.WARNING, logger="sweeps.analyze"):
        df = analyze.load_results(tmp_path)
    assert len(df) == 30 and "truncated last line" in caplog.text
