"""The engine's lookup (forward): pooled embeddings of a batch from tables laid out in buffers
(``recscale.embeddings.layout``), with ``shard_map`` collectives.

Per sharded buffer, inside ``shard_map`` on every device:

1. all-gather the batch's ids (``[B, F, H]``; each device holds ``B/N`` examples);
2. for each slot, the ids that fall in its row range become buffer rows (``keys``; ``R`` =
   none), pooled from the device's block by the configured embedding-bag kernel, giving each
   slot's partial output for the whole batch ``[S, B, w]`` (a row-wise shard's partial sum, a
   column-wise shard's columns);
3. an ``all_to_all`` sends every example's partial outputs to the device that holds the example
   (optionally in bf16/fp16), and a static gather-and-sum assembles ``[B/N, ΣD]`` (row-wise
   partial sums are added here: the reduce-scatter of TorchRec's row-wise sharding).

Data-parallel tables are looked up under plain ``jax.jit`` shardings: each device pools its own
examples from the replicated buffer.

Inside a train step (:func:`step_context`) each lookup adds a zero **delta** to its slots'
pooled outputs and records the keys it read: the step differentiates with respect to the deltas
and hands keys and gradients to ``recscale.embeddings.update`` (never a table gradient).

Dimension glossary: ``N`` devices, ``B`` global batch, ``F`` features, ``H`` bag slots, ``S``
slots per device, ``R`` rows per device block, ``w`` a buffer's width, ``ΣD`` the features'
total width.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from recscale import sharding
from recscale.embeddings import compress
from recscale.embeddings.layout import DTYPES, BufferLayout, Layout
from recscale.kernels.embedding_bag import api as bag_api
from recscale.kernels.quantized_embedding_bag import api as q_api

AXIS = sharding.DATA_AXIS


def _pool(buf_rw, keys_sbh: jax.Array, impl: str = "auto", pack: int = 1) -> jax.Array:
    """``[S, B, w]`` float32: bags summed from rows ``keys`` of ``buf [R, w]`` (``R`` = none;
    stored ``[R/pack, pack·w]`` when packed), by the embedding-bag kernel ``impl``
    (``recscale.kernels.embedding_bag``); ``buf`` may be an int8 ``(q, scale_bias)`` pair
    (inference; quantized as rows, so ``pack`` does not apply), pooled by the fused
    dequantizing kernel."""
    s, b, h = keys_sbh.shape
    ids = keys_sbh.reshape(s * b, h)
    if isinstance(buf_rw, tuple):
        pooled = q_api.pool(*buf_rw, ids, impl="auto" if impl == "cpu_ffi" else impl)
        return pooled.reshape(s, b, buf_rw[0].shape[1])
    pooled = bag_api.pool(buf_rw, ids, impl=impl, pack=pack)
    return pooled.reshape(s, b, buf_rw.shape[1] // pack)


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
    that writes each part's gradient once (XLA would pad and add one copy per slice). One part
    whose rows are the output's columns in order (every table whole in one buffer, e.g. on one
    device) is one transpose instead of a slice per slot."""
    maps = _assembly_map(layout, metas)
    if len(xs) == 1 and _in_column_order(maps[0], xs[0].shape[0], xs[0].shape[2]):
        k, b, w = xs[0].shape
        if k * w == int(sum(layout.feature_dims)):
            return jnp.transpose(xs[0], (1, 0, 2)).reshape(b, k * w)
    by_col: dict[int, list[jax.Array]] = {}
    for rows in maps:
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


def _in_column_order(rows: list[tuple[int, int, int, int]], k: int, w: int) -> bool:
    """Whether a part's ``k`` rows all contribute, row ``r`` at output column ``c0 + r·w``."""
    by_row = {row: col for _, row, col, _ in rows}
    c0 = by_row.get(0)
    return len(by_row) == k and all(by_row[r] == c0 + r * w for r in range(k))


def _assemble_fwd(layout, xs, metas):
    return _assemble(layout, xs, metas), tuple(x.shape for x in xs)


def _assemble_bwd(layout, metas, shapes, g):
    b = g.shape[0]
    g_ext = None
    grads = []
    for rows, (k, _, w) in zip(_assembly_map(layout, metas), shapes, strict=True):
        by_row = {row: col for _, row, col, _ in rows}
        c0 = by_row.get(0)
        if _in_column_order(rows, k, w):
            # rows in column order (e.g. every table whole on one device): a transpose
            grads.append(jnp.transpose(g[:, c0 : c0 + k * w].reshape(b, k, w), (1, 0, 2)))
            continue
        if g_ext is None:  # a zero column for the rows that contribute nothing
            g_ext = jnp.concatenate([g, jnp.zeros((b, 1), g.dtype)], axis=1)
        zero = g.shape[1]
        idx = np.array(
            [[by_row[r] + j if r in by_row else zero for j in range(w)] for r in range(k)], np.int32
        ).reshape(-1)
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


def with_error_bounds(
    graphdef: nnx.GraphDef, params: Any, batch_stats: Any, eps: float, eps_grad: float
) -> nnx.GraphDef:
    """``graphdef`` with its engine collections' exchanges bounded by ``eps`` / ``eps_grad``
    (``error_bounded`` compression; the same state fits it: the bounds change only code
    widths on the wire). ``params`` / ``batch_stats`` may be abstract."""
    model = nnx.merge(graphdef, params, batch_stats)
    for coll in engine_collections(model).values():
        comp = dataclasses.replace(coll.layout.compression, eps=eps, eps_grad=eps_grad)
        coll.layout = nnx.static(dataclasses.replace(coll.layout, compression=comp))
    return nnx.split(model, nnx.Param, nnx.BatchStat, ...)[0]


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
            x, k = _lookup_replicated(layout, bl, buffers[bl.key], ids_bfh, delta, mesh)
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
        scale = jnp.repeat(
            counts, np.asarray(layout.feature_dims), axis=1, total_repeat_length=out.shape[1]
        )
        is_mean = np.repeat(
            np.array([p == "mean" for p in layout.feature_pooling]), layout.feature_dims
        )
        out = jnp.where(is_mean[None], out / scale, out)
    return out


def _lookup_replicated(layout: Layout, bl: BufferLayout, buf, ids_bfh, delta, mesh):
    """Slots of a replicated buffer pool every example where it lives (no exchange)."""
    feat = bl.arr("feature")[0]
    offset = bl.arr("offset")[0]
    ids_sbh = jnp.transpose(ids_bfh[:, feat, :], (1, 0, 2))
    keys = jnp.where(ids_sbh >= 0, offset[:, None, None] + ids_sbh, bl.rows)
    if mesh is None:
        pooled = _pool(buf, keys, layout.bag_kernel, bl.pack)
    else:  # each device pools its own examples (a kernel is a custom call XLA cannot split)
        spec = P(None, AXIS, None)
        keys = jax.lax.with_sharding_constraint(keys, NamedSharding(mesh, spec))
        pooled = jax.shard_map(
            functools.partial(_pool, impl=layout.bag_kernel, pack=bl.pack),
            mesh=mesh,
            in_specs=(jax.tree.map(lambda _: P(), buf), spec),
            out_specs=spec,
            check_vma=False,
        )(buf, keys)
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
        # [S, B, w]: partial outputs for the whole batch
        pooled = _pool(buf_rw, keys, layout.bag_kernel, bl.pack)
        if maybe_delta:
            pooled = pooled + maybe_delta[0]
        comp = layout.compression_of(bl)
        if not comp.lossless:
            return compress.exchange(pooled, AXIS, comp), keys
        recv = jax.lax.all_to_all(
            pooled.astype(comm), AXIS, split_axis=1, concat_axis=0, tiled=True
        )
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
    ) + ((P(AXIS),) if delta is not None else ())
    return jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=(P(None, AXIS), P(AXIS)), check_vma=False
    )(*args)
