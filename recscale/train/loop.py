"""The training loop: mesh once, restore first, jitted pure steps, eval, checkpoints, metrics.

Model families plug in with ``build_model(cfg, schema, rngs) -> nnx.Module`` whose
``__call__(dense_bn, ids_bfh, *, dropout_key=None)`` returns logits ``[B]``. The config is any
family config with the fields ``data``, ``dense_optim``, ``embedding_optim``, ``train``, ``mesh``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from data.batch import Batch, Schema
from data.sources import DataSource, make_source
from recscale import config as config_lib
from recscale import optim, sharding
from recscale.embeddings import EmbeddingTable, engine
from recscale.metrics import EvalAccumulator
from recscale.train.checkpoint import Checkpointer
from recscale.train.steps import (
    SparseOptimizer,
    TrainState,
    make_eval_step,
    make_sparse_train_step,
    make_train_step,
)

BuildModel = Callable[[Any, Schema, nnx.Rngs], nnx.Module]


def make_optimizer(cfg: Any, params: Any):
    """The combined optimizer: dense optax chain + the tables' own optimizer (the engine's
    sparse updates when the embedding engine is active).

    Tables are routed by type (``EmbeddingTable``); the label tree is computed once from the
    typed state, because optax calls a label function on params at init but on grads at update.
    """
    steps = cfg.train.num_steps
    if sharding.active_engine() is not None:
        e = cfg.embedding_optim
        return SparseOptimizer(
            dense=optim.dense_optimizer(cfg.dense_optim, steps),
            embedding_lr=optim.embedding_schedule(e, steps),
            rule=engine.UpdateRule(e.name, eps=e.eps),
            initial_accumulator=e.initial_accumulator,
        )
    return optim.combine(
        optim.dense_optimizer(cfg.dense_optim, steps),
        optim.embedding_optimizer(cfg.embedding_optim, steps),
        optim.embedding_labels(params, EmbeddingTable),
    )


@dataclasses.dataclass
class Experiment:
    """A model, its data, its optimizer and the shardings of its state, under an active mesh.

    Nothing is materialised at build time: ``abstract_state`` holds shapes, dtypes and
    shardings (what a checkpoint restores onto), and ``init_state()`` initialises the state
    directly into its shardings, so no table ever sits whole on one device.
    """

    cfg: Any
    source: DataSource
    graphdef: nnx.GraphDef
    tx: Any
    abstract_state: TrainState
    state_sharding: Any
    _init: Callable[[], TrainState]
    _eval_step: Callable

    @classmethod
    def build(
        cls,
        cfg: Any,
        build_model: BuildModel,
        *,
        workdir: str | None = None,
        eval_path: str | None = None,
        with_optimizer: bool = True,
        eval_only: bool = False,
    ) -> Experiment:
        """Builds the data source, the abstract model and optimizer, and the state shardings.

        Must be called inside ``sharding.activate(mesh, rules)``. ``eval_only`` skips reading
        training rows (checkpoint evaluation).
        """
        mesh = sharding.active_mesh()
        if mesh is None:
            raise RuntimeError("Experiment.build needs an active mesh (sharding.activate)")
        data_size = sharding.axis_size("batch")
        pcount = jax.process_count()
        for name, b in (
            ("data.batch_size", cfg.data.batch_size),
            ("data.eval_batch_size", cfg.data.eval_batch_size),
        ):
            if b % data_size or b % pcount:
                raise ValueError(
                    f"{name}={b} must be divisible by the {data_size} data-parallel devices and "
                    f"{pcount} processes"
                )
        source = make_source(
            cfg.data,
            process_index=jax.process_index(),
            process_count=pcount,
            eval_path=eval_path,
            rejects_dir=workdir,
            eval_only=eval_only,
        )

        def make_params():
            model = build_model(cfg, source.schema, nnx.Rngs(params=cfg.train.seed))
            graphdef, params, batch_stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
            if jax.tree.leaves(rest):
                raise ValueError(
                    f"model has state other than nnx.Param and nnx.BatchStat, unsupported by this "
                    f"trainer (randomness must come from the step's dropout_key): {rest}"
                )
            return graphdef, params, batch_stats

        graphdef, abstract_params, abstract_stats = nnx.eval_shape(make_params)
        tx = make_optimizer(cfg, abstract_params) if with_optimizer else None
        abstract_opt = jax.eval_shape(tx.init, abstract_params) if tx is not None else None
        state_sharding = TrainState(
            step=sharding.replicated(),
            params=sharding.state_shardings(abstract_params),
            opt_state=sharding.state_shardings(abstract_opt) if tx is not None else None,
            batch_stats=sharding.state_shardings(abstract_stats),
        )

        @functools.partial(jax.jit, out_shardings=state_sharding)
        def init() -> TrainState:
            _, params, batch_stats = make_params()
            opt_state = tx.init(params) if tx is not None else None
            return TrainState(
                step=jnp.zeros((), jnp.int32),
                params=params,
                opt_state=opt_state,
                batch_stats=batch_stats,
            )

        abstract_state = jax.eval_shape(init)
        eval_step = jax.jit(make_eval_step(graphdef))
        return cls(cfg, source, graphdef, tx, abstract_state, state_sharding, init, eval_step)

    def embedding_plans(self) -> dict[str, str]:
        """``{collection path: the rendered plan}`` of the model's engine-backed tables."""
        model = nnx.merge(
            self.graphdef, self.abstract_state.params, self.abstract_state.batch_stats
        )
        return {k: c.layout.plan_text for k, c in engine.engine_collections(model).items()}

    def init_state(self) -> TrainState:
        """A freshly initialised state, created directly in its shardings."""
        return self._init()

    def device_batch(self, batch: Batch) -> Batch:
        """Host-local numpy batch -> global jax arrays sharded over ``batch``."""
        return Batch(
            *(
                jax.make_array_from_process_local_data(
                    sharding.batch_sharding(np.ndim(x)), np.asarray(x)
                )
                for x in batch
            )
        )

    def evaluate(
        self,
        params: Any,
        batch_stats: Any,
        *,
        max_batches: int = 0,
        graphdef: nnx.GraphDef | None = None,
    ) -> dict:
        """Exact metrics over the evaluation set (or its first ``max_batches`` batches).

        ``graphdef``: evaluate a model of another structure than the trained one (e.g. with
        int8 tables, ``EmbeddingCollection.quantize_int8``)."""
        eval_step = self._eval_step if graphdef is None else jax.jit(make_eval_step(graphdef))
        acc = EvalAccumulator()
        batches = self.source.eval_batches()
        if max_batches:
            batches = itertools.islice(batches, max_batches)
        for batch in batches:
            dbatch = self.device_batch(batch)
            logits = eval_step(params, batch_stats, dbatch)
            logits, labels, weights = (
                np.asarray(multihost_utils.process_allgather(x, tiled=True))
                for x in (logits, dbatch.labels_b, dbatch.weights_b)
            )
            acc.update(logits, labels, weights)
        return acc.result()


def _has_checkpoints(workdir: Path) -> bool:
    d = workdir / "checkpoints"
    return d.is_dir() and any(p.name.isdigit() for p in d.iterdir())


def write_run_files(workdir: Path, cfg: Any, argv: list[str] | None) -> None:
    """``config.json`` (the resolved config) and ``command.txt`` (every invocation, appended).

    When the workdir already holds checkpoints, the saved config must match ``cfg`` except for
    non-semantic fields (checked on every process, so all of them stop together).
    """
    cfg_path = workdir / "config.json"
    if cfg_path.is_file() and _has_checkpoints(workdir):
        # Resuming: the checkpoints belong to the saved config; a changed one would silently mix.
        old = config_lib.to_dict(config_lib.load_json(type(cfg), cfg_path))
        diffs = _config_diffs(old, config_lib.to_dict(cfg))
        if diffs:
            raise ValueError(
                f"{workdir} holds a run with another config ({'; '.join(diffs)}); resume it with the "
                "same config or use a new --workdir"
            )
    if jax.process_index() != 0:
        return
    workdir.mkdir(parents=True, exist_ok=True)
    config_lib.save_json(cfg, cfg_path)
    args = sys.argv if argv is None else argv
    cmd = f"cd {shlex.quote(os.getcwd())} && " + shlex.join([Path(sys.executable).name, *args])
    with open(workdir / "command.txt", "a") as f:
        f.write(cmd + "\n")


def write_run_info(workdir: Path, start_step: int) -> None:
    """``run_info.json``: the devices and library versions of every (re)start of the run."""
    if jax.process_index() != 0:
        return
    import importlib.metadata as md  # noqa: PLC0415

    path = workdir / "run_info.json"
    info = json.loads(path.read_text()) if path.is_file() else {"starts": []}
    devices = jax.devices()
    info["starts"].append(
        {
            "start_step": start_step,
            "time": time.time(),
            "device_kind": devices[0].device_kind,
            "platform": devices[0].platform,
            "device_count": len(devices),
            "process_count": jax.process_count(),
            "versions": {
                "python": sys.version.split()[0],
                **{p: md.version(p) for p in ("jax", "jaxlib", "flax", "optax", "numpy")},
            },
        }
    )
    path.write_text(json.dumps(info, indent=2) + "\n")


def _config_diffs(old: Any, new: Any, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            out += _config_diffs(old.get(k), new.get(k), f"{path}.{k}" if path else k)
        return out
    if old == new or path in config_lib.NON_SEMANTIC_FIELDS:
        return []
    return [f"{path}: saved {old!r}, now {new!r}"]


class MetricsWriter:
    """Appends JSON rows to ``<workdir>/metrics.jsonl`` (process 0 only)."""

    def __init__(self, path: Path):
        self.path = path
        self.enabled = jax.process_index() == 0

    def write(self, row: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")


def _progress(enabled: bool, total: int, start: int):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    prog = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        disable=not enabled or jax.process_index() != 0,
    )
    task = prog.add_task("train", total=total, completed=start, info="")
    return prog, task


def _prefetch(source: DataSource, start: int, stop: int) -> Iterator[tuple[int, Batch]]:
    """Host batches for steps [start, stop), produced one step ahead on a thread."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        fut = pool.submit(source.train_batch, start) if start < stop else None
        for step in range(start, stop):
            batch = fut.result()
            fut = pool.submit(source.train_batch, step + 1) if step + 1 < stop else None
            yield step, batch


def train(
    cfg: Any, build_model: BuildModel, workdir: str | Path, *, argv: list[str] | None = None
) -> dict:
    """Trains ``cfg`` in ``workdir`` (resuming from its latest checkpoint) and returns final eval."""
    workdir = Path(workdir)
    cfg = config_lib.absolute_paths(cfg)
    write_run_files(workdir, cfg, argv)
    mesh = sharding.make_mesh(cfg.mesh)
    tcfg = cfg.train
    with sharding.activate(mesh, cfg.mesh.rules, engine=engine.EngineSpec.from_config(cfg)):
        exp = Experiment.build(cfg, build_model, workdir=str(workdir))
        ckpt = Checkpointer(
            workdir / "checkpoints",
            max_to_keep=tcfg.max_checkpoints,
            async_save=tcfg.async_checkpoint,
        )
        writer = MetricsWriter(workdir / "metrics.jsonl")
        plans = exp.embedding_plans()
        if plans and jax.process_index() == 0:
            text = "\n\n".join(f"{path or 'model'}:\n{plan}" for path, plan in plans.items())
            (workdir / "embedding_plan.txt").write_text(text + "\n")
            print(text, file=sys.stderr)
        if jax.process_index() == 0 and getattr(exp.source, "stats", None):
            # Reader counters (rows read / kept / rejected by reason, OOV counts): nothing is
            # dropped without a count.
            (workdir / "data_stats.json").write_text(
                json.dumps(exp.source.stats, indent=2, default=str) + "\n"
            )
        # Restore order: this run's latest checkpoint, then another run's parameters, then fresh.
        abstract = exp.abstract_state
        latest = ckpt.latest_step()
        if latest is not None:
            trees, meta = ckpt.restore(
                latest,
                {
                    "params": abstract.params,
                    "opt_state": abstract.opt_state,
                    "batch_stats": abstract.batch_stats,
                },
            )
            step = jax.device_put(jnp.asarray(meta["step"], jnp.int32), sharding.replicated())
            state = TrainState(step=step, **trees)
            print(f"restored checkpoint step {latest} from {ckpt.directory}", file=sys.stderr)
        elif tcfg.init_from:
            src = Checkpointer(Path(tcfg.init_from) / "checkpoints", async_save=False)
            src_step = src.latest_step()
            if src_step is None:
                raise FileNotFoundError(f"train.init_from: no checkpoints in {src.directory}")
            trees, _ = src.restore(
                src_step, {"params": abstract.params, "batch_stats": abstract.batch_stats}
            )
            src.close()
            init_opt = jax.jit(exp.tx.init, out_shardings=exp.state_sharding.opt_state)
            step = jax.device_put(jnp.zeros((), jnp.int32), sharding.replicated())
            state = TrainState(step=step, opt_state=init_opt(trees["params"]), **trees)
            print(f"initialised parameters from {src.directory} step {src_step}", file=sys.stderr)
        else:
            state = exp.init_state()
        start = int(state.step)
        write_run_info(workdir, start)

        make_step = (
            make_sparse_train_step if isinstance(exp.tx, SparseOptimizer) else make_train_step
        )
        train_step = jax.jit(
            make_step(exp.graphdef, exp.tx, tcfg.seed),
            in_shardings=(exp.state_sharding, None),
            out_shardings=(exp.state_sharding, None),
            donate_argnums=(0,),
        )

        def save(step: int, state: TrainState) -> None:
            trees = {
                "params": state.params,
                "opt_state": state.opt_state,
                "batch_stats": state.batch_stats,
            }
            ckpt.save(step, trees, {"step": step})

        prog, task = _progress(tcfg.progress, tcfg.num_steps, start)
        pending: list[dict] = []
        t_last, step_last = time.perf_counter(), start
        examples_per_step = cfg.data.batch_size
        with prog:
            for step, host_batch in _prefetch(exp.source, start, tcfg.num_steps):
                state, metrics = train_step(state, exp.device_batch(host_batch))
                pending.append(metrics)
                done = step + 1
                if done % tcfg.log_every == 0 or done == tcfg.num_steps:
                    rows = jax.device_get(pending)
                    pending = []
                    now = time.perf_counter()
                    eps = (done - step_last) * examples_per_step / max(now - t_last, 1e-9)
                    t_last, step_last = now, done
                    row = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
                    if not np.isfinite(row["loss"]):
                        raise FloatingPointError(
                            f"non-finite training loss {row['loss']} at step {done}"
                        )
                    row.update(step=done, split="train", examples_per_sec=eps)
                    writer.write(row)
                    prog.update(task, info=f"loss {row['loss']:.4f}  {eps:,.0f} ex/s")
                prog.update(task, completed=done)
                if tcfg.eval_every and done % tcfg.eval_every == 0 and done != tcfg.num_steps:
                    ev = exp.evaluate(
                        state.params, state.batch_stats, max_batches=tcfg.eval_max_batches
                    )
                    writer.write({"step": done, "split": "eval", **ev})
                if (
                    tcfg.checkpoint_every
                    and done % tcfg.checkpoint_every == 0
                    and done != tcfg.num_steps
                ):
                    save(done, state)
        final_step = int(state.step)
        if ckpt.latest_step() != final_step:
            save(final_step, state)
        ev = exp.evaluate(state.params, state.batch_stats)
        writer.write({"step": final_step, "split": "eval", **ev})
        ckpt.close()
    return {"step": final_step, **ev}
