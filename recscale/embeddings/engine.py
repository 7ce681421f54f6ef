"""The sharded embedding engine: tables laid out over the mesh by a plan, pooled lookups with
``shard_map`` collectives, and sparse in-place updates of the rows a batch touches.

Layout. A plan (``recscale.embeddings.planner``) cuts every table into shards ``(device, rows,
columns)``. Shards of equal width and storage dtype share one **buffer**: a ``[N·R, w]`` array
sharded over the mesh's ``data`` axis, whose device block ``d`` (rows ``[d·R, (d+1)·R)``) holds
that device's shards one after another (each at an ``offset``). That one layout expresses every
sharding type: table-wise is one shard on one device, row-wise a row range on every device,
column-wise a column range on each of ``k`` devices, the hybrids the same within a host's
devices. Data-parallel tables live in a replicated ``[R, w]`` buffer instead. Each device's
shards are its **slots** (padded to the same count ``S`` on every device, as SPMD needs).

Lookup (forward), per sharded buffer, inside ``shard_map`` on every device:

1. all-gather the batch's ids (``[B, F, H]``; each device holds ``B/N`` examples);
2. for each slot, the ids that fall in its row range become buffer rows; their distinct rows
   (``uids [S, U]``, ``U = B·H``) are gathered once into the **sub-buffer** ``[S, U, w]``;
3. bags are pooled from the sub-buffer, giving each slot's partial output for the whole batch
   ``[S, B, w]`` (a row-wise shard's partial sum, a column-wise shard's columns);
4. an ``all_to_all`` sends every example's partial outputs to the device that holds the example
   (optionally in bf16/fp16), and a static gather-and-sum assembles ``[B/N, ΣD]`` (row-wise
   partial sums are added here: the reduce-scatter of TorchRec's row-wise sharding).

Data-parallel tables are looked up under plain ``jax.jit`` shardings: distinct rows over the
global batch, pooling of each device's own examples, gradients all-reduced by XLA.

Sparse updates. The train step never differentiates with respect to a buffer. Each lookup adds
a zero **delta** to its sub-buffer (``stop_gradient(sub) + delta``) and the step takes the
gradient with respect to the deltas: exactly the touched rows' gradients, duplicate ids already
combined by the transpose of the gather. :func:`apply_update` then updates those rows in place
(buffers donated; ``mode="drop"`` skips the padding slots): SGD, row-wise Adagrad (FBGEMM's
``EXACT_ROWWISE_ADAGRAD``; a column-wise table's per-row sum of squares is summed over its
column shards with a ``psum``, so it equals the unsharded update) and lazy Adam (moments and
rows of touched rows only, bias correction by the global step, as TF's LazyAdam).

Dimension glossary: ``N`` devices, ``B`` global batch, ``F`` features, ``H`` bag slots, ``S``
slots per device, ``U = B·H`` distinct-row bound of a slot, ``R`` rows per device block, ``w``
a buffer's width, ``ΣD`` the features' total width.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from recscale import sharding
from recscale.embeddings import planner as planner_lib
from recscale.embeddings.spec import FeatureSpec, TableSpec
from recscale.kernels.embedding_bag import api as bag_api
from recscale.kernels.embedding_update import api as update_api
from recscale.kernels.quantized_embedding_bag import api as q_api
from tpu_gpu_configs.profiles import get_profile

AXIS = sharding.DATA_AXIS
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
COLUMN_TYPES = ("column_wise", "table_column_wise")


class EngineOptState(nnx.Variable):
    """Optimizer state of an engine buffer (row-wise Adagrad accumulators, Adam moments)."""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What embedding collections need to lay their tables out (set by the trainer)."""

    sharding: str
    per_table: tuple[str, ...]
    profile: str
    host_size: int
    storage_dtype: str
    comm_dtype: str
    optimizer: str
    batch_size: int
    bag_kernel: str = "auto"
    """Implementation of the pooled lookups (``recscale.kernels.embedding_bag``)."""
    update_kernel: str = "auto"
    """Implementation of the fused backward + row update (``recscale.kernels.embedding_update``)."""

    @classmethod
    def from_config(cls, cfg: Any) -> EngineSpec | None:
        """The spec of an experiment config (None when ``embeddings.sharding`` is ``off``)."""
        e = cfg.embeddings
        if e.sharding == "off":
            return None
        if cfg.embedding_optim.l2 > 0:
            raise ValueError(
                f"embedding_optim.l2={cfg.embedding_optim.l2}: coupled L2 touches every row each "
                "step, which the sparse engine does not do; set embeddings.sharding=off or l2=0"
            )
        return cls(e.sharding, tuple(e.per_table), e.profile, e.host_size, e.storage_dtype,
                   e.comm_dtype, cfg.embedding_optim.name, cfg.data.batch_size,
                   cfg.kernels.embedding_bag, cfg.kernels.embedding_update)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class BufferLayout:
    """One buffer: its shape, and per device (outer) and slot (inner) what each slot holds."""

    key: str
    width: int
    dtype: str
    replicated: bool
    rows: int
    """R: rows per device block (replicated: rows of the buffer)."""
    feature: tuple[tuple[int, ...], ...]
    row_start: tuple[tuple[int, ...], ...]
    row_count: tuple[tuple[int, ...], ...]
    """Rows of the shard (0: a padding slot)."""
    offset: tuple[tuple[int, ...], ...]
    col_start: tuple[tuple[int, ...], ...]
    table_dim: tuple[tuple[int, ...], ...]
    cw_group: tuple[tuple[int, ...], ...]
    """Index of the slot's table among column-split tables (``num_cw_groups``: not split)."""

    def arr(self, name: str) -> np.ndarray:
        return np.asarray(getattr(self, name), np.int32)


@dataclasses.dataclass(frozen=True)
class Layout:
    num_devices: int
    buffers: tuple[BufferLayout, ...]
    feature_dims: tuple[int, ...]
    feature_hotness: tuple[int, ...]
    feature_pooling: tuple[str, ...]
    num_cw_groups: int
    comm_dtype: str
    plan_text: str

    def buffer(self, key: str) -> BufferLayout:
        return next(b for b in self.buffers if b.key == key)


# ------------------------------------------------------------------------------------------------
# Planning.


def default_profile() -> str:
    platform = jax.devices()[0].platform
    return {"gpu": "gpu-h100", "tpu": "tpu-v5p"}.get(platform, "cpu-2core")


def build_layout(
    tables: tuple[TableSpec, ...], features: tuple[FeatureSpec, ...], num_devices: int,
    spec: EngineSpec,
) -> Layout:  # fmt: skip
    """Plans ``tables`` on ``num_devices`` devices and lays the shards out in buffers."""
    by_table: dict[str, list[int]] = {t.name: [] for t in tables}
    for i, f in enumerate(features):
        by_table[f.table].append(i)
    for name, fs in by_table.items():
        if len(fs) != 1:
            raise ValueError(
                f"embedding engine: table {name!r} is read by {len(fs)} features; the engine "
                "needs exactly one feature per table (set embeddings.sharding=off for shared or "
                "unused tables)"
            )
    pins = dict(item.split("=", 1) for item in spec.per_table)
    unknown = set(pins) - set(by_table)
    if unknown:
        raise ValueError(f"embeddings.per_table names unknown tables {sorted(unknown)}")
    profile = get_profile(spec.profile or default_profile())
    if spec.host_size:
        profile = dataclasses.replace(profile, devices_per_host=spec.host_size)
    itemsize = jnp.dtype(DTYPES[spec.storage_dtype]).itemsize
    default = () if spec.sharding == "auto" else (spec.sharding,)
    hot = {f.table: f.max_hotness for f in features}

    def allowed(name: str) -> tuple[str, ...]:
        kinds = (pins[name],) if name in pins else default
        if num_devices == 1 and kinds and kinds != ("data_parallel",):
            return ("table_wise",)  # on one device every split is the whole table there
        return kinds

    ptables = [
        planner_lib.PlannerTable(
            name=t.name, num_rows=t.num_rows, dim=t.dim, bytes_per_element=itemsize,
            pooling_factor=float(hot[t.name]), optimizer=spec.optimizer,
            allowed=allowed(t.name),
        )
        for t in tables
    ]  # fmt: skip
    plan = planner_lib.plan(ptables, profile, num_devices, batch_size=spec.batch_size)
    table_plans = plan.by_table()
    cw_tables = [t.name for t in tables if table_plans[t.name].sharding in COLUMN_TYPES]
    cw_index = {name: i for i, name in enumerate(cw_tables)}
    # groups: key -> per device list of (feature, row_start, row_count, col_start, dim, cw)
    groups: dict[tuple[int, bool], list[list[tuple]]] = {}
    for t in tables:
        tp = table_plans[t.name]
        (f,) = by_table[t.name]
        replicated = tp.sharding == "data_parallel"
        shards = tp.shards[:1] if replicated else tp.shards
        for sh in shards:
            r0, r1 = sh.rows
            c0, c1 = sh.cols[0], min(sh.cols[1], t.dim)
            if r1 <= r0 or c1 <= c0:
                continue
            devs = groups.setdefault((c1 - c0, replicated), [[] for _ in range(num_devices)])
            cw = cw_index.get(t.name, len(cw_tables))
            devs[0 if replicated else sh.device].append((f, r0, r1 - r0, c0, t.dim, cw))
    buffers = []
    for (width, replicated), devs in sorted(groups.items()):
        if replicated:
            devs = devs[:1]
        num_slots = max(len(d) for d in devs)
        fields: dict[str, list[list[int]]] = {
            k: [] for k in ("feature", "row_start", "row_count", "offset", "col_start",
                            "table_dim", "cw_group")
        }  # fmt: skip
        rows = 1
        for slots in devs:
            off, per = 0, {k: [] for k in fields}
            for f, r0, count, c0, dim, cw in slots:
                for k, v in zip(fields, (f, r0, count, off, c0, dim, cw), strict=True):
                    per[k].append(v)
                off += count
            for _ in range(num_slots - len(slots)):  # padding slots: no rows
                for k, v in zip(fields, (0, 0, 0, off, 0, 1, len(cw_tables)), strict=True):
                    per[k].append(v)
            rows = max(rows, off)
            for k in fields:
                fields[k].append(tuple(per[k]))
        rows = -(-rows // 8) * 8
        kind = "replicated" if replicated else "sharded"
        buffers.append(
            BufferLayout(
                key=f"{kind}_w{width}_{spec.storage_dtype}", width=width,
                dtype=spec.storage_dtype, replicated=replicated, rows=rows,
                **{k: tuple(v) for k, v in fields.items()},
            )
        )  # fmt: skip
    return Layout(
        num_devices=num_devices,
        buffers=tuple(buffers),
        feature_dims=tuple(next(t.dim for t in tables if t.name == f.table) for f in features),
        feature_hotness=tuple(f.max_hotness for f in features),
        feature_pooling=tuple(f.pooling for f in features),
        num_cw_groups=len(cw_tables),
        comm_dtype=spec.comm_dtype,
        plan_text=plan.render(),
    )


def init_buffers(layout: Layout, make_table, table_of_feature: list[int], num_tables: int):
    """Buffers holding the tables as the layout places them. ``make_table(t)`` returns table
    ``t`` (``[V_t, D_t]``); tables are made one at a time and copied into their shards, so the
    peak is the buffers plus one table."""
    out = {}
    for bl in layout.buffers:
        n_blocks = 1 if bl.replicated else layout.num_devices
        out[bl.key] = jnp.zeros((n_blocks * bl.rows, bl.width), DTYPES[bl.dtype])
    for t in range(num_tables):
        value = None
        for bl in layout.buffers:
            for d in range(1 if bl.replicated else layout.num_devices):
                for s in range(len(bl.feature[d])):
                    count = bl.row_count[d][s]
                    if not count or table_of_feature[bl.feature[d][s]] != t:
                        continue
                    value = make_table(t) if value is None else value
                    r0, c0 = bl.row_start[d][s], bl.col_start[d][s]
                    piece = value[r0 : r0 + count, c0 : c0 + bl.width].astype(out[bl.key].dtype)
                    start = (d * bl.rows + bl.offset[d][s], 0)
                    out[bl.key] = jax.lax.dynamic_update_slice(out[bl.key], piece, start)
    return out


def export_tables(layout: Layout, buffers: dict, tables: tuple[TableSpec, ...],
                  features: tuple[FeatureSpec, ...]) -> dict[str, np.ndarray]:  # fmt: skip
    """The tables ``{name: [V, D]}`` reassembled from the buffers (host numpy)."""
    out = {t.name: np.zeros((t.num_rows, t.dim), np.float32) for t in tables}
    for bl in layout.buffers:
        buf = np.asarray(jax.device_get(buffers[bl.key]), np.float32)
        for d in range(1 if bl.replicated else layout.num_devices):
            for s in range(len(bl.feature[d])):
                count = bl.row_count[d][s]
                if count:
                    name = features[bl.feature[d][s]].table
                    r0, c0, base = bl.row_start[d][s], bl.col_start[d][s], d * bl.rows
                    rows = buf[base + bl.offset[d][s] : base + bl.offset[d][s] + count]
                    out[name][r0 : r0 + count, c0 : c0 + bl.width] = rows
    return out


# ------------------------------------------------------------------------------------------------
# Building blocks.


def _kernel(kind: str) -> str:
    """The configured implementation of the engine's ``bag`` or ``update`` kernel."""
    spec = sharding.active_engine()
    return "auto" if spec is None else getattr(spec, f"{kind}_kernel")


def _pool(buf_rw, keys_sbh: jax.Array) -> jax.Array:
    """``[S, B, w]`` float32: bags summed from rows ``keys`` of ``buf [R, w]`` (``R`` = none), by
    the configured embedding-bag kernel (``recscale.kernels.embedding_bag``); ``buf`` may be an
    int8 ``(q, scale_bias)`` pair (inference), pooled by the fused dequantizing kernel."""
    s, b, h = keys_sbh.shape
    ids = keys_sbh.reshape(s * b, h)
    if isinstance(buf_rw, tuple):
        impl = _kernel("bag")
        pooled = q_api.pool(*buf_rw, ids, impl="auto" if impl == "cpu_ffi" else impl)
        return pooled.reshape(s, b, buf_rw[0].shape[1])
    pooled = bag_api.pool(buf_rw, ids, impl=_kernel("bag"))
    return pooled.reshape(s, b, buf_rw.shape[1])


def batched_unique(keys_sn: jax.Array, sentinel: int) -> tuple[jax.Array, jax.Array]:
    """Distinct keys of every row of ``keys [S, N]``: buffer rows in ``[0, sentinel)``, disjoint
    between rows of ``keys`` (each slot reads its own rows), ``sentinel`` = no key.

    Returns ``uids [S, N]`` (each row's distinct keys in order of first occurrence, then
    ``sentinel``) and ``inv [S, N]`` (each key's index into its row of ``uids``; arbitrary for
    ``sentinel``). No sort: a scatter-min of positions into a ``[sentinel + 1]`` int32 array
    finds each key's first occurrence (XLA's CPU sort is ~30x slower at these sizes; the array
    is 4 bytes per buffer row, a sixteenth of a 16-wide float32 table, and lives for one step).
    First-occurrence order makes column shards of one table, on different devices, list their
    rows in the same order (the column-wise row-wise-Adagrad reduction relies on it).
    """
    s, n = keys_sn.shape
    pos = jnp.arange(s * n, dtype=jnp.int32).reshape(s, n)
    first = jnp.full((sentinel + 1,), s * n, jnp.int32).at[keys_sn].min(pos)
    first_sn = first[keys_sn]  # flat position of each key's first occurrence (same slot)
    is_first = (first_sn == pos) & (keys_sn < sentinel)
    rank = jnp.cumsum(is_first, axis=1, dtype=jnp.int32) - 1
    inv = rank.reshape(-1)[first_sn]
    rows = jax.lax.broadcasted_iota(jnp.int32, (s, n), 0)
    slots = jnp.where(is_first, rank, n)
    uids = jnp.full((s, n), sentinel, keys_sn.dtype).at[rows, slots].set(keys_sn, mode="drop")
    return uids, inv


def _assembly_map(layout: Layout, metas) -> list[list[tuple[int, int, int, int]]]:
    """Per part, per row: ``(part, row, output column, width)`` of every contributing row."""
    feat_off = np.concatenate([[0], np.cumsum(layout.feature_dims)])
    out = []
    for p, (bl, replicated) in enumerate(metas):
        rows, row = [], 0
        for d in [0] if replicated else range(layout.num_devices):
            for s in range(len(bl.feature[d])):
                if bl.row_count[d][s]:
                    col = int(feat_off[bl.feature[d][s]] + bl.col_start[d][s])
                    rows.append((p, row, col, bl.width))
                row += 1
        out.append(rows)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 2))
def _assemble(layout: Layout, xs: tuple, metas: tuple) -> jax.Array:
    """``[B, ΣD]`` from every buffer's received partial outputs ``xs`` (``[K, B, w]``, rows in
    (source device, slot) order; ``metas``: ``(buffer layout, replicated)`` per part): static
    slices concatenated in column order, row-wise shards' partial sums added. Slices, not a
    gather (XLA fuses the producers into a gather and recomputes them); and a custom backward
    that writes each part's gradient once (XLA would pad and add one copy per slice)."""
    by_col: dict[int, list[jax.Array]] = {}
    for rows in _assembly_map(layout, metas):
        for p, row, col, _ in rows:
            by_col.setdefault(col, []).append(xs[p][row])
    out, col, total = [], 0, int(sum(layout.feature_dims))
    while col < total:
        if col not in by_col:
            raise AssertionError(f"the layout leaves output column {col} unfilled")
        terms = by_col[col]
        block = terms[0]
        for t in terms[1:]:
            block = block + t
        out.append(block)
        col += block.shape[1]
    return jnp.concatenate(out, axis=1)


def _assemble_fwd(layout, xs, metas):
    return _assemble(layout, xs, metas), tuple(x.shape for x in xs)


def _assemble_bwd(layout, metas, shapes, g):
    b = g.shape[0]
    g_ext = None
    grads = []
    for rows, (k, _, w) in zip(_assembly_map(layout, metas), shapes, strict=True):
        by_row = {row: col for _, row, col, _ in rows}
        c0 = by_row.get(0)
        if len(by_row) == k and all(by_row[r] == c0 + r * w for r in range(k)):
            # rows in column order (e.g. every table whole on one device): a transpose
            grads.append(jnp.transpose(g[:, c0 : c0 + k * w].reshape(b, k, w), (1, 0, 2)))
            continue
        if g_ext is None:  # a zero column for the rows that contribute nothing
            g_ext = jnp.concatenate([g, jnp.zeros((b, 1), g.dtype)], axis=1)
        zero = g.shape[1]
        idx = np.array([[by_row[r] + j if r in by_row else zero for j in range(w)]
                        for r in range(k)], np.int32).reshape(-1)  # fmt: skip
        grads.append(jnp.transpose(g_ext[:, idx].reshape(b, k, w), (1, 0, 2)))
    return (tuple(grads),)


_assemble.defvjp(_assemble_fwd, _assemble_bwd)


def _hotness_mask(layout: Layout, ids_bfh: jax.Array) -> jax.Array:
    """Ids beyond a feature's ``max_hotness`` become padding (-1)."""
    h = ids_bfh.shape[2]
    keep = np.arange(h)[None, :] < np.asarray(layout.feature_hotness)[:, None]  # [F, H]
    if keep.all():
        return ids_bfh
    return jnp.where(keep[None], ids_bfh, -1)


# ------------------------------------------------------------------------------------------------
# Lookup.


@dataclasses.dataclass
class _StepContext:
    deltas: dict | None  # path key -> {buffer key: delta}
    paths: dict  # id(collection) -> path key
    keys: dict = dataclasses.field(default_factory=dict)
    shapes: dict = dataclasses.field(default_factory=dict)


_STEP: contextvars.ContextVar[_StepContext | None] = contextvars.ContextVar(
    "recscale_engine_step", default=None
)


def _path_key(path: tuple) -> str:
    return "/".join(str(p) for p in path)


@contextlib.contextmanager
def step_context(model: nnx.Module, deltas: dict | None) -> Iterator[_StepContext]:
    """Within it, engine collections of ``model`` add ``deltas[path][buffer key]`` to their
    slots' pooled outputs and record the buffer rows they read (``ctx.keys``); with
    ``deltas=None`` they record only the deltas' shapes (``ctx.shapes``)."""
    paths = {id(m): k for k, m in engine_collections(model).items()}
    ctx = _StepContext(deltas=deltas, paths=paths)
    token = _STEP.set(ctx)
    try:
        yield ctx
    finally:
        _STEP.reset(token)


def engine_collections(model: nnx.Module) -> dict[str, Any]:
    """``{path key: collection}`` of the engine-backed embedding collections of ``model``."""
    return {
        _path_key(path): m
        for path, m in nnx.iter_modules(model)
        if getattr(m, "layout", None) is not None
    }


def lookup(module: Any, layout: Layout, buffers: dict, ids_bfh: jax.Array) -> jax.Array:
    """Pooled embeddings ``[B, ΣD]`` of the features of ``layout`` (see the module docstring)."""
    ctx = _STEP.get()
    key = ctx.paths.get(id(module)) if ctx is not None else None
    if key is not None and (key in ctx.keys or key in ctx.shapes):
        raise RuntimeError(
            f"embedding collection {key!r} was called twice in one train step; the sparse "
            "engine supports one lookup per collection per step"
        )
    deltas = ctx.deltas[key] if key is not None and ctx.deltas is not None else None
    ids_bfh = _hotness_mask(layout, ids_bfh)
    mesh = sharding.active_mesh()
    parts, keys, shapes = [], {}, {}
    for bl in layout.buffers:
        delta = None if deltas is None else deltas[bl.key]
        if bl.replicated:
            x, k = _lookup_replicated(bl, buffers[bl.key], ids_bfh, delta, mesh)
        else:
            x, k = _lookup_sharded(layout, bl, buffers[bl.key], ids_bfh, delta, mesh)
        parts.append((x, bl, bl.replicated))
        keys[bl.key] = k
        spec = P(None, AXIS) if bl.replicated else P(AXIS)
        shapes[bl.key] = jax.ShapeDtypeStruct(
            (*k.shape[:2], bl.width),
            jnp.float32,
            sharding=None if mesh is None else NamedSharding(mesh, spec),
        )
    if key is not None:
        if ctx.deltas is None:
            ctx.shapes[key] = shapes
        else:
            ctx.keys[key] = keys
    out = _assemble(layout, tuple(x for x, _, _ in parts), tuple((bl, r) for _, bl, r in parts))
    if "mean" in layout.feature_pooling:
        counts = jnp.maximum((ids_bfh >= 0).sum(axis=2), 1).astype(out.dtype)  # [B, F]
        scale = jnp.repeat(counts, np.asarray(layout.feature_dims), axis=1,
                           total_repeat_length=out.shape[1])  # fmt: skip
        is_mean = np.repeat(
            np.array([p == "mean" for p in layout.feature_pooling]), layout.feature_dims
        )
        out = jnp.where(is_mean[None], out / scale, out)
    return out


def _lookup_replicated(bl: BufferLayout, buf, ids_bfh, delta, mesh):
    """Slots of a replicated buffer pool every example where it lives (no exchange)."""
    feat = bl.arr("feature")[0]
    offset = bl.arr("offset")[0]
    ids_sbh = jnp.transpose(ids_bfh[:, feat, :], (1, 0, 2))
    keys = jnp.where(ids_sbh >= 0, offset[:, None, None] + ids_sbh, bl.rows)
    if mesh is None:
        pooled = _pool(buf, keys)
    else:  # each device pools its own examples (a kernel is a custom call XLA cannot split)
        spec = P(None, AXIS, None)
        keys = jax.lax.with_sharding_constraint(keys, NamedSharding(mesh, spec))
        pooled = jax.shard_map(
            _pool, mesh=mesh, in_specs=(jax.tree.map(lambda _: P(), buf), spec), out_specs=spec,
            check_vma=False,
        )(buf, keys)  # fmt: skip
    return (pooled if delta is None else pooled + delta), keys


def _lookup_sharded(layout: Layout, bl: BufferLayout, buf, ids_bfh, delta, mesh):
    """Slots of a sharded buffer pool the whole batch's ids that fall in their rows; an
    all-to-all returns every example's partial outputs to the device holding the example."""
    if mesh is None:
        raise RuntimeError("a sharded embedding buffer needs an active mesh (sharding.activate)")
    comm = DTYPES[layout.comm_dtype]
    rows = bl.rows

    def body(buf_rw, ids_l, feat, row_start, row_count, offset, *maybe_delta):
        ids = jax.lax.all_gather(ids_l, AXIS, axis=0, tiled=True)  # [B, F, H]
        feat, row_start, row_count, offset = feat[0], row_start[0], row_count[0], offset[0]
        ids_sbh = jnp.transpose(jnp.take(ids, feat, axis=1), (1, 0, 2))
        local = ids_sbh - row_start[:, None, None]
        ok = (ids_sbh >= 0) & (local >= 0) & (local < row_count[:, None, None])
        keys = jnp.where(ok, offset[:, None, None] + local, rows)
        pooled = _pool(buf_rw, keys)  # [S, B, w]: partial outputs for the whole batch
        if maybe_delta:
            pooled = pooled + maybe_delta[0]
        recv = jax.lax.all_to_all(pooled.astype(comm), AXIS, split_axis=1, concat_axis=0,
                                  tiled=True)  # fmt: skip
        return recv.astype(jnp.float32), keys

    slot_arrays = [jnp.asarray(bl.arr(k)) for k in ("feature", "row_start", "row_count", "offset")]
    args = [buf, ids_bfh, *slot_arrays] + ([delta] if delta is not None else [])
    in_specs = (
        jax.tree.map(lambda _: P(AXIS, None), buf),
        P(AXIS),
        P(AXIS),
        P(AXIS),
        P(AXIS),
        P(AXIS),
    ) + (  # fmt: skip
        (P(AXIS),) if delta is not None else ()
    )
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(None, AXIS), P(AXIS)),
                         check_vma=False)(*args)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Sparse updates.


def init_opt_state_for(buffer: nnx.Variable, optimizer: str, initial_accumulator: float) -> dict:
    """Optimizer state of one buffer Variable, as Variables carrying the buffer's sharding."""
    shape = buffer[...].shape
    ax = (buffer.get_metadata().get("logical_axes") or (None,))[0]
    if optimizer == "sgd":
        return {}
    if optimizer == "rowwise_adagrad":
        acc = jnp.full(shape[:1], initial_accumulator, jnp.float32)
        return {"acc": EngineOptState(acc, logical_axes=(ax,))}
    if optimizer == "adam":
        return {
            m: EngineOptState(jnp.zeros(shape, jnp.float32), logical_axes=(ax, None))
            for m in ("m", "v")
        }
    raise ValueError(f"unknown embedding optimizer {optimizer!r}")


@dataclasses.dataclass(frozen=True)
class UpdateRule:
    optimizer: str
    eps: float = 1e-8
    b1: float = 0.9
    b2: float = 0.999


def row_gradients(keys_sbh: jax.Array, g_sbw: jax.Array, sentinel: int):
    """The touched rows and their gradients from the pooled outputs' gradients.

    A sum-pooled bag's gradient reaches each of its rows whole, so a row's gradient is the sum
    of the gradients of the bags that read it (repeats included). Returns ``uids [S, U]``
    (``U = B·H``; ``sentinel`` in unused slots) and ``grad [S, U, w]``.
    """
    s, b, h = keys_sbh.shape
    w = g_sbw.shape[-1]
    uids, inv = batched_unique(keys_sbh.reshape(s, b * h), sentinel)
    u = b * h
    flat_inv = inv.reshape(s, b, h) + (jnp.arange(s, dtype=jnp.int32) * u)[:, None, None]
    flat_inv = jnp.moveaxis(flat_inv, 2, 0)
    ok_h = jnp.moveaxis(keys_sbh < sentinel, 2, 0)
    g_sbw = g_sbw.astype(jnp.float32)

    def add(j, acc):  # padding ids add zeros (to the sentinel's slot, whose row is dropped)
        return acc.at[flat_inv[j]].add(jnp.where(ok_h[j][..., None], g_sbw, 0.0))

    # The first slot outside the loop: inside shard_map the carry must start device-varying.
    grad = add(0, jnp.zeros((s * u, w), jnp.float32))
    if h > 1:
        grad = jax.lax.fori_loop(1, h, add, grad)
    return uids, grad.reshape(s, u, w)


def apply_update(
    layout: Layout, bl: BufferLayout, buf, state: dict, keys, grad_pooled, lr, step,
    rule: UpdateRule,
):  # fmt: skip
    """Updates the rows read at ``keys [S, B, H]`` given the gradients of the slots' pooled
    outputs ``[S, B, w]``; returns ``(buf, state, [sum of squared updates, sum of squared row
    gradients])``."""
    values = {k: v[...] for k, v in state.items()}
    names = sorted(values)
    slot = {k: jnp.asarray(bl.arr(k)) for k in ("cw_group", "table_dim")}
    groups = 0 if bl.replicated else layout.num_cw_groups
    split = groups and bool((bl.arr("cw_group") < groups).any())
    # SGD and row-wise Adagrad of whole rows run in the update kernel (recscale.kernels
    # .embedding_update); a column-split table's row statistic needs a psum across its column
    # shards, and lazy Adam keeps per-column moments, so those stay here.
    kernel = rule.optimizer in ("sgd", "rowwise_adagrad") and not split
    impl = _kernel("update")

    def body(buf_rw, keys_sbh, g_sbw, cw, tdim, lr, step, *vals):
        st = dict(zip(names, vals, strict=True))
        if kernel:
            s, b, h = keys_sbh.shape
            new_buf, acc, sq = update_api.update(
                buf_rw, st.get("acc"), keys_sbh.reshape(s * b, h), g_sbw.reshape(s * b, -1), lr,
                optimizer=rule.optimizer, eps=rule.eps, impl=impl,
            )  # fmt: skip
            new_st = {"acc": acc} if "acc" in st else {}
        else:
            uids, grad = row_gradients(keys_sbh, g_sbw, buf_rw.shape[0])
            new_buf, new_st, sq = _update_rows(
                buf_rw, st, uids, grad, cw[0], tdim[0], lr, step, rule, groups
            )
            sq = jnp.stack([sq, jnp.sum(jnp.square(grad))])  # padding slots: zero gradients
        if not bl.replicated:
            sq = jax.lax.psum(sq, AXIS)
        return new_buf, tuple(new_st[k] for k in names), sq

    args = (buf, keys, grad_pooled, slot["cw_group"], slot["table_dim"], lr, step,
            *(values[k] for k in names))  # fmt: skip
    if bl.replicated:
        new_buf, new_vals, sq = body(*args)
    else:
        specs = {"acc": P(AXIS), "m": P(AXIS, None), "v": P(AXIS, None)}
        new_buf, new_vals, sq = jax.shard_map(
            body,
            mesh=sharding.active_mesh(),
            in_specs=(P(AXIS, None), P(AXIS), P(AXIS), P(AXIS), P(AXIS), P(), P(),
                      *(specs[k] for k in names)),
            out_specs=(P(AXIS, None), tuple(specs[k] for k in names), P()),
            check_vma=False,
        )(*args)  # fmt: skip
    new_state = {k: state[k].replace(v) for k, v in zip(names, new_vals, strict=True)}
    return new_buf, new_state, sq


def _update_rows(buf, st, uids_su, g_suw, cw_s, tdim_s, lr, step, rule: UpdateRule, groups: int):
    s, u, w = g_suw.shape
    flat_u = uids_su.reshape(-1)
    g = g_suw.astype(jnp.float32)
    if rule.optimizer == "sgd":
        upd = -lr * g
        new_st = st
    elif rule.optimizer == "rowwise_adagrad":
        sq_su = jnp.sum(jnp.square(g), axis=-1)
        nz_su = jnp.any(g != 0, axis=-1).astype(jnp.float32)
        if groups:
            # A column-split table's row statistic spans all its column shards (other devices).
            tot = jnp.zeros((groups + 1, u), jnp.float32).at[cw_s].add(sq_su)
            nzt = jnp.zeros((groups + 1, u), jnp.float32).at[cw_s].add(nz_su)
            tot, nzt = jax.lax.psum((tot, nzt), AXIS)
            split = (cw_s < groups)[:, None]
            sq_su = jnp.where(split, tot[cw_s], sq_su)
            nz_su = jnp.where(split, nzt[cw_s], nz_su)
        mean_su = sq_su / tdim_s[:, None].astype(jnp.float32)
        acc_su = st["acc"].at[uids_su].get(mode="clip") + mean_su
        touched = nz_su > 0
        denom = jnp.where(touched, jnp.sqrt(acc_su) + rule.eps, 1.0)
        upd = jnp.where(touched[..., None], g / denom[..., None], 0.0) * -lr
        new_st = {"acc": st["acc"].at[flat_u].set(acc_su.reshape(-1), mode="drop")}
    elif rule.optimizer == "adam":
        t = (step + 1).astype(jnp.float32)
        m = rule.b1 * st["m"].at[uids_su].get(mode="clip") + (1 - rule.b1) * g
        v = rule.b2 * st["v"].at[uids_su].get(mode="clip") + (1 - rule.b2) * g * g
        m_hat = m / (1 - rule.b1**t)
        v_hat = v / (1 - rule.b2**t)
        upd = -lr * m_hat / (jnp.sqrt(v_hat) + rule.eps)
        new_st = {
            "m": st["m"].at[flat_u].set(m.reshape(-1, w), mode="drop"),
            "v": st["v"].at[flat_u].set(v.reshape(-1, w), mode="drop"),
        }
    else:
        raise ValueError(f"unknown embedding optimizer {rule.optimizer!r}")
    valid = (uids_su < buf.shape[0])[..., None]
    sq = jnp.sum(jnp.where(valid, jnp.square(upd), 0.0))
    new_buf = buf.at[flat_u].add(upd.reshape(-1, w).astype(buf.dtype), mode="drop")
    return new_buf, new_st, sq


def generated_rows(num_rows: int) -> int:
    """Rows a table is generated with (as the per-table path pads them), so both paths draw
    the same initial values."""
    return math.ceil(num_rows / sharding.ROW_PAD_MULTIPLE) * sharding.ROW_PAD_MULTIPLE
