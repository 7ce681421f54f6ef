"""Worker bookkeeping without training: settled attempts, non-finite metrics."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from sweeps.runner import WorkerOptions, claim_order, run_worker
from sweeps.spec import Trial
from sweeps.store import SweepStore


def fake_trial(tid="t1", steps=10) -> Trial:
    return Trial(
        trial_id=tid,
        family="dlrm",
        package="dlrm",
        rung="d1",
        rung_index=0,
        budget=1e9,
        seed=0,
        flops_per_example=1e3,
        examples=steps * 64,
        steps=steps,
        batch_size=64,
        params_dense=10,
        params_sparse=100,
        config={"dense_optim": {"learning_rate": 1e-3}, "embedding_optim": {"learning_rate": 0.05}},
    )


def setup(tmp_path, attempts, evals=()):
    store = SweepStore(tmp_path)
    t = fake_trial()
    run = store.workdir(t.trial_id)
    run.mkdir(parents=True)
    for a in attempts:
        store.record_attempt(t.trial_id, a)
    with open(run / "metrics.jsonl", "w") as f:
        for e in evals:
            f.write(json.dumps({"split": "eval", **e}) + "\n")
    return store, t


@pytest.mark.parametrize(
    ("attempts", "status"),
    [
        ([{"exit_code": 0, "duration_s": 1.0}], "SUCCESS"),
        (
            [
                {
                    "exit_code": 3,
                    "duration_s": 1.0,
                    "error_tail": "non-finite training loss nan at step 4",
                }
            ],
            "DIVERGED",
        ),
        ([{"exit_code": 1, "duration_s": 1.0, "error_tail": "boom"}] * 2, "FAILED"),
    ],
)
def test_a_settled_trial_whose_worker_died_gets_its_row_without_rerunning(
    tmp_path, attempts, status
):
    # The last attempt finished (and was recorded), but its worker died before the row.
    store, t = setup(tmp_path, attempts, evals=[{"step": 10, "logloss": 0.5, "auc": 0.7}])
    counts = run_worker(str(tmp_path), [t.to_dict()], WorkerOptions(max_retries=1, wait=False))
    assert counts["ran"] == 0  # nothing re-run
    (row,) = store.results()
    assert row["status"] == status and row["attempts"] == len(attempts)
    if status == "DIVERGED":
        assert row["diverged_at_step"] == 4


def test_one_failure_within_the_retry_budget_is_not_settled(tmp_path):
    store, t = setup(tmp_path, [{"exit_code": 1, "duration_s": 1.0, "error_tail": "boom"}])
    from sweeps.outcome import settled_status

    assert settled_status(store.attempts(t.trial_id), max_retries=1) is None
    assert settled_status(store.attempts(t.trial_id), max_retries=0) == "FAILED"


def test_non_finite_metrics_become_null(tmp_path):
    # One-class eval sets give AUC NaN; JSON rows cannot hold NaN, so it is recorded as null.
    store, t = setup(
        tmp_path,
        [{"exit_code": 0, "duration_s": 1.0}],
        evals=[
            {"step": 5, "logloss": 0.6, "auc": float("nan")},
            {"step": 10, "logloss": 0.5, "auc": float("nan")},
        ],
    )
    run_worker(str(tmp_path), [t.to_dict()], WorkerOptions(wait=False))
    (row,) = store.results()
    assert row["final"]["auc"] is None and row["final"]["logloss"] == 0.5
    assert row["best"]["step"] == 10


def test_a_trial_that_keeps_killing_its_worker_is_failed(tmp_path):
    from sweeps.outcome import TAKEOVER, settled_status

    lost = {"exit_code": TAKEOVER, "duration_s": 0.0, "error_tail": "its worker died"}
    assert settled_status([lost] * 3, max_retries=1, max_takeovers=3) is None
    assert settled_status([lost] * 4, max_retries=1, max_takeovers=3) == "FAILED"
    # takeovers are not failures of the trial itself: they do not use up retries
    assert settled_status([lost, lost, {"exit_code": 1}], max_retries=1) is None


def test_a_preempted_attempt_is_run_again_and_uses_no_retry(tmp_path):
    from sweeps.outcome import settled_status, was_preempted

    preempted = {"exit_code": 0, "duration_s": 1.0, "preempted": True}
    assert settled_status([preempted], max_retries=0) is None
    assert settled_status([preempted] * 5 + [{"exit_code": 0}], max_retries=0) == "SUCCESS"
    tail = "restored checkpoint step 4\nSIGTERM: saved checkpoint step 7, stopping\n"
    assert was_preempted(tail + '{"preempted": true, "step": 7}\n')
    assert not was_preempted(tail + '{"auc": 0.7, "step": 10}\n')
    assert not was_preempted("no result line\n")


def test_a_preempted_trial_is_released_not_recorded(tmp_path):
    # The train command stands in for a trainer that got SIGTERM: the first attempt prints the
    # trainer's preemption result and exits 0; the next one fails. The preempted attempt must
    # not end the trial (no row for it) nor use up its retry.
    store = SweepStore(tmp_path)
    t = fake_trial()
    marker = tmp_path / "attempted"
    script = (
        "import pathlib, sys; m = pathlib.Path(sys.argv[1])\n"
        "if m.exists(): sys.exit(1)\n"
        'm.touch(); print(\'{"preempted": true, "step": 3}\')'
    )
    # The prefix runs first; the real command becomes its ignored arguments.
    opts = WorkerOptions(
        wait=False, max_retries=0, command_prefix=(sys.executable, "-c", script, str(marker))
    )
    counts = run_worker(str(tmp_path), [t.to_dict()], opts)
    assert counts.get("preempted") == 1 and counts.get("failed") == 1
    first, second = store.attempts(t.trial_id)
    assert first["preempted"] and first["exit_code"] == 0 and second["exit_code"] == 1
    (row,) = store.results()
    assert row["status"] == "FAILED" and row["attempts"] == 2


def test_claim_order_keeps_a_worker_on_the_sizes_it_has_compiled(tmp_path):
    """A worker tries the sizes its process has compiled first, then sizes no other worker is
    running, then the rest (spec order within each); a stale claim does not make a size busy."""
    store = SweepStore(tmp_path, stale_after=60)

    def trial(rung, budget):
        t = fake_trial(f"{rung}-{budget:g}")
        return Trial(**{**t.to_dict(), "rung": rung, "budget": budget})

    spec_order = [trial(r, b) for b in (1e9, 1e10) for r in ("d1", "d2", "d3", "d4")]

    def ids(trials):
        return [t.trial_id for t in trials]

    assert store.claim("d2-1e+09", "other")  # another worker is running d2 now
    assert store.claim("d4-1e+09", "gone")  # and one that died long ago held a d4 trial
    stale = store._claim_path("d4-1e+09")
    os.utime(stale, (time.time() - 600, time.time() - 600))
    order = claim_order(spec_order, {("dlrm", "d3")}, store, "me")
    assert ids(order) == [
        "d3-1e+09",
        "d3-1e+10",  # compiled here
        "d1-1e+09",
        "d4-1e+09",
        "d1-1e+10",
        "d4-1e+10",  # nobody's running these sizes
        "d2-1e+09",
        "d2-1e+10",  # another worker's size: its programs are there, not here
    ]
    # A worker's own claim does not make its size busy for it; with nothing warm: spec order.
    assert ids(claim_order(spec_order, set(), store, "other")) == ids(spec_order)
