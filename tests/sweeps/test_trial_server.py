"""The worker's long-lived trial process, on a stand-in family whose train command does what the
trial's config says (succeed, raise, diverge, die): which trials share a process, what each
attempt records, and that every failure gets the next trial a fresh process."""

from __future__ import annotations

import json
import textwrap

from sweeps.runner import WorkerOptions, run_worker
from sweeps.spec import Trial
from sweeps.store import SweepStore

FAKE_TRAIN = textwrap.dedent(
    """
    import json, os, pathlib, signal, sys

    def main(args):
        cfg = json.loads(pathlib.Path(args[0]).read_text())
        workdir = pathlib.Path(args[args.index("--workdir") + 1])
        workdir.mkdir(parents=True, exist_ok=True)
        with open(workdir.parent.parent.parent / "pids.jsonl", "a") as f:
            f.write(json.dumps({"trial": cfg["name"], "pid": os.getpid()}) + "\\n")
        what = cfg["do"]
        print(f"stdout of {cfg['name']}")
        print(f"stderr of {cfg['name']}", file=sys.stderr)
        if what == "raise":
            raise RuntimeError(f"boom in {cfg['name']}")
        if what == "diverge":
            raise SystemExit(3)
        if what == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        print(json.dumps({"step": 1, "logloss": 0.5}))

    if __name__ == "__main__":
        main(sys.argv[1:])
    """
)


def fake_trial(name: str, do: str) -> Trial:
    return Trial(
        trial_id=name,
        family="fake",
        package="fakefam",
        rung="r",
        rung_index=0,
        budget=1.0,
        seed=0,
        flops_per_example=1.0,
        examples=1,
        steps=1,
        batch_size=1,
        params_dense=1,
        params_sparse=1,
        config={
            "name": name,
            "do": do,
            "dense_optim": {"learning_rate": 1.0},
            "embedding_optim": {"learning_rate": 1.0},
        },
    )


def run(tmp_path, trials, **opts):
    pkg = tmp_path / "lib" / "fakefam"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(FAKE_TRAIN)
    sweep = tmp_path / "sw"
    store = SweepStore(sweep)
    for t in trials:
        store.trial_dir(t.trial_id).mkdir(parents=True)
        (store.trial_dir(t.trial_id) / "config.json").write_text(json.dumps(t.config))
    options = WorkerOptions(
        wait=False, max_retries=0, env={"PYTHONPATH": str(tmp_path / "lib")}, **opts
    )
    counts = run_worker(str(sweep), [t.to_dict() for t in trials], options)
    pids = [json.loads(x) for x in (sweep / "pids.jsonl").read_text().splitlines()]
    return store, counts, {p["trial"]: p["pid"] for p in pids}


def test_successful_trials_share_one_process_and_each_failure_gets_a_fresh_one(tmp_path):
    trials = [
        fake_trial("a", "ok"),
        fake_trial("b", "ok"),
        fake_trial("c", "raise"),
        fake_trial("d", "ok"),
        fake_trial("e", "diverge"),
        fake_trial("f", "die"),
        fake_trial("g", "ok"),
    ]
    store, counts, pid = run(tmp_path, trials)
    assert counts["success"] == 4 and counts["failed"] == 2 and counts["diverged"] == 1
    assert pid["a"] == pid["b"] == pid["c"]  # one warm process until a trial fails
    assert pid["d"] != pid["c"] and pid["e"] == pid["d"]
    assert pid["f"] != pid["e"] and pid["g"] != pid["f"]
    codes = {t.trial_id: store.attempts(t.trial_id)[-1]["exit_code"] for t in trials}
    assert codes == {"a": 0, "b": 0, "c": 1, "d": 0, "e": 3, "f": -9, "g": 0}
    status = {r["trial_id"]: r["status"] for r in store.results()}
    assert status == {
        "a": "SUCCESS",
        "b": "SUCCESS",
        "c": "FAILED",
        "d": "SUCCESS",
        "e": "DIVERGED",
        "f": "FAILED",
        "g": "SUCCESS",
    }
    # Each trial's output (both streams) lands in its own log, and only there.
    for t in trials:
        log = (store.trial_dir(t.trial_id) / "train.log").read_text()
        assert f"stdout of {t.trial_id}" in log and f"stderr of {t.trial_id}" in log
        assert all(f"of {o.trial_id}" not in log for o in trials if o is not t)
    err = (store.trial_dir("c") / "train.log").read_text()
    assert "RuntimeError: boom in c" in err and "Traceback" in err


def test_a_process_serves_at_most_max_trials_per_process(tmp_path):
    trials = [fake_trial(n, "ok") for n in "abcde"]
    _, counts, pid = run(tmp_path, trials, max_trials_per_process=2)
    assert counts["success"] == 5
    assert pid["a"] == pid["b"] != pid["c"] == pid["d"] != pid["e"]


def test_isolated_trials_each_get_their_own_process(tmp_path):
    trials = [fake_trial(n, "ok") for n in "abc"]
    _, counts, pid = run(tmp_path, trials, reuse_process=False)
    assert counts["success"] == 3 and len(set(pid.values())) == 3
