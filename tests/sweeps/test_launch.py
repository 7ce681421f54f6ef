"""The sweep launcher end to end: real train subprocesses on dlrm/tiny, killed and relaunched.

Each trial is a real ``python -m dlrm.train`` run (a few seconds: jax import and compilation
dominate), so these tests are marked slow; CI still runs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from sweeps.store import SweepStore, read_results

pytestmark = pytest.mark.slow

# dlrm/tiny rung d1 costs 1,732 training FLOPs per example; at batch 64 one step is 110,848.
STEP_FLOPS_D1 = 1732 * 64


def write_spec(
    path: Path, *, budgets, name="t", overrides=None, max_retries=1, ckpts=2, timeout=0.0
) -> Path:
    path.write_text(
        textwrap.dedent(
            f"""
            from sweeps.spec import FamilySpec, SweepSpec, dlrm_ladder

            SPEC = SweepSpec(
                name={name!r},
                families=(
                    FamilySpec(
                        family="dlrm", preset="dlrm/tiny",
                        ladder=dlrm_ladder(((4, (8, 4), (8, 1)),)),
                        overrides={overrides or {}!r},
                    ),
                ),
                budgets={tuple(budgets)!r},
                min_steps=5,
                evals_per_trial=2,
                checkpoints_per_trial={ckpts},
                max_retries={max_retries},
                trial_timeout_s={timeout},
                code_version="test",
            )
            """
        )
    )
    return path


def launch_cmd(spec: Path, sweep_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sweeps.launch",
        str(spec),
        "--sweep-dir",
        str(sweep_dir),
        "--heartbeat",
        "0.5",
        "--stale-after",
        "4",
        *extra,
    ]


def run_launch(spec: Path, sweep_dir: Path, *extra: str, timeout=300, env=None) -> dict:
    proc = subprocess.run(
        launch_cmd(spec, sweep_dir, *extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rows(sweep_dir: Path) -> list[dict]:
    return read_results(sweep_dir / "results.jsonl").rows


def trial_processes(sweep: Path) -> list[int]:
    """Pids of live trial processes of ``sweep`` (Linux /proc)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
                state = (p / "stat").read_text().split()[2]
            except OSError:
                continue
            # trial commands only (python -m dlrm.train <sweep>/trials/...), not the launcher
            if str(sweep).encode() in cmd and b"sweeps.launch" not in cmd and state != "Z":
                pids.append(int(p.name))
    return pids


def wait_for(pred, timeout=120.0, poll=0.05):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return True
        time.sleep(poll)
    raise TimeoutError("condition not reached")


def test_dry_run_lists_trials_without_running(tmp_path):
    spec = write_spec(tmp_path / "spec.py", budgets=[20 * STEP_FLOPS_D1, 40 * STEP_FLOPS_D1])
    out = subprocess.run(
        launch_cmd(spec, tmp_path / "sw", "--dry-run"), capture_output=True, text=True, check=True
    ).stdout
    assert out.count("PENDING") == 2 and " 20 " in out and " 40 " in out
    assert not (tmp_path / "sw" / "results.jsonl").exists()


def test_trials_in_one_warm_process_equal_trials_in_their_own(tmp_path):
    # The second trial of the warm worker runs after the first in the same Python: anything a
    # trial left behind (caches, random state, handlers) would change its result.
    spec = write_spec(tmp_path / "spec.py", budgets=[10 * STEP_FLOPS_D1, 20 * STEP_FLOPS_D1])
    warm, isolated = tmp_path / "warm", tmp_path / "isolated"
    assert run_launch(spec, warm)["statuses"] == {"SUCCESS": 2}
    assert run_launch(spec, isolated, "--isolate-trials")["statuses"] == {"SUCCESS": 2}
    finals = {d: {r["trial_id"]: r["final"] for r in rows(d)} for d in (warm, isolated)}
    assert len(finals[warm]) == 2 and finals[warm] == finals[isolated]
    logs = {
        d: [(SweepStore(d).trial_dir(t) / "train.log").read_text() for t in finals[d]]
        for d in (warm, isolated)
    }
    pids = {re.search(r"trial server pid (\d+)", log).group(1) for log in logs[warm]}
    assert len(pids) == 1  # one process ran both
    assert not any("trial server" in log for log in logs[isolated])


def test_kill9_then_relaunch_gives_exactly_n_rows(tmp_path):
    n = 3
    spec = write_spec(tmp_path / "spec.py", budgets=[s * STEP_FLOPS_D1 for s in (20, 30, 40)])
    sweep = tmp_path / "sw"
    proc = subprocess.Popen(
        launch_cmd(spec, sweep), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for(lambda: len(rows(sweep)) >= 1)

    def next_claimed() -> bool:
        """A trial without a result is claimed (the trial server alone, idle between trials,
        is no sign of one: killing then would leave no claim to take over)."""
        path = sweep / "events.jsonl"
        events = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
        done = {r["trial_id"] for r in rows(sweep)}
        return any(e["event"] == "claim" and e["trial_id"] not in done for e in events)

    wait_for(next_claimed)
    wait_for(lambda: trial_processes(sweep))  # the next trial is running
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    k = len(rows(sweep))
    assert 1 <= k < n
    # The running trial dies with its launcher (PR_SET_PDEATHSIG) at once, not when it ends.
    wait_for(lambda: not trial_processes(sweep), timeout=2)
    summary = run_launch(spec, sweep)
    got = rows(sweep)
    ids = [r["trial_id"] for r in got]
    assert len(got) == n and len(set(ids)) == n, ids
    assert summary["statuses"] == {"SUCCESS": n}
    events = [json.loads(x) for x in (sweep / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "takeover" for e in events)  # the dead launcher's claim


def test_two_concurrent_launchers_run_each_trial_once(tmp_path):
    n = 4
    spec = write_spec(tmp_path / "spec.py", budgets=[s * STEP_FLOPS_D1 for s in (10, 15, 20, 25)])
    sweep = tmp_path / "sw"
    procs = [
        subprocess.Popen(
            launch_cmd(spec, sweep), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        for _ in range(2)
    ]
    outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    got = rows(sweep)
    assert sorted(r["trial_id"] for r in got) == sorted({r["trial_id"] for r in got})
    assert len(got) == n
    store = SweepStore(sweep)
    for r in got:
        assert len(store.attempts(r["trial_id"])) == 1  # run once, by one launcher
        log = (store.trial_dir(r["trial_id"]) / "train.log").read_text()
        assert log.count("=== ") == 1
    ran = [w["ran"] for o in outs for w in o["workers"]]
    assert sum(ran) == n


def test_trial_killed_mid_run_resumes_from_its_checkpoint(tmp_path):
    steps = 3000
    spec = write_spec(tmp_path / "spec.py", budgets=[steps * STEP_FLOPS_D1], ckpts=6)
    sweep = tmp_path / "sw"
    proc = subprocess.Popen(
        launch_cmd(spec, sweep), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )

    def checkpointed():
        return any(p.name.isdigit() for p in sweep.glob("trials/*/run/checkpoints/*"))

    wait_for(checkpointed)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert rows(sweep) == []
    run_launch(spec, sweep)
    (row,) = rows(sweep)
    assert row["status"] == "SUCCESS"
    assert row["resumed_from_step"] > 0  # restored, not restarted
    assert row["final"]["step"] == steps


def test_diverged_and_failed_trials_are_recorded(tmp_path):
    sweep = tmp_path / "sw"
    diverge = write_spec(
        tmp_path / "diverge.py",
        budgets=[20 * STEP_FLOPS_D1],
        name="d",
        overrides={
            "dense_optim.name": "sgd",
            "dense_optim.learning_rate": 1e30,
            "embedding_optim.name": "sgd",
            "embedding_optim.learning_rate": 1e30,
        },
    )
    run_launch(diverge, sweep)
    (row,) = rows(sweep)
    assert row["status"] == "DIVERGED" and row["attempts"] == 1  # deterministic: no retry
    assert row["diverged_at_step"] is not None and "non-finite" in row["error"]

    fail = write_spec(
        tmp_path / "fail.py",
        budgets=[20 * STEP_FLOPS_D1],
        name="f",
        max_retries=1,
        overrides={"train.init_from": str(tmp_path / "no_such_run")},
    )
    sweep2 = tmp_path / "sw2"
    summary = run_launch(fail, sweep2)
    (row,) = rows(sweep2)
    assert row["status"] == "FAILED" and row["attempts"] == 2  # first try + one retry
    # the trainer's one-line error (no traceback) names what is missing
    assert "error: train.init_from: no checkpoints in" in row["error"]
    assert "no_such_run" in row["error"]
    assert summary["statuses"] == {"FAILED": 1}
    # A relaunch does not run a finished trial again.
    run_launch(fail, sweep2)
    assert len(rows(sweep2)) == 1 and len(SweepStore(sweep2).attempts(row["trial_id"])) == 2


def test_slurm_backend_with_submitits_local_executor(tmp_path):
    spec = write_spec(tmp_path / "spec.py", budgets=[10 * STEP_FLOPS_D1, 20 * STEP_FLOPS_D1])
    sweep = tmp_path / "sw"
    summary = run_launch(
        spec, sweep, "--backend", "slurm", "--submitit-cluster", "local", "--max-parallel", "2"
    )
    assert summary["statuses"] == {"SUCCESS": 2}
    got = rows(sweep)
    owners = {a["owner"] for r in got for a in SweepStore(sweep).attempts(r["trial_id"])}
    assert all(o.startswith("slurm") for o in owners)
    assert any((sweep / "submitit").iterdir())  # submitit's own job folders


@pytest.mark.parametrize("backend", ["slurm"])
def test_trials_that_are_themselves_multi_process(tmp_path, backend):
    """``--hardware cpu-local-2proc``: every trial is one run of 2 JAX processes (the local
    launcher as the trial's command prefix, as ``srun`` on a cluster), here through
    submitit's local executor (the local and Ray backends run the same worker code); each
    trial succeeds once and its run recorded 2 processes on 8 devices. One trial: each costs
    two JAX start-ups and compiles on 2 cores (about 20 s), and the other launch tests cover
    several trials per sweep."""
    spec = write_spec(tmp_path / "spec.py", budgets=[10 * STEP_FLOPS_D1])
    sweep = tmp_path / "sw"
    extra = ("--submitit-cluster", "local") if backend == "slurm" else ()
    summary = run_launch(
        spec,
        sweep,
        "--backend",
        backend,
        "--max-parallel",
        "1",
        "--hardware",
        "cpu-local-2proc",
        *extra,
    )
    assert summary["statuses"] == {"SUCCESS": 1}
    got = rows(sweep)
    assert len(got) == 1
    store = SweepStore(sweep)
    for r in got:
        info = json.loads((store.workdir(r["trial_id"]) / "run_info.json").read_text())
        assert [(s["process_count"], s["device_count"]) for s in info["starts"]] == [(2, 8)]


def test_results_rows_carry_what_fits_and_audits_need(tmp_path):
    spec = write_spec(tmp_path / "spec.py", budgets=[10 * STEP_FLOPS_D1])
    sweep = tmp_path / "sw"
    run_launch(spec, sweep)
    (row,) = rows(sweep)
    for key in (
        "trial_id",
        "config",
        "budget",
        "compute",
        "flops_per_example",
        "flops_convention",
        "examples",
        "params_dense",
        "params_sparse",
        "final",
        "best",
        "wall_time_s",
        "device_kind",
        "host_cpu",
        "device_count",
        "seed",
        "code_version",
        "versions",
        "status",
        "data_fingerprint",
    ):
        assert row.get(key) is not None, key
    assert row["examples"] == 10 * 64 and row["compute"] == pytest.approx(10 * STEP_FLOPS_D1)
    assert row["final"]["step"] == 10 and row["best"]["logloss"] <= row["final"]["logloss"]
    assert row["versions"]["jax"]
    # The trial's workdir is a normal run: the evaluate command works on it.
    wd = SweepStore(sweep).workdir(row["trial_id"])
    ev = subprocess.run(
        [sys.executable, "-m", "dlrm.evaluate", "--workdir", str(wd)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(ev.strip().splitlines()[-1])["logloss"] == pytest.approx(
        row["final"]["logloss"], abs=1e-6
    )
    shutil.rmtree(sweep)


def test_an_attempt_over_its_timeout_is_killed_and_counted(tmp_path):
    spec = write_spec(
        tmp_path / "spec.py", budgets=[20000 * STEP_FLOPS_D1], max_retries=0, timeout=3.0
    )
    sweep = tmp_path / "sw"
    t0 = time.time()
    summary = run_launch(spec, sweep)
    assert time.time() - t0 < 60  # 20,000 steps would take minutes
    (row,) = rows(sweep)
    assert row["status"] == "FAILED" and "timeout_s=3" in row["error"]
    assert summary["statuses"] == {"FAILED": 1}
    assert not trial_processes(sweep)


RAY_HEAD = """
import json, os, sys
import ray
from sweeps.launch import ray_init_kwargs
ctx = ray.init(num_cpus=2, _temp_dir=sys.argv[1], **ray_init_kwargs("", os.environ))
print(json.dumps({"gcs": ctx.address_info["gcs_address"]}), flush=True)
sys.stdin.read()  # until the test closes stdin
ray.shutdown()
"""

RAY_CLIENT = """
import sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
print("CONNECTED", flush=True)
"""


@dataclasses.dataclass(frozen=True)
class RayCluster:
    gcs: str
    """The cluster's address (``host:port`` of its GCS)."""
    env: dict
    """The environment it was started in: ``HOME`` is a folder of the module's, whose
    ``.ray/auth_token`` Ray wrote."""
    home: Path


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """The cluster ``--backend ray`` starts when given no address (``ray_init_kwargs("")``, as
    the launcher calls ``ray.init``), with 2 CPUs, one for this module's Ray tests: starting a
    Ray cluster costs about 10 s of CPU on 2 cores."""
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    # The trials Ray's workers run keep the C++ kernels already built (HOME moves ~/.cache).
    cache = os.environ.get("RECSCALE_CACHE") or str(Path.home() / ".cache" / "recscale")
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", RECSCALE_CACHE=cache)
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths stay short
    head = subprocess.Popen(
        [sys.executable, "-c", RAY_HEAD, ray_tmp],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        gcs = json.loads(head.stdout.readline())["gcs"]
        yield RayCluster(gcs=gcs, env=env, home=home)
    finally:
        head.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # this module's own cluster only
        head.wait()
        head.stdout.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_a_local_ray_cluster_refuses_a_client_without_its_token(tmp_path, ray_cluster):
    """The cluster ``--backend ray`` starts when given no address listens on every interface
    (Ray cannot bind it to 127.0.0.1), and Ray's token authentication is what guards it: a
    client with another token is refused, one with the token Ray wrote to the launching user's
    ``~/.ray/auth_token`` (``HOME`` here: a folder of the fixture's) connects."""
    other = tmp_path / "other"
    other.mkdir()
    env, gcs = ray_cluster.env, ray_cluster.gcs
    assert (ray_cluster.home / ".ray" / "auth_token").is_file()
    intruder = subprocess.run(
        [sys.executable, "-c", RAY_CLIENT, gcs],
        env={**env, "HOME": str(other), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "CONNECTED" not in intruder.stdout
    assert "InvalidAuthToken" in intruder.stderr, intruder.stderr[-2000:]
    owner = subprocess.run(
        [sys.executable, "-c", RAY_CLIENT, gcs],
        env={**env, "RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "CONNECTED" in owner.stdout, owner.stderr[-2000:]


def test_ray_backend_on_a_local_cluster(tmp_path, ray_cluster):
    """``--backend ray --ray-address``: the trials run as tasks of a cluster already up (this
    module's token-guarded one; the launcher reads the token from ``~/.ray/auth_token``)."""
    spec = write_spec(tmp_path / "spec.py", budgets=[10 * STEP_FLOPS_D1, 20 * STEP_FLOPS_D1])
    sweep = tmp_path / "sw"
    summary = run_launch(
        spec,
        sweep,
        "--backend",
        "ray",
        "--max-parallel",
        "2",
        "--ray-address",
        ray_cluster.gcs,
        env={**ray_cluster.env, "RAY_AUTH_MODE": "token"},
    )
    assert summary["statuses"] == {"SUCCESS": 2}
    got = rows(sweep)
    assert len(got) == 2
    owners = {a["owner"] for r in got for a in SweepStore(sweep).attempts(r["trial_id"])}
    assert all(o.startswith("ray") for o in owners)
