"""Checkpoint evaluation: rebuild a run from its workdir, restore parameters, evaluate.

The JSON contract (later tooling depends on it): one object on the last line of stdout with at
least ``auc``, ``logloss``, ``ne``, ``calibration``, ``num_examples``, ``step``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax

from recscale import config as config_lib
from recscale import sharding
from recscale.embeddings import engine
from recscale.train.checkpoint import Checkpointer
from recscale.train.loop import BuildModel, Experiment


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalArgs:
    """Evaluate a saved run."""

    workdir: str
    """The run's directory (holds config.json and checkpoints/)."""
    step: int | None = None
    """Checkpoint step to evaluate (default: the latest)."""
    data_path: str | None = None
    """Evaluate on this file instead of the run's eval set (same format as the run's dataset)."""
    output: str | None = None
    """Also write the metrics JSON object to this file."""
    num_devices: int = 0
    """Devices to evaluate on (0: as many as divide the eval batch)."""
    embeddings_int8: bool = False
    """Quantize the embedding tables to int8 row-wise (FBGEMM's format: per-row scale and
    bias) and evaluate with the fused dequantize-and-pool lookup (inference serving's tables:
    about a quarter of the float32 bytes). The JSON adds ``embeddings: "int8"``."""


def json_line(obj: dict) -> str:
    """One-line JSON with non-finite floats (a NaN AUC of a single-class set) written as null."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    return json.dumps(clean(obj), sort_keys=True, allow_nan=False)


def evaluate_workdir(config_cls: type, build_model: BuildModel, args: EvalArgs) -> dict:
    workdir = Path(args.workdir)
    cfg_path = workdir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: is {workdir} a recscale run directory?")
    cfg = config_lib.load_json(config_cls, cfg_path)
    ckpt = Checkpointer(workdir / "checkpoints", async_save=False)
    step = args.step if args.step is not None else ckpt.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoints in {ckpt.directory}")
    # Evaluate on this machine's devices, whatever mesh the run trained on (checkpoints restore
    # onto any mesh; the engine's buffers are re-laid out): as many as divide the eval batch.
    n = args.num_devices or math.gcd(cfg.data.eval_batch_size, jax.device_count())
    spec = engine.EngineSpec.from_config(cfg)
    mesh = sharding.make_mesh(dataclasses.replace(cfg.mesh, data_parallel=n))
    with sharding.activate(mesh, cfg.mesh.rules, engine=spec):
        exp = Experiment.build(
            cfg,
            build_model,
            eval_path=args.data_path,
            with_optimizer=False,
            eval_only=True,
            workdir=str(workdir),
        )
        abstract = exp.abstract_state
        n_train = n
        if spec is not None:
            n_train = cfg.mesh.data_parallel
            n_train = _trained_device_count(workdir) if n_train == -1 else n_train
        if n_train != n:
            # The engine's buffers are laid out for the training mesh: restore that layout on
            # the host, then re-lay the tables out for this one.
            params, batch_stats, meta = _restore_resharded(
                ckpt, step, exp, cfg, build_model, n_train
            )
        else:
            trees, meta = ckpt.restore(
                step, {"params": abstract.params, "batch_stats": abstract.batch_stats}
            )
            params, batch_stats = trees["params"], trees["batch_stats"]
        graphdef = None
        if args.embeddings_int8:
            graphdef, params, batch_stats = quantize_embeddings_int8(exp.graphdef, params,
                                                                     batch_stats)  # fmt: skip
        metrics = exp.evaluate(params, batch_stats, graphdef=graphdef)
    ckpt.close()
    result: dict[str, Any] = {**metrics, "step": int(meta.get("step", step))}
    if args.embeddings_int8:
        result["embeddings"] = "int8"
    result["data_path"] = args.data_path or cfg.data.eval_path or f"synthetic:{cfg.data.kind}"
    if args.output and jax.process_index() == 0:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json_line(result) + "\n")
    return result


def quantize_embeddings_int8(graphdef, params, batch_stats):
    """``(graphdef, params, batch_stats)`` of the same model with every embedding collection's
    tables quantized to int8 row-wise (:meth:`EmbeddingCollection.quantize_int8`), laid out on
    the active mesh."""
    from flax import nnx  # noqa: PLC0415

    from recscale.embeddings import EmbeddingCollection  # noqa: PLC0415

    model = nnx.merge(graphdef, params, batch_stats)
    collections = [m for _, m in nnx.iter_modules(model) if isinstance(m, EmbeddingCollection)]
    if not collections:
        raise ValueError("embeddings_int8: the model has no embedding collection to quantize")
    for coll in collections:
        coll.quantize_int8()
    graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    params = jax.device_put(params, sharding.state_shardings(params))
    return graphdef, params, batch_stats


def _trained_device_count(workdir: Path) -> int:
    info = workdir / "run_info.json"
    if not info.is_file():
        raise FileNotFoundError(
            f"{info} is missing: cannot tell the mesh the engine's buffers need"
        )
    return int(json.loads(info.read_text())["starts"][-1]["device_count"])


def _restore_resharded(ckpt, step, exp, cfg, build_model, n_train: int):
    """Parameters of an engine run trained on ``n_train`` devices, laid out for ``exp``'s mesh.

    The training layout is rebuilt from the config on an abstract mesh of ``n_train`` devices
    (the plan is a pure function of the tables, the device count and the engine config), its
    buffers are restored to the host, cut back into tables, and packed into this mesh's layout.
    """
    from flax import nnx  # noqa: PLC0415

    spec = sharding.active_engine()
    train_mesh = jax.sharding.AbstractMesh(
        (n_train,), (sharding.DATA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,)
    )
    with sharding.activate(train_mesh, cfg.mesh.rules, engine=spec):
        train_model = nnx.eval_shape(
            lambda: build_model(cfg, exp.source.schema, nnx.Rngs(params=cfg.train.seed))
        )
    train_params = nnx.state(train_model, nnx.Param)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host),
                          train_params)  # fmt: skip
    trees, meta = ckpt.restore(
        step, {"params": target, "batch_stats": exp.abstract_state.batch_stats}
    )
    restored = trees["params"]
    model = nnx.merge(exp.graphdef, exp.abstract_state.params, exp.abstract_state.batch_stats)
    new_colls = engine.engine_collections(model)
    old_colls = engine.engine_collections(train_model)
    flat = dict(nnx.to_flat_state(restored))
    out = {}
    for path, _ in nnx.to_flat_state(exp.abstract_state.params):
        if path in flat and "buffers" not in path:
            out[path] = flat[path]
    for key, coll in new_colls.items():
        old = old_colls[key]
        prefix = tuple(p for p in key.split("/") if p)
        bufs = {bl.key: flat[prefix + ("buffers", bl.key)][...] for bl in old.layout.buffers}
        tables = engine.export_tables(old.layout, bufs, old.table_specs, old.feature_specs)
        names = [t.name for t in coll.table_specs]
        index = {n: i for i, n in enumerate(names)}
        new_bufs = engine.init_buffers(
            coll.layout, lambda i, tables=tables, names=names: jax.numpy.asarray(tables[names[i]]),
            [index[f.table] for f in coll.feature_specs], len(names),
        )  # fmt: skip
        for bl in coll.layout.buffers:
            out[prefix + ("buffers", bl.key)] = new_bufs[bl.key]
    params = jax.tree.map(lambda x: x, exp.abstract_state.params)  # a fresh State to fill
    leaves = []
    for path, var in nnx.to_flat_state(params):
        value = out[path]
        leaves.append((path, var.replace(value[...] if hasattr(value, "get_value") else value)))
    params = nnx.from_flat_state(leaves)
    params = jax.device_put(params, exp.state_sharding.params)
    return params, trees["batch_stats"], meta
