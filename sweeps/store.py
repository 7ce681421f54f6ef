"""The sweep directory: per-trial claims with heartbeats, attempt logs and append-only results.

Layout of ``SWEEP_DIR``::

    sweep.json            the resolved sweep (code version, data fingerprints, trial ids, skips)
    results.jsonl         one row per finished trial (SUCCESS, FAILED after retries, DIVERGED)
    events.jsonl          claims, take-overs, retries, exclusions: the launcher's audit log
    .lock                 flock'd around every read-modify-write of claims and results
    trials/<id>/
        trial.json        the trial (``sweeps.spec.Trial``)
        config.json       its resolved config, the file the train command is given
        claim.json        who runs it; the file's mtime is the heartbeat
        attempts.jsonl    one row per attempt (exit status, duration, error tail)
        train.log         stdout + stderr of every attempt
        run/              the train workdir (checkpoints, metrics.jsonl, run_info.json)

Concurrency: every decision (claim, take-over, heartbeat, result append) happens under an
exclusive ``fcntl.flock`` of ``.lock``, so two launchers, or the workers of one Ray/SLURM launch,
never both claim a trial. ``flock`` is exact on a local disk; on NFS (a cluster's shared home)
Linux maps it to POSIX byte-range locks, which NFSv4 servers honour. A claim whose heartbeat is
older than ``stale_after`` seconds belongs to a dead worker and may be taken over; the new owner
runs the same train command in the same workdir, which resumes from the trial's last checkpoint.

``results.jsonl`` is append-only. A worker killed mid-append can leave a truncated last line:
readers skip it (counted in ``ResultsFile.truncated``) and the next append moves it to
``results.truncated.jsonl`` before writing, so the trial, having no row, is simply run again.
A malformed line anywhere else is corruption and raises, naming the line.

``attempts.jsonl`` and ``events.jsonl`` are bookkeeping, read tolerantly: a line that is not a
JSON object (a torn append, left mid-file once the next append starts on a line of its own) is
skipped, counted and reported once, so a killed worker costs its trial at most an uncounted
attempt, never the trial itself. Every other file (``sweep.json``, ``trial.json``,
``config.json``, claims) is replaced whole: written to a temporary file in the same folder and
renamed over the old one (:func:`atomic_write_text`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FINISHED = ("SUCCESS", "FAILED", "DIVERGED")


class SweepStore:
    """Claims, statuses and results of one sweep directory."""

    def __init__(self, root: str | Path, *, stale_after: float = 60.0):
        self.root = Path(root)
        self.stale_after = float(stale_after)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "trials").mkdir(exist_ok=True)
        self.results_path = self.root / "results.jsonl"

    # -- paths -------------------------------------------------------------------------------

    def trial_dir(self, trial_id: str) -> Path:
        return self.root / "trials" / trial_id

    def workdir(self, trial_id: str) -> Path:
        return self.trial_dir(trial_id) / "run"

    def _claim_path(self, trial_id: str) -> Path:
        return self.trial_dir(trial_id) / "claim.json"

    # -- locking -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        with open(self.root / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # -- results -----------------------------------------------------------------------------

    def results(self) -> list[dict]:
        return read_results(self.results_path).rows

    def finished_ids(self) -> set[str]:
        return {r["trial_id"] for r in self.results()}

    def append_result(self, row: dict) -> bool:
        """Appends ``row`` unless its trial already has one; returns whether it was written."""
        line = json.dumps(row, sort_keys=True, allow_nan=False) + "\n"
        with self.lock():
            _repair_tail(self.results_path)
            if row["trial_id"] in self.finished_ids():
                return False
            with open(self.results_path, "a") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        return True

    # -- claims ------------------------------------------------------------------------------

    def claim(self, trial_id: str, owner: str) -> str | None:
        """Claims ``trial_id`` for ``owner``: returns ``"new"``, ``"takeover"`` (the previous
        owner's heartbeat is stale) or None (finished, or claimed by a live owner)."""
        with self.lock():
            if trial_id in self.finished_ids():
                return None
            path = self._claim_path(trial_id)
            kind = "new"
            if path.exists():
                age = time.time() - path.stat().st_mtime
                prev = _read_json(path)
                if prev.get("owner") != owner and age < self.stale_after:
                    return None
                kind = "takeover"
                self.log_event(
                    {
                        "event": "takeover",
                        "trial_id": trial_id,
                        "owner": owner,
                        "previous": prev.get("owner"),
                        "heartbeat_age_s": round(age, 1),
                    }
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(
                path,
                {
                    "owner": owner,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "claimed_at": time.time(),
                },
            )
            self.log_event({"event": "claim", "trial_id": trial_id, "owner": owner, "kind": kind})
            return kind

    def heartbeat(self, trial_id: str, owner: str) -> bool:
        """Refreshes the claim's heartbeat; False when ``owner`` no longer holds it."""
        with self.lock():
            path = self._claim_path(trial_id)
            if not path.exists() or _read_json(path).get("owner") != owner:
                return False
            os.utime(path)
            return True

    def release(self, trial_id: str, owner: str) -> None:
        with self.lock():
            path = self._claim_path(trial_id)
            if path.exists() and _read_json(path).get("owner") == owner:
                path.unlink()

    def claim_state(self, trial_id: str) -> tuple[str, float] | None:
        """(owner, heartbeat age in seconds) of the current claim, or None."""
        path = self._claim_path(trial_id)
        try:
            age = time.time() - path.stat().st_mtime
            return _read_json(path).get("owner", "?"), age
        except FileNotFoundError:
            return None

    # -- attempts and events -----------------------------------------------------------------

    def attempts(self, trial_id: str) -> list[dict]:
        """The trial's recorded attempts, torn lines skipped (:func:`read_tolerant`)."""
        return read_tolerant(self.trial_dir(trial_id) / "attempts.jsonl").rows

    def record_attempt(self, trial_id: str, row: dict) -> None:
        append_line(self.trial_dir(trial_id) / "attempts.jsonl", json.dumps(row, sort_keys=True))

    def log_event(self, row: dict) -> None:
        append_line(
            self.root / "events.jsonl", json.dumps({"time": time.time(), **row}, sort_keys=True)
        )

    def status(self, trial_id: str, results: dict[str, dict] | None = None) -> str:
        """SUCCESS / FAILED / DIVERGED (finished), RUNNING (live claim), STALE (dead claim), or
        PENDING (never started, or waiting for a retry)."""
        results = results if results is not None else {r["trial_id"]: r for r in self.results()}
        if trial_id in results:
            return results[trial_id]["status"]
        state = self.claim_state(trial_id)
        if state is None:
            return "PENDING"
        return "RUNNING" if state[1] < self.stale_after else "STALE"


class ResultsFile:
    def __init__(self, rows: list[dict], truncated: int):
        self.rows = rows
        self.truncated = truncated
        """1 when the file ended in a partial line that was skipped, else 0."""


def read_results(path: str | Path) -> ResultsFile:
    """Parses a JSONL file, skipping a truncated final line (a writer killed mid-append)."""
    path = Path(path)
    if not path.exists():
        return ResultsFile([], 0)
    data = path.read_bytes()
    lines = data.split(b"\n")
    truncated = 0
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:  # no final newline: the last line was cut short
        lines.pop()
        truncated = 1
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: malformed JSON line ({e}); the file is corrupt") from e
    return ResultsFile(rows, truncated)


_warned: set[Path] = set()


def read_tolerant(path: str | Path) -> ResultsFile:
    """The JSON objects of a bookkeeping JSONL file; a line that is not one (cut short by a
    killed writer, or garbage) is skipped and counted in ``truncated``, and reported once per
    file and process on stderr."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ResultsFile([], 0)
    rows, torn = [], []
    for i, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            torn.append(i)
    if torn and path not in _warned:
        _warned.add(path)
        print(
            f"warning: {path}: skipped {len(torn)} torn or malformed line(s) "
            f"(line {', '.join(map(str, torn[:5]))}): a writer was killed mid-append",
            file=sys.stderr,
        )
    return ResultsFile(rows, len(torn))


def append_line(path: Path, line: str) -> None:
    """Appends ``line`` on a line of its own: after a last line a killed writer left without
    its newline, a newline first (the torn line stays, and readers skip it)."""
    with open(path, "a+b") as f:
        end = f.seek(0, os.SEEK_END)
        torn = False
        if end:
            f.seek(end - 1)
            torn = f.read(1) != b"\n"
        f.write((b"\n" if torn else b"") + line.encode() + b"\n")


def _repair_tail(path: Path) -> None:
    """Moves a partial last line (no newline) to ``<stem>.truncated.jsonl`` (caller holds the
    lock)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    with open(path.with_name(path.stem + ".truncated.jsonl"), "ab") as f:
        f.write(data[cut:] + b"\n")
    with open(path, "r+b") as f:
        f.truncate(cut)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def atomic_write_text(path: Path, text: str) -> None:
    """Replaces ``path`` with ``text`` whole or not at all: written and synced to a new file of
    its own in the same folder, then renamed over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    f = open(tmp, "x")  # exclusive: a new file, so the cleanup below deletes only ours
    try:
        with f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _atomic_write(path: Path, obj: dict) -> None:
    atomic_write_text(path, json.dumps(obj, sort_keys=True) + "\n")
