"""Moving an embedding engine's rows between layouts on device (``recscale.embeddings.relayout``):
staging shardings for the saved buffers, chunked gathers of a table's rows to the host and
scatters into the new layout's arrays, bit for bit (no arithmetic; a float's bits travel as an
unsigned integer of its width).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from recscale import sharding
from recscale.embeddings import engine

_AXIS = sharding.DATA_AXIS
CHUNK_ROWS = 1 << 16
"""Most table rows moved through the host at once."""
_MIN_CHUNK = 1 << 10  # smaller tables share one compiled gather / scatter per array


def staging(shape: tuple[int, ...]) -> NamedSharding:
    """Rows over as many of the active mesh's devices as divide them (all of them, usually).

    Over several processes every process reads the rows back (``gather``), so each must hold
    a part of the array: where the rows do not divide over all the devices, every process holds
    a copy, its rows over as many of its own devices as divide them."""
    devices = sharding.active_mesh().devices.reshape(-1)
    spec = P(_AXIS, *(None,) * (len(shape) - 1))
    auto = jax.sharding.AxisType.Auto
    g = math.gcd(shape[0], devices.size)
    procs = sorted({d.process_index for d in devices})
    if g == devices.size or len(procs) == 1:
        return NamedSharding(jax.sharding.Mesh(devices[:g], (_AXIS,), axis_types=(auto,)), spec)
    local = [[d for d in devices if d.process_index == p] for p in procs]
    k = math.gcd(shape[0], min(map(len, local)))
    grid = np.array([ds[:k] for ds in local])
    return NamedSharding(jax.sharding.Mesh(grid, ("process", _AXIS), axis_types=(auto, auto)), spec)


def full(sds: jax.ShapeDtypeStruct, fill: float) -> jax.Array:
    return _full_fn(tuple(sds.shape), jnp.dtype(sds.dtype), sds.sharding, float(fill))()


@functools.lru_cache(maxsize=64)  # one-off restores: bounded
def _full_fn(shape, dtype, s, fill):
    return jax.jit(lambda: jnp.full(shape, fill, dtype), out_shardings=s)


def _row_axis(s: NamedSharding) -> str | None:
    """The mesh axis the rows (dimension 0) of an array with sharding ``s`` are split over."""
    spec = tuple(s.spec)
    ax = spec[0] if spec else None
    if isinstance(ax, tuple):
        ax = ax[0] if len(ax) == 1 else ax
    if ax is not None and not isinstance(ax, str):
        raise ValueError(f"rows split over several mesh axes {ax}: unsupported")
    for rest in spec[1:]:
        if rest is not None:
            raise ValueError(f"sharding {s} splits more than the rows: unsupported")
    return ax


def _bits(x: jax.Array) -> jax.Array:
    word = {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, word).astype(jnp.uint32)


def _from_bits(bits: jax.Array, dtype) -> jax.Array:
    word = {2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]
    return jax.lax.bitcast_convert_type(bits.astype(word), dtype)


@functools.lru_cache(maxsize=64)  # one-off restores: bounded
def _gather_fn(s: NamedSharding, dtype):
    """``f(arr, idx [C]) -> arr[idx]`` (replicated; rows of ``idx < 0`` zero) for arrays of
    sharding ``s``: each device reads its own rows, and the rows meet in an integer ``psum`` of
    their bits (one device contributes each row, the others zeros: exact, ``-0.0`` included)."""
    ax = _row_axis(s)

    def body(block, idx):
        n = block.shape[0]
        local = idx - (jax.lax.axis_index(ax) * n if ax else 0)
        ok = (local >= 0) & (local < n)
        rows = _bits(block[jnp.clip(local, 0, n - 1)])
        rows = jnp.where(ok.reshape(-1, *(1,) * (rows.ndim - 1)), rows, 0)
        if ax:
            rows = jax.lax.psum(rows, ax)
        return _from_bits(rows, dtype)

    return jax.jit(
        jax.shard_map(body, mesh=s.mesh, in_specs=(s.spec, P()), out_specs=P(), check_vma=False)
    )


@functools.lru_cache(maxsize=64)  # one-off restores: bounded
def _scatter_fn(s: NamedSharding):
    """``f(arr, idx [C], rows) -> arr`` with ``arr[idx] = rows`` (``idx < 0`` dropped) for arrays
    of sharding ``s``, in place (donated): each device writes the rows in its block."""
    ax = _row_axis(s)

    def body(block, idx, rows):
        n = block.shape[0]
        local = idx - (jax.lax.axis_index(ax) * n if ax else 0)
        local = jnp.where((local >= 0) & (local < n), local, n)
        return block.at[local].set(rows.astype(block.dtype), mode="drop")

    return jax.jit(
        jax.shard_map(
            body, mesh=s.mesh, in_specs=(s.spec, P(), P()), out_specs=s.spec, check_vma=False
        ),
        donate_argnums=0,
    )


def gather(arr: jax.Array, idx: np.ndarray) -> np.ndarray:
    return np.asarray(_gather_fn(arr.sharding, arr.dtype)(arr, idx))


def scatter(arr: jax.Array, idx: np.ndarray, rows: np.ndarray) -> jax.Array:
    return _scatter_fn(arr.sharding)(arr, idx, rows)


def _column_groups(layout: engine.Layout, feature: int, num_rows: int):
    """``[(buffer layout, first column, pos [V])]``: where a table's rows live, one entry per
    column range (one for an unsplit table): ``pos[r]`` is row ``r``'s buffer row."""
    groups: dict[tuple[str, int], tuple[Any, int, np.ndarray]] = {}
    for bl in layout.buffers:
        for d in range(1 if bl.replicated else layout.num_devices):
            for s, f in enumerate(bl.feature[d]):
                count = bl.row_count[d][s]
                if f != feature or not count:
                    continue
                c0 = bl.col_start[d][s]
                _, _, pos = groups.setdefault(
                    (bl.key, c0), (bl, c0, np.full(num_rows, -1, np.int64))
                )
                r0 = bl.row_start[d][s]
                pos[r0 : r0 + count] = d * bl.rows + bl.offset[d][s] + np.arange(count)
    for bl, _, pos in groups.values():
        if (pos < 0).any():  # the planner covers every row of every column range
            raise AssertionError(f"layout leaves rows of feature {feature} in {bl.key} unplaced")
    return list(groups.values())


def copy_tables(old, new, src, src_state, dst, dst_state, stores=None) -> None:
    """Copies every table of collection ``old`` (arrays ``src``, optimizer state ``src_state``,
    per buffer key) into collection ``new``'s arrays ``dst`` / ``dst_state``, in place; the
    rows of a table in ``stores`` (``{table: StoreView}``, ``dst_state`` empty) from there."""
    stores = stores or {}
    # packed buffers (``engine.BufferLayout.pack``) move as rows [X, w]: viewed so here, back after
    src = {bl.key: engine.rows_view(bl, src[bl.key]) for bl in old.layout.buffers}
    packed = [bl for bl in new.layout.buffers if bl.pack > 1]
    for bl in packed:
        dst[bl.key] = engine.rows_view(bl, dst[bl.key])
    feature_of = {f.table: i for i, f in enumerate(old.feature_specs)}
    new_feature_of = {f.table: i for i, f in enumerate(new.feature_specs)}
    for t in new.table_specs:
        groups_old = (
            [] if t.name in stores else _column_groups(old.layout, feature_of[t.name], t.num_rows)
        )
        groups_new = _column_groups(new.layout, new_feature_of[t.name], t.num_rows)
        chunk = min(max(1 << (t.num_rows - 1).bit_length(), _MIN_CHUNK), CHUNK_ROWS)
        for a in range(0, t.num_rows, chunk):
            b = min(a + chunk, t.num_rows)
            rows = state = None
            if t.name in stores:
                rows = np.zeros((chunk, t.dim), np.float32)
                rows[: b - a] = stores[t.name].read(a, b)[:, : t.dim]
            for bl, c0, pos in groups_old:
                i = _chunk(pos, a, b, chunk)
                part = gather(src[bl.key], i)
                if rows is None:
                    rows = np.zeros((chunk, t.dim), part.dtype)
                    state = {k: None for k in src_state.get(bl.key, {})}
                rows[:, c0 : c0 + bl.width] = part
                for k, arr in src_state.get(bl.key, {}).items():
                    got = gather(arr, i)
                    if k == "acc":  # one value per row, held by every column shard of it
                        if state[k] is None:
                            state[k] = got
                        elif not np.array_equal(_as_bits(state[k]), _as_bits(got)):
                            raise ValueError(
                                f"table {t.name!r}: the column shards' row-wise accumulators "
                                f"differ (rows {a}..{b}); the checkpoint is inconsistent"
                            )
                    else:  # per element, like the rows
                        if state[k] is None:
                            state[k] = np.zeros((chunk, t.dim), got.dtype)
                        state[k][:, c0 : c0 + bl.width] = got
            for bl, c0, pos in groups_new:
                i = _chunk(pos, a, b, chunk)
                dst[bl.key] = scatter(dst[bl.key], i, rows[:, c0 : c0 + bl.width])
                for k in dst_state.get(bl.key, {}):
                    value = state[k] if k == "acc" else state[k][:, c0 : c0 + bl.width]
                    dst_state[bl.key][k] = scatter(dst_state[bl.key][k], i, value)
    for bl in packed:
        dst[bl.key] = engine.stored_view(bl, dst[bl.key])


def _chunk(pos: np.ndarray, a: int, b: int, size: int) -> np.ndarray:
    """Buffer rows of table rows ``[a, b)``, padded with -1 (no row) to ``size``."""
    out = np.full(size, -1, np.int32)
    out[: b - a] = pos[a:b]
    return out


def _as_bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)
