"""What stops or rewinds training: preemption notices, non-finite steps (skip, raise or roll
back, ``train.nonfinite*``), and errors that must not lose an in-flight checkpoint."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from recscale import config as config_lib
from recscale.train.checkpoint import Checkpointer


@contextlib.contextmanager
def closed_on_error(ckpt: Checkpointer) -> Iterator[None]:
    """Lets in-flight asynchronous saves commit before an error (e.g. a divergence) ends the
    process: they would otherwise fail at exit and bury the error under their tracebacks."""
    try:
        yield
    except BaseException:
        ckpt.close()
        raise


class Preemption:
    """A preemption notice, read at each step boundary.

    Within it, SIGTERM sets a flag instead of killing the process (the previous handler is
    restored on exit; outside the main thread, where Python cannot install handlers, it stays
    unset); multi-process runs agree on the step through JAX's preemption sync point
    (``jax.distributed``).
    """

    def __init__(self):
        self._event = threading.Event()
        self._previous: Any = None

    def reached(self, done: int) -> bool:
        """Whether training stops after step ``done`` (a collective in multi-process runs)."""
        return self._event.is_set() or (
            jax.process_count() > 1 and multihost_utils.reached_preemption_sync_point(done)
        )

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda *_: self._event.set())
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class NonfiniteGuard:
    """Reads the steps' ``nonfinite`` flags in step order and applies ``train.nonfinite*``.

    ``observe`` raises ``FloatingPointError`` (``raise``; or ``nonfinite_max_consecutive`` bad
    steps in a row) or returns the step indices of the ``nonfinite_rollback`` bad steps in a row
    that call for a rollback; ``total`` counts every non-finite step of the run.
    """

    def __init__(self, tcfg: config_lib.TrainConfig, total: int = 0):
        self.mode = tcfg.nonfinite
        self.rollback = tcfg.nonfinite_rollback
        self.limit = tcfg.nonfinite_max_consecutive
        self.total = total
        self.streak: list[int] = []

    def observe(self, step: int, row: dict) -> list[int] | None:
        if not row["nonfinite"]:
            self.streak = []
            return None
        self.total += 1
        self.streak.append(step)
        # The wording "non-finite training loss X at step N" is what sweeps parse (DIVERGED).
        where = f"non-finite training loss {row['loss']} at step {step + 1}"
        if self.mode == "raise":
            raise FloatingPointError(f"{where} (train.nonfinite=raise; the step was not applied)")
        if self.mode != "skip":
            return None
        if self.rollback and len(self.streak) >= self.rollback:
            bad, self.streak = self.streak, []
            return bad
        if self.limit and len(self.streak) >= self.limit:
            raise FloatingPointError(
                f"{where}: {len(self.streak)} non-finite steps in a row, all skipped "
                "(train.nonfinite_max_consecutive)"
            )
        return None


def rollback_point(bad: list[int], checkpoints: list[int]) -> tuple[int, int]:
    """``(checkpoint, step)`` of a rollback over the ``bad`` steps in a row: the last checkpoint
    from before them, and the step to go on from (after them; the batches from that checkpoint
    to the last bad step are skipped)."""
    good = [c for c in checkpoints if c <= bad[0]]
    if not good:
        raise FloatingPointError(
            f"non-finite training loss at step {bad[-1] + 1}: {len(bad)} non-finite "
            f"steps in a row (from step {bad[0] + 1}) and no checkpoint at or "
            f"before step {bad[0]} to roll back to (set train.checkpoint_every)"
        )
    return max(good), bad[-1] + 1


def train_row(rows: list[dict], mode: str, step: int) -> dict:
    """The train row of ``rows`` (the steps since the last one): means of the applied steps'
    metrics (every step's under ``ignore``) and ``nonfinite_steps``, the count of the others.
    A row of skipped steps only has no loss."""
    bad = sum(bool(r["nonfinite"]) for r in rows)
    used = rows if mode == "ignore" else [r for r in rows if not r["nonfinite"]]
    row = {
        k: float(np.mean([r[k] for r in used]))
        for k in (used[0] if used else ())
        if k != "nonfinite"
    }
    if mode == "ignore" and not np.isfinite(row["loss"]):
        raise FloatingPointError(f"non-finite training loss {row['loss']} at step {step}")
    row["nonfinite_steps"] = bad
    return row
