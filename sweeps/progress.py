"""The launcher's live view of a sweep: done / running / failed / remaining, and an ETA.

It reads the sweep directory (results and claims, the same files every worker writes), so it
shows the whole sweep whatever backend runs it and however many launchers share it. The bar
and the ETA count the training FLOPs each trial runs itself (a cooldown branch's own steps),
not trials: trials differ in size by 10x or more, so a
count-based ETA would swing with the order they happen to finish in. On a terminal it is a
rich progress bar; otherwise (a log file, CI) one line every ``line_every_s`` seconds.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

from sweeps.store import SweepStore

_DONE = ("SUCCESS", "DIVERGED")


def own_compute(trial: dict) -> float:
    """The training FLOPs a trial (``sweeps.spec.Trial`` as a dict) runs itself: a cooldown
    branch's own steps, not those it shares with its stable run."""
    compute = trial["flops_per_example"] * trial["examples"]
    if trial.get("branch_step"):
        compute *= 1 - trial["branch_step"] / trial["steps"]
    return compute


def summarise(store: SweepStore, trials: list[dict]) -> dict[str, Any]:
    """Counts per state and the training FLOPs of the finished trials."""
    rows = {r["trial_id"]: r for r in store.results()}
    counts: Counter[str] = Counter()
    finished_compute = 0.0
    walls: list[tuple[float, float]] = []  # (compute, wall seconds) of finished trials
    unfinished: list[float] = []  # compute of running and remaining trials
    units: set = set()  # what the workers run now: a population's members run as one process
    for t in trials:
        status = store.status(t["trial_id"], rows)
        state = {
            "SUCCESS": "done",
            "DIVERGED": "done",
            "FAILED": "failed",
            "RUNNING": "running",
        }.get(status, "remaining")
        counts[state] += 1
        compute = own_compute(t)
        if state in ("done", "failed"):
            finished_compute += compute
            if state == "done":
                walls.append((compute, float(rows[t["trial_id"]].get("wall_time_s") or 0.0)))
        else:
            unfinished.append(compute)
            if state == "running":
                units.add(tuple(t.get("population") or ()) or t["trial_id"])
    return {
        "counts": counts,
        "running_units": len(units),
        "finished_compute": finished_compute,
        "walls": walls,
        "unfinished": unfinished,
    }


class SweepProgress:
    """A background thread that shows the sweep's state until :meth:`stop`."""

    def __init__(
        self,
        store: SweepStore,
        trials: list[dict],
        *,
        poll_s: float = 2.0,
        line_every_s: float = 30.0,
        stream=None,
    ):
        self.store, self.trials = store, trials
        self.poll_s, self.line_every_s = poll_s, line_every_s
        self.stream = stream or sys.stderr
        self.total = sum(own_compute(t) for t in trials)
        self.n_branches = sum(1 for t in trials if t.get("branch_of"))
        self.n_populations = len({tuple(t["population"]) for t in trials if t.get("population")})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start_compute = summarise(store, trials)["finished_compute"]
        self._t0 = time.time()

    def __enter__(self) -> SweepProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def line(self, s: dict[str, Any]) -> str:
        """``done / running / failed / remaining`` and the ETA from this launch's rate."""
        c = s["counts"]
        text = (
            f"{c['done']} done, {c['running']} running, {c['failed']} failed, "
            f"{c['remaining']} remaining of {len(self.trials)}"
        )
        shared = []
        if self.n_branches:
            shared.append(f"{len(self.trials) - self.n_branches} runs, {self.n_branches} branches")
        if self.n_populations:
            shared.append(f"{self.n_populations} populations")
        if shared:
            text += f" ({'; '.join(shared)})"
        eta = self.eta(s)
        if eta is None and s["unfinished"]:
            return text + ", ETA once a trial near the largest size has finished"
        return text + (f", ETA {_duration(eta)}" if eta is not None else "")

    def eta(self, s: dict[str, Any]) -> float | None:
        """Seconds left: each unfinished trial's wall time predicted as ``a + b * compute`` (a
        least-squares line through the finished trials: a trial costs a fixed overhead plus
        its compute), summed and shared among the processes running at once (a population's
        members are one process, and each records its share of the population's wall time).
        While the finished trials are all of about one size (within 2x: a line through them
        would have its slope set by their wall times' noise, e.g. hours per FLOP for the
        trials of one budget), their mean wall time per FLOP; with no finished trial, the FLOP
        rate of this launch so far. None (no ETA) while an unfinished trial is more than 10x
        the largest finished one: small trials are mostly fixed overhead, and their line says
        nothing of what a large one costs."""
        walls, running = s["walls"], max(s.get("running_units", s["counts"]["running"]), 1)
        if s["unfinished"] and max(s["unfinished"]) > 10 * max((c for c, _ in walls), default=0):
            return None
        if walls:
            x = np.array([c for c, _ in walls])
            y = np.array([w for _, w in walls])
            if x.max() >= 2 * x.min():
                b, a = np.polyfit(x, y, 1)
                a, b = max(a, 0.0), max(b, 0.0)
            else:
                a, b = 0.0, float(y.sum() / x.sum())
            return float(sum(a + b * c for c in s["unfinished"])) / running
        done_here = s["finished_compute"] - self._start_compute
        if done_here <= 0:
            return None
        rate = done_here / (time.time() - self._t0)
        return (self.total - s["finished_compute"]) / rate

    def _run(self) -> None:
        from rich.console import Console  # noqa: PLC0415

        console = Console(file=self.stream)
        if console.is_terminal:
            self._run_bar(console)
        else:
            last = 0.0
            while not self._stop.wait(self.poll_s):
                if time.time() - last >= self.line_every_s:
                    last = time.time()
                    print(
                        f"sweep: {self.line(summarise(self.store, self.trials))}",
                        file=self.stream,
                        flush=True,
                    )
            print(
                f"sweep: {self.line(summarise(self.store, self.trials))}",
                file=self.stream,
                flush=True,
            )

    def _run_bar(self, console) -> None:
        from rich.progress import BarColumn, Progress, TextColumn  # noqa: PLC0415

        with Progress(
            TextColumn("[bold]sweep"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
        ) as prog:
            task = prog.add_task("sweep", total=self.total or 1.0, info="")
            while True:
                s = summarise(self.store, self.trials)
                prog.update(task, completed=s["finished_compute"], info=self.line(s))
                if self._stop.wait(self.poll_s):
                    break


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
