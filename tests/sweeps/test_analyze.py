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
                store.append_result(
                    {
                        "trial_id": tid,
                        "status": "SUCCESS",
                        "family": fam,
                        "rung": f"r{ri}",
                        "rung_index": ri,
                        "budget": float(budget),
                        "compute": float(budget),
                        "flops_per_example": float(size),
                        "steps": 100,
                        "params_dense": 10,
                        "wall_time_s": 1.0,
                        "final": {"logloss": float(y), "auc": 0.7, "step": 100},
                        "best": {"logloss": float(y), "auc": 0.7, "step": 100},
                        "config": {},
                        "versions": {},
                        "diverged_at_step": None,
                    }
                )
    if diverged:
        ids.append("boom")
        store.append_result(
            {
                "trial_id": "boom",
                "status": "DIVERGED",
                "family": "dlrm",
                "rung": "r9",
                "rung_index": 9,
                "budget": float(BUDGETS[-1]),
                "compute": float(BUDGETS[-1]),
                "flops_per_example": 1e9,
                "steps": 100,
                "params_dense": 10,
                "wall_time_s": 1.0,
                "final": None,
                "best": None,
                "config": {},
                "versions": {},
                "diverged_at_step": 7,
                "error": "FloatingPointError: non-finite training loss nan at step 7",
            }
        )
    (root / "sweep.json").write_text(
        json.dumps({"name": "t", "metric": "logloss", "trial_ids": ids})
    )
    return store


def test_analyze_cli_recovers_laws_writes_plots_and_exports(tmp_path, caplog, monkeypatch):
    make_sweep(tmp_path)
    # This grid's losses are parabolas in log size, not the loss surface's form: its bootstrap
    # would grind through ill-posed refits here. The surface has its own tests (test_surface.py).
    monkeypatch.setattr(analyze, "_loss_surface", lambda per, **kw: {"loss_surface": {}})
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


def make_seeded_sweep(root, *, floor=0.4, seeds=3, grid=False):
    """A seeded IsoFLOP grid (or, with ``grid``, a sparse/dense grid at 2 budgets) whose losses
    follow known laws, as results rows and a sweep.json."""
    rng = np.random.default_rng(5)
    store = SweepStore(root)
    ids = []
    cells = []
    if grid:
        for bi, budget in enumerate((1e10, 1e11)):
            for d, psp in (("d8/rows100", 800), ("d8/rowsall", 8000), ("d16/rowsall", 16000)):
                for dense, fpe in (("S", 1e4), ("M", 3e4)):
                    # best: the most sparse parameters with the small dense part at 1e10, the
                    # large one at 1e11
                    y = 0.6 - 0.02 * np.log10(psp) - (0.01 if (dense == "M") == (bi == 1) else 0)
                    cells.append((budget, f"{d}/{dense}", fpe, psp, y))
    else:
        for budget in np.geomspace(1e9, 1e12, 7):
            for ri, size in enumerate(1e4 * (budget / 1e9) ** 0.5 * np.array([0.3, 1.0, 3.0])):
                y = (
                    floor
                    + 0.3 * (budget / 1e9) ** -0.2
                    + 0.05 * np.log10(size / (1e4 * (budget / 1e9) ** 0.5)) ** 2
                )
                cells.append((budget, f"r{ri}", size, 1000, y))
    for k, (budget, rung, fpe, psp, y) in enumerate(cells):
        for seed in range(seeds):
            tid = f"t{k}-{seed}"
            ids.append(tid)
            v = float(y * np.exp(rng.normal(0, 0.002)))
            store.append_result(
                {
                    "trial_id": tid,
                    "status": "SUCCESS",
                    "family": "wukong",
                    "rung": rung,
                    "rung_index": k,
                    "budget": float(budget),
                    "compute": float(budget),
                    "flops_per_example": float(fpe),
                    "steps": 100,
                    "params_dense": 10,
                    "params_sparse": psp,
                    "wall_time_s": 1.0,
                    "seed": seed,
                    "final": {"logloss": v, "auc": 0.7, "step": 100},
                    "best": {"logloss": v, "auc": 0.7, "step": 100},
                    "config": {},
                    "versions": {},
                    "diverged_at_step": None,
                }
            )
    spec = {"analyses": ["sparse_dense"]} if grid else {}
    (root / "sweep.json").write_text(
        json.dumps({"name": "t", "metric": "logloss", "trial_ids": ids, "spec": spec})
    )


def test_seeded_sweep_gets_seed_intervals_and_a_fixed_floor_law(tmp_path, monkeypatch):
    make_seeded_sweep(tmp_path)
    monkeypatch.setattr(analyze, "bayes_reference_of", lambda df, metric: 0.4)
    out = analyze.main([str(tmp_path), "--n-boot", "200"])
    d = out["families"]["wukong"]
    assert d["intervals_from"] == "bootstrap over seeds" and d["seeds_per_point"] == 3
    for key in ("law", "law_bayes_floor"):  # coverage itself is tested in test_fit
        lo, hi = d[key]["intervals"]["b"]
        assert lo < d[key]["b"] < hi and abs(d[key]["b"] - 0.2) < 0.02, (key, d[key])
    assert np.subtract(*d["law_bayes_floor"]["intervals"]["b"][::-1]) < np.subtract(
        *d["law"]["intervals"]["b"][::-1]
    )
    assert d["law_bayes_floor"]["c"] == 0.4 and d["law_bayes_floor"]["floor_fixed"]
    assert d["holdout_bayes_floor"]["rel_error"] < 0.005
    osl = d["optimal_size_law"]
    assert osl["alpha"] == pytest.approx(0.5, abs=0.1)
    assert osl["alpha_interval"][0] < 0.5 < osl["alpha_interval"][1]
    for name in ("scaling.png", "isoflop.png", "optimal_size.png", "residuals.png"):
        assert (tmp_path / name).stat().st_size > 1000
    # Regenerating gives the same bytes (the committed study results are reproduced so).
    first = {
        p.name: p.read_bytes() for p in tmp_path.iterdir() if p.suffix in (".json", ".csv", ".png")
    }
    analyze.main([str(tmp_path), "--n-boot", "200"])
    assert first == {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name in first}


def test_sparse_dense_grid_finds_the_best_cell_per_budget(tmp_path):
    make_seeded_sweep(tmp_path, seeds=1, grid=True)
    out = analyze.main([str(tmp_path), "--n-boot", "50"])
    best = {b["budget"]: b["best"] for b in out["sparse_dense"]["wukong"]}
    assert (best[1e10]["embedding"], best[1e10]["dense"]) == ("d16/rowsall", "S")
    assert (best[1e11]["embedding"], best[1e11]["dense"]) == ("d16/rowsall", "M")
    assert len(out["sparse_dense"]["wukong"][0]["cells"]) == 6
    assert (tmp_path / "sparse_dense.png").stat().st_size > 1000


def test_quality_vs_size_of_a_fixed_data_sweep(tmp_path, capsys):
    store = SweepStore(tmp_path)
    ids = []
    for ri, (fpe, ll) in enumerate(((1e4, 0.20), (1e5, 0.15), (1e6, 0.16))):
        for seed in range(3):
            tid = f"r{ri}-{seed}"
            ids.append(tid)
            v = ll + 0.001 * seed
            store.append_result(
                {
                    "trial_id": tid,
                    "status": "SUCCESS",
                    "family": "dlrm",
                    "rung": f"d{ri}",
                    "rung_index": ri,
                    "budget": 1.0,
                    "compute": fpe * 1e6,
                    "flops_per_example": fpe,
                    "steps": 100,
                    "params_dense": 10,
                    "params_sparse": 100,
                    "wall_time_s": 1.0,
                    "final": {"logloss": v + 0.01, "auc": 0.9},
                    "best": {"logloss": v, "auc": 0.95},
                    "config": {},
                    "versions": {},
                    "diverged_at_step": None,
                }
            )
    (tmp_path / "sweep.json").write_text(
        json.dumps(
            {
                "name": "f",
                "metric": "logloss",
                "trial_ids": ids,
                "spec": {"analyses": ["quality_vs_size"]},
            }
        )
    )
    out = analyze.main([str(tmp_path), "--n-boot", "20"])
    rows = out["quality_vs_size"]["dlrm"]
    assert [r["rung"] for r in rows] == ["d0", "d1", "d2"]
    assert rows[1]["best_logloss"] == pytest.approx(0.151) and rows[1]["best_logloss_sd"] > 0
    assert rows[1]["final_logloss"] == pytest.approx(0.161)
    assert (tmp_path / "quality_vs_size.png").stat().st_size > 1000
    assert not (tmp_path / "scaling.png").exists()  # one budget: no compute laws to plot
    printed = capsys.readouterr().out  # nor a table of laws that cannot be fitted
    assert "one compute budget: no scaling laws" in printed
    assert "scaling laws:" not in printed and "need at least" not in printed
    assert "dlrm: best eval logloss by size d0 0.2010" in printed


def test_bayes_reference_reads_the_generator_from_the_results():
    """The teacher's eval logloss, from the results' configs alone (no trial folders), the same
    for trials that differ only in batching or table caps; None for mixed datasets."""
    from data.config import DataConfig, SyntheticConfig  # noqa: PLC0415
    from data.synthetic import EVAL_INDEX_OFFSET, SyntheticGenerator  # noqa: PLC0415
    from recscale import config as config_lib  # noqa: PLC0415

    syn = SyntheticConfig(vocab_sizes=(50, 20), max_hotness=(2, 1), num_eval_examples=2000)
    a = DataConfig(kind="synthetic", batch_size=64, synthetic=syn)
    b = DataConfig(
        kind="synthetic", batch_size=128, synthetic=syn, max_table_rows=10, id_policy="hash"
    )
    df = pd.DataFrame({"config": [json.dumps({"data": config_lib.to_dict(d)}) for d in (a, b)]})
    g = SyntheticGenerator(syn, 0)
    idx = EVAL_INDEX_OFFSET + np.arange(2000)
    z, y = g.teacher_logits(idx), g.examples(idx).labels_b
    assert analyze.bayes_reference_of(df, "logloss") == pytest.approx(
        np.mean(np.logaddexp(0, z) - y * z), rel=1e-12
    )
    other = DataConfig(kind="synthetic", synthetic=syn, shuffle_seed=1)
    df2 = pd.DataFrame(
        {"config": [json.dumps({"data": config_lib.to_dict(d)}) for d in (a, other)]}
    )
    assert analyze.bayes_reference_of(df2, "logloss") is None


def test_a_learning_rate_search_is_not_fitted_as_seeds():
    import pandas as pd  # noqa: PLC0415

    from sweeps.table import learning_rate_search  # noqa: PLC0415

    row = {"family": "dlrm", "rung": "d1", "budget": 1e10, "seed": 0, "learning_rate": 1e-3}
    seeds = pd.DataFrame([row, {**row, "seed": 1}])
    assert learning_rate_search(seeds) == ""
    search = pd.DataFrame([row, {**row, "learning_rate": 3e-3}])
    assert "dlrm d1 at budget 1e+10, seed 0, ran at 2 learning rates" in learning_rate_search(
        search
    )
