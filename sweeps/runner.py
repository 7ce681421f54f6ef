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
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from data import _child
from recscale.train import DIVERGED_EXIT_CODE
from sweeps.outcome import (
    TAKEOVER,
    TIMEOUT_EXIT_CODE,
    branch_ready,
    log_tail,
    result_row,
    settled_status,
    stable_ended,
    was_preempted,
)
from sweeps.spec import Trial
from sweeps.store import SweepStore


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


def units(trials: list[Trial]) -> list[tuple[Trial, ...]]:
    """The work a worker claims and runs at once: a population's members together (where its
    first member stands in ``trials``), every other trial alone."""
    out: list[list[Trial]] = []
    by_population: dict[tuple[str, ...], list[Trial]] = {}
    for t in trials:
        if t.population and t.population in by_population:
            by_population[t.population].append(t)
            continue
        out.append([t])
        if t.population:
            by_population[t.population] = out[-1]
    return [tuple(u) for u in out]


def _work(store, todo, opts, owner, stop, done, server) -> None:
    warm: set[tuple[str, str]] = set()  # sizes this worker's process has compiled
    work = units(todo)
    while not (stop and stop.is_set()):
        finished = store.finished_ids()
        remaining = [
            u for u in (tuple(t for t in u if t.trial_id not in finished) for u in work) if u
        ]
        if not remaining:
            break
        if server is None or not server.alive():
            warm.clear()  # a fresh process (or one per trial) holds no programs
        order = {
            t.trial_id: i
            for i, t in enumerate(claim_order([u[0] for u in remaining], warm, store, owner))
        }
        claimed: tuple[Trial, ...] = ()
        rows: list = []  # results, read once a branch needs them
        for unit in sorted(remaining, key=lambda u: order[u[0].trial_id]):
            claimed = _claim(store, unit, owner, opts, rows)
            if claimed:
                break
        if not claimed:
            if not opts.wait:
                break
            time.sleep(opts.poll_s)
            continue
        for outcome in run_trial(store, claimed, owner, opts, stop, server):
            done["ran"] += 1
            done[outcome] = done.get(outcome, 0) + 1
        warm.add(program_group(claimed[0]))


def _claim(store, unit, owner, opts, rows: list) -> tuple[Trial, ...]:
    """Claims ``unit``'s members and returns those to run: none while a branch's point is not
    on disk yet or another worker holds a member; members whose outcome is already settled
    (their stable run ended before their point, or their last attempt finished before its
    worker died) get their rows instead."""
    ended = {}
    for t in unit:
        if t.branch_of:
            if not rows:
                rows.append({r["trial_id"]: r for r in store.results()})
            end = stable_ended(store, t, rows[0])
            if not branch_ready(store, t):
                if end is None:
                    return ()  # its stable run has not reached the branch point yet
                ended[t.trial_id] = end
    kinds = []
    for t in unit:
        kind = store.claim(t.trial_id, owner)
        if not kind:
            for c, _ in kinds:
                store.release(c.trial_id, owner)
            return ()
        kinds.append((t, kind))
    run = []
    for t, kind in kinds:
        if t.trial_id in ended:
            status, error = ended[t.trial_id]
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
        status = settled_status(attempts, opts.max_retries, opts.max_takeovers)
        if status is not None:
            # Its last attempt settled it, but that worker died before writing the row.
            error = attempts[-1].get("error_tail", "") if status != "SUCCESS" else ""
            store.append_result(result_row(store, t, status, attempts, opts, error=error))
            store.release(t.trial_id, owner)
            continue
        run.append(t)
    return tuple(run)


def _command(store: SweepStore, members: tuple[Trial, ...]) -> tuple[list[str], Path]:
    """The train command of ``members`` and the log it writes: a trial's own command and
    ``train.log``; a population's ``python -m recscale.population`` over its members' configs
    and folders, logged under ``populations/`` (each member's ``train.log`` points there)."""
    if len(members) == 1:
        t = members[0]
        tdir = store.trial_dir(t.trial_id)
        return t.train_command(tdir / "config.json", store.workdir(t.trial_id)), tdir / "train.log"
    ids = [t.trial_id for t in members]
    argv = [
        "-m",
        "recscale.population",
        "--package",
        members[0].package,
        "--configs",
        *(str(store.trial_dir(i) / "config.json") for i in ids),
        "--workdirs",
        *(str(store.workdir(i)) for i in ids),
    ]
    log = store.root / "populations" / f"{'-'.join(i[:6] for i in ids)}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    for i in ids:
        with open(store.trial_dir(i) / "train.log", "a") as f:
            f.write(f"\n=== {time.ctime()}: in a population of {len(ids)}, logged in {log}\n")
    return argv, log


def _member_results(tail: str, n: int) -> list[dict]:
    """Each member's result from a population's last JSON line (``recscale.population``)."""
    for line in reversed(tail.splitlines()):
        if line.startswith("{"):
            try:
                results = json.loads(line).get("population")
            except (json.JSONDecodeError, AttributeError):
                break
            if isinstance(results, list) and len(results) == n:
                return results
            break
    return [{} for _ in range(n)]


def run_trial(
    store: SweepStore,
    members: tuple[Trial, ...],
    owner: str,
    opts: WorkerOptions,
    stop: threading.Event | None = None,
    server: TrialServer | None = None,
) -> list[str]:
    """Runs one claimed trial, or a population's claimed members as one process, to an outcome
    per trial: success, diverged, failed, retry, preempted, lost or stopped.

    With a ``server`` it runs in the worker's long-lived process (replaced afterwards unless
    it exited 0 unpreempted), otherwise in a process of its own. A population's wall time is
    shared among its members' attempts (each records its share, so a sweep's summed trial
    wall time is what it took), and its members' outcomes are their own (one may diverge)."""
    argv, log_path = _command(store, members)
    ids = [t.trial_id for t in members]
    t0 = time.time()
    lost = threading.Event()
    timed_out = threading.Event()
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
                if not all([store.heartbeat(i, owner) for i in ids]):
                    lost.set()  # another worker took one over: stop writing into its workdir
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
            for i in ids:
                store.release(i, owner)
            raise
        finally:
            exited.set()
        hb.join()
    duration = time.time() - t0
    tail = log_tail(log_path)
    if server is not None and (
        rc != 0 or was_preempted(tail) or server.trials >= opts.max_trials_per_process
    ):
        server.retire()  # the next trial starts in a fresh process
    if lost.is_set():
        for i in ids:
            store.log_event({"event": "claim_lost", "trial_id": i, "owner": owner})
        return ["lost"] * len(ids)
    if stop is not None and stop.is_set():
        for i in ids:
            store.release(i, owner)
        return ["stopped"] * len(ids)
    if timed_out.is_set():
        tail += f"\nkilled by the sweep: attempt exceeded timeout_s={opts.timeout_s:g}"
        rc = TIMEOUT_EXIT_CODE
    preempted = rc == 0 and was_preempted(tail)
    results = _member_results(tail, len(members)) if len(members) > 1 else [{}]
    return [
        _record(store, t, owner, opts, rc, tail, preempted, res, t0, duration, len(members))
        for t, res in zip(members, results, strict=True)
    ]


def _record(store, trial, owner, opts, rc, tail, preempted, result, t0, duration, k) -> str:
    """Records one trial's attempt (run with ``k - 1`` others: its share of the ``duration``)
    and, when it is settled, its results row; returns its outcome."""
    attempt = {
        "owner": owner,
        "exit_code": rc,
        "duration_s": round(duration / k, 2),
        "start": t0,
        "error_tail": tail if rc else "",
    }
    if k > 1:
        attempt["population"] = k
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
    if rc == 0 and result.get("diverged"):  # a population member stopped by train.nonfinite*
        row = result_row(store, trial, "DIVERGED", attempts, opts, error=result["diverged"])
        outcome = "diverged"
    elif rc == 0:
        row = result_row(store, trial, "SUCCESS", attempts, opts)
        outcome = "success"
    elif rc == DIVERGED_EXIT_CODE:
        row = result_row(store, trial, "DIVERGED", attempts, opts, error=tail)
        outcome = "diverged"
    elif settled_status(attempts, opts.max_retries, opts.max_takeovers) is None:
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
