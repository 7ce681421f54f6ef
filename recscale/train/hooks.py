"""What plugs into the training loop: a feature is one :class:`Hook`, never a branch in the loop.

The loop (``recscale.train.loop``) calls every hook of its run at the same points, in this order:

- ``start`` once the state is restored or initialised, ``rolled_back`` after a rollback;
- per training step: ``batches`` wraps the stream of host batches (once per stretch of steps),
  ``host_batch`` sees each batch before it goes to the devices (also each evaluation batch),
  ``before_step`` the device batch and the state before the update;
- ``train_row`` adds columns to each train row of ``metrics.jsonl``; ``evaluated`` sees each
  evaluation, after which ``stop_reason`` may end training;
- at each checkpoint: ``before_save`` (may update the state), ``meta`` (added to the
  checkpoint's meta, handed back to ``start`` on resume), ``after_save``;
- at the end: ``wants_final_eval`` asks for an evaluation of the last step before the final
  checkpoint, ``result`` may replace the final evaluation, ``close`` releases what the hook
  holds (also after a preemption).

Here: the tiered tables (:class:`TieredTablesHook`) and the gradient noise scale
(:class:`NoiseScaleHook`); early stopping is ``recscale.train.early_stopping.EarlyStopping``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from data.batch import Batch
from recscale import config as config_lib
from recscale import sharding
from recscale.analysis import noise_scale
from recscale.embeddings import engine
from recscale.embeddings import tiers as tiers_lib
from recscale.train.checkpoint import Checkpointer
from recscale.train.experiment import Experiment
from recscale.train.run_files import MetricsWriter
from recscale.train.steps import TrainState, make_gradient_sq_norms
from recscale.train.timing import PhaseTimer

Batches = Iterator[tuple[int, Batch]]


class Hook:
    """A feature plugged into training. Every method does nothing here; a hook overrides the
    few it needs (the module docstring says when the loop calls each)."""

    needs_every_eval = False
    """Whether an evaluation due at a preemption's step still runs (before its checkpoint)."""

    def start(self, restored: int | None, meta: dict, step: int) -> None:
        """The run starts at ``step`` from this run's checkpoint ``restored`` (``meta``: its
        meta), or from a fresh or ``train.init_from`` state (``None, {}``)."""

    def rolled_back(self, restored: int) -> None:
        """The state is checkpoint ``restored``'s again (a rollback over non-finite steps)."""

    def batches(self, batches: Batches) -> Batches:
        """The stream of ``(step, host batch)`` the training steps read."""
        return batches

    def host_batch(
        self, state: TrainState, batch: Batch, *, train: bool
    ) -> tuple[TrainState, Batch]:
        """A host batch before it goes to the devices: a training step's (``train``) or an
        evaluation's."""
        return state, batch

    def before_step(self, step: int, state: TrainState, batch: Batch) -> None:
        """Training step ``step`` is about to run on the device ``batch`` from ``state``."""

    def train_row(self) -> dict:
        """Columns added to a train row."""
        return {}

    def evaluated(self, step: int, ev: dict, state: TrainState) -> None:
        """An evaluation of the state after ``step`` steps."""

    def stop_reason(self) -> str | None:
        """Why training stops now (printed), or None to go on."""
        return None

    def before_save(self, state: TrainState, step: int) -> TrainState:
        """The state about to be checkpointed at ``step``."""
        return state

    def meta(self) -> dict:
        """Entries of each checkpoint's meta (``start`` gets them back on resume)."""
        return {}

    def after_save(self, step: int, ckpt: Checkpointer) -> None:
        """Checkpoint ``step`` was saved to ``ckpt`` (its previous save is committed)."""

    def wants_final_eval(self, step: int) -> bool:
        """Whether the last step (``step``) is evaluated (like the others, ``evaluated``)
        before the final checkpoint."""
        return False

    def result(self, step: int, last: dict | None) -> dict | None:
        """The run's result in place of the final evaluation, or None (``last``: the
        ``wants_final_eval`` evaluation, if one ran)."""
        return None

    def close(self) -> None:
        """The run ends (completed or preempted): commit and release."""


class Hooks(Hook):
    """A run's hooks, called in order; a state or batch passes through each in turn."""

    def __init__(self, hooks: list[Hook]):
        self.hooks = hooks
        self.needs_every_eval = any(h.needs_every_eval for h in hooks)

    def __iter__(self) -> Iterator[Hook]:
        return iter(self.hooks)

    def start(self, restored: int | None, meta: dict, step: int) -> None:
        for h in self.hooks:
            h.start(restored, meta, step)

    def rolled_back(self, restored: int) -> None:
        for h in self.hooks:
            h.rolled_back(restored)

    def batches(self, batches: Batches) -> Batches:
        for h in self.hooks:
            batches = h.batches(batches)
        return batches

    def host_batch(
        self, state: TrainState, batch: Batch, *, train: bool
    ) -> tuple[TrainState, Batch]:
        for h in self.hooks:
            state, batch = h.host_batch(state, batch, train=train)
        return state, batch

    def before_step(self, step: int, state: TrainState, batch: Batch) -> None:
        for h in self.hooks:
            h.before_step(step, state, batch)

    def train_row(self) -> dict:
        return {k: v for h in self.hooks for k, v in h.train_row().items()}

    def evaluated(self, step: int, ev: dict, state: TrainState) -> None:
        for h in self.hooks:
            h.evaluated(step, ev, state)

    def stop_reason(self) -> str | None:
        return next((r for h in self.hooks if (r := h.stop_reason()) is not None), None)

    def before_save(self, state: TrainState, step: int) -> TrainState:
        for h in self.hooks:
            state = h.before_save(state, step)
        return state

    def meta(self) -> dict:
        return {k: v for h in self.hooks for k, v in h.meta().items()}

    def after_save(self, step: int, ckpt: Checkpointer) -> None:
        for h in self.hooks:
            h.after_save(step, ckpt)

    def wants_final_eval(self, step: int) -> bool:
        return any(h.wants_final_eval(step) for h in self.hooks)

    def result(self, step: int, last: dict | None) -> dict | None:
        return next((r for h in self.hooks if (r := h.result(step, last)) is not None), None)

    def close(self) -> None:
        for h in self.hooks:
            h.close()


class TieredTablesHook(Hook):
    """The tiered tables (``embeddings.tiers``, ``recscale.embeddings.tiers``): each batch's
    tiered ids become cache slots before it goes to the devices, the stores are restored with
    the state and checkpointed before it, and the train rows report hit rates and tier bytes."""

    def __init__(self, cfg: Any, exp: Experiment, workdir: Path, timer: PhaseTimer):
        e, tcfg = cfg.embeddings, cfg.train
        for bad, why in (
            (
                bool(tcfg.early_stopping_metric),
                "train.early_stopping_metric (a best checkpoint would need its "
                "own copy of the tiered tables)",
            ),
            (jax.process_count() > 1, f"{jax.process_count()} processes (one store per table)"),
            (bool(tcfg.init_from), "train.init_from (the tables live in the other run's stores)"),
        ):
            if bad:
                raise config_lib.ConfigError(f"embeddings.tiers does not work with {why}")
        model = nnx.merge(exp.graphdef, exp.abstract_state.params, exp.abstract_state.batch_stats)
        self.tables = tiers_lib.TieredTables(
            model,
            exp.source.schema,
            tiers_lib.parse_tiers(e.tiers),
            Path(e.tier_dir) if e.tier_dir else workdir / "tiers",
            optimizer=cfg.embedding_optim.name,
            initial_accumulator=cfg.embedding_optim.initial_accumulator,
            seed=tcfg.seed,
            mesh=sharding.active_mesh(),
            policy=e.tier_policy,
            state_sharding=exp.state_sharding,
            owner=str(Path(workdir).resolve()),
        )
        self.timer = timer

    def start(self, restored: int | None, meta: dict, step: int) -> None:
        if restored is None:
            self.tables.create()
        else:
            self.tables.restore(restored)

    def rolled_back(self, restored: int) -> None:
        self.tables.restore(restored)

    def batches(self, batches: Batches) -> Batches:
        return self.tables.lookahead(batches)  # the next batch's missed rows read ahead

    def host_batch(
        self, state: TrainState, batch: Batch, *, train: bool
    ) -> tuple[TrainState, Batch]:
        if not train:  # timed with the evaluation
            return self.tables.prepare(state, batch, train=False)
        with self.timer.phase("tiers"):
            return self.tables.prepare(state, batch, train=True)

    def train_row(self) -> dict:
        return self.tables.stats()

    def before_save(self, state: TrainState, step: int) -> TrainState:
        return self.tables.checkpoint(state, step)  # the stores as of this step, first

    def after_save(self, step: int, ckpt: Checkpointer) -> None:
        self.tables.prune(min([step, *ckpt.all_steps()]))

    def close(self) -> None:
        self.tables.close()


class NoiseScaleHook(Hook):
    """The gradient noise scale (``train.noise_scale_every``, ``recscale.analysis.noise_scale``),
    measured on a step's batch and state before its update; ``split="noise_scale"`` rows."""

    def __init__(self, cfg: Any, exp: Experiment, writer: MetricsWriter, timer: PhaseTimer):
        k, batch = cfg.train.noise_scale_micro_batches, cfg.data.batch_size
        if k < 2 or batch % k:
            raise config_lib.ConfigError(
                f"train.noise_scale_micro_batches={k}: must divide data.batch_size={batch}"
            )
        sq = make_gradient_sq_norms(
            exp.graphdef, sparse=engine.EngineSpec.from_config(cfg) is not None
        )
        self.every, self.k, self.batch = cfg.train.noise_scale_every, k, batch
        self.writer, self.timer = writer, timer
        self.noise = noise_scale.NoiseScale()
        self._measure = jax.jit(
            lambda s, b: noise_scale.micro_batch_sq_norms(lambda x: sq(s, x), b, k)
        )

    def before_step(self, step: int, state: TrainState, batch: Batch) -> None:
        if step % self.every:
            return
        with self.timer.phase("analysis"):
            small, big = jax.device_get(self._measure(state, batch))
            out = self.noise.update(small, big, self.batch / self.k, self.batch)
            self.writer.write(
                {
                    "step": step,
                    "split": "noise_scale",
                    **{f"noise_scale/{p}": v for p, v in out.items()},
                }
            )
