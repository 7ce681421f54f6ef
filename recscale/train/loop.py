"""The training loop: mesh once, restore first, jitted pure steps, eval, checkpoints, metrics.

Model families plug in with ``build_model(cfg, schema, rngs) -> nnx.Module`` whose
``__call__(dense_bn, ids_bfh, *, dropout_key=None)`` returns logits ``[B]``. The config is any
family config with the fields ``data``, ``dense_optim``, ``embedding_optim``, ``train``, ``mesh``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
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
from recscale.analysis import noise_scale
from recscale.embeddings import EmbeddingTable, engine, plan_inputs, relayout
from recscale.embeddings import tiers as tiers_lib
from recscale.metrics import EvalAccumulator
from recscale.train.checkpoint import Checkpointer
from recscale.train.steps import (
    SparseOptimizer,
    TrainState,
    initial_rng,
    make_eval_step,
    make_gradient_sq_norms,
    make_train_step,
)
from recscale.train.timing import PhaseTimer

BuildModel = Callable[[Any, Schema, nnx.Rngs], nnx.Module]

_FAST_INIT_BYTES = 256 << 20
"""States up to this size have their init compiled without backend optimisation (``Experiment``)."""


def schedule_args(cfg: Any) -> dict[str, np.ndarray]:
    """The numbers of a run's learning-rate schedules: its length, and each optimizer's peak
    learning rate and warmup. The trainer passes them to its jitted train step as arguments
    instead of baking them in as constants, so runs that differ only in them (a sweep's budgets,
    seeds and learning rates at one model size) compile to the same program, which the
    persistent compilation cache then serves to all of them."""
    d, e = cfg.dense_optim, cfg.embedding_optim
    return {
        "num_steps": np.int32(cfg.train.num_steps),
        "dense_lr": np.float32(d.learning_rate),
        "dense_warmup": np.int32(d.warmup_steps),
        "embedding_lr": np.float32(e.learning_rate),
        "embedding_warmup": np.int32(e.warmup_steps),
    }


# ------------------------------------------------------------------------------------------------
# Compiled programs kept across runs in one process.

_PROGRAMS: collections.OrderedDict[str, Callable] = collections.OrderedDict()
_PROGRAMS_MAX = 24  # jitted functions (3 per model: init, train step, eval step)

# Config fields that reach the compiled programs only as arguments (``schedule_args`` and the
# init seed) or not at all (cadences of logging, evaluation and checkpoints): runs that differ
# in nothing else run the same programs.
_PROGRAM_FREE_FIELDS = (
    "train.num_steps",
    "train.seed",
    "dense_optim.learning_rate",
    "dense_optim.warmup_steps",
    "embedding_optim.learning_rate",
    "embedding_optim.warmup_steps",
    "train.log_every",
    "train.eval_every",
    "train.eval_max_batches",
    "train.checkpoint_every",
    "train.max_checkpoints",
    "train.progress",
    "train.async_checkpoint",
    "train.noise_scale_every",
    "train.noise_scale_micro_batches",
)


def _program_key(cfg: Any, build_model: BuildModel, schema: Schema, what: str) -> str:
    """What a jitted function of this run computes: the config without the argument-only
    fields, the model builder, the data schema (table sizes) and the mesh."""
    d = config_lib.to_dict(cfg)
    for dotted in _PROGRAM_FREE_FIELDS:
        *parents, leaf = dotted.split(".")
        node = d
        for p in parents:
            node = node.get(p, {})
        node.pop(leaf, None)
    blob = json.dumps(
        [
            what,
            f"{build_model.__module__}.{build_model.__qualname__}",
            d,
            repr(schema),
            repr(sharding.active_mesh()),
            repr(sharding.active_rules()),
            repr(engine.EngineSpec.from_config(cfg)),
            jax.process_count(),
        ],
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _cached_program(key: str, make: Callable[[], Callable]) -> Callable:
    """The jitted function stored under ``key`` in this process, else ``make()``'s (stored).

    A sweep's trial server runs many trials in one process; a model size recurs there across
    seeds, budgets and learning rates. Reusing the jitted function object skips what even a
    persistent-cache hit pays per run (tracing, lowering, loading: ~6 s a trial for the study's
    26-table models on 2 cores), and gives the same results: the key holds everything the
    trace reads except the argument-only fields (``tests/dlrm/test_train.py``)."""
    fn = _PROGRAMS.get(key)
    if fn is None:
        fn = _PROGRAMS[key] = make()
        while len(_PROGRAMS) > _PROGRAMS_MAX:
            _PROGRAMS.popitem(last=False)
    else:
        _PROGRAMS.move_to_end(key)
    return fn


def make_optimizer(cfg: Any, params: Any, args: dict[str, Any] | None = None):
    """The combined optimizer: dense optax chain + the tables' own optimizer (the engine's
    sparse updates when ``cfg.embeddings`` turns the embedding engine on).

    Tables are routed by type (``EmbeddingTable``); the label tree is computed once from the
    typed state, because optax calls a label function on params at init but on grads at update.
    ``args`` (``schedule_args``, possibly traced) replace the config's schedule numbers.
    """
    a = args or {}
    steps = a.get("num_steps", cfg.train.num_steps)
    dense = optim.dense_optimizer(
        cfg.dense_optim, steps, peak=a.get("dense_lr"), warmup_steps=a.get("dense_warmup")
    )
    e = cfg.embedding_optim
    hf = cfg.dense_optim.name == "hessian_free"
    if engine.EngineSpec.from_config(cfg) is not None:
        return SparseOptimizer(
            dense=dense,
            embedding_lr=optim.embedding_schedule(
                e, steps, peak=a.get("embedding_lr"), warmup_steps=a.get("embedding_warmup")
            ),
            rule=engine.UpdateRule.from_config(e),
            initial_accumulator=e.initial_accumulator,
            dense_needs_loss=hf,
        )
    if hf:
        raise config_lib.ConfigError(
            "dense_optim.name=hessian_free needs the embedding engine (embeddings.sharding "
            "other than off): its curvature products hold the engine's lookups fixed while the "
            "tables keep their sparse optimizer"
        )
    return optim.combine(
        dense,
        optim.embedding_optimizer(
            e, steps, peak=a.get("embedding_lr"), warmup_steps=a.get("embedding_warmup")
        ),
        optim.embedding_labels(params, EmbeddingTable),
    )


def state_parts(
    cfg: Any, build_model: BuildModel, schema: Schema, *, with_optimizer: bool = True
) -> tuple[nnx.GraphDef, Any, TrainState, Callable[[jax.Array], TrainState]]:
    """``(graphdef, tx, state_sharding, init)`` of ``cfg``'s model on ``schema``, under the
    active mesh and rules, nothing allocated: ``init(seed)`` builds the train state (trace it
    with ``jax.eval_shape`` for its shapes), ``state_sharding`` is its shardings (a
    ``TrainState`` of NamedShardings), ``tx`` the optimizer (None without one)."""

    def make_params(seed: Any = cfg.train.seed):
        # jax.random.key(seed) is nnx.Rngs(params=seed)'s own key, and takes a traced seed.
        model = build_model(cfg, schema, nnx.Rngs(params=jax.random.key(seed)))
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

    def init(seed: jax.Array) -> TrainState:
        _, params, batch_stats = make_params(seed)
        opt_state = tx.init(params) if tx is not None else None
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=opt_state,
            batch_stats=batch_stats,
            rng=initial_rng(seed),
        )

    return graphdef, tx, state_sharding, init


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

        schema = source.schema  # closures below must not hold the source (and its rows)
        if cfg.embeddings.tiers:  # the model's tiered tables are their caches
            schema = tiers_lib.model_schema(schema, tiers_lib.parse_tiers(cfg.embeddings.tiers))
        graphdef, tx, state_sharding, init = state_parts(
            cfg, build_model, schema, with_optimizer=with_optimizer
        )
        seed = jnp.int32(cfg.train.seed)
        shapes = jax.tree.leaves(jax.eval_shape(init, seed))
        state_bytes = sum(x.size * x.dtype.itemsize for x in shapes)
        # Init runs once: below _FAST_INIT_BYTES of state its run time is nothing next to
        # its compile (a small DLRM's init compiles in 3.2 s at XLA's default optimisation,
        # 1.2 s without), so it is compiled without backend optimisation. Large states keep
        # the default: unfused random-number code would materialise table-sized temporaries.
        options = {"xla_backend_optimization_level": 0} if state_bytes <= _FAST_INIT_BYTES else None
        # The seed is an argument, not a constant: every seed of a model shares one program.
        key = functools.partial(_program_key, cfg, build_model, schema)
        jit_init = _cached_program(
            key(f"init:{with_optimizer}"),
            lambda: jax.jit(init, out_shardings=state_sharding, compiler_options=options),
        )
        abstract_state = jax.eval_shape(jit_init, seed)  # with the state's shardings
        init = functools.partial(jit_init, seed)
        eval_step = _cached_program(key("eval"), lambda: jax.jit(make_eval_step(graphdef)))
        return cls(cfg, source, graphdef, tx, abstract_state, state_sharding, init, eval_step)

    def embedding_plans(self) -> dict[str, str]:
        """``{collection path: the rendered plan}`` of the model's engine-backed tables."""
        model = nnx.merge(
            self.graphdef, self.abstract_state.params, self.abstract_state.batch_stats
        )
        out = {}
        for k, c in engine.engine_collections(model).items():
            x = c.layout.exchange_bytes(self.cfg.data.batch_size)
            sent = x["forward"] + x["backward"]
            scaled = any(b.scaled for b in c.layout.buffers)
            out[k] = (
                f"{c.layout.plan_text.rstrip()}\nall-to-all per step, all devices: "
                f"{x['forward'] / 2**20:.6g} MiB forward + {x['backward'] / 2**20:.6g} MiB "
                f"backward ({c.layout.compression.describe()}"
                + (", bounds per table" if scaled else "")
                + (f", {x['float32'] / sent:.2f}x fewer bytes than float32)" if sent else ")")
            )
            for bl in c.layout.buffers:  # per-table bounds: each scaled buffer's own codes
                if bl.scaled and not bl.replicated:
                    comp = c.layout.compression_of(bl)
                    out[k] += (
                        f"\n  buffer {bl.key} (bounds x{bl.bound_scale:g} forward, "
                        f"x{bl.bound_scale_grad:g} back): {comp.describe()}"
                    )
        return out

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
        prepare: Callable[[Batch], tuple[Any, Batch]] | None = None,
    ) -> dict:
        """Exact metrics over the evaluation set (or its first ``max_batches`` batches).

        ``graphdef``: evaluate a model of another structure than the trained one (e.g. with
        int8 tables, ``EmbeddingCollection.quantize_int8``). ``prepare(batch) -> (params,
        batch)`` before each batch: the tiered tables' caches (``recscale.embeddings.tiers``)."""
        eval_step = self._eval_step if graphdef is None else jax.jit(make_eval_step(graphdef))
        acc = EvalAccumulator()
        batches = self.source.eval_batches()
        if max_batches:
            batches = itertools.islice(batches, max_batches)
        for batch in batches:
            if prepare is not None:
                params, batch = prepare(batch)
            dbatch = self.device_batch(batch)
            logits = eval_step(params, batch_stats, dbatch)
            logits, labels, weights = (
                np.asarray(multihost_utils.process_allgather(x, tiled=True))
                for x in (logits, dbatch.labels_b, dbatch.weights_b)
            )
            acc.update(logits, labels, weights)
        return acc.result()


def _bound_phases(cfg: Any) -> list[tuple[int, float, float]]:
    """``(first step, eps, eps_grad)`` of the exchange's error bounds, from
    ``embeddings.comm_error_bound{,_grad}`` and ``comm_error_bound_schedule``."""
    e = cfg.embeddings
    out = [(0, e.comm_error_bound, e.comm_error_bound_grad)]
    for item in e.comm_error_bound_schedule:
        step, eps, eps_grad = item.split(":")
        if int(step) == 0:
            out = []
        out.append((int(step), float(eps), float(eps_grad)))
    return out


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


def host_cpu() -> str:
    """The host's CPU model (``/proc/cpuinfo``'s model name, else ``platform.processor()``).

    XLA:CPU compiles for the host's instruction set, so runs on two CPU models may differ in
    the last bits of a step and, over a long training run, visibly (BENCHMARKS.md, the Frappe
    arm re-run): results rows record it so such differences can be told from a bug.
    """
    import platform  # noqa: PLC0415

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
            "host_cpu": host_cpu(),
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
    Where the wall time went (setup, restore, data waits, training steps, evaluations,
    checkpoints, each with its compile seconds) is appended to ``timings.jsonl``.
    """
    workdir = Path(workdir)
    cfg = config_lib.absolute_paths(cfg)
    timer = PhaseTimer()
    with timer.phase("setup"):
        cfg = plan_inputs.resolve(cfg, workdir)  # measured skew, lookup calibration
        write_run_files(workdir, cfg, argv)
        mesh = sharding.make_mesh(cfg.mesh)
    with sharding.activate(mesh, cfg.mesh):
        with timer.phase("setup"):
            exp = Experiment.build(cfg, build_model, workdir=str(workdir))
            _write_run_notes(workdir, exp)
        run = _TrainRun(cfg, build_model, exp, workdir, timer)
        with timer.phase("init"):
            run.restore_or_init()
        result = run.run()
        reads = _reads_per_process(exp.source)
    if jax.process_index() == 0:
        row = {"start_step": run.start_step, "end_step": result["step"], **timer.summary()}
        with open(workdir / "timings.jsonl", "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        row = {"start_step": run.start_step, "end_step": result["step"], "processes": reads}
        with open(workdir / "data_reads.jsonl", "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    return result


def _reads_per_process(source: DataSource) -> list[dict[str, int]]:
    """Examples each process read in this start (``data.sources.ReadCounts``), gathered from
    every process (a collective: all of them call it)."""
    mine = source.reads.as_dict()
    if jax.process_count() == 1:
        return [mine]
    keys = sorted(mine)
    # int32 halves (JAX arrays are 32-bit here): counts pass 2^31 in long runs.
    local = np.asarray([[mine[k] >> 31, mine[k] & 0x7FFFFFFF] for k in keys], np.int32)
    every = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(keys), 2)
    every = (every[..., 0].astype(np.int64) << 31) | every[..., 1]
    return [dict(zip(keys, map(int, row), strict=True)) for row in every]


def _write_run_notes(workdir: Path, exp: Experiment) -> None:
    """``embedding_plan.txt`` (also printed) and ``data_stats.json``: the reader's counters
    (rows read / kept / rejected by reason, OOV counts), so nothing is dropped without a count."""
    if jax.process_index() != 0:
        return
    plans = exp.embedding_plans()
    if plans:
        text = "\n\n".join(f"{path or 'model'}:\n{plan}" for path, plan in plans.items())
        (workdir / "embedding_plan.txt").write_text(text + "\n")
        print(text, file=sys.stderr)
    if getattr(exp.source, "stats", None):
        (workdir / "data_stats.json").write_text(
            json.dumps(exp.source.stats, indent=2, default=str) + "\n"
        )


class _EarlyStopping:
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

    @property
    def enabled(self) -> bool:
        return bool(self.metric)

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


BEST_DIR = "checkpoints_best"
"""Workdir folder of the early-stopping best checkpoint (parameters and batch stats)."""


class _TrainRun:
    """One ``train()`` call, as named steps: :meth:`restore_or_init`, then :meth:`run`, which
    repeats :meth:`_steps` (train, read flags, log, evaluate, checkpoint, stop on preemption)
    and :meth:`_rollback` until the last step, and ends with :meth:`_finish`."""

    def __init__(
        self, cfg: Any, build_model: BuildModel, exp: Experiment, workdir: Path, timer: PhaseTimer
    ):
        self.cfg, self.tcfg, self.build_model, self.exp = cfg, cfg.train, build_model, exp
        self.timer, self.workdir = timer, workdir
        self.ckpt = Checkpointer(
            workdir / "checkpoints",
            max_to_keep=self.tcfg.max_checkpoints,
            async_save=self.tcfg.async_checkpoint,
        )
        self.writer = MetricsWriter(workdir / "metrics.jsonl")
        self.layout = relayout.layout_meta(cfg)  # what a resume on another layout re-lays out from
        self.state: TrainState | None = None
        self.start_step = 0
        self.data_offset = 0
        self.guard = _NonfiniteGuard(self.tcfg)
        self.early = _EarlyStopping(self.tcfg)
        # Every best is kept until a committed regular checkpoint records a later one (see
        # ``save``): a kill between a new best and the next checkpoint must not lose the best
        # the resumed state points at.
        self.best_ckpt = (
            Checkpointer(workdir / BEST_DIR, max_to_keep=None, async_save=False)
            if self.early.enabled
            else None
        )
        self._best_in_saved: int | None = None  # best step recorded by the last regular save
        self.tiers = self._tiers(cfg, exp, workdir)
        self.preempted = False
        # (step index, device metrics) not yet read back; read at log / checkpoint boundaries,
        # on preemption and at the end, so the host does not wait on the device every step.
        self.pending: list[tuple[int, dict]] = []
        self.window: list[dict] = []  # host metrics of the steps since the last train row
        self.t_last, self.step_last = time.perf_counter(), 0
        # The step may outlive this run (``_cached_program``): it closes over plain values, not
        # over the run or its experiment (their state and data).
        params, graphdef, nonfinite = exp.abstract_state.params, exp.graphdef, self.tcfg.nonfinite
        clip = optim.cowclip.from_config(cfg.embedding_optim)

        def train_step(state: TrainState, batch: Batch, args: dict) -> tuple[TrainState, dict]:
            # The optimizer is rebuilt at trace time around the traced schedule numbers: the
            # same structure and state as ``exp.tx``, without run-specific constants.
            tx = make_optimizer(cfg, params, args)
            return make_train_step(graphdef, tx, nonfinite=nonfinite, embedding_clip=clip)(
                state, batch
            )

        self._train_step = _cached_program(
            _program_key(cfg, build_model, exp.source.schema, "train"),
            lambda: jax.jit(
                train_step,
                in_shardings=(exp.state_sharding, None, sharding.replicated()),
                out_shardings=(exp.state_sharding, None),
                donate_argnums=(0,),
            ),
        )
        # Per-iteration error bounds of the compressed exchange: one compiled step per pair.
        self.bound_phases = _bound_phases(cfg)
        # the model's own bounds run in ``_train_step`` (tests wrap it), the others in their own
        self._base_bounds = (cfg.embeddings.comm_error_bound, cfg.embeddings.comm_error_bound_grad)
        self._phase_steps = {}
        for _, eps, eps_grad in self.bound_phases:
            if (eps, eps_grad) in self._phase_steps or (eps, eps_grad) == self._base_bounds:
                continue
            g = engine.with_error_bounds(
                graphdef, params, exp.abstract_state.batch_stats, eps, eps_grad
            )

            def phase_step(state, batch, args, g=g):
                tx = make_optimizer(cfg, params, args)
                return make_train_step(g, tx, nonfinite=nonfinite, embedding_clip=clip)(
                    state, batch
                )

            self._phase_steps[eps, eps_grad] = _cached_program(
                _program_key(cfg, build_model, exp.source.schema, f"train:{eps}:{eps_grad}"),
                lambda f=phase_step: jax.jit(
                    f,
                    in_shardings=(exp.state_sharding, None, sharding.replicated()),
                    out_shardings=(exp.state_sharding, None),
                    donate_argnums=(0,),
                ),
            )
        self.schedule_args = jax.device_put(schedule_args(cfg), sharding.replicated())
        self.noise = None
        if self.tcfg.noise_scale_every:
            k, batch = self.tcfg.noise_scale_micro_batches, cfg.data.batch_size
            if k < 2 or batch % k:
                raise config_lib.ConfigError(
                    f"train.noise_scale_micro_batches={k}: must divide data.batch_size={batch}"
                )
            sq = make_gradient_sq_norms(
                graphdef, sparse=engine.EngineSpec.from_config(cfg) is not None
            )
            self.noise = noise_scale.NoiseScale()
            self._measure = jax.jit(
                lambda s, b: noise_scale.micro_batch_sq_norms(lambda x: sq(s, x), b, k)
            )

    def _tiers(self, cfg: Any, exp: Experiment, workdir: Path) -> tiers_lib.TieredTables | None:
        """The tiered tables (``embeddings.tiers``), or None."""
        e = cfg.embeddings
        if not e.tiers:
            return None
        for bad, why in (
            (
                self.early.enabled,
                "train.early_stopping_metric (a best checkpoint would need its "
                "own copy of the tiered tables)",
            ),
            (jax.process_count() > 1, f"{jax.process_count()} processes (one store per table)"),
            (
                bool(self.tcfg.init_from),
                "train.init_from (the tables live in the other run's stores)",
            ),
        ):
            if bad:
                raise config_lib.ConfigError(f"embeddings.tiers does not work with {why}")
        model = nnx.merge(exp.graphdef, exp.abstract_state.params, exp.abstract_state.batch_stats)
        return tiers_lib.TieredTables(
            model,
            exp.source.schema,
            tiers_lib.parse_tiers(e.tiers),
            Path(e.tier_dir) if e.tier_dir else workdir / "tiers",
            optimizer=cfg.embedding_optim.name,
            initial_accumulator=cfg.embedding_optim.initial_accumulator,
            seed=self.tcfg.seed,
            mesh=sharding.active_mesh(),
            policy=e.tier_policy,
            state_sharding=exp.state_sharding,
        )

    def _bounds(self, step: int) -> tuple[float, float]:
        """The compressed exchange's ``(eps, eps_grad)`` at ``step``
        (``embeddings.comm_error_bound_schedule``)."""
        return next(p[1:] for p in reversed(self.bound_phases) if p[0] <= step)

    def _evaluate(self, max_batches: int = 0) -> dict:
        """The evaluation of the current state (its tiered tables' caches filled as it goes)."""
        prepare = None
        if self.tiers is not None:

            def prepare(batch: Batch) -> tuple[Any, Batch]:
                self.state, batch = self.tiers.prepare(self.state, batch, train=False)
                return self.state.params, batch

        return self.exp.evaluate(
            self.state.params, self.state.batch_stats, max_batches=max_batches, prepare=prepare
        )

    # -- restore ---------------------------------------------------------------------------

    def _restore_items(self, c: Checkpointer, step: int, *, with_opt_state: bool = True):
        """``(trees, meta)`` of ``step`` of ``c``, re-laid out if it was saved on another device
        count or embedding plan."""
        cfg, exp = self.cfg, self.exp
        meta = c.read_meta(step)
        saved = meta.get("layout")
        items = _state_items(exp.abstract_state)
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
        """Restore order: this run's latest checkpoint, then another run's parameters
        (``train.init_from``), then a fresh init."""
        ckpt, tcfg, exp = self.ckpt, self.tcfg, self.exp
        restored_meta: dict = {}
        latest = ckpt.restore_latest(
            lambda step: self._restore_items(ckpt, step), fallback=tcfg.checkpoint_fallback
        )
        if latest is not None:
            latest_step, trees, restored_meta = latest
            state = _state_from(trees, restored_meta["step"])
            if self.tiers is not None:
                self.tiers.restore(latest_step)
            print(f"restored checkpoint step {latest_step} from {ckpt.directory}", file=sys.stderr)
        elif tcfg.init_from:
            src = Checkpointer(Path(tcfg.init_from) / "checkpoints", async_save=False)
            src_step = src.latest_step()
            if src_step is None:
                raise FileNotFoundError(f"train.init_from: no checkpoints in {src.directory}")
            trees, _ = self._restore_items(src, src_step, with_opt_state=False)
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
            if self.tiers is not None:
                self.tiers.create()
        self.state = state
        self.start_step = int(state.step)
        # The next batch's index in the training stream: the step, unless a checkpoint says
        # otherwise (it always records it: ``data_position``).
        self.data_offset = restored_meta.get("data_position", self.start_step) - self.start_step
        self.guard = _NonfiniteGuard(tcfg, total=restored_meta.get("nonfinite_total", 0))
        self.early.load(restored_meta.get("early_stopping"))
        if self.early.enabled:  # bests saved after the restored step belong to a lost future
            for s in self.best_ckpt.all_steps():
                if s > self.start_step:
                    self.best_ckpt.delete(s)
            self._best_in_saved = self.early.best_step
        write_run_info(self.workdir, self.start_step)

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, step: int) -> None:
        meta = {
            "step": step,
            "data_position": step + self.data_offset,
            "nonfinite_total": self.guard.total,
            "layout": self.layout,
            "early_stopping": self.early.state() if self.early.enabled else None,
        }
        if self.tiers is not None:  # the stores as of this step, before the checkpoint
            self.state = self.tiers.checkpoint(self.state, step)
        self.ckpt.save(step, _state_items(self.state), meta)
        if self.tiers is not None:
            self.tiers.prune(min([step, *self.ckpt.all_steps()]))
        if self.early.enabled:
            # ``ckpt.save`` waited for the previous regular save: it is committed, and so is the
            # best it records; older bests are no longer reachable by any resume.
            self._purge_bests(below=self._best_in_saved)
            self._best_in_saved = self.early.best_step

    def _purge_bests(self, below: int | None) -> None:
        for s in self.best_ckpt.all_steps():
            if below is not None and s < below:
                self.best_ckpt.delete(s)

    def _restore(self, ckpt_step: int, at_step: int) -> TrainState:
        self.ckpt.wait()  # an asynchronous save of that step may still be in flight
        trees, _ = self._restore_items(self.ckpt, ckpt_step)
        if self.tiers is not None:
            self.tiers.restore(ckpt_step)
        return _state_from(trees, at_step)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> dict:
        """Trains to ``train.num_steps`` (or a preemption) and returns the result."""
        tcfg = self.tcfg
        start = self.start_step
        self.t_last, self.step_last = time.perf_counter(), start
        prog, task = _progress(tcfg.progress, tcfg.num_steps, start)
        with prog, _SigtermFlag() as sigterm, _closed_on_error(self.ckpt):
            while start < tcfg.num_steps and not self.preempted and not self.early.stopped:
                bad = self._steps(start, sigterm, prog, task)
                if bad is None:
                    break
                start = self._rollback(bad)
        return self._finish()

    def _steps(self, start: int, sigterm: _SigtermFlag, prog, task) -> list[int] | None:
        """Steps from ``start`` to the end or a preemption; returns the bad steps that call
        for a rollback, or None."""
        batches = _prefetch(self.exp.source, start, self.tcfg.num_steps, self.data_offset)
        with contextlib.closing(batches):  # stops the prefetch thread on every way out
            if self.tiers is not None:  # the next batch's missed rows read ahead
                return self._steps_from(self.tiers.lookahead(batches), start, sigterm, prog, task)
            return self._steps_from(batches, start, sigterm, prog, task)

    def _steps_from(self, batches, start: int, sigterm, prog, task) -> list[int] | None:
        tcfg, timer = self.tcfg, self.timer
        for step in range(start, tcfg.num_steps):
            with timer.phase("data"):
                _, host_batch = next(batches)
                # Here, not on the prefetch threads: measured, the copy there slowed the loop
                # (DLRM d4 of the showcase, 1,017 steps: 8.2-8.4 s here, 8.7-9.4 s there).
                if self.tiers is None:
                    batch = self.exp.device_batch(host_batch)
            if self.tiers is not None:  # the tiered ids become cache slots first
                with timer.phase("tiers"):
                    self.state, host_batch = self.tiers.prepare(self.state, host_batch, train=True)
                    batch = self.exp.device_batch(host_batch)
            if self.noise is not None and step % tcfg.noise_scale_every == 0:
                with timer.phase("analysis"):
                    self._noise_scale(step, batch)
            with timer.phase("train"):
                bounds = self._bounds(step)
                fn = self._phase_steps.get(bounds, self._train_step)
                self.state, metrics = fn(self.state, batch, self.schedule_args)
                self.pending.append((step, metrics))
                done = step + 1
                is_log = done % tcfg.log_every == 0 or done == tcfg.num_steps
                is_ckpt = (
                    tcfg.checkpoint_every
                    and done % tcfg.checkpoint_every == 0
                    and done != tcfg.num_steps
                )
                is_eval = bool(
                    tcfg.eval_every and done % tcfg.eval_every == 0 and done != tcfg.num_steps
                )
                # SIGTERM (preemption): stop at this step boundary. Multi-process runs agree
                # on the step through JAX's preemption sync point (jax.distributed).
                self.preempted = sigterm.is_set() or (
                    jax.process_count() > 1 and multihost_utils.reached_preemption_sync_point(done)
                )
                if is_log or is_ckpt or self.preempted:
                    # Read the step flags before a checkpoint is written, so a rollback never
                    # has a checkpoint from after its bad steps to delete.
                    bad = self._read_flags()
                    if bad is not None:
                        return bad  # the later steps run again after the rollback
                if is_log or self.preempted:
                    self._log(done, prog, task)
                prog.update(task, completed=done)
                if is_eval or is_ckpt or self.preempted:
                    # Attributes the queued steps' device time to training, not to what
                    # waits for them next.
                    jax.block_until_ready(self.state)
            # Early stopping needs every evaluation (the resumed run goes on after this step),
            # so a preemption on an evaluation step still evaluates, before the checkpoint.
            if is_eval and (not self.preempted or self.early.enabled):
                with timer.phase("eval"):
                    ev = self._evaluate(max_batches=tcfg.eval_max_batches)
                    self.writer.write({"step": done, "split": "eval", **ev})
                if self.early.enabled:
                    self._early_stopping(done, ev)
            if (
                is_ckpt or self.preempted or self.early.stopped
            ) and self.ckpt.latest_step() != done:
                with timer.phase("checkpoint"):
                    self.save(done)
            if self.preempted:
                print(f"SIGTERM: saved checkpoint step {done}, stopping", file=sys.stderr)
                return None
            if self.early.stopped:
                e = self.early
                print(
                    f"early stopping at step {done}: {e.metric} did not improve on "
                    f"{e.best_value:.6g} (step {e.best_step}) in {e.patience} evaluations",
                    file=sys.stderr,
                )
                return None
        return None

    def _noise_scale(self, step: int, batch: Batch) -> None:
        """One noise-scale measurement on this step's batch and state (before its update)."""
        small, big = jax.device_get(self._measure(self.state, batch))
        k, b = self.tcfg.noise_scale_micro_batches, self.cfg.data.batch_size
        out = self.noise.update(small, big, b / k, b)
        self.writer.write(
            {
                "step": step,
                "split": "noise_scale",
                **{f"noise_scale/{p}": v for p, v in out.items()},
            }
        )

    def _early_stopping(self, done: int, ev: dict) -> None:
        """Records an evaluation; a new best is saved to ``checkpoints_best/`` at once."""
        # A resumed run replays bitwise, so a best step saved before the kill is saved again
        # identically: it is kept, not overwritten.
        if self.early.observe(done, ev) and done not in self.best_ckpt.all_steps():
            with self.timer.phase("checkpoint"):
                trees = {"params": self.state.params, "batch_stats": self.state.batch_stats}
                self.best_ckpt.save(
                    done, trees, {"step": done, "layout": self.layout, "metric": ev}
                )

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

    def _log(self, done: int, prog, task) -> None:
        """A train row: the window's mean metrics, examples/s and the non-finite counts."""
        now = time.perf_counter()
        eps = (done - self.step_last) * self.cfg.data.batch_size / max(now - self.t_last, 1e-9)
        self.t_last, self.step_last = now, done
        row = _train_row(self.window, self.tcfg.nonfinite, done)
        self.window = []
        row.update(step=done, split="train", examples_per_sec=eps)
        row["nonfinite_total"] = self.guard.total
        if len(self.bound_phases) > 1:  # the exchange's bounds in force at the last step
            row["comm_error_bound"], row["comm_error_bound_grad"] = self._bounds(done - 1)
        if self.tiers is not None:
            row.update(self.tiers.stats())
        self.writer.write(row)
        if "loss" in row:
            prog.update(task, info=f"loss {row['loss']:.4f}  {eps:,.0f} ex/s")

    def _rollback(self, bad: list[int]) -> int:
        """Restores the last checkpoint from before the bad steps and returns the step to go on
        from (after them): the batches from that checkpoint to the last bad step are skipped."""
        good = [c for c in self.ckpt.all_steps() if c <= bad[0]]
        if not good:
            raise FloatingPointError(
                f"non-finite training loss at step {bad[-1] + 1}: {len(bad)} non-finite "
                f"steps in a row (from step {bad[0] + 1}) and no checkpoint at or "
                f"before step {bad[0]} to roll back to (set train.checkpoint_every)"
            )
        c = max(good)
        start = bad[-1] + 1
        with self.timer.phase("init"):
            self.state = self._restore(c, start)
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
        preemption), then every asynchronous save committed."""
        ckpt, timer = self.ckpt, self.timer
        if self.preempted:
            with timer.phase("close"):
                ckpt.close()
                if self.tiers is not None:
                    self.tiers.close()
                if self.best_ckpt is not None:
                    self.best_ckpt.close()
            return {"step": int(self.state.step), "preempted": True}
        final_step = int(self.state.step)
        last = None
        if self.early.enabled and not self.early.stopped and self.early.observed != final_step:
            # The last step is a candidate too (BARS evaluates after the last epoch): observed
            # before the final checkpoint, whose meta then records it.
            with timer.phase("final_eval"):
                last = self._evaluate(max_batches=self.tcfg.eval_max_batches)
                self.writer.write({"step": final_step, "split": "eval", **last})
            self._early_stopping(final_step, last)
        if ckpt.latest_step() != final_step:
            with timer.phase("checkpoint"):
                self.save(final_step)
        if self.early.enabled and self.early.best_step is not None:
            full = self.tcfg.eval_max_batches == 0 and self.early.best_step == final_step
            return self._finish_best(final_step, last if full else None)
        with timer.phase("final_eval"):
            ev = self._evaluate()
            self.writer.write({"step": final_step, "split": "eval", **ev})
        with timer.phase("close"):
            ckpt.close()
            if self.tiers is not None:
                self.tiers.close()
        return {"step": final_step, **ev}

    def _finish_best(self, final_step: int, ev: dict | None = None) -> dict:
        """Early stopping's result: the best parameters, evaluated on the whole eval set
        (``ev``: that evaluation, when the last step is the best and was just evaluated)."""
        best = self.early.best_step
        if best not in self.best_ckpt.all_steps():
            raise FileNotFoundError(
                f"early stopping: best step {best} is not in {self.best_ckpt.directory} (it has "
                f"{self.best_ckpt.all_steps()}); was train.num_steps lowered on resume?"
            )
        with self.timer.phase("final_eval"):
            if ev is None:
                items = _state_items(self.exp.abstract_state)
                trees, _ = self.best_ckpt.restore(
                    best, {"params": items["params"], "batch_stats": items["batch_stats"]}
                )
                ev = self.exp.evaluate(trees["params"], trees["batch_stats"])
            self.writer.write({"step": best, "split": "eval_best", **ev})
        with self.timer.phase("close"):
            self.ckpt.close()  # every regular checkpoint committed: only the best is needed
            self._purge_bests(below=best)
            self.best_ckpt.close()
        return {"step": final_step, "best_step": best, "stopped_early": self.early.stopped, **ev}
