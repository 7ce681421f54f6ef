"""The launcher's progress view: counts by state from the sweep directory, and the ETA."""

from __future__ import annotations

import io
import time

import pytest

from sweeps.progress import SweepProgress, summarise
from sweeps.store import SweepStore


def trial(tid: str, compute: float) -> dict:
    return {"trial_id": tid, "flops_per_example": compute / 100, "examples": 100}


def finish(store: SweepStore, tid: str, status: str, wall: float) -> None:
    store.trial_dir(tid).mkdir(parents=True, exist_ok=True)
    store.append_result({"trial_id": tid, "status": status, "wall_time_s": wall})


def make(tmp_path):
    store = SweepStore(tmp_path)
    trials = [
        trial("a", 1e9),
        trial("b", 3e9),
        trial("c", 2e9),
        trial("d", 1e9),
        trial("e", 4e9),
        trial("f", 6e9),
    ]
    # Finished trials cost 2 s plus 1 s per 1e9 FLOPs.
    finish(store, "a", "SUCCESS", 3.0)
    finish(store, "b", "SUCCESS", 5.0)
    finish(store, "c", "DIVERGED", 4.0)
    finish(store, "d", "FAILED", 0.5)
    store.trial_dir("e").mkdir(parents=True)
    assert store.claim("e", "worker-1")  # running
    return store, trials


def test_counts_and_eta_from_the_finished_trials(tmp_path):
    store, trials = make(tmp_path)
    s = summarise(store, trials)
    assert dict(s["counts"]) == {"done": 3, "failed": 1, "running": 1, "remaining": 1}
    assert s["finished_compute"] == pytest.approx(7e9)
    progress = SweepProgress(store, trials)
    # Unfinished: e (4e9) and f (6e9): (2 + 4) + (2 + 6) seconds, one trial running at a time.
    assert progress.eta(s) == pytest.approx(14.0, rel=1e-6)
    line = progress.line(s)
    assert line.startswith("3 done, 1 running, 1 failed, 1 remaining of 6, ETA 0m14s")


def test_without_a_terminal_it_prints_lines(tmp_path):
    store, trials = make(tmp_path)
    out = io.StringIO()
    with SweepProgress(store, trials, poll_s=0.01, line_every_s=0.0, stream=out):
        t0 = time.time()
        while not out.getvalue() and time.time() - t0 < 30:  # the first line
            time.sleep(0.01)
        finish(store, "e", "SUCCESS", 6.0)
    # and the last line, printed on leaving, sees the finished trial
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("sweep: 3 done, 1 running, 1 failed, 1 remaining of 6")
    assert lines[-1].startswith("sweep: 4 done, 0 running, 1 failed, 1 remaining of 6")


def test_no_eta_from_trials_far_smaller_than_the_remaining(tmp_path):
    """Finished trials of 1-3e9 FLOPs do not price one of 1e11: the line says so instead."""
    store, trials = make(tmp_path)
    trials = [*trials, trial("g", 1e11)]
    progress = SweepProgress(store, trials)
    s = summarise(store, trials)
    assert progress.eta(s) is None
    assert progress.line(s).endswith("ETA once a trial near the largest size has finished")


def test_a_branch_counts_its_own_steps_only(tmp_path):
    # A cooldown branch of 10 steps from step 8 runs a fifth of its point's compute itself.
    store = SweepStore(tmp_path)
    stable = {**trial("s", 5e9), "steps": 50}
    branch = {**trial("b", 1e9), "steps": 10, "branch_of": "s", "branch_step": 8}
    progress = SweepProgress(store, [stable, branch], stream=io.StringIO())
    assert progress.total == pytest.approx(5e9 + 0.2e9)
    assert "(1 runs, 1 branches)" in progress.line(summarise(store, [stable, branch]))


def test_populations_are_counted(tmp_path):
    store = SweepStore(tmp_path)
    trials = [{**trial(t, 1e9), "population": ["a", "b"]} for t in ("a", "b")] + [trial("c", 1e9)]
    line = SweepProgress(store, trials, stream=io.StringIO()).line(summarise(store, trials))
    assert "(1 populations)" in line


def test_eta_from_trials_of_one_size_and_populations_as_one_process(tmp_path):
    """Finished trials of one budget differ in compute by a few FLOPs in 1e12: a line through
    them would price the rest at hours per FLOP; their mean cost per FLOP prices it instead.
    The running population's two members are one process, not two."""
    store = SweepStore(tmp_path)
    done = [trial(t, 1e12 + d) for t, d in (("a", 0.0), ("b", 4.8e6), ("c", -1.0))]
    pop = [{**trial(t, 1e12), "population": ["p", "q"]} for t in ("p", "q")]
    trials = [*done, *pop, trial("r", 1e12)]
    for t, wall in zip(("a", "b", "c"), (500.0, 600.0, 700.0), strict=True):
        finish(store, t, "SUCCESS", wall)
    for t in ("p", "q"):
        store.trial_dir(t).mkdir(parents=True)
        assert store.claim(t, "worker-1")
    s = summarise(store, trials)
    assert s["running_units"] == 1
    # Three unfinished trials of 1e12 FLOPs at 1,800 s per 3e12 finished, one process running.
    per_flop = 1800.0 / (3e12 + 4.8e6 - 1.0)
    assert SweepProgress(store, trials).eta(s) == pytest.approx(3e12 * per_flop, rel=1e-9)
