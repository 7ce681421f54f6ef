"""Restore a training state saved under one embedding layout onto another.

The engine's tables live in per-width buffers laid out by a plan of (device count, sharding
types, placement), and so does their optimizer state: row-wise Adagrad keeps one accumulator
per buffer row (``acc [N·R]``; every column shard of a column-split row holds that row's value,
since the update sums the row's squares over the shards), lazy Adam moments are shaped like the
buffer (``m``, ``v [N·R, w]``). A checkpoint records the layout it was saved under
(``layout_meta``, in its meta under ``"layout"``); ``restore_relaid`` restores it onto another
device count, sharding type or per-table pins:

1. the saved plan is rebuilt on an abstract mesh of the saved device count (the planner is a
   pure function of the tables, the device count and the engine spec, all recorded);
2. the checkpoint is restored with the saved structure: dense parameters, their optax state and
   the BatchNorm statistics straight onto the new shardings (their shapes do not depend on the
   layout), the saved buffers and their optimizer state onto a row sharding over the new
   mesh's devices (as many as divide their rows: **staging**);
3. table by table, in chunks of rows, each table's rows (and accumulators / moments) are
   gathered from the staging arrays to the host and scattered into the new layout's arrays,
   created in their shardings (rows the new layout does not use keep their initial values:
   zero rows, ``initial_accumulator``, zero moments, as a fresh state has them).

Every copy moves bits (no arithmetic), so a restored state is bitwise the saved one, and a
round trip A -> B -> A gives the original arrays. The host holds one chunk of one table at a
time; the devices hold the staging arrays and the new ones (twice the embedding state) until
the function returns.

Any process count restores any checkpoint (orbax reads each process's part of an array
whichever processes wrote it): every process runs the same steps, reads every chunk back (the
gathers' results are replicated) and writes its own devices' rows of the new arrays. Staging
rows that do not divide over all the devices of several processes are held once per process
instead, over that process's devices (each must read them back), so such a buffer takes a
copy per process while it is staged.

Tiered tables (``recscale.embeddings.tiers``): the checkpoint holds their device caches, laid
out like any table. Restored for the same tiers, a cache is re-laid out as the table it is to
the engine (its slots keep their rows, so the caches' directories still hold); restored without
them (evaluation, export), a table is filled whole from its store as of the checkpoint
(``tier_view.StoreView``).

Refused (``ValueError`` naming the change): the engine turned on or off (per-table arrays and
their optax state against buffers and sparse state), a changed ``storage_dtype`` (not exact), a
changed embedding optimizer (another state). The engine ``off`` path needs no re-layout: its
tables are one array each, whose shape is the same on any device count dividing 64 (rows are
padded to ``lcm(64, devices)``), so orbax restores them onto the new shardings.

Dimension glossary: ``V`` table rows, ``D`` table width, ``w`` buffer width, ``C`` rows of a
chunk, ``N`` devices, ``R`` rows per device block.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from data import roles
from recscale import config as config_lib
from recscale import sharding
from recscale.embeddings import engine, row_moves
from recscale.embeddings import tiers as tiers_lib
from recscale.embeddings.tier_view import StoreView

AXIS = sharding.DATA_AXIS
_PLAN_FIELDS = tuple(roles.plan_inputs(config_lib.ExperimentConfig))
"""The engine spec's fields the plan depends on, as the config fields that set them declare
(``plan_input``; kernels do not move rows; ``comm_dtype`` is in the planner's costs)."""
_PLAN_DEFAULTS = {
    "comm_dtype": "float32",
    "bound_scales": [],
    "l2": 0.0,
    "zipf_exponents": [],
    "lookup_factor": 0.0,
    "pack_rows": False,
    "planner": "analytic",
    "cost_model": "",
    "cost_model_digest": "",
}
"""Plan inputs recorded since: a checkpoint without one was planned as with this value (the
planner costed float32 exchanges whatever ``comm_dtype`` said; per-table bounds, which group
tables into buffers, came later; the engine refused coupled L2 before it kept such tables
data-parallel; the tables' measured skew and the lookup calibration came later too, before
which every table was costed as uniform and uncalibrated; narrow buffers were stored packed
(``EngineSpec.pack_rows``) later still, and the learned planner last)."""


# ------------------------------------------------------------------------------------------------
# Layout descriptions.


def _device_count(cfg: Any) -> int:
    mesh = sharding.active_mesh()
    if mesh is not None:
        return int(mesh.shape[AXIS])
    n = cfg.mesh.data_parallel
    return jax.device_count() if n == -1 else n


def layout_meta(cfg: Any, *, device_count: int | None = None) -> dict:
    """JSON-able description of the layout a checkpoint of ``cfg`` is saved under.

    ``{"device_count": devices on the mesh's data axis (the active mesh's, else
    ``cfg.mesh.data_parallel`` resolved), "embeddings": config_lib.to_dict(cfg.embeddings),
    "engine": the engine spec's plan inputs with the hardware profile resolved (None: engine
    off)}``. ``device_count`` overrides the count (e.g. the training mesh's, known from
    ``run_info.json``, for checkpoints written without a layout).
    """
    spec = engine.EngineSpec.from_config(cfg)
    plan = None
    if spec is not None:
        spec = dataclasses.replace(spec, profile=spec.profile or engine.default_profile())
        plan = {k: config_lib.to_dict(getattr(spec, k)) for k in _PLAN_FIELDS}
        plan["pack_rows"] = spec.pack_rows  # the buffers' shapes (from the kernels)
    return {
        "device_count": int(device_count or _device_count(cfg)),
        "embeddings": config_lib.to_dict(cfg.embeddings),
        "engine": plan,
    }


def _checked(saved: Any) -> dict:
    if not isinstance(saved, dict) or not {"device_count", "engine"} <= set(saved):
        raise ValueError(
            f"not a layout description (relayout.layout_meta): {saved!r}; expected the keys "
            "device_count, embeddings, engine"
        )
    return saved


def _layout_key(meta: dict) -> tuple:
    if meta["engine"] is None:  # one array per table: any device count restores through orbax
        return ("off",)
    e = {**_PLAN_DEFAULTS, **meta["engine"]}
    fields = (*_PLAN_FIELDS, "pack_rows")
    return (int(meta["device_count"]), *(config_lib.to_dict(e.get(k)) for k in fields))


def needs_relayout(saved: dict | None, cfg: Any) -> bool:
    """Whether a checkpoint saved under layout ``saved`` (``layout_meta``; None: unrecorded,
    taken to be ``cfg``'s) must go through ``restore_relaid`` to be restored for ``cfg`` on the
    active mesh: the engine's plan inputs or device count changed, or the engine was turned on or
    off (which ``restore_relaid`` refuses with the reason)."""
    if saved is None:
        return False
    return _layout_key(_checked(saved)) != _layout_key(layout_meta(cfg))


def check_relayout(saved: dict, cfg: Any, *, with_opt_state: bool = True) -> None:
    """Raises ``ValueError`` naming what changed when a state saved under ``saved`` cannot be
    re-laid out for ``cfg`` exactly (see the module docstring). Without the optimizer state
    (``train.init_from``, evaluation), a per-table checkpoint converts to the engine."""
    saved = _checked(saved)
    now = layout_meta(cfg)
    old_e, new_e = saved["engine"], now["engine"]
    old_kind = saved.get("embeddings", {}).get("sharding", "off" if old_e is None else "?")
    if old_e is None and new_e is not None and not with_opt_state:
        return  # parameters only: the per-table arrays convert (``_per_table_to_engine``)
    if (old_e is None) != (new_e is None):
        raise ValueError(
            f"cannot restore across the embedding engine being turned "
            f"{'on' if old_e is None else 'off'}: the checkpoint was saved with "
            f"embeddings.sharding={old_kind!r}, the run has {cfg.embeddings.sharding!r} "
            "(per-table arrays with their optax state and the engine's buffers with their "
            "sparse optimizer state do not convert); resume with the saved setting, or start a "
            "new run from its parameters with train.init_from"
        )
    if old_e is None:
        return
    for key, field in (
        ("storage_dtype", "embeddings.storage_dtype"),
        ("optimizer", "embedding_optim.name"),
    ):
        if old_e[key] != new_e[key]:
            why = (
                "re-laying out moves bits; converting the stored tables is not exact"
                if key == "storage_dtype"
                else "the tables' optimizer state has another form"
            )
            raise ValueError(
                f"cannot re-lay out the checkpoint: {field} changed from {old_e[key]!r} to "
                f"{new_e[key]!r} ({why}); resume with {field}={old_e[key]!r}"
            )


def _saved_config(saved: dict, cfg: Any) -> Any:
    """``cfg`` with the plan inputs the checkpoint was saved under (``_PLAN_FIELDS``), so that
    ``build_model`` lays the saved model out as it was (its ``EngineSpec.from_config`` gives
    the saved spec)."""
    e = {**_PLAN_DEFAULTS, **saved["engine"]}
    d = config_lib.to_dict(cfg)
    for name, dotted in roles.plan_inputs(type(cfg)).items():
        *parents, leaf = dotted.split(".")
        node = d
        for p in parents:
            node = node[p]
        node[leaf] = e[name]
    old = config_lib.from_dict(type(cfg), d, path="saved layout")
    spec = engine.EngineSpec.from_config(old)
    if spec is not None and spec.pack_rows != e["pack_rows"]:
        # The kernels decide only whether narrow buffers were stored packed: set ones that did
        # (the TPU kernels) or did not, to build the saved model's shapes.
        kernels = d["kernels"]
        for k in ("embedding_bag", "embedding_update"):
            if e["pack_rows"]:
                kernels[k] = "pallas_tpu"
            elif kernels[k] == "pallas_tpu":
                kernels[k] = "xla"
        old = config_lib.from_dict(type(cfg), d, path="saved layout")
    return old


# ------------------------------------------------------------------------------------------------
# Restore.


def restore_relaid(
    ckpt: Any,
    step: int,
    exp: Any,
    cfg: Any,
    build_model: Any,
    saved: dict,
    *,
    with_opt_state: bool = True,
    extra: dict[str, Any] | None = None,
    tier_dir: Any = None,
) -> dict[str, Any]:
    """``{"params", "opt_state", "batch_stats"}`` of checkpoint ``step`` (saved under layout
    ``saved``), laid out for ``exp``'s active mesh and engine.

    Call inside ``sharding.activate`` of the new layout, with ``exp`` built there (with its
    optimizer unless ``with_opt_state=False``, which leaves ``opt_state`` None). ``extra``:
    further checkpoint items restored as they are, onto the abstract trees given (e.g.
    ``{"rng": ...}``), returned under their names. Raises ``ValueError`` for the refused changes
    (``check_relayout``).

    Tiered tables (``embeddings.tiers``): the checkpoint holds their caches. A table tiered
    alike in ``saved`` and ``cfg`` is re-laid out as the cache it is; one tiered in ``saved``
    but not in ``cfg`` is restored whole, its rows read from its store in ``tier_dir`` as of
    ``step`` (``tier_view.StoreView``; its rows only: ``with_opt_state=False``).
    """
    check_relayout(saved, cfg, with_opt_state=with_opt_state)
    saved_tiers = tiers_lib.parse_tiers(tuple(saved.get("embeddings", {}).get("tiers", ())))
    whole = sorted(set(saved_tiers) - set(tiers_lib.parse_tiers(cfg.embeddings.tiers)))
    if whole and (with_opt_state or tier_dir is None):
        raise ValueError(
            f"checkpoint step {step} holds only the caches of the tiered tables {whole}: "
            "restoring them whole needs their stores (tier_dir) and gives their rows, not "
            "their optimizer state; resume with the run's embeddings.tiers"
        )
    if sharding.active_mesh() is None:
        raise RuntimeError("restore_relaid runs inside sharding.activate of the new layout")
    if saved["engine"] is None and engine.EngineSpec.from_config(cfg) is not None:
        return _per_table_to_engine(ckpt, step, exp, cfg, build_model, extra)
    abstract = exp.abstract_state
    likes: dict[str, Any] = {"batch_stats": abstract.batch_stats, **(extra or {})}
    if with_opt_state:
        if exp.tx is None:
            raise ValueError("with_opt_state=True needs an Experiment built with its optimizer")
    n_old = int(saved["device_count"])
    mesh = jax.sharding.AbstractMesh((n_old,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    old_cfg = cfg if saved["engine"] is None else _saved_config(saved, cfg)
    # the saved buffers' layout: data axis only (the engine ignores a model axis)
    schema = exp.source.schema
    # a tiered table: its cache (a sequential model's schema has no features, nor tiers)
    old_schema = tiers_lib.model_schema(schema, saved_tiers) if saved_tiers else schema
    with sharding.activate(mesh, dataclasses.replace(cfg.mesh, model_parallel=1, fsdp=False)):
        old_model = nnx.eval_shape(
            lambda: build_model(old_cfg, old_schema, nnx.Rngs(params=cfg.train.seed))
        )
    old_params = nnx.state(old_model, nnx.Param)
    if saved["engine"] is None:
        _check_same_shapes(old_params, abstract.params, n_old)
        likes["params"] = abstract.params
        if with_opt_state:
            likes["opt_state"] = abstract.opt_state
        trees, _ = ckpt.restore(step, likes)
        return {"opt_state": None, **trees}

    old_colls = _collections(old_model)
    new_colls = _collections(nnx.merge(exp.graphdef, abstract.params, abstract.batch_stats))
    if set(old_colls) != set(new_colls):
        raise ValueError(
            f"embedding collections differ: saved {sorted(old_colls)}, now {sorted(new_colls)}"
        )
    old_buffers = {
        path + ("buffers", bl.key): bl for path, c in old_colls.items() for bl in c.layout.buffers
    }
    target = {path: _value(var) for path, var in nnx.to_flat_state(abstract.params)}
    leaves = []
    for path, var in nnx.to_flat_state(old_params):
        v = _value(var)
        if path in old_buffers:
            value = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=row_moves.staging(v.shape))
        elif path in target and target[path].shape == v.shape:
            value = target[path]
        else:
            raise ValueError(
                f"parameter {_name(path)} of the saved model has no counterpart of "
                f"shape {v.shape} in this model"
            )
        leaves.append((path, var.replace(value)))
    likes["params"] = nnx.from_flat_state(leaves)
    if with_opt_state:
        old_opt = jax.eval_shape(exp.tx.init, old_params)
        likes["opt_state"] = {
            "dense": abstract.opt_state["dense"],
            "embedding": jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=row_moves.staging(x.shape)
                ),
                old_opt["embedding"],
            ),
        }
    trees, _ = ckpt.restore(step, likes)

    restored = {path: _value(var) for path, var in nnx.to_flat_state(trees["params"])}
    new_arrays: dict[tuple, jax.Array] = {}
    new_state: dict[str, dict[str, jax.Array]] = {}
    init_acc = cfg.embedding_optim.initial_accumulator
    vocab = {f.table_name: f.vocab_size for f in schema.features} if whole else {}
    for path, new in new_colls.items():
        old = old_colls[path]
        _check_same_tables(old, new, path, {t: vocab[t] for t in whole})
        stores = {
            t.name: StoreView(
                Path(tier_dir) / t.name,
                t.num_rows,
                t.dim + tiers_lib.state_width(saved["engine"]["optimizer"], t.dim),
                step,
            )
            for t in new.table_specs
            if t.name in whole
        }
        src, src_state, dst, dst_state = {}, {}, {}, {}
        for bl in old.layout.buffers:
            p = path + ("buffers", bl.key)
            src[bl.key] = restored.pop(p)
            if with_opt_state:
                src_state[bl.key] = {
                    k: _value(v) for k, v in trees["opt_state"]["embedding"][_key(p)].items()
                }
        for bl in new.layout.buffers:
            p = path + ("buffers", bl.key)
            dst[bl.key] = row_moves.full(target[p], 0)
            if with_opt_state:
                dst_state[bl.key] = {
                    k: row_moves.full(_value(v), init_acc if k == "acc" else 0)
                    for k, v in abstract.opt_state["embedding"][_key(p)].items()
                }
        row_moves.copy_tables(old, new, src, src_state, dst, dst_state, stores)
        for a in jax.tree.leaves((src, src_state)):
            a.delete()  # the staging copy is no longer needed
        for bl in new.layout.buffers:
            p = path + ("buffers", bl.key)
            new_arrays[p] = dst[bl.key]
            new_state[_key(p)] = dst_state.get(bl.key, {})

    out_leaves = []
    for path, var in nnx.to_flat_state(abstract.params):
        value = new_arrays[path] if path in new_arrays else restored[path]
        out_leaves.append((path, var.replace(value)))
    out = {**trees, "params": nnx.from_flat_state(out_leaves), "opt_state": None}
    if with_opt_state:
        emb = {
            p: {k: var.replace(new_state[p][k]) for k, var in per.items()}
            for p, per in abstract.opt_state["embedding"].items()
        }
        out["opt_state"] = {"dense": trees["opt_state"]["dense"], "embedding": emb}
    return out


def _per_table_to_engine(ckpt, step, exp, cfg, build_model, extra) -> dict[str, Any]:
    """The parameters of a per-table checkpoint (``embeddings.sharding=off``) in ``exp``'s
    engine layout: each table's rows copied into its shards (``engine.init_buffers``), the
    dense parameters and statistics restored as they are. Bits move, nothing is computed."""
    old_cfg = dataclasses.replace(
        cfg, embeddings=dataclasses.replace(cfg.embeddings, sharding="off")
    )
    old_model = nnx.eval_shape(
        lambda: build_model(old_cfg, exp.source.schema, nnx.Rngs(params=cfg.train.seed))
    )
    abstract = exp.abstract_state
    replicated = sharding.replicated()
    target = {path: _value(var) for path, var in nnx.to_flat_state(abstract.params)}
    leaves = []
    for path, var in nnx.to_flat_state(nnx.state(old_model, nnx.Param)):
        v = _value(var)
        if path in target and target[path].shape == v.shape:
            value = target[path]
        elif "tables" in path:  # whole on every device: the host copies it into the buffers
            value = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated)
        else:
            raise ValueError(
                f"parameter {_name(path)} of the saved model has no counterpart of "
                f"shape {v.shape} in this model"
            )
        leaves.append((path, var.replace(value)))
    likes = {"params": nnx.from_flat_state(leaves), "batch_stats": abstract.batch_stats}
    trees, _ = ckpt.restore(step, {**likes, **(extra or {})})
    restored = {path: _value(var) for path, var in nnx.to_flat_state(trees["params"])}
    new_colls = _collections(nnx.merge(exp.graphdef, abstract.params, abstract.batch_stats))
    new_arrays: dict[tuple, jax.Array] = {}
    for path, coll in new_colls.items():
        specs = coll.table_specs
        tables = [
            np.asarray(jax.device_get(restored.pop(path + ("tables", t.name)))) for t in specs
        ]
        index = {t.name: i for i, t in enumerate(specs)}
        buffers = engine.init_buffers(
            coll.layout,
            lambda i, tables=tables, specs=specs: tables[i][: specs[i].num_rows],
            [index[f.table] for f in coll.feature_specs],
            len(specs),
        )
        for key, buf in buffers.items():
            p = path + ("buffers", key)
            new_arrays[p] = jax.device_put(buf, target[p].sharding)
    out_leaves = [
        (path, var.replace(new_arrays[path] if path in new_arrays else restored[path]))
        for path, var in nnx.to_flat_state(abstract.params)
    ]
    return {**trees, "params": nnx.from_flat_state(out_leaves), "opt_state": None}


def _value(var: Any) -> Any:
    return var.get_value() if hasattr(var, "get_value") else var


def _name(path: tuple) -> str:
    return "/".join(str(p) for p in path)


_key = _name  # SparseOptimizer's key of a buffer's state: the buffer's path, "/"-joined


def _collections(model: nnx.Module) -> dict[tuple, Any]:
    """``{module path: collection}`` of the engine-backed embedding collections of ``model``."""
    return {
        tuple(path): m
        for path, m in nnx.iter_modules(model)
        if getattr(m, "layout", None) is not None
    }


def _check_same_shapes(old: Any, new: Any, n_old: int) -> None:
    shapes = {path: _value(v).shape for path, v in nnx.to_flat_state(new)}
    for path, var in nnx.to_flat_state(old):
        shape = _value(var).shape
        if shapes.get(path) != shape:
            raise ValueError(
                f"parameter {_name(path)} was saved with shape {shape} on {n_old} devices and "
                f"has shape {shapes.get(path)} here: per-table rows are padded to a multiple of "
                f"lcm({sharding.ROW_PAD_MULTIPLE}, devices); use a device count that keeps it"
            )


def _check_same_tables(old: Any, new: Any, path: tuple, whole: dict[str, int]) -> None:
    """``whole``: ``{table: rows}`` of the tables restored whole from their stores (saved as
    caches of fewer rows)."""

    def specs(c, rows):
        by_table = {f.table: f.name for f in c.feature_specs}
        return [
            (t.name, rows.get(t.name, t.num_rows), t.dim, by_table.get(t.name))
            for t in c.table_specs
        ]

    if specs(old, whole) != specs(new, {}):
        raise ValueError(
            f"embedding collection {_name(path) or 'model'}: the saved tables "
            f"{specs(old, whole)} differ from this model's {specs(new, {})}"
        )
