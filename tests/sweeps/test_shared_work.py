"""Sweeps that share work between trials (``sweeps.grouping``): the budgets of one size as one
stable run and its cooldown branches (``SweepSpec.branches``), the seeds of a point as one
population (``SweepSpec.populations``). How a spec resolves, how workers wait for and settle
branches and run populations, and end-to-end sweeps whose rows are those of the separate runs
they stand for."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sweeps import analyze
from sweeps.runner import WorkerOptions, run_worker
from sweeps.spec import FamilySpec, SweepSpec, dlrm_ladder, resolve
from sweeps.store import SweepStore, read_results
from tests.sweeps.test_launch import STEP_FLOPS_D1, run_launch, write_spec

WSD = {
    "dense_optim.decay": "wsd",
    "embedding_optim.decay": "wsd",
    "dense_optim.learning_rate": 3e-3,
}


def spec(
    *, steps=(10, 20, 40), seeds=(0, 1), overrides=WSD, branches=True, populations=False
) -> SweepSpec:
    return SweepSpec(
        name="b",
        families=(
            FamilySpec(
                family="dlrm",
                preset="dlrm/tiny",
                ladder=dlrm_ladder(((4, (8, 4), (8, 1)),)),
                overrides=overrides,
            ),
        ),
        budgets=tuple(s * STEP_FLOPS_D1 for s in steps),
        seeds=seeds,
        min_steps=5,
        branches=branches,
        populations=populations,
        code_version="test",
    )


def test_a_size_resolves_to_one_stable_run_and_its_branches():
    res = resolve(spec())
    assert len(res.trials) == 6
    for seed in (0, 1):
        ts = sorted((t for t in res.trials if t.seed == seed), key=lambda t: t.steps)
        assert [t.steps for t in ts] == [10, 20, 40]
        stable, branches = ts[-1], ts[:-1]
        # 20% 1-sqrt cooldowns: the 10- and 20-step budgets decay from steps 8 and 16
        assert [b.branch_step for b in branches] == [8, 16]
        assert all(b.branch_of == stable.trial_id for b in branches)
        assert not stable.branch_of and stable.config["train"]["branch_steps"] == [8, 16]
        # one warmup for the whole size: 5% of its shortest budget's steps, rounded
        warmups = {
            t.config[o]["warmup_steps"] for t in ts for o in ("dense_optim", "embedding_optim")
        }
        assert warmups == {round(0.05 * 10)}
        # what a branch trains with: its one-piece config, from the stable run's checkpoint
        run = branches[0].run_config("/sweep/stable/run")
        assert run["train"]["init_from"] == "/sweep/stable/run" and run["train"]["init_step"] == 8
        assert branches[0].config["train"]["init_from"] == ""
        assert branches[0].own_compute == branches[0].compute * (10 - 8) / 10


def test_a_branch_has_the_id_of_the_one_piece_run_it_equals():
    # Without branches, a sweep of the shortest budget alone resolves to the same run (same
    # warmup, same schedule), so it must be the same trial: the results store sees one point.
    branched = {t.steps: t for t in resolve(spec(seeds=(0,))).trials}
    alone = resolve(spec(steps=(10,), seeds=(0,), branches=False)).trials
    assert [t.trial_id for t in alone] == [branched[10].trial_id]


def test_branches_refuse_a_schedule_that_depends_on_the_runs_length():
    cosine = {**WSD, "dense_optim.decay": "cosine"}
    with pytest.raises(ValueError, match="branches need dense_optim.decay 'wsd'"):
        resolve(spec(overrides=cosine))
    with pytest.raises(ValueError, match="steps_per_trial"):
        dataclasses.replace(spec(), steps_per_trial=10)


@pytest.mark.parametrize(
    ("stable_status", "error", "diverged_at"),
    [
        ("FAILED", "Traceback ... boom", None),
        ("DIVERGED", "non-finite training loss nan at step 5", 5),
    ],
)
def test_a_branch_whose_stable_run_ended_before_its_point_ends_the_same_way(
    tmp_path, stable_status, error, diverged_at
):
    store = SweepStore(tmp_path)
    stable, branch, _ = sorted(resolve(spec(seeds=(0,))).trials, key=lambda t: -t.steps)
    opts = WorkerOptions(wait=False)
    # A worker finds the branch not ready (no checkpoint at its point) and claims nothing.
    assert run_worker(str(tmp_path), [branch.to_dict()], opts)["ran"] == 0
    assert store.results() == []
    store.append_result({"trial_id": stable.trial_id, "status": stable_status, "error": error})
    assert run_worker(str(tmp_path), [branch.to_dict()], opts)["ran"] == 0  # settled, not run
    (row,) = [r for r in store.results() if r["trial_id"] == branch.trial_id]
    assert row["status"] == stable_status and row["diverged_at_step"] == diverged_at
    assert f"stable run {stable.trial_id} ended {stable_status}" in row["error"]
    assert not (store.trial_dir(branch.trial_id) / "train.log").exists()


@pytest.mark.slow
def test_a_branched_sweep_gives_the_rows_of_its_one_piece_runs(tmp_path):
    overrides = {**WSD, "embeddings.sharding": "auto"}
    budgets = [s * STEP_FLOPS_D1 for s in (10, 20, 40)]
    path = write_spec(tmp_path / "spec.py", budgets=budgets, overrides=overrides)
    text = path.read_text().replace("code_version=", "branches=True, code_version=")
    path.write_text(text)
    sweep = tmp_path / "sw"
    assert run_launch(path, sweep)["statuses"] == {"SUCCESS": 3}
    got = {r["steps"]: r for r in read_results(sweep / "results.jsonl").rows}
    stable = got[40]
    assert stable["branch_of"] is None and stable["own_steps"] == 40
    for steps, start in ((10, 8), (20, 16)):
        r = got[steps]
        assert r["branch_of"] == stable["trial_id"] and r["shared_steps"] == start
        assert r["own_steps"] == steps - start and r["resumed_from_step"] == 0
        assert r["final"]["step"] == steps
        record = json.loads((SweepStore(sweep).workdir(r["trial_id"]) / "branch.json").read_text())
        assert record["init_step"] == start and record["own_steps"] == steps - start
    cost = analyze.analyze(analyze.load_results(sweep), "logloss", n_boot=10)["cost"]
    assert (cost["runs"], cost["branches"]) == (1, 2)
    assert cost["points_per_run_compute"] == pytest.approx((10 + 20 + 40) / (2 + 4 + 40))
    # The 10-step budget run alone (no branches: its own warmup and schedule are the same).
    alone = write_spec(tmp_path / "alone.py", budgets=budgets[:1], overrides=overrides)
    assert run_launch(alone, tmp_path / "alone")["statuses"] == {"SUCCESS": 1}
    (row,) = read_results(tmp_path / "alone" / "results.jsonl").rows
    assert row["trial_id"] == got[10]["trial_id"]
    assert row["final"] == got[10]["final"]  # bit for bit, every metric


def test_the_seeds_of_a_point_resolve_to_one_population():
    plain = {(t.steps, t.seed): t for t in resolve(spec(seeds=(0, 1, 2))).trials}
    trials = resolve(spec(seeds=(0, 1, 2), populations=True)).trials
    assert {(t.steps, t.seed): t.trial_id for t in trials} == {
        k: t.trial_id for k, t in plain.items()
    }  # the ids of the separate runs
    for steps in (10, 20, 40):
        members = [t for t in trials if t.steps == steps]
        assert {t.population for t in members} == {tuple(sorted(t.trial_id for t in members))}
    # branches of one budget, from each seed's own stable run, in one population
    assert {t.branch_step for t in trials if t.steps == 10} == {8}
    assert resolve(spec(seeds=(0,), populations=True)).trials[0].population == ()
    # learning-rate multipliers of one recipe: one population too (members differ in rates)
    lrs = dataclasses.replace(
        spec(seeds=(0,), populations=True), lr_rules=("none",), lr_multipliers=(0.5, 1.0, 2.0)
    )
    trials = resolve(lrs).trials
    for steps in (10, 20, 40):
        members = [t for t in trials if t.steps == steps]
        assert sorted(t.lr_multiplier for t in members) == [0.5, 1.0, 2.0]
        assert len({t.population for t in members}) == 1 and len(members[0].population) == 3


@pytest.mark.slow
def test_a_sweep_of_populations_gives_the_rows_of_its_separate_runs(tmp_path):
    overrides = {**WSD, "embeddings.sharding": "auto"}
    budgets = [s * STEP_FLOPS_D1 for s in (10, 20)]
    rows = {}
    for name, extra in (("pop", "populations=True, "), ("alone", "")):
        path = write_spec(tmp_path / f"{name}.py", budgets=budgets, overrides=overrides)
        text = path.read_text().replace(
            "code_version=", f"branches=True, {extra}seeds=(0, 1), code_version="
        )
        path.write_text(text)
        assert run_launch(path, tmp_path / name)["statuses"] == {"SUCCESS": 4}
        rows[name] = {
            r["trial_id"]: r for r in read_results(tmp_path / name / "results.jsonl").rows
        }
    assert rows["pop"].keys() == rows["alone"].keys()
    store = SweepStore(tmp_path / "pop")
    for tid, r in rows["pop"].items():
        want = rows["alone"][tid]["final"]
        # each member equals its run to float32 rounding (tests/recscale/test_population.py)
        assert r["final"]["logloss"] == pytest.approx(want["logloss"], rel=1e-5)
        (attempt,) = store.attempts(tid)
        assert attempt["population"] == 2
        assert "in a population of 2" in (store.trial_dir(tid) / "train.log").read_text()
    # Two populations (the stable runs, then the branches), each one process: two logs.
    assert len(list((tmp_path / "pop" / "populations").glob("*.log"))) == 2
