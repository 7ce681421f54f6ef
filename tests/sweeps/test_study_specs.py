"""The scaling study's specs (``sweeps/specs/study*.py``) against what is committed under ``docs/``.

Resolving a spec needs no jax and no data, so this runs in a second: it guards the promise that a
relaunch of any of them skips the trials whose results are committed (the trial ids the spec
resolves to are the ones ``docs/<study>/sweep.json`` records), and the study's design as issue 15
set it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sweeps import spec as spec_lib

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _check_committed(name):
    res = spec_lib.resolve(spec_lib.load_spec(f"sweeps.specs.{name}"))
    committed = json.loads((DOCS / name / "sweep.json").read_text())["trial_ids"]
    assert [t.trial_id for t in res.trials] == committed


@pytest.mark.parametrize(
    "name",
    [
        "study",
        "study_lr",
        "study_grid",
        "study_check",
        "study_pilot",
        "study_pilot_lr",
        "study_opt",
        "study_opt_check",
        "study_opt_1e12",
    ],
)
def test_spec_resolves_to_the_committed_trials(name):
    _check_committed(name)


def test_frappe_arm_resolves_to_the_committed_trials(frappe_dir, monkeypatch):
    # Its trial ids hash the data files (``identity.data_fingerprint``), read where the presets
    # point: ../shared/data/frappe from the repository root.
    monkeypatch.chdir(DOCS.parent)
    _check_committed("study_frappe")


def test_the_study_spans_three_decades_with_seeded_isoflop_grids():
    sp = spec_lib.load_spec("sweeps.specs.study")
    res = spec_lib.resolve(sp)
    budgets = np.array(sp.budgets)
    assert len(budgets) >= 7 and budgets.max() / budgets.min() >= 1e3
    assert len(sp.seeds) >= 3
    for fam in sp.families:
        assert len(fam.ladder) >= 6
        dims = [r.model.get("embed_dim") for r in fam.ladder]
        assert dims == sorted(dims) and dims[-1] > dims[0], (fam.family, dims)  # d grows too
        trials = [t for t in res.trials if t.family == fam.family]
        for b in budgets:
            sizes = {t.rung for t in trials if t.budget == b}
            assert len(sizes) >= 4, (fam.family, b, sizes)


def test_frappe_rerun_on_another_cpu_agrees_within_seed_noise():
    """``docs/study_frappe_rerun`` is the Frappe arm's 60 trials run again on another CPU model
    (README): the same trial ids, and each size's 3-seed mean best logloss within 3 standard
    errors of the committed run's (single trials differ: XLA:CPU compiles per instruction set)."""

    def by_trial(name):
        rows = [json.loads(x) for x in (DOCS / name / "results.jsonl").read_text().splitlines()]
        return {r["trial_id"]: r for r in rows if r["status"] == "SUCCESS"}

    first, rerun = by_trial("study_frappe"), by_trial("study_frappe_rerun")
    assert len(rerun) == 60 and set(rerun) <= set(first)
    assert set(rerun) == set(
        json.loads((DOCS / "study_frappe" / "sweep.json").read_text())["trial_ids"]
    )
    groups: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for tid, r in rerun.items():
        a, b = groups.setdefault((r["family"], r["rung"]), ([], []))
        a.append(first[tid]["best"]["logloss"])
        b.append(r["best"]["logloss"])
    assert len(groups) == 20
    for key, (a, b) in groups.items():
        se = np.sqrt(np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b))
        assert abs(np.mean(a) - np.mean(b)) <= 3 * se, (key, np.mean(a), np.mean(b), se)
    assert any(first[t]["best"] != r["best"] for t, r in rerun.items())  # not a copy


def test_the_study_at_the_optimum_is_a_full_seeded_grid_around_the_pilots_best_sizes():
    """``sweeps.specs.study_opt``: every size at every budget, 3 seeds as populations of one
    size's runs, one stable run per (size, seed), and every pilot's best size (each family, each
    pilot budget) within the family's ladder, at its smallest size only where the family has no
    smaller working one (DCNv2's and FinalMLP's d = 2, DLRM's floor)."""
    sp = spec_lib.load_spec("sweeps.specs.study_opt")
    res = spec_lib.resolve(sp)
    assert sp.branches and sp.populations and sp.seeds == (0, 1, 2)
    assert len(sp.budgets) == 7 and np.allclose(np.diff(np.log10(sp.budgets)), 0.25)
    stable = [t for t in res.trials if not t.branch_of]
    assert len(res.trials) == 7 * 20 * 3 and len(stable) == 20 * 3
    assert {t.budget for t in stable} == {max(sp.budgets)}
    members: dict[tuple[str, ...], list[int]] = {}
    for t in res.trials:
        members.setdefault(t.population, []).append(t.seed)
    assert sorted(map(sorted, members.values())) == [[0, 1, 2]] * 140
    rows = [
        json.loads(x) for x in (DOCS / "study_pilot" / "results.jsonl").read_text().splitlines()
    ]
    for fam in sp.families:
        fpe = sorted({t.flops_per_example for t in res.trials if t.family == fam.family})
        assert len(fpe) == 5
        pilot = [r for r in rows if r["family"] == fam.family and r["status"] == "SUCCESS"]
        for b in {r["budget"] for r in pilot}:
            best = min((r for r in pilot if r["budget"] == b), key=lambda r: r["final"]["logloss"])
            smallest_working = min(
                r["flops_per_example"] for r in pilot if r["final"]["logloss"] < 0.54
            )
            assert fpe[0] <= best["flops_per_example"] < fpe[-1], (fam.family, b)
            if best["flops_per_example"] == fpe[0]:
                assert fpe[0] == smallest_working, (fam.family, b)


def test_the_study_to_1e12_reuses_study_opt_and_adds_a_seeded_slice_at_1e12():
    """``sweeps.specs.study_opt_1e12``: every ``study_opt`` trial by id, and at 1e12 at least
    three sizes of every family (the sizes under ``max_steps``), each size's three seeds one
    population and a new stable run whose smaller budgets are ``study_opt``'s branches."""
    sp = spec_lib.load_spec("sweeps.specs.study_opt_1e12")
    res = spec_lib.resolve(sp)
    opt = json.loads((DOCS / "study_opt" / "sweep.json").read_text())["trial_ids"]
    ids = [t.trial_id for t in res.trials]
    assert set(opt) <= set(ids) and len(ids) == len(opt) + 42
    top = [t for t in res.trials if t.budget == 1e12]
    assert {t.trial_id for t in top}.isdisjoint(opt) and all(not t.branch_of for t in top)
    assert max(t.steps for t in res.trials if t.budget < 1e12) < sp.max_steps
    for fam in sp.families:
        sizes = {t.rung for t in top if t.family == fam.family}
        assert len(sizes) >= 3, (fam.family, sizes)
        for rung in sizes:
            members = [t for t in top if t.family == fam.family and t.rung == rung]
            assert sorted(t.seed for t in members) == [0, 1, 2]
            assert len({t.population for t in members}) == 1
            # the size's branches below 1e12 branch off this stable run
            branches = [
                t
                for t in res.trials
                if t.family == fam.family and t.rung == rung and t.budget < 1e12
            ]
            assert {t.branch_of for t in branches} <= {t.trial_id for t in members}
