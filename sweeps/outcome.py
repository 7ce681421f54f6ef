"""What a trial's attempts came to, and the results row of a finished trial (``sweeps.runner``
records both): a settled status, a branch's wait for its stable run, the row's metrics and
costs read from the trial's run folder."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

from recscale.train import DIVERGED_EXIT_CODE
from sweeps.spec import FLOPS_CONVENTION
from sweeps.store import SweepStore
from sweeps.trial import Trial

TIMEOUT_EXIT_CODE = -1000
"""Recorded exit code of an attempt the worker killed for exceeding ``timeout_s``."""
TAKEOVER = "takeover"
"""Recorded exit code of an attempt whose worker died (found stale and taken over)."""


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


def settled_status(attempts: list[dict], max_retries: int, max_takeovers: int = 3) -> str | None:
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


def was_preempted(log_tail: str) -> bool:
    """Whether the train command's result (its last JSON line) says ``"preempted": true``."""
    for line in reversed(log_tail.splitlines()):
        if line.startswith("{"):
            try:
                return bool(json.loads(line).get("preempted"))
            except (json.JSONDecodeError, AttributeError):
                return False
    return False


def log_tail(path: Path, n: int = 4000) -> str:
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
    opts: Any,
    *,
    error: str = "",
) -> dict[str, Any]:
    """The results.jsonl row of a finished trial (``opts``: its worker's
    ``sweeps.runner.WorkerOptions``)."""
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
