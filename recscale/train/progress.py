"""The trainer's progress display (``train.progress``), on process 0: a rich bar on a terminal
or in a notebook; elsewhere (a run logged to a file, a sweep's worker) one plain line per log
interval on stderr, such as ``step 250/2000  loss 0.1423  12,345 ex/s  ETA 4m12s``."""

from __future__ import annotations

import sys
import time

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as Bar


def duration(seconds: float) -> str:
    """``45s``, ``4m12s``, ``3h05m``."""
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """``advance`` after each step, ``logged`` with each train row; a context manager."""

    def __init__(self, enabled: bool, total: int, start: int):
        on = enabled and jax.process_index() == 0
        # Off a terminal (rich's judgement, made now: its environment variables count) rich
        # would draw the bar once, at the end: lines instead.
        c = Console()
        self.plain = on and not (c.is_interactive or c.is_jupyter)
        self.total = total
        self._bar = Bar(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=c,
            disable=not on or self.plain,
        )
        self._task = self._bar.add_task("train", total=total, completed=start, info="")
        self._last = (time.perf_counter(), start)  # for the ETA: the latest interval's pace

    def __enter__(self) -> Progress:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def advance(self, done: int) -> None:
        """Step ``done`` (counted from 1) finished."""
        self._bar.update(self._task, completed=done)

    def logged(self, done: int, row: dict) -> None:
        """A train row at step ``done`` (``loss``, absent when every step of it was skipped,
        ``examples_per_sec``, ``nonfinite_steps``)."""
        eps = row["examples_per_sec"]
        if not self.plain:
            if "loss" in row:
                self._bar.update(self._task, info=f"loss {row['loss']:.4f}  {eps:,.0f} ex/s")
            return
        now = time.perf_counter()
        (t0, s0), self._last = self._last, (now, done)
        parts = [f"step {done}/{self.total}"]
        if "loss" in row:
            parts.append(f"loss {row['loss']:.4f}")
        if row.get("nonfinite_steps"):
            parts.append(f"{row['nonfinite_steps']} non-finite steps skipped")
        parts.append(f"{eps:,.0f} ex/s")
        if done > s0:
            parts.append(f"ETA {duration((self.total - done) * (now - t0) / (done - s0))}")
        print("  ".join(parts), file=sys.stderr, flush=True)
