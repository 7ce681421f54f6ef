"""The training loop: mesh once, restore first, jitted pure steps, eval, checkpoints, metrics.

Model families plug in with ``build_model(cfg, schema, rngs) -> nnx.Module`` whose
``__call__(dense_bn, ids_bfh, *, dropout_key=None)`` returns logits ``[B]``. The config is any
family config with the fields ``data``, ``dense_optim``, ``embedding_optim``, ``train``, ``mesh``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import os
import shlex
import signal
import sys
import threading
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
from recscale.train import relayout
from recscale.train.checkpoint import Checkpointer
from recscale.train.steps import (
    SparseOptimizer,
    TrainState,
    initial_rng,
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
            rng=sharding.replicated(),
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
                rng=initial_rng(cfg.train.seed),
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


def _state_items(state: TrainState) -> dict[str, Any]:
    """The checkpoint items of a (possibly abstract) train state; the step goes in the meta."""
    return {
        "params": state.params,
        "opt_state": state.opt_state,
        "batch_stats": state.batch_stats,
        "rng": {"key_data": state.rng},  # orbax saves pytrees, not bare arrays
    }


def _state_from(trees: dict[str, Any], step: int) -> TrainState:
    """A train state at ``step`` from restored checkpoint items (``_state_items``)."""
    step_arr = jax.device_put(jnp.asarray(step, jnp.int32), sharding.replicated())
    return TrainState(step=step_arr, **{**trees, "rng": trees["rng"]["key_data"]})


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
    if old == new or path in config_lib.NON_SEMANTIC_FIELDS or path in config_lib.LAYOUT_FIELDS:
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


def _prefetch(
    source: DataSource, start: int, stop: int, data_offset: int = 0
) -> Iterator[tuple[int, Batch]]:
    """``(step, host batch)`` for steps [start, stop), step ``s`` getting the stream's batch
    ``s + data_offset``, produced one step ahead on a thread."""
    from concurrent.futures import ThreadPoolExecutor

    def get(step: int) -> Batch:
        return source.train_batch(step + data_offset)

    with ThreadPoolExecutor(max_workers=1) as pool:
        fut = pool.submit(get, start) if start < stop else None
        for step in range(start, stop):
            batch = fut.result()
            fut = pool.submit(get, step + 1) if step + 1 < stop else None
            yield step, batch


@contextlib.contextmanager
def _closed_on_error(ckpt: Checkpointer) -> Iterator[None]:
    """Lets in-flight asynchronous saves commit before an error (e.g. a divergence) ends the
    process: they would otherwise fail at exit and bury the error under their tracebacks."""
    try:
        yield
    except BaseException:
        ckpt.close()
        raise


class _SigtermFlag:
    """Within it, SIGTERM (a preemption notice) sets a flag the loop reads at each step boundary
    instead of killing the process; the previous handler is restored on exit. Outside the main
    thread (where Python cannot install handlers) it stays unset."""

    def __init__(self):
        self._event = threading.Event()
        self._previous: Any = None

    def is_set(self) -> bool:
        return self._event.is_set()

    def __enter__(self) -> _SigtermFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda *_: self._event.set())
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class _NonfiniteGuard:
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


def _train_row(rows: list[dict], mode: str, step: int) -> dict:
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


def train(
    cfg: Any, build_model: BuildModel, workdir: str | Path, *, argv: list[str] | None = None
) -> dict:
    """Trains ``cfg`` in ``workdir`` (resuming from its latest checkpoint) and returns final eval.

    On SIGTERM (preemption) it saves a checkpoint at the next step boundary, waits for every
    save to be committed and returns ``{"step": ..., "preempted": True}`` without evaluating;
    the same call again continues from there. Non-finite steps follow ``train.nonfinite*``
    (``_NonfiniteGuard``); a rollback writes a ``split="rollback"`` row to metrics.jsonl.
    """
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
        restored_meta: dict = {}

        def restore_items(c: Checkpointer, step: int, *, with_opt_state: bool = True):
            """``(trees, meta)`` of ``step`` of ``c``, re-laid out if it was saved on another
            device count or embedding plan."""
            meta = c.read_meta(step)
            saved = meta.get("layout")
            items = _state_items(abstract)
            if not with_opt_state:
                items = {k: items[k] for k in ("params", "batch_stats")}
            if not relayout.needs_relayout(saved, cfg):
                return c.restore(step, items)
            extra = {"rng": items["rng"]} if with_opt_state else None
            trees = relayout.restore_relaid(c, step, exp, cfg, build_model, saved,
                                            with_opt_state=with_opt_state, extra=extra)  # fmt: skip
            print(
                f"re-laid out checkpoint step {step} from {saved['device_count']} devices "
                f"(embeddings {saved['embeddings']}) for this run's {relayout.layout_meta(cfg)}",
                file=sys.stderr,
            )
            return trees, meta

        latest = ckpt.restore_latest(
            lambda step: restore_items(ckpt, step), fallback=tcfg.checkpoint_fallback
        )
        if latest is not None:
            latest_step, trees, restored_meta = latest
            state = _state_from(trees, restored_meta["step"])
            print(f"restored checkpoint step {latest_step} from {ckpt.directory}", file=sys.stderr)
        elif tcfg.init_from:
            src = Checkpointer(Path(tcfg.init_from) / "checkpoints", async_save=False)
            src_step = src.latest_step()
            if src_step is None:
                raise FileNotFoundError(f"train.init_from: no checkpoints in {src.directory}")
            trees, _ = restore_items(src, src_step, with_opt_state=False)
            trees = {"params": trees["params"], "batch_stats": trees["batch_stats"]}
            src.close()
            init_opt = jax.jit(exp.tx.init, out_shardings=exp.state_sharding.opt_state)
            state = _state_from(
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
        start = int(state.step)
        # The next batch's index in the training stream: the step, unless a checkpoint says
        # otherwise (it always records it: ``data_position``).
        data_offset = restored_meta.get("data_position", start) - start
        write_run_info(workdir, start)

        make_step = (
            make_sparse_train_step if isinstance(exp.tx, SparseOptimizer) else make_train_step
        )
        train_step = jax.jit(
            make_step(exp.graphdef, exp.tx, nonfinite=tcfg.nonfinite),
            in_shardings=(exp.state_sharding, None),
            out_shardings=(exp.state_sharding, None),
            donate_argnums=(0,),
        )

        layout = relayout.layout_meta(cfg)  # what a resume on another layout re-lays out from

        def save(step: int, state: TrainState) -> None:
            meta = {
                "step": step,
                "data_position": step + data_offset,
                "nonfinite_total": guard.total,
                "layout": layout,
            }
            ckpt.save(step, _state_items(state), meta)

        def restore(ckpt_step: int, at_step: int) -> TrainState:
            ckpt.wait()  # an asynchronous save of that step may still be in flight
            trees, _ = restore_items(ckpt, ckpt_step)
            return _state_from(trees, at_step)

        guard = _NonfiniteGuard(tcfg, total=restored_meta.get("nonfinite_total", 0))
        prog, task = _progress(tcfg.progress, tcfg.num_steps, start)
        # (step index, device metrics) not yet read back; read at log / checkpoint boundaries, on
        # preemption and at the end, so the host does not wait on the device every step.
        pending: list[tuple[int, dict]] = []
        window: list[dict] = []  # host metrics of the steps since the last train row
        t_last, step_last = time.perf_counter(), start
        examples_per_step = cfg.data.batch_size
        preempted = False
        with prog, _SigtermFlag() as sigterm, _closed_on_error(ckpt):
            while start < tcfg.num_steps and not preempted:
                rollback = None
                for step, host_batch in _prefetch(exp.source, start, tcfg.num_steps, data_offset):
                    state, metrics = train_step(state, exp.device_batch(host_batch))
                    pending.append((step, metrics))
                    done = step + 1
                    is_log = done % tcfg.log_every == 0 or done == tcfg.num_steps
                    is_ckpt = (
                        tcfg.checkpoint_every
                        and done % tcfg.checkpoint_every == 0
                        and done != tcfg.num_steps
                    )
                    # SIGTERM (preemption): stop at this step boundary. Multi-process runs agree
                    # on the step through JAX's preemption sync point (jax.distributed).
                    preempted = sigterm.is_set() or (
                        jax.process_count() > 1
                        and multihost_utils.reached_preemption_sync_point(done)
                    )
                    if is_log or is_ckpt or preempted:
                        # Read the step flags before a checkpoint is written, so a rollback never
                        # has a checkpoint from after its bad steps to delete.
                        rows = jax.device_get(pending)
                        pending = []
                        for s, row in rows:
                            window.append(row)
                            rollback = guard.observe(s, row)
                            if rollback is not None:
                                break  # the later steps run again after the rollback
                        if rollback is not None:
                            break
                    if is_log or preempted:
                        now = time.perf_counter()
                        eps = (done - step_last) * examples_per_step / max(now - t_last, 1e-9)
                        t_last, step_last = now, done
                        row = _train_row(window, tcfg.nonfinite, done)
                        window = []
                        row.update(step=done, split="train", examples_per_sec=eps)
                        row["nonfinite_total"] = guard.total
                        writer.write(row)
                        if "loss" in row:
                            prog.update(task, info=f"loss {row['loss']:.4f}  {eps:,.0f} ex/s")
                    prog.update(task, completed=done)
                    if (
                        not preempted
                        and tcfg.eval_every
                        and done % tcfg.eval_every == 0
                        and done != tcfg.num_steps
                    ):
                        ev = exp.evaluate(
                            state.params, state.batch_stats, max_batches=tcfg.eval_max_batches
                        )
                        writer.write({"step": done, "split": "eval", **ev})
                    if is_ckpt or preempted:
                        if ckpt.latest_step() != done:
                            save(done, state)
                    if preempted:
                        print(f"SIGTERM: saved checkpoint step {done}, stopping", file=sys.stderr)
                        break
                if rollback is None:
                    break
                # Restore the last checkpoint from before the bad steps, and go on after them:
                # the batches from that checkpoint to the last bad step are skipped.
                bad = rollback
                good = [c for c in ckpt.all_steps() if c <= bad[0]]
                if not good:
                    raise FloatingPointError(
                        f"non-finite training loss at step {bad[-1] + 1}: {len(bad)} non-finite "
                        f"steps in a row (from step {bad[0] + 1}) and no checkpoint at or "
                        f"before step {bad[0]} to roll back to (set train.checkpoint_every)"
                    )
                c = max(good)
                start = bad[-1] + 1
                state = restore(c, start)
                pending = []
                writer.write(
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
                save(start, state)
        if preempted:
            ckpt.close()
            return {"step": int(state.step), "preempted": True}
        final_step = int(state.step)
        if ckpt.latest_step() != final_step:
            save(final_step, state)
        ev = exp.evaluate(state.params, state.batch_stats)
        writer.write({"step": final_step, "split": "eval", **ev})
        ckpt.close()
    return {"step": final_step, **ev}
