"""The training loop: restore first, then jitted pure steps, evaluations and checkpoints.

:func:`train` is the whole of a run: the run files (``run_files``), the experiment under its
mesh (``experiment``), then :class:`_TrainRun`, the step loop. What plugs into training (tiered
tables, the noise scale, early stopping) is a hook (``hooks``, ``early_stopping``) the loop calls
at fixed points; what stops or rewinds it (preemption, non-finite steps) is in ``guards``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from data.batch import Batch
from data.sources import DataSource
from recscale import config as config_lib
from recscale import sharding
from recscale.embeddings import plan_inputs, relayout
from recscale.train import branches
from recscale.train import task as task_lib
from recscale.train.checkpoint import Checkpointer
from recscale.train.early_stopping import BEST_DIR as BEST_DIR  # re-exported (evaluation.py)
from recscale.train.early_stopping import EarlyStopping
from recscale.train.experiment import (
    BuildModel,
    Experiment,
    bound_phases,
    schedule_args,
    train_programs,
)
from recscale.train.experiment import make_optimizer as make_optimizer  # re-exported (tests)
from recscale.train.guards import (
    NonfiniteGuard,
    Preemption,
    closed_on_error,
    rollback_point,
    train_row,
)
from recscale.train.hooks import Hooks, NoiseScaleHook, TieredTablesHook
from recscale.train.progress import Progress
from recscale.train.run_files import (
    MetricsWriter,
    append_row,
    reads_per_process,
    write_run_files,
    write_run_info,
    write_run_notes,
)
from recscale.train.steps import TrainState, initial_rng
from recscale.train.timing import PhaseTimer


def train(
    cfg: Any, build_model: BuildModel, workdir: str | Path, *, argv: list[str] | None = None
) -> dict:
    """Trains ``cfg`` in ``workdir`` (resuming from its latest checkpoint) and returns final eval.

    On SIGTERM (preemption) it saves a checkpoint at the next step boundary, waits for every
    save to be committed and returns ``{"step": ..., "preempted": True}`` without evaluating;
    the same call again continues from there. Non-finite steps follow ``train.nonfinite*``
    (``guards.NonfiniteGuard``); a rollback writes a ``split="rollback"`` row to metrics.jsonl.
    Where the wall time went (setup, restore, data waits, training steps, evaluations,
    checkpoints, each with its compile seconds) is appended to ``timings.jsonl``.
    """
    workdir = Path(workdir)
    cfg = config_lib.absolute_paths(cfg)
    timer = PhaseTimer()
    with timer.phase("setup"):
        task_lib.of(cfg).check(cfg)  # before the measurements, which may read its data
        cfg = plan_inputs.resolve(cfg, workdir)  # measured skew, lookup calibration
        write_run_files(workdir, cfg, argv)
        mesh = sharding.make_mesh(cfg.mesh)
    with sharding.activate(mesh, cfg.mesh):
        with timer.phase("setup"):
            exp = Experiment.build(cfg, build_model, workdir=str(workdir))
            write_run_notes(workdir, exp)
        run = _TrainRun(cfg, build_model, exp, workdir, timer)
        with timer.phase("init"):
            run.restore_or_init()
        result = run.run()
        reads = reads_per_process(exp.source)
    span = {"start_step": run.start_step, "end_step": result["step"]}
    append_row(workdir / "timings.jsonl", {**span, **timer.summary()})
    append_row(workdir / "data_reads.jsonl", {**span, "processes": reads})
    return result


def state_items(state: TrainState) -> dict[str, Any]:
    """The checkpoint items of a (possibly abstract) train state; the step goes in the meta."""
    return {
        "params": state.params,
        "opt_state": state.opt_state,
        "batch_stats": state.batch_stats,
        "rng": {"key_data": state.rng},  # orbax saves pytrees, not bare arrays
    }


def state_from(trees: dict[str, Any], step: int) -> TrainState:
    """A train state at ``step`` from restored checkpoint items (``state_items``)."""
    step_arr = jax.device_put(jnp.asarray(step, jnp.int32), sharding.replicated())
    return TrainState(step=step_arr, **{**trees, "rng": trees["rng"]["key_data"]})


def step_flags(tcfg: Any, done: int, branch_steps: frozenset[int]) -> tuple[bool, bool, bool]:
    """``(log, checkpoint, evaluate)`` after step ``done`` of a run with ``train`` config
    ``tcfg``: a train row every ``log_every`` steps and at the end; a checkpoint every
    ``checkpoint_every`` steps and at the branch points, not at the end (the end saves its
    own); an evaluation every ``eval_every`` steps, not at the end (the final one is full)."""
    is_log = done % tcfg.log_every == 0 or done == tcfg.num_steps
    is_ckpt = done != tcfg.num_steps and (
        bool(tcfg.checkpoint_every and done % tcfg.checkpoint_every == 0) or done in branch_steps
    )
    is_eval = bool(tcfg.eval_every and done % tcfg.eval_every == 0 and done != tcfg.num_steps)
    return is_log, is_ckpt, is_eval


def prefetch(
    source: DataSource, start: int, stop: int, data_offset: int = 0
) -> Iterator[tuple[int, Batch]]:
    """``(step, host batch)`` for steps [start, stop), step ``s`` getting the stream's batch
    ``s + data_offset``, produced ahead on threads: two batches on two threads when the source
    says its ``train_batch`` may run concurrently (``parallel_batches``, e.g. the pure synthetic
    generator, whose numpy work releases the GIL), else one on one."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    ahead = 2 if getattr(source, "parallel_batches", False) else 1

    def get(step: int) -> Batch:
        return source.train_batch(step + data_offset)

    with ThreadPoolExecutor(max_workers=ahead) as pool:
        futs = deque(pool.submit(get, s) for s in range(start, min(start + ahead, stop)))
        for step in range(start, stop):
            batch = futs.popleft().result()
            if step + ahead < stop:
                futs.append(pool.submit(get, step + ahead))
            yield step, batch


def _hooks(
    cfg: Any,
    exp: Experiment,
    workdir: Path,
    writer: MetricsWriter,
    timer: PhaseTimer,
    layout: dict,
) -> Hooks:
    """The hooks ``cfg`` turns on, in the order the loop calls them."""
    tcfg, hooks = cfg.train, []
    if cfg.embeddings.tiers:
        hooks.append(TieredTablesHook(cfg, exp, workdir, timer))
    if tcfg.noise_scale_every:
        hooks.append(NoiseScaleHook(cfg, exp, writer, timer))
    if tcfg.early_stopping_metric:
        hooks.append(EarlyStopping(tcfg, workdir, exp, writer, timer, layout))
    return Hooks(hooks)


class _TrainRun:
    """One ``train()`` call, as named steps: :meth:`restore_or_init`, then :meth:`run`, which
    repeats :meth:`_steps` (train, read flags, log, evaluate, checkpoint, stop on preemption or
    a hook's word) and :meth:`_rollback` until the last step, and ends with :meth:`_finish`."""

    def __init__(
        self, cfg: Any, build_model: BuildModel, exp: Experiment, workdir: Path, timer: PhaseTimer
    ):
        self.cfg, self.tcfg, self.build_model, self.exp = cfg, cfg.train, build_model, exp
        self.timer, self.workdir = timer, workdir
        self.ckpt = Checkpointer(
            workdir / "checkpoints",
            max_to_keep=self.tcfg.max_checkpoints,
            async_save=self.tcfg.async_checkpoint,
            keep_steps=self.tcfg.branch_steps,
        )
        self.branch_steps = frozenset(self.tcfg.branch_steps)
        self.writer = MetricsWriter(workdir / "metrics.jsonl")
        self.layout = relayout.layout_meta(cfg)  # what a resume on another layout re-lays out from
        self.state: TrainState | None = None
        self.start_step = 0
        self.data_offset = 0
        self.guard = NonfiniteGuard(self.tcfg)
        self.hooks = _hooks(cfg, exp, workdir, self.writer, timer, self.layout)
        self.preempted = False
        # (step index, device metrics) not yet read back; read at log / checkpoint boundaries,
        # on preemption and at the end, so the host does not wait on the device every step.
        self.pending: list[tuple[int, dict]] = []
        self.window: list[dict] = []  # host metrics of the steps since the last train row
        self.t_last, self.step_last = time.perf_counter(), 0
        self._train_step, self._phase_steps = train_programs(cfg, build_model, exp)
        # Per-iteration error bounds of the compressed exchange: one compiled step per pair.
        self.bound_phases = bound_phases(cfg)
        # The schedule's numbers and the task's arrays (``Task.step_args``), e.g. a sampler's.
        args = {**schedule_args(cfg), **exp.task.step_args(exp.source)}
        self.schedule_args = jax.device_put(args, sharding.replicated())

    def _bounds(self, step: int) -> tuple[float, float]:
        """The compressed exchange's ``(eps, eps_grad)`` at ``step``
        (``embeddings.comm_error_bound_schedule``)."""
        return next(p[1:] for p in reversed(self.bound_phases) if p[0] <= step)

    def _evaluate(self, max_batches: int = 0) -> dict:
        """The evaluation of the current state (the hooks see each batch first: the tiered
        tables fill their caches as it goes)."""

        def prepare(batch: Batch) -> tuple[Any, Batch]:
            self.state, batch = self.hooks.host_batch(self.state, batch, train=False)
            return self.state.params, batch

        return self.exp.evaluate(
            self.state.params, self.state.batch_stats, max_batches=max_batches, prepare=prepare
        )

    def _evaluate_and_record(self, step: int, phase: str) -> dict:
        """An evaluation (``train.eval_max_batches``) written to metrics.jsonl and shown to
        the hooks."""
        with self.timer.phase(phase):
            ev = self._evaluate(max_batches=self.tcfg.eval_max_batches)
            self.writer.write({"step": step, "split": "eval", **ev})
        self.hooks.evaluated(step, ev, self.state)
        return ev

    # -- restore and save --------------------------------------------------------------------

    def _restore_items(self, c: Checkpointer, step: int, *, with_opt_state: bool = True):
        """``(trees, meta)`` of ``step`` of ``c``, re-laid out if it was saved on another device
        count or embedding plan."""
        cfg, exp = self.cfg, self.exp
        meta = c.read_meta(step)
        saved = meta.get("layout")
        items = state_items(exp.abstract_state)
        if not with_opt_state:
            items = {k: items[k] for k in ("params", "batch_stats")}
        if not relayout.needs_relayout(saved, cfg):
            return c.restore(step, items)
        extra = {"rng": items["rng"]} if with_opt_state else None
        trees = relayout.restore_relaid(
            c, step, exp, cfg, self.build_model, saved, with_opt_state=with_opt_state, extra=extra
        )
        print(
            f"re-laid out checkpoint step {step} from {saved['device_count']} devices "
            f"(embeddings {saved['embeddings']}) for this run's {relayout.layout_meta(cfg)}",
            file=sys.stderr,
        )
        return trees, meta

    def restore_or_init(self) -> None:
        """Restore order: this run's latest checkpoint, then another run's state at
        ``train.init_step`` (a cooldown branch) or its parameters (``train.init_from``), then a
        fresh init."""
        ckpt, tcfg, exp = self.ckpt, self.tcfg, self.exp
        restored, restored_meta, hook_meta = None, {}, None
        latest = ckpt.restore_latest(
            lambda step: self._restore_items(ckpt, step), fallback=tcfg.checkpoint_fallback
        )
        if latest is not None:
            restored, trees, restored_meta = latest
            state = state_from(trees, restored_meta["step"])
            print(f"restored checkpoint step {restored} from {ckpt.directory}", file=sys.stderr)
        elif tcfg.init_step:
            state, restored_meta = self._restore_branch_point()
            hook_meta = {}  # the hooks start afresh; the stream and counters go on
        elif tcfg.init_from:
            src = Checkpointer(
                Path(tcfg.init_from) / "checkpoints", async_save=False, read_only=True
            )
            src_step = src.latest_step()
            if src_step is None:
                raise FileNotFoundError(f"train.init_from: no checkpoints in {src.directory}")
            trees, _ = self._restore_items(src, src_step, with_opt_state=False)
            trees = {"params": trees["params"], "batch_stats": trees["batch_stats"]}
            src.close()
            init_opt = jax.jit(exp.tx.init, out_shardings=exp.state_sharding.opt_state)
            state = state_from(
                {
                    **trees,
                    "opt_state": init_opt(trees["params"]),
                    "rng": {"key_data": initial_rng(tcfg.seed)},
                },
                0,
            )
            print(f"initialised parameters from {src.directory} step {src_step}", file=sys.stderr)
        else:
            state = exp.init_state()
        self.state = state
        self.start_step = int(state.step)
        # The next batch's index in the training stream: the step, unless a checkpoint says
        # otherwise (it always records it: ``data_position``).
        self.data_offset = restored_meta.get("data_position", self.start_step) - self.start_step
        self.guard = NonfiniteGuard(tcfg, total=restored_meta.get("nonfinite_total", 0))
        self.hooks.start(
            restored, restored_meta if hook_meta is None else hook_meta, self.start_step
        )
        write_run_info(self.workdir, self.start_step)

    def _restore_branch_point(self) -> tuple[TrainState, dict]:
        """The whole training state of ``train.init_from`` at ``train.init_step``, and that
        checkpoint's meta (its data position and counters), after checking that this run
        continues that one as its own config would (``branches.check_branch``)."""
        tcfg = self.tcfg
        src_dir = Path(tcfg.init_from)
        if not (src_dir / "config.json").is_file():
            raise FileNotFoundError(f"train.init_from: no run (config.json) in {src_dir}")
        branches.check_branch(
            self.cfg, config_lib.load_json(type(self.cfg), src_dir / "config.json")
        )
        src = Checkpointer(src_dir / "checkpoints", async_save=False, read_only=True)
        try:
            trees, meta = self._restore_items(src, tcfg.init_step)
        finally:
            src.close()
        print(f"branched from {src.directory} step {tcfg.init_step}", file=sys.stderr)
        if jax.process_index() == 0:
            branches.write_record(self.workdir, self.cfg)
        return state_from(trees, tcfg.init_step), meta

    def save(self, step: int) -> None:
        meta = {
            "step": step,
            "data_position": step + self.data_offset,
            "nonfinite_total": self.guard.total,
            "layout": self.layout,
            **self.hooks.meta(),
        }
        self.state = self.hooks.before_save(self.state, step)
        self.ckpt.save(step, state_items(self.state), meta)
        self.hooks.after_save(step, self.ckpt)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> dict:
        """Trains to ``train.num_steps`` (or a preemption, or a hook's stop) and returns the
        result."""
        tcfg = self.tcfg
        start = self.start_step
        self.t_last, self.step_last = time.perf_counter(), start
        prog = Progress(tcfg.progress, tcfg.num_steps, start)
        with prog, Preemption() as preemption, closed_on_error(self.ckpt):
            while (
                start < tcfg.num_steps and not self.preempted and self.hooks.stop_reason() is None
            ):
                bad = self._steps(start, preemption, prog)
                if bad is None:
                    break
                start = self._rollback(bad)
        return self._finish()

    def _steps(self, start: int, preemption: Preemption, prog: Progress) -> list[int] | None:
        """Steps from ``start`` to the end, a preemption or a stop; returns the bad steps that
        call for a rollback, or None."""
        batches = prefetch(self.exp.source, start, self.tcfg.num_steps, self.data_offset)
        with contextlib.closing(batches):  # stops the prefetch thread on every way out
            return self._steps_from(self.hooks.batches(batches), start, preemption, prog)

    def _steps_from(
        self, batches, start: int, preemption: Preemption, prog: Progress
    ) -> list[int] | None:
        tcfg, timer, hooks = self.tcfg, self.timer, self.hooks
        for step in range(start, tcfg.num_steps):
            with timer.phase("data"):
                _, host_batch = next(batches)
                self.state, host_batch = hooks.host_batch(self.state, host_batch, train=True)
                # Here, not on the prefetch threads: measured, the copy there slowed the loop
                # (DLRM d4 of the showcase, 1,017 steps: 8.2-8.4 s here, 8.7-9.4 s there).
                batch = self.exp.device_batch(host_batch)
            hooks.before_step(step, self.state, batch)
            with timer.phase("train"):
                fn = self._phase_steps.get(self._bounds(step), self._train_step)
                self.state, metrics = fn(self.state, batch, self.schedule_args)
                self.pending.append((step, metrics))
                done = step + 1
                is_log, is_ckpt, is_eval = step_flags(tcfg, done, self.branch_steps)
                self.preempted = preemption.reached(done)  # stop at this step boundary
                if is_log or is_ckpt or self.preempted:
                    # Read the step flags before a checkpoint is written, so a rollback never
                    # has a checkpoint from after its bad steps to delete.
                    bad = self._read_flags()
                    if bad is not None:
                        return bad  # the later steps run again after the rollback
                if is_log or self.preempted:
                    self._log(done, prog)
                prog.advance(done)
                if is_eval or is_ckpt or self.preempted:
                    # Attributes the queued steps' device time to training, not to what
                    # waits for them next.
                    jax.block_until_ready(self.state)
            if is_eval and (not self.preempted or hooks.needs_every_eval):
                self._evaluate_and_record(done, "eval")
            stop = hooks.stop_reason()
            if (is_ckpt or self.preempted or stop) and self.ckpt.latest_step() != done:
                with timer.phase("checkpoint"):
                    self.save(done)
            if self.preempted:
                print(f"SIGTERM: saved checkpoint step {done}, stopping", file=sys.stderr)
                return None
            if stop:
                print(stop, file=sys.stderr)
                return None
        return None

    def _read_flags(self) -> list[int] | None:
        """Reads back the pending steps' metrics in step order through the non-finite guard;
        returns the bad steps of a rollback it calls for, or None."""
        rows = jax.device_get(self.pending)
        self.pending = []
        for s, row in rows:
            self.window.append(row)
            bad = self.guard.observe(s, row)
            if bad is not None:
                return bad
        return None

    def _log(self, done: int, prog: Progress) -> None:
        """A train row: the window's mean metrics, examples/s and the non-finite counts."""
        now = time.perf_counter()
        steps, seconds = done - self.step_last, max(now - self.t_last, 1e-9)
        eps = steps * self.cfg.data.batch_size / seconds
        self.t_last, self.step_last = now, done
        row = train_row(self.window, self.tcfg.nonfinite, done)
        self.window = []
        row.update(step=done, split="train", examples_per_sec=eps)
        row.update(self.exp.task.rates(row, steps, seconds))
        row["nonfinite_total"] = self.guard.total
        if len(self.bound_phases) > 1:  # the exchange's bounds in force at the last step
            row["comm_error_bound"], row["comm_error_bound_grad"] = self._bounds(done - 1)
        row.update(self.hooks.train_row())
        self.writer.write(row)
        prog.logged(done, row)

    def _rollback(self, bad: list[int]) -> int:
        """Restores the last checkpoint from before the bad steps and returns the step to go on
        from (after them): the batches from that checkpoint to the last bad step are skipped."""
        c, start = rollback_point(bad, self.ckpt.all_steps())
        with self.timer.phase("init"):
            self.ckpt.wait()  # an asynchronous save of that step may still be in flight
            trees, _ = self._restore_items(self.ckpt, c)
            self.hooks.rolled_back(c)
            self.state = state_from(trees, start)
        self.pending = []
        self.writer.write(
            {
                "step": start,
                "split": "rollback",
                "restored_step": c,
                "nonfinite_steps": [s + 1 for s in bad],
                "skipped_batches": [c, start],
            }
        )
        print(
            f"{len(bad)} non-finite steps in a row (steps {bad[0] + 1}..{bad[-1] + 1}): "
            f"restored checkpoint step {c}, skipping batches [{c}, {start}), going on at "
            f"step {start}",
            file=sys.stderr,
        )
        # Saved now, so a relaunch resumes after the rollback rather than replaying it.
        with self.timer.phase("checkpoint"):
            self.save(start)
        return start

    def _finish(self) -> dict:
        """After the last step: the final checkpoint and the full evaluation (none after a
        preemption; a hook's result in its place), then every asynchronous save committed."""
        ckpt, timer = self.ckpt, self.timer
        if self.preempted:
            with timer.phase("close"):
                ckpt.close()
                self.hooks.close()
            return {"step": int(self.state.step), "preempted": True}
        final_step = int(self.state.step)
        last = None
        if self.hooks.wants_final_eval(final_step):
            last = self._evaluate_and_record(final_step, "final_eval")
        if ckpt.latest_step() != final_step:
            with timer.phase("checkpoint"):
                self.save(final_step)
        result = self.hooks.result(final_step, last)
        if result is None:
            with timer.phase("final_eval"):
                ev = self._evaluate()
                self.writer.write({"step": final_step, "split": "eval", **ev})
            result = {"step": final_step, **ev}
        with timer.phase("close"):
            ckpt.close()  # every regular checkpoint committed
            self.hooks.close()
        return result
