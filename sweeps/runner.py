"""Workers: claim a trial, run its train command as a subprocess, record the outcome, repeat.

Every backend runs the same :func:`run_worker` loop — as threads of the launcher (local), as
Ray tasks, or as SLURM jobs through submitit — so the claim/heartbeat/retry logic is written
once and every backend is idempotent and resumable in the same way.

By default a worker runs its trials in one long-lived Python (:class:`TrialServer`,
``sweeps/trial_server.py``), which calls the family's train entry point in-process, so start-up,
imports and JAX's backend are paid once per worker rather than once per trial; a trial that
fails (or is killed, preempted or timed out) takes that process with it and the next one gets a
fresh one. Such a worker keeps to the model sizes it has compiled (:func:`claim_order`), so
each size is compiled by as few workers as the schedule allows.
``WorkerOptions.reuse_process=False`` (``--isolate-trials``), and any ``command_prefix``
(multi-host trials), run each trial as a process of its own instead.

Either process is started through ``python -m data._child`` which asks the kernel
(``prctl(PR_SET_PDEATHSIG)``, Linux) to SIGKILL it when its worker dies, so a ``kill -9`` of a
launcher never leaves an orphan training into a workdir another launcher will take over.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from data import _child
from recscale.train import DIVERGED_EXIT_CODE
from sweeps.spec import FLOPS_CONVENTION, Trial
from sweeps.store import SweepStore

TIMEOUT_EXIT_CODE = -1000
"""Recorded exit code of an attempt the worker killed for exceeding ``timeout_s``."""
TAKEOVER = "takeover"
"""Recorded exit code of an attempt whose worker died (found stale and taken over)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    heartbeat_s: float = 10.0
    """Seconds between heartbeats of a running trial's claim."""
    stale_after_s: float = 60.0
    """A claim whose heartbeat is older than this belongs to a dead worker."""
    max_retries: int = 1
    """Retries of a FAILED trial before its FAILED row is final."""
    timeout_s: float = 0.0
    """Wall-clock limit of one attempt (0 = none); an attempt over it is killed and counts as
    a failure."""
    max_takeovers: int = 3
    """A trial whose workers died this many times (their heartbeats went stale) is FAILED: it
    probably kills its host (out of memory) or outlives its allocation."""
    wait: bool = True
    """Keep polling while other workers run the remaining trials (to take over dead ones)."""
    poll_s: float = 2.0
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment of trial processes (XLA flags, RECSCALE_DISTRIBUTED, ...)."""
    command_prefix: tuple[str, ...] = ()
    """Prepended to the trial command (e.g. ``srun --ntasks-per-node=1`` for multi-host;
    ``{python}`` stands for this worker's interpreter, e.g. ``{python} -m recscale.launch``)."""
    sweep: str = ""
    code_version: str = ""
    data_fingerprints: dict[str, str] = dataclasses.field(default_factory=dict)
    metric: str = "logloss"
    reuse_process: bool = True
    """Run this worker's trials one after another in one long-lived Python
    (``sweeps.trial_server``) instead of a fresh process each; ignored with a
    ``command_prefix``."""
    max_trials_per_process: int = 32
    """With ``reuse_process``: start a fresh process after this many trials (bounds any memory
    a trial leaves behind)."""


class TrialServer:
    """The worker's long-lived trial process (``sweeps.trial_server``), started on demand and
    replaced after a trial that did not end cleanly."""

    def __init__(self, opts: WorkerOptions, log_path: Path):
        self.opts = opts
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.trials = 0

    def submit(self, argv: list[str], log: Path) -> subprocess.Popen:
        """Sends a trial; returns the process running it (what a kill must take down)."""
        if self.proc is None or self.proc.poll() is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            cmd = _child.command(
                sys.executable,
                "-m",
                "sweeps.trial_server",
                str(self.log_path),
            )
            env = {**os.environ, **self.opts.env, "PYTHONUNBUFFERED": "1"}
            with open(self.log_path, "ab") as err:
                self.proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    env=env,
                    start_new_session=True,
                    text=True,
                )
            self.trials = 0
        self.trials += 1
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        return self.proc

    def alive(self) -> bool:
        """Whether the process is up (and so holds the programs its trials compiled)."""
        return self.proc is not None and self.proc.poll() is None

    def wait(self) -> int:
        """The running trial's exit code; the process's own (negative for a signal) if it died."""
        line = self.proc.stdout.readline()
        if not line:
            return self.proc.wait()
        return int(json.loads(line)["exit_code"])

    def retire(self) -> None:
        """Ends the process (it is replaced on the next ``submit``)."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()  # EOF: the server exits between trials
        except OSError:  # it died, and the pipe with it
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _kill(self.proc)
            self.proc.wait()
        self.proc.stdout.close()
        self.proc = None


def new_owner(prefix: str = "local") -> str:
    return f"{prefix}-{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def run_worker(
    sweep_dir: str,
    trials: list[dict],
    opts: WorkerOptions,
    owner: str = "",
    stop: threading.Event | None = None,
) -> dict[str, int]:
    """Claims and runs trials until every one is finished (or, without ``opts.wait``, until
    none is left to claim). Returns counts of what this worker did."""
    if int(os.environ.get("SLURM_PROCID", "0")) != 0:
        # A multi-node SLURM job runs this function in every task: rank 0 claims trials and
        # starts each one on all the job's nodes (the preset's srun prefix); the others idle.
        return {"ran": 0}
    owner = owner or new_owner()
    store = SweepStore(sweep_dir, stale_after=opts.stale_after_s)
    todo = [Trial.from_dict(t) if isinstance(t, dict) else t for t in trials]
    done: dict[str, int] = {"ran": 0, "success": 0, "failed": 0, "diverged": 0, "retry": 0}
    server = None
    if opts.reuse_process and not opts.command_prefix:
        server = TrialServer(opts, store.root / "workers" / f"{owner}.log")
    try:
        _work(store, todo, opts, owner, stop, done, server)
    finally:
        if server is not None:
            server.retire()
    return done


def program_group(trial: Trial) -> tuple[str, str]:
    """Trials that share compiled programs: one model size of one family. Within a spec the
    size fixes everything a train step's trace reads; budgets, seeds and learning rates are
    arguments of the programs (``recscale.train.experiment.cached_program``)."""
    return trial.family, trial.rung


def claim_order(
    remaining: list[Trial], warm: set[tuple[str, str]], store: SweepStore, owner: str
) -> list[Trial]:
    """``remaining`` in the order a worker tries to claim them: first the sizes its process has
    already compiled (their programs are in memory), then sizes no other worker is running
    now (so two workers do not both compile the same size), then the rest; spec order within
    each. Which worker runs a trial never changes its result, only how much it compiles."""
    busy = set()
    for t in remaining:
        state = store.claim_state(t.trial_id)
        if state and state[0] != owner and state[1] < store.stale_after:
            busy.add(program_group(t))

    def rank(t: Trial) -> int:
        g = program_group(t)
        return 0 if g in warm else 2 if g in busy else 1

    return sorted(remaining, key=rank)  # stable: spec order within a rank


def _work(store, todo, opts, owner, stop, done, server) -> None:
    warm: set[tuple[str, str]] = set()  # sizes this worker's process has compiled
    while not (stop and stop.is_set()):
        finished = store.finished_ids()
        remaining = [t for t in todo if t.trial_id not in finished]
        if not remaining:
            break
        if server is None or not server.alive():
            warm.clear()  # a fresh process (or one per trial) holds no programs
        claimed = None
        rows = None
        for t in claim_order(remaining, warm, store, owner):
            ended = None
            if t.branch_of:
                rows = rows if rows is not None else {r["trial_id"]: r for r in store.results()}
                ended = stable_ended(store, t, rows)
                if ended is None and not branch_ready(store, t):
                    continue  # its stable run has not reached the branch point yet
            kind = store.claim(t.trial_id, owner)
            if not kind:
                continue
            if ended is not None and not branch_ready(store, t):
                status, error = ended
                attempts = store.attempts(t.trial_id)
                store.append_result(result_row(store, t, status, attempts, opts, error=error))
                store.release(t.trial_id, owner)
                continue
            if kind == "takeover":
                store.record_attempt(
                    t.trial_id,
                    {
                        "owner": owner,
                        "exit_code": TAKEOVER,
                        "duration_s": 0.0,
                        "start": time.time(),
                        "error_tail": "its worker died",
                    },
                )
            attempts = store.attempts(t.trial_id)
            status = _settled_status(attempts, opts.max_retries, opts.max_takeovers)
            if status is not None:
                # Its last attempt settled it, but that worker died before writing the row.
                error = attempts[-1].get("error_tail", "") if status != "SUCCESS" else ""
                store.append_result(result_row(store, t, status, attempts, opts, error=error))
                store.release(t.trial_id, owner)
                continue
            claimed = t
            break
        if claimed is None:
            if not opts.wait:
                break
            time.sleep(opts.poll_s)
            continue
        outcome = run_trial(store, claimed, owner, opts, stop, server)
        warm.add(program_group(claimed))
        done["ran"] += 1
        done[outcome] = done.get(outcome, 0) + 1


def branch_ready(store: SweepStore, trial: Trial) -> bool:
    """Whether a branch's starting point, its stable run's checkpoint at ``branch_step``, is on
    disk (Orbax writes a step to a temporary folder and renames it when complete)."""
    return (store.workdir(trial.branch_of) / "checkpoints" / str(trial.branch_step)).is_dir()


def stable_ended(store: SweepStore, trial: Trial, rows: dict[str, dict]) -> tuple[str, str] | None:
    """A branch's outcome when its stable run has finished without reaching the branch point
    (it diverged or failed first), as ``(status, error)``; None while that run is unfinished or
    finished successfully. The branch's one-piece run shares those steps bit for bit, so it
    would have ended the same way: a stable run's divergence is its branches' too."""
    row = rows.get(trial.branch_of)
    if row is None or row["status"] == "SUCCESS":
        return None
    error = (
        f"its stable run {trial.branch_of} ended {row['status']} before the branch point, "
        f"step {trial.branch_step}: {row.get('error', '')[-2000:]}"
    )
    return row["status"], error


def _settled_status(attempts: list[dict], max_retries: int, max_takeovers: int = 3) -> str | None:
    """The final status the recorded attempts already imply, or None (run it again)."""
    if not attempts:
        return None
    last = attempts[-1].get("exit_code")
    if last == 0 and not attempts[-1].get("preempted"):
        return "SUCCESS"
    if last == DIVERGED_EXIT_CODE:
        return "DIVERGED"
    takeovers = sum(1 for a in attempts if a.get("exit_code") == TAKEOVER)
    if takeovers > max_takeovers:
        return "FAILED"
    # A preempted attempt (exit 0 after checkpointing) is neither a success nor a failure.
    failed = sum(1 for a in attempts if a.get("exit_code") not in (0, DIVERGED_EXIT_CODE, TAKEOVER))
    return "FAILED" if failed > max_retries else None


def run_trial(
    store: SweepStore,
    trial: Trial,
    owner: str,
    opts: WorkerOptions,
    stop: threading.Event | None = None,
    server: TrialServer | None = None,
) -> str:
    """Runs one claimed trial to an outcome: success, diverged, failed, retry, lost or stopped.

    With a ``server`` the trial runs in the worker's long-lived process (replaced afterwards
    unless the trial exited 0 unpreempted), otherwise in a process of its own."""
    tdir = store.trial_dir(trial.trial_id)
    workdir = store.workdir(trial.trial_id)
    cfg_path = tdir / "config.json"
    argv = trial.train_command(cfg_path, workdir)
    t0 = time.time()
    lost = threading.Event()
    timed_out = threading.Event()
    log_path = tdir / "train.log"
    with open(log_path, "ab") as log:
        if server is not None:
            log.write(f"\n=== {owner} {time.ctime()}: (trial server) {' '.join(argv)}\n".encode())
            log.flush()
            proc = server.submit(argv, log_path)
            wait = server.wait
        else:
            # The trampoline goes first, so a prefix (srun) is what dies with this worker.
            prefix = [sys.executable if a == "{python}" else a for a in opts.command_prefix]
            cmd = _child.command(*prefix, sys.executable, *argv)
            env = {**os.environ, **opts.env, "PYTHONUNBUFFERED": "1"}
            log.write(f"\n=== {owner} {time.ctime()}: {' '.join(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            wait = proc.wait

        exited = threading.Event()

        def beat():
            while not exited.wait(opts.heartbeat_s):
                if not store.heartbeat(trial.trial_id, owner):
                    lost.set()  # another worker took it over: stop writing into its workdir
                    _kill(proc)
                    return
                if stop is not None and stop.is_set():
                    _kill(proc)
                    return
                if opts.timeout_s and time.time() - t0 > opts.timeout_s:
                    timed_out.set()
                    _kill(proc)
                    return

        hb = threading.Thread(target=beat, daemon=True)
        hb.start()
        try:
            rc = wait()
        except BaseException:
            _kill(proc)
            store.release(trial.trial_id, owner)
            raise
        finally:
            exited.set()
        hb.join()
    duration = time.time() - t0
    tail = _log_tail(log_path)
    if server is not None and (
        rc != 0 or _was_preempted(tail) or server.trials >= opts.max_trials_per_process
    ):
        server.retire()  # the next trial starts in a fresh process
    if lost.is_set():
        store.log_event({"event": "claim_lost", "trial_id": trial.trial_id, "owner": owner})
        return "lost"
    if stop is not None and stop.is_set():
        store.release(trial.trial_id, owner)
        return "stopped"
    if timed_out.is_set():
        tail += f"\nkilled by the sweep: attempt exceeded timeout_s={opts.timeout_s:g}"
        rc = TIMEOUT_EXIT_CODE
    attempt = {
        "owner": owner,
        "exit_code": rc,
        "duration_s": round(duration, 2),
        "start": t0,
        "error_tail": tail if rc else "",
    }
    preempted = rc == 0 and _was_preempted(tail)
    if preempted:
        attempt["preempted"] = True
    store.record_attempt(trial.trial_id, attempt)
    attempts = store.attempts(trial.trial_id)
    if preempted:
        # SIGTERM reached the trainer: it checkpointed and exited 0 without finishing. Run it
        # again (it resumes); not a failure, so no retry is used up.
        store.log_event(
            {"event": "preempted", "trial_id": trial.trial_id, "attempt": len(attempts)}
        )
        store.release(trial.trial_id, owner)
        return "preempted"
    if rc == 0:
        row = result_row(store, trial, "SUCCESS", attempts, opts)
        outcome = "success"
    elif rc == DIVERGED_EXIT_CODE:
        row = result_row(store, trial, "DIVERGED", attempts, opts, error=tail)
        outcome = "diverged"
    elif _settled_status(attempts, opts.max_retries, opts.max_takeovers) is None:
        store.log_event(
            {
                "event": "retry",
                "trial_id": trial.trial_id,
                "exit_code": rc,
                "attempt": len(attempts),
            }
        )
        store.release(trial.trial_id, owner)
        return "retry"
    else:
        row = result_row(store, trial, "FAILED", attempts, opts, error=tail)
        outcome = "failed"
    store.append_result(row)
    store.release(trial.trial_id, owner)
    return outcome


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _was_preempted(log_tail: str) -> bool:
    """Whether the train command's result (its last JSON line) says ``"preempted": true``."""
    for line in reversed(log_tail.splitlines()):
        if line.startswith("{"):
            try:
                return bool(json.loads(line).get("preempted"))
            except (json.JSONDecodeError, AttributeError):
                return False
    return False


def _log_tail(path: Path, n: int = 4000) -> str:
    data = path.read_bytes()[-n:]
    return data.decode(errors="replace")


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # metrics.jsonl of a killed attempt may end in a partial line
    return rows


def _finite(row: dict) -> dict:
    """Non-finite metrics (e.g. AUC of a one-class eval set) become None: JSON has no NaN."""
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()
    }


def result_row(
    store: SweepStore,
    trial: Trial,
    status: str,
    attempts: list[dict],
    opts: WorkerOptions,
    *,
    error: str = "",
) -> dict[str, Any]:
    """The results.jsonl row of a finished trial."""
    workdir = store.workdir(trial.trial_id)
    evals = [_finite(r) for r in _jsonl(workdir / "metrics.jsonl") if r.get("split") == "eval"]
    final = evals[-1] if evals and evals[-1].get("step") == trial.steps else None
    if trial.branch_of:  # steps 1..branch_step are the stable run's, and so are their evals
        shared = _jsonl(store.workdir(trial.branch_of) / "metrics.jsonl")
        evals = [
            _finite(r)
            for r in shared
            if r.get("split") == "eval" and r.get("step", 0) <= trial.branch_step
        ] + evals
    higher_better = opts.metric == "auc"
    scored = [r for r in evals if r.get(opts.metric) is not None]
    best = (max if higher_better else min)(scored, key=lambda r: r[opts.metric]) if scored else None
    info = (
        json.loads((workdir / "run_info.json").read_text())
        if (workdir / "run_info.json").exists()
        else {"starts": []}
    )
    starts = info["starts"]
    last = starts[-1] if starts else {}
    diverged_at = None
    m = re.search(r"non-finite training loss \S+ at step (\d+)", error)
    if m:
        diverged_at = int(m.group(1))
    code = opts.code_version
    return {
        "trial_id": trial.trial_id,
        "sweep": opts.sweep,
        "status": status,
        "family": trial.family,
        "rung": trial.rung,
        "rung_index": trial.rung_index,
        "budget": trial.budget,
        "compute": trial.compute,
        "flops_per_example": trial.flops_per_example,
        "flops_convention": FLOPS_CONVENTION,
        "examples": trial.examples,
        "steps": trial.steps,
        "branch_of": trial.branch_of or None,
        "shared_steps": trial.branch_step,
        "own_steps": trial.steps - trial.branch_step,
        "own_compute": trial.own_compute,
        "batch_size": trial.batch_size,
        "learning_rate": trial.config["dense_optim"]["learning_rate"],
        "embedding_learning_rate": trial.config["embedding_optim"]["learning_rate"],
        "params_dense": trial.params_dense,
        "params_sparse": trial.params_sparse,
        "seed": trial.seed,
        "final": final,
        "best": best,
        "diverged_at_step": diverged_at,
        "error": error,
        "attempts": len(attempts),
        # (a branch's first start is at its branch point: not a resume)
        "resumed_from_step": max((s["start_step"] for s in starts[1:]), default=0),
        "wall_time_s": round(sum(a.get("duration_s", 0.0) for a in attempts), 2),
        "device_kind": last.get("device_kind"),
        "host_cpu": last.get("host_cpu"),
        "device_count": last.get("device_count"),
        "process_count": last.get("process_count"),
        "versions": last.get("versions"),
        "code_version": code,
        "git_sha": code.split("+", 1)[1].split(".")[0] if "+" in code else None,
        "data_fingerprint": opts.data_fingerprints.get(trial.family),
        "finished_at": time.time(),
        "config": trial.config,
    }
