"""Experiment assembly: a model, its data, its optimizer and its state's shardings, and the
jitted programs (init, train step, eval step) kept across the runs of one process.

Model families plug in with ``build_model(cfg, schema, rngs) -> nnx.Module``; what the model is
called on, its loss and its evaluation metrics are the run's task (``recscale.train.task``: for
the CTR families, ``__call__(dense_bn, ids_bfh, *, dropout_key=None)`` returning logits ``[B]``).
The config is any family config with the fields ``data``, ``dense_optim``, ``embedding_optim``,
``train``, ``mesh``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import json
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data import roles
from data.batch import Schema
from data.sources import DataSource
from recscale import config as config_lib
from recscale import optim, sharding
from recscale.embeddings import EmbeddingTable, engine
from recscale.embeddings import tiers as tiers_lib
from recscale.train import task as task_lib
from recscale.train.steps import (
    SparseOptimizer,
    TrainState,
    initial_rng,
    make_train_step,
)

BuildModel = Callable[[Any, Schema, nnx.Rngs], nnx.Module]

_FAST_INIT_BYTES = 256 << 20
"""States up to this size have their init compiled without backend optimisation (``Experiment``)."""


def schedule_args(cfg: Any) -> dict[str, np.ndarray]:
    """The numbers of a run's learning-rate schedules: its length, and each optimizer's peak
    learning rate, warmup and warmup-stable-decay cooldown steps (0 without ``wsd``). The trainer passes them to its jitted train step as arguments
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
        "dense_cooldown": np.int32(_cooldown(d, cfg.train.num_steps)),
        "embedding_cooldown": np.int32(_cooldown(e, cfg.train.num_steps)),
    }


def _cooldown(ocfg: Any, num_steps: int) -> int:
    wsd = ocfg.decay == "wsd"
    return optim.cooldown_steps(num_steps, ocfg.cooldown_fraction) if wsd else 0


# ------------------------------------------------------------------------------------------------
# Compiled programs kept across runs in one process.

_PROGRAMS: collections.OrderedDict[str, Callable] = collections.OrderedDict()
_PROGRAMS_MAX = 24  # jitted functions (3 per model: init, train step, eval step)


def program_key(cfg: Any, build_model: BuildModel, schema: Schema, what: str) -> str:
    """What a jitted function of this run computes: the config without the argument-only
    fields, the model builder, the data schema (table sizes) and the mesh."""
    d = config_lib.to_dict(cfg)
    # Fields that reach the programs only as arguments (``schedule_args``, the init seed) or not
    # at all (logging, evaluation and checkpoint cadence): runs differing only in them share.
    for dotted in roles.paths(type(cfg), program=False):
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


def cached_program(key: str, make: Callable[[], Callable]) -> Callable:
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
        cfg.dense_optim,
        steps,
        peak=a.get("dense_lr"),
        warmup_steps=a.get("dense_warmup"),
        cooldown=a.get("dense_cooldown"),
    )
    e = cfg.embedding_optim
    hf = cfg.dense_optim.name == "hessian_free"
    if engine.EngineSpec.from_config(cfg) is not None:
        return SparseOptimizer(
            dense=dense,
            embedding_lr=optim.config_schedule(
                e,
                steps,
                peak=a.get("embedding_lr"),
                warmup_steps=a.get("embedding_warmup"),
                cooldown=a.get("embedding_cooldown"),
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
            e,
            steps,
            peak=a.get("embedding_lr"),
            warmup_steps=a.get("embedding_warmup"),
            cooldown=a.get("embedding_cooldown"),
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
    task: task_lib.Task = task_lib.CTR
    """What the run trains and evaluates (``recscale.train.task``)."""

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
        task = task_lib.of(cfg)
        task.check(cfg)
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
        source = task.make_source(
            cfg,
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
        key = functools.partial(program_key, cfg, build_model, schema)
        jit_init = cached_program(
            key(f"init:{with_optimizer}"),
            lambda: jax.jit(init, out_shardings=state_sharding, compiler_options=options),
        )
        abstract_state = jax.eval_shape(jit_init, seed)  # with the state's shardings
        init = functools.partial(jit_init, seed)
        eval_step = cached_program(key("eval"), lambda: jax.jit(task.eval_step(graphdef)))
        return cls(cfg, source, graphdef, tx, abstract_state, state_sharding, init, eval_step, task)

    def embedding_plans(self) -> dict[str, str]:
        """``{collection path: the rendered plan}`` of the model's engine-backed tables."""
        model = nnx.merge(
            self.graphdef, self.abstract_state.params, self.abstract_state.batch_stats
        )
        out = {}
        for k, c in engine.engine_collections(model).items():
            x = c.layout.exchange_bytes(c.layout.lookup_batch)
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

    def device_batch(self, batch: Any) -> Any:
        """Host-local numpy batch (a pytree of arrays, the batch on their leading axis) ->
        global jax arrays sharded over ``batch``."""
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(
                sharding.batch_sharding(np.ndim(x)), np.asarray(x)
            ),
            batch,
        )

    def evaluate(
        self,
        params: Any,
        batch_stats: Any,
        *,
        max_batches: int = 0,
        graphdef: nnx.GraphDef | None = None,
        prepare: Callable[[Any], tuple[Any, Any]] | None = None,
    ) -> dict:
        """Exact metrics over the evaluation set (or its first ``max_batches`` batches).

        ``graphdef``: evaluate a model of another structure than the trained one (e.g. with
        int8 tables, ``EmbeddingCollection.quantize_int8``). ``prepare(batch) -> (params,
        batch)`` before each batch: the tiered tables' caches (``recscale.embeddings.tiers``)."""
        eval_step = self._eval_step
        if graphdef is not None:
            eval_step = jax.jit(self.task.eval_step(graphdef))
        acc = self.task.accumulator(self.source)
        batches = self.source.eval_batches()
        if max_batches:
            batches = itertools.islice(batches, max_batches)
        for batch in batches:
            if prepare is not None:
                params, batch = prepare(batch)
            dbatch = self.device_batch(batch)
            acc.update(eval_step(params, batch_stats, dbatch), dbatch)
        return acc.result()


def bound_phases(cfg: Any) -> list[tuple[int, float, float]]:
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


def step_function(cfg: Any, graphdef: nnx.GraphDef, params: Any) -> Callable:
    """The pure train step ``(state, batch, args) -> (state, metrics)`` of ``cfg``'s model
    ``graphdef`` (``params``: its abstract parameters; ``args``: ``schedule_args`` and the
    task's ``step_args``), before jitting: what
    :func:`train_programs` compiles, and a population (``recscale.train.population``) vmaps."""
    nonfinite, clip = cfg.train.nonfinite, optim.cowclip.from_config(cfg.embedding_optim)
    task = task_lib.of(cfg)

    def train_step(state: TrainState, batch: Any, args: dict) -> tuple[TrainState, dict]:
        # The optimizer is rebuilt at trace time around the traced schedule numbers: the
        # same structure and state as ``exp.tx``, without run-specific constants.
        tx = make_optimizer(cfg, params, args)

        def loss_fn(model, batch, key):
            return task.loss(model, batch, key, args)

        step = make_train_step(
            graphdef, tx, nonfinite=nonfinite, embedding_clip=clip, loss_fn=loss_fn
        )
        return step(state, batch)

    return train_step


def train_programs(
    cfg: Any, build_model: BuildModel, exp: Experiment
) -> tuple[Callable, dict[tuple[float, float], Callable]]:
    """The jitted train step ``(state, batch, schedule_args) -> (state, metrics)`` of ``exp``'s
    model, and ``{(eps, eps_grad): step}`` for the other error bounds of the compressed exchange
    in ``embeddings.comm_error_bound_schedule`` (one compiled step per pair).

    The steps may outlive the run (``cached_program``): they close over plain values, not over
    the experiment (its state and data).
    """
    params, graphdef = exp.abstract_state.params, exp.graphdef

    def jitted(graph: nnx.GraphDef, what: str) -> Callable:
        return cached_program(
            program_key(cfg, build_model, exp.source.schema, what),
            lambda: jax.jit(
                step_function(cfg, graph, params),
                in_shardings=(exp.state_sharding, None, sharding.replicated()),
                out_shardings=(exp.state_sharding, None),
                donate_argnums=(0,),
            ),
        )

    # The model's own bounds run in the main step (tests wrap it), the others in their own.
    main = jitted(graphdef, "train")
    base = (cfg.embeddings.comm_error_bound, cfg.embeddings.comm_error_bound_grad)
    others = {}
    for _, eps, eps_grad in bound_phases(cfg):
        if (eps, eps_grad) in others or (eps, eps_grad) == base:
            continue
        g = engine.with_error_bounds(
            graphdef, params, exp.abstract_state.batch_stats, eps, eps_grad
        )
        others[eps, eps_grad] = jitted(g, f"train:{eps}:{eps_grad}")
    return main, others
