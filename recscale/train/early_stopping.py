"""Early stopping (``train.early_stopping_*``): the best evaluation so far, its parameters in
``checkpoints_best/``, and the end of training once ``patience`` evaluations in a row did not
improve on it; the run's result is then the best parameters' full evaluation."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from recscale import config as config_lib
from recscale.train.checkpoint import Checkpointer
from recscale.train.experiment import Experiment
from recscale.train.hooks import Hook
from recscale.train.run_files import MetricsWriter
from recscale.train.steps import TrainState
from recscale.train.timing import PhaseTimer

BEST_DIR = "checkpoints_best"
"""Workdir folder of the early-stopping best checkpoint (parameters and batch stats)."""


class BestTracker:
    """Best-so-far tracking of one validation metric (``train.early_stopping_*``); its state
    goes into every checkpoint's meta, so a resumed run keeps its best and its patience."""

    def __init__(self, tcfg: config_lib.TrainConfig):
        self.metric = tcfg.early_stopping_metric
        self.patience, self.min_delta = tcfg.early_stopping_patience, tcfg.early_stopping_min_delta
        self.sign = 1.0 if self.metric == "auc" else -1.0  # larger is better after the sign
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.bad = 0
        self.stopped = False
        self.observed: int | None = None  # the last step evaluated

    def observe(self, step: int, ev: dict) -> bool:
        """Records an evaluation; returns whether it is the new best (``stopped`` is set once
        ``patience`` evaluations in a row did not improve)."""
        value = float(ev[self.metric])
        self.observed = step
        if not np.isfinite(value):  # e.g. a one-class AUC on few batches: never a best
            self.bad += 1
            self.stopped = self.bad >= self.patience
            return False
        if self.best_value is None or self.sign * (value - self.best_value) > self.min_delta:
            self.best_value, self.best_step, self.bad = value, step, 0
            return True
        self.bad += 1
        self.stopped = self.bad >= self.patience
        return False

    def state(self) -> dict:
        return {
            "best_value": self.best_value,
            "best_step": self.best_step,
            "bad": self.bad,
            "stopped": self.stopped,
            "observed": self.observed,
        }

    def load(self, state: dict | None) -> None:
        if state:
            self.best_value, self.best_step = state["best_value"], state["best_step"]
            self.bad, self.stopped = state["bad"], state["stopped"]
            self.observed = state.get("observed")


class EarlyStopping(Hook):
    """The trainer's early stopping: a :class:`BestTracker` over the evaluations, each new best
    saved to ``checkpoints_best/`` at once, its state in every regular checkpoint's meta."""

    needs_every_eval = True  # the resumed run goes on after a preemption's evaluation step

    def __init__(
        self,
        tcfg: config_lib.TrainConfig,
        workdir: Path,
        exp: Experiment,
        writer: MetricsWriter,
        timer: PhaseTimer,
        layout: dict,
    ):
        self.tracker = BestTracker(tcfg)
        self.max_batches = tcfg.eval_max_batches
        self.exp, self.writer, self.timer, self.layout = exp, writer, timer, layout
        # Every best is kept until a committed regular checkpoint records a later one (see
        # ``after_save``): a kill between a new best and the next checkpoint must not lose the
        # best the resumed state points at.
        self.best_ckpt = Checkpointer(workdir / BEST_DIR, max_to_keep=None, async_save=False)
        self._best_in_saved: int | None = None  # best step recorded by the last regular save
        self._result_of: int | None = None  # the best step the run's result evaluated

    def start(self, restored: int | None, meta: dict, step: int) -> None:
        self.tracker.load(meta.get("early_stopping"))
        for s in self.best_ckpt.all_steps():  # bests after ``step`` belong to a lost future
            if s > step:
                self.best_ckpt.delete(s)
        self._best_in_saved = self.tracker.best_step

    def evaluated(self, step: int, ev: dict, state: TrainState) -> None:
        """Records an evaluation; a new best is saved to ``checkpoints_best/`` at once."""
        # A resumed run replays bitwise, so a best step saved before the kill is saved again
        # identically: it is kept, not overwritten.
        if self.tracker.observe(step, ev) and step not in self.best_ckpt.all_steps():
            with self.timer.phase("checkpoint"):
                trees = {"params": state.params, "batch_stats": state.batch_stats}
                self.best_ckpt.save(
                    step, trees, {"step": step, "layout": self.layout, "metric": ev}
                )

    def stop_reason(self) -> str | None:
        t = self.tracker
        if not t.stopped:
            return None
        return (
            f"early stopping at step {t.observed}: {t.metric} did not improve on "
            f"{t.best_value:.6g} (step {t.best_step}) in {t.patience} evaluations"
        )

    def meta(self) -> dict:
        return {"early_stopping": self.tracker.state()}

    def after_save(self, step: int, ckpt: Checkpointer) -> None:
        # ``ckpt.save`` waited for the previous regular save: it is committed, and so is the
        # best it records; older bests are no longer reachable by any resume.
        self._purge_bests(below=self._best_in_saved)
        self._best_in_saved = self.tracker.best_step

    def _purge_bests(self, below: int | None) -> None:
        for s in self.best_ckpt.all_steps():
            if below is not None and s < below:
                self.best_ckpt.delete(s)

    def wants_final_eval(self, step: int) -> bool:
        # The last step is a candidate too (BARS evaluates after the last epoch): observed
        # before the final checkpoint, whose meta then records it.
        return not self.tracker.stopped and self.tracker.observed != step

    def result(self, step: int, last: dict | None) -> dict | None:
        """The best parameters, evaluated on the whole eval set (``last``, when the last step
        is the best and its evaluation was of the whole set)."""
        best = self.tracker.best_step
        if best is None:
            return None
        if best not in self.best_ckpt.all_steps():
            raise FileNotFoundError(
                f"early stopping: best step {best} is not in {self.best_ckpt.directory} (it has "
                f"{self.best_ckpt.all_steps()}); was train.num_steps lowered on resume?"
            )
        ev = last if self.max_batches == 0 and best == step else None
        with self.timer.phase("final_eval"):
            if ev is None:
                abstract = self.exp.abstract_state
                trees, _ = self.best_ckpt.restore(
                    best, {"params": abstract.params, "batch_stats": abstract.batch_stats}
                )
                ev = self.exp.evaluate(trees["params"], trees["batch_stats"])
            self.writer.write({"step": best, "split": "eval_best", **ev})
        self._result_of = best
        return {"step": step, "best_step": best, "stopped_early": self.tracker.stopped, **ev}

    def close(self) -> None:
        # After the result every regular checkpoint is committed (the loop closed them first):
        # only the best is needed.
        if self._result_of is not None:
            self._purge_bests(below=self._result_of)
        self.best_ckpt.close()
