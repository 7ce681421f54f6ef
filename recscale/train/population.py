"""Seeds as a vmapped population: K runs of one model size in one compiled program.

A sweep's points of one size differ only in their seed (and, optionally, their learning rates),
so their K runs can be one program over states with a leading *member* axis: the init vmapped
over the seeds, the train step over the members' states and schedule numbers
(``experiment.schedule_args``), every batch shared (``train.seed`` seeds a model's init and
dropout, not its data, which ``data.shuffle_seed`` seeds). The engine's tables carry the member
axis like every other leaf, its ``shard_map`` batches over it, the C++ CPU kernels run all
members in one call (``recscale.kernels.native.VMAP``) and the Pallas kernels get a member grid
axis (``tests/recscale/kernels/test_vmap.py``).

On a CPU the members' work adds up (a small model's step is per-example work already), so
what a population saves there is the data (one batch for K members), the per-step dispatch
and the compiles; on a GPU or TPU a small model fills a fraction of the chip and K members
run in about the time of one (``benchmarks/population.py``).

Each member keeps a run folder of its own, the same files a single run writes (``config.json``,
``metrics.jsonl``, ``run_info.json``, ``timings.jsonl``, and checkpoints holding its slice of the
population's state in a single run's format), so a member resumes, evaluates, exports or branches
on its own, and a population resumes from the latest step all of its members hold. A member
equals its separate run (``tests/recscale/test_population.py``). A member whose loss goes
non-finite past what ``train.nonfinite*`` allows is stopped (its result says why) while the
others go on: its steps keep running in the program, skipped.

What a population does not run (refused with the field to change): tiered tables, the noise
scale, early stopping, non-finite rollbacks, a schedule of exchange error bounds, and several
processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from data import roles
from recscale import config as config_lib
from recscale import sharding
from recscale.embeddings import plan_inputs, relayout
from recscale.train import branches
from recscale.train import task as task_lib
from recscale.train.checkpoint import CheckpointCorruptError, Checkpointer
from recscale.train.experiment import (
    BuildModel,
    Experiment,
    cached_program,
    program_key,
    schedule_args,
    state_parts,
    step_function,
)
from recscale.train.guards import NonfiniteGuard, Preemption, closed_on_error, train_row
from recscale.train.loop import prefetch, state_from, state_items, step_flags
from recscale.train.progress import Progress
from recscale.train.run_files import (
    MetricsWriter,
    append_row,
    write_run_files,
    write_run_info,
    write_run_notes,
)
from recscale.train.steps import TrainState
from recscale.train.timing import PhaseTimer

MEMBER_FREE = frozenset(
    {
        "train.seed",
        "train.init_from",
        "dense_optim.learning_rate",
        "embedding_optim.learning_rate",
    }
)
"""Config fields in which a population's members may differ: what reaches the compiled step as
an argument (the seed, the peak learning rates) and the run a branch starts from."""


def check_members(cfgs: list[Any]) -> None:
    """Raises ``ConfigError`` unless ``cfgs`` can train as one population: the same config but
    for :data:`MEMBER_FREE`, and nothing a population does not run (module docstring)."""
    if not cfgs:
        raise config_lib.ConfigError("a population needs at least one member")
    if task_lib.of(cfgs[0]) is not task_lib.CTR:
        raise config_lib.ConfigError(
            f"{type(cfgs[0]).__name__}: populations train the CTR families only (their batches, "
            "loss and evaluation); train its members one by one"
        )
    first = config_lib.to_dict(cfgs[0])
    for i, cfg in enumerate(cfgs[1:], 1):
        diffs = roles.config_diffs(first, config_lib.to_dict(cfg), MEMBER_FREE)
        if diffs:
            raise config_lib.ConfigError(
                f"population member {i} differs from member 0 in more than "
                f"{sorted(MEMBER_FREE)}: {'; '.join(diffs)}"
            )
    cfg, t = cfgs[0], cfgs[0].train
    refused = [
        (bool(cfg.embeddings.tiers), "embeddings.tiers"),
        (bool(t.noise_scale_every), "train.noise_scale_every"),
        (bool(t.early_stopping_metric), "train.early_stopping_metric"),
        (bool(t.nonfinite_rollback), "train.nonfinite_rollback"),
        (bool(cfg.embeddings.comm_error_bound_schedule), "embeddings.comm_error_bound_schedule"),
        (jax.process_count() > 1, "several processes"),
    ]
    for bad, what in refused:
        if bad:
            raise config_lib.ConfigError(f"a population does not run {what}: run its members alone")


def member_sharding(state_sharding: Any) -> Any:
    """The shardings of a population's state: each leaf's own, after an unsharded member axis."""
    return jax.tree.map(
        lambda s: NamedSharding(s.mesh, PartitionSpec(None, *s.spec)), state_sharding
    )


def population_programs(cfg: Any, build_model: BuildModel, exp: Experiment, k: int):
    """``(init, step)`` of a population of ``k`` members of ``cfg``'s model: ``init(seeds [k])``
    and ``step(states, batch, schedule args with a leading [k])``, each one compiled program
    (kept across runs in this process, as a single run's are)."""
    shardings = member_sharding(exp.state_sharding)
    _, _, _, init = state_parts(cfg, build_model, exp.source.schema)
    step = step_function(cfg, exp.graphdef, exp.abstract_state.params)
    key = functools.partial(program_key, cfg, build_model, exp.source.schema)
    jit_init = cached_program(
        key(f"population-init:{k}"), lambda: jax.jit(jax.vmap(init), out_shardings=shardings)
    )
    jit_step = cached_program(
        key(f"population-train:{k}"),
        lambda: jax.jit(
            jax.vmap(step, in_axes=(0, None, 0)),
            in_shardings=(shardings, None, sharding.replicated()),
            out_shardings=(shardings, None),
            donate_argnums=(0,),
        ),
    )
    return jit_init, jit_step


def member(tree: Any, m: int) -> Any:
    """Member ``m``'s slice of a population's (state) tree."""
    return jax.tree.map(lambda x: x[m], tree)


def train_population(
    cfgs: list[Any],
    build_model: BuildModel,
    workdirs: list[str | Path],
    *,
    argv: list[str] | None = None,
) -> list[dict]:
    """Trains the members ``cfgs`` as one population, member ``m`` in ``workdirs[m]`` (resuming
    from the latest step every member's checkpoints hold); returns each member's final eval, as
    :func:`recscale.train.loop.train` returns a run's (``{"step", "preempted": True}`` after a
    SIGTERM, ``{"step", "diverged": <reason>}`` for a member stopped by ``train.nonfinite*``)."""
    if len(workdirs) != len(cfgs) or len({str(Path(w).absolute()) for w in workdirs}) != len(cfgs):
        raise ValueError(f"a population needs one distinct folder per member, got {workdirs}")
    workdirs = [Path(w) for w in workdirs]
    cfgs = [config_lib.absolute_paths(c) for c in cfgs]
    check_members(cfgs)
    timer = PhaseTimer()
    with timer.phase("setup"):
        cfgs = [plan_inputs.resolve(c, w) for c, w in zip(cfgs, workdirs, strict=True)]
        for c, w in zip(cfgs, workdirs, strict=True):
            write_run_files(w, c, argv)
        mesh = sharding.make_mesh(cfgs[0].mesh)
    with sharding.activate(mesh, cfgs[0].mesh):
        with timer.phase("setup"):
            exp = Experiment.build(cfgs[0], build_model, workdir=str(workdirs[0]))
            for w in workdirs:
                write_run_notes(w, exp)
        run = _Population(cfgs, build_model, exp, workdirs, timer)
        with contextlib.ExitStack() as stack:  # every member's saves settle before an error
            for m in run.members:
                stack.enter_context(closed_on_error(m.ckpt))
            with timer.phase("init"):
                run.restore_or_init()
            results = run.run()
    span = {"start_step": run.start_step, "end_step": int(run.states.step[0])}
    summary = {**span, **timer.summary(), "population": len(cfgs)}
    for w in workdirs:
        append_row(w / "timings.jsonl", summary)
    return results


@dataclasses.dataclass
class _Member:
    cfg: Any
    workdir: Path
    ckpt: Checkpointer
    writer: MetricsWriter
    guard: NonfiniteGuard
    window: list = dataclasses.field(default_factory=list)
    stopped: str = ""
    """Why ``train.nonfinite*`` stopped this member (empty while it trains)."""


class _Population:
    """One :func:`train_population` call: :meth:`restore_or_init`, then :meth:`run`."""

    def __init__(self, cfgs, build_model, exp: Experiment, workdirs, timer: PhaseTimer):
        self.cfg, self.tcfg, self.exp, self.timer = cfgs[0], cfgs[0].train, exp, timer
        self.layout = relayout.layout_meta(self.cfg)
        self.members = [
            _Member(
                cfg=c,
                workdir=w,
                ckpt=Checkpointer(
                    w / "checkpoints",
                    max_to_keep=self.tcfg.max_checkpoints,
                    async_save=self.tcfg.async_checkpoint,
                    keep_steps=self.tcfg.branch_steps,
                ),
                writer=MetricsWriter(w / "metrics.jsonl"),
                guard=NonfiniteGuard(c.train),
            )
            for c, w in zip(cfgs, workdirs, strict=True)
        ]
        self.init, self.step = population_programs(self.cfg, build_model, exp, len(cfgs))
        self.shardings = member_sharding(exp.state_sharding)
        args = [schedule_args(c) for c in cfgs]
        self.args = jax.device_put(
            {k: np.stack([a[k] for a in args]) for k in args[0]}, sharding.replicated()
        )
        self.branch_steps = frozenset(self.tcfg.branch_steps)
        self.states: TrainState | None = None
        self.start_step = 0
        self.data_offset = 0
        self.pending: list[tuple[int, dict]] = []

    # -- restore and save --------------------------------------------------------------------

    def _stack(self, states: list[TrainState]) -> TrainState:
        def stack(*xs):
            return jax.tree.map(lambda *a: jnp.stack(a), *xs)

        return jax.jit(stack, out_shardings=self.shardings)(*states)

    def _restore(self, c: Checkpointer, step: int) -> tuple[TrainState, dict]:
        meta = c.read_meta(step)
        if relayout.needs_relayout(meta.get("layout"), self.cfg):
            raise config_lib.ConfigError(
                f"{c.directory} step {step} was saved on another layout "
                f"({meta.get('layout')}): resume that member alone first"
            )
        trees, meta = c.restore(step, state_items(self.exp.abstract_state))
        return state_from(trees, step), meta

    def _restore_common(self, steps: list[int]) -> tuple[int, list[tuple[TrainState, dict]]]:
        """Every member at the latest of ``steps`` (those all of them hold); a corrupt one raises,
        or with ``train.checkpoint_fallback`` is reported and the step before it tried, as a
        single run's restore does (``Checkpointer.restore_latest``)."""
        for step in reversed(steps):
            try:
                return step, [self._restore(m.ckpt, step) for m in self.members]
            except CheckpointCorruptError as e:
                if not self.tcfg.checkpoint_fallback:
                    raise
                print(f"WARNING: {e}; falling back to the previous common step", file=sys.stderr)
        raise CheckpointCorruptError(
            f"no step the population's members share is readable (steps {steps})", step=steps[0]
        )

    def restore_or_init(self) -> None:
        """Every member's checkpoint at the latest step all of them hold, else every member's
        branch point (``train.init_step``), else a fresh init of all seeds at once."""
        tcfg = self.tcfg
        held = [set(m.ckpt.all_steps()) for m in self.members]
        common = set.intersection(*held)
        if any(held) and not common:
            steps = "; ".join(
                f"{m.workdir}: {sorted(h)}" for m, h in zip(self.members, held, strict=True)
            )
            raise config_lib.ConfigError(
                f"population members hold checkpoints but no step in common ({steps}): resume "
                "them alone, or as a population from folders that started together"
            )
        if common:
            step, restored = self._restore_common(sorted(common))
            print(f"restored the population at step {step}", file=sys.stderr)
        elif tcfg.init_step:
            restored = []
            for m in self.members:
                src_dir = Path(m.cfg.train.init_from)
                branches.check_branch(
                    m.cfg, config_lib.load_json(type(m.cfg), src_dir / "config.json")
                )
                src = Checkpointer(src_dir / "checkpoints", async_save=False, read_only=True)
                try:
                    restored.append(self._restore(src, tcfg.init_step))
                finally:
                    src.close()
                if jax.process_index() == 0:
                    branches.write_record(m.workdir, m.cfg)
        elif tcfg.init_from:
            raise config_lib.ConfigError(
                "train.init_from without train.init_step (parameters only): run members alone"
            )
        else:
            restored = None
            seeds = jnp.asarray([m.cfg.train.seed for m in self.members], jnp.int32)
            self.states = self.init(seeds)
        if restored is not None:
            self.states = self._stack([s for s, _ in restored])
            meta = restored[0][1]
            for m, (_, mt) in zip(self.members, restored, strict=True):
                m.guard = NonfiniteGuard(m.cfg.train, total=mt.get("nonfinite_total", 0))
        else:
            meta = {}
        self.start_step = int(self.states.step[0])
        self.data_offset = meta.get("data_position", self.start_step) - self.start_step
        for m in self.members:
            write_run_info(m.workdir, self.start_step)

    def save(self, step: int) -> None:
        for i, m in enumerate(self.members):
            meta = {
                "step": step,
                "data_position": step + self.data_offset,
                "nonfinite_total": m.guard.total,
                "layout": self.layout,
            }
            m.ckpt.save(step, state_items(member(self.states, i)), meta)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> list[dict]:
        tcfg, timer = self.tcfg, self.timer
        prog = Progress(tcfg.progress, tcfg.num_steps, self.start_step)
        self.t_last, self.step_last = time.perf_counter(), self.start_step
        preempted = False
        batches = prefetch(self.exp.source, self.start_step, tcfg.num_steps, self.data_offset)
        with prog, Preemption() as preemption:
            for step, host_batch in batches:
                with timer.phase("data"):
                    batch = self.exp.device_batch(host_batch)
                with timer.phase("train"):
                    self.states, metrics = self.step(self.states, batch, self.args)
                    self.pending.append((step, metrics))
                    done = step + 1
                    is_log, is_ckpt, is_eval = step_flags(tcfg, done, self.branch_steps)
                    preempted = preemption.reached(done)
                    if is_log or is_ckpt or preempted:
                        self._read_flags()
                    if is_log or preempted:
                        self._log(done)
                    prog.advance(done)
                    if is_eval or is_ckpt or preempted:
                        jax.block_until_ready(self.states)
                if is_eval and not preempted:
                    with timer.phase("eval"):
                        self._evaluate_all(done, tcfg.eval_max_batches)
                if is_ckpt or preempted:
                    with timer.phase("checkpoint"):
                        self.save(done)
                if preempted:
                    print(
                        f"SIGTERM: saved the population at step {done}, stopping", file=sys.stderr
                    )
                    break
            batches.close()
        return self._finish(preempted)

    def _read_flags(self) -> None:
        """Each member's pending metrics through its non-finite guard, in step order."""
        rows = jax.device_get(self.pending)
        self.pending = []
        for s, metrics in rows:
            for i, m in enumerate(self.members):
                if m.stopped:
                    continue
                row = {k: float(v[i]) for k, v in metrics.items()}
                m.window.append(row)
                try:
                    m.guard.observe(s, row)
                except FloatingPointError as e:
                    self._stop(m, str(e))

    def _stop(self, m: _Member, reason: str) -> None:
        m.stopped = reason
        m.window = []
        print(f"population member {m.workdir}: stopped: {reason}", file=sys.stderr)

    def _log(self, done: int) -> None:
        """Each training member's train row; ``examples_per_sec`` is each member's (the
        population's examples trained per second over its members)."""
        now = time.perf_counter()
        eps = (done - self.step_last) * self.cfg.data.batch_size / max(now - self.t_last, 1e-9)
        self.t_last, self.step_last = now, done
        for m in self.members:
            if m.stopped or not m.window:
                continue
            try:
                row = train_row(m.window, self.tcfg.nonfinite, done)
            except FloatingPointError as e:
                self._stop(m, str(e))
                continue
            m.window = []
            row.update(
                step=done, split="train", examples_per_sec=eps, nonfinite_total=m.guard.total
            )
            m.writer.write(row)

    def _evaluate_all(self, step: int, max_batches: int = 0) -> list[dict | None]:
        out = []
        for i, m in enumerate(self.members):
            if m.stopped:
                out.append(None)
                continue
            s = member(self.states, i)
            ev = self.exp.evaluate(s.params, s.batch_stats, max_batches=max_batches)
            m.writer.write({"step": step, "split": "eval", **ev})
            out.append(ev)
        return out

    def _finish(self, preempted: bool) -> list[dict]:
        step = int(self.states.step[0])
        if preempted:
            self._close()
            return [{"step": step, "preempted": True} for _ in self.members]
        self._read_flags()
        with self.timer.phase("checkpoint"):
            if any(m.ckpt.latest_step() != step for m in self.members):
                self.save(step)
        with self.timer.phase("final_eval"):
            evals = self._evaluate_all(step)
        self._close()
        return [
            {"step": step, "diverged": m.stopped} if m.stopped else {"step": step, **ev}
            for m, ev in zip(self.members, evals, strict=True)
        ]

    def _close(self) -> None:
        with self.timer.phase("close"):
            for m in self.members:
                m.ckpt.close()
