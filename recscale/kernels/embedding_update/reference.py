"""The backward of the pooled embedding lookup fused with the sparse optimizer update, in plain
jnp: the spec, the tests' oracle of the kernels' building blocks, and the XLA implementation
(the production path wherever no kernel runs).

Dimension glossary: ``V`` table rows, ``D`` embedding width, ``N`` bags (examples), ``H`` bag
slots (ids per bag), ``P = N·H`` (row, bag) pairs, ``U`` distinct-row bound (``U = P``).

The row math here (:func:`batched_distinct_rows`, :func:`batched_row_gradients`,
:func:`rowwise_adagrad_rows`, :func:`clip_scale`) is the only copy: the sharded engine's update
(``recscale.embeddings.update``) runs it on every slot of a device at once, the dense optax
row-wise Adagrad (``recscale.optim.embedding``) calls :func:`rowwise_adagrad_rows`, and CowClip
(``recscale.optim.cowclip``) is :func:`clip_scale`.

Equations (the engine's update of one slot of a table that is not column-split)::

    valid(n, h) = 0 <= ids[n, h] < V           (other ids are padding)
    c_n         = #{h : valid(n, h)}
    w_n         = 1 (sum pooling) | 1 / max(c_n, 1) (mean pooling)
    g_r         = Σ_{(n, h): ids[n, h] = r} w_n · grad[n]      (repeats combined first)
    c_r         = #{(n, h) : ids[n, h] = r}                  (the row's pairs in the batch)
    row L2:            g_r <- g_r + row_l2 · t_r                    (optional, touched rows)
    CowClip:           g_r <- g_r · min(1, c_r · max(ratio · ‖t_r‖, min_norm) / ‖g_r‖)
                                                          (optional, ratio > 0; 1 where g_r = 0)
    SGD:               t_r <- t_r - lr · g_r
    row-wise Adagrad:  acc_r <- acc_r + mean_d(g_r²)            (FBGEMM EXACT_ROWWISE_ADAGRAD)
                       t_r <- t_r - lr · g_r / (sqrt(acc_r) + eps)     (rows with g_r != 0)
    stats       = [Σ_r ‖Δt_r‖², Σ_r ‖g_r‖²]     (g_r before the row L2 and the clip)

Update arithmetic is float32; the table is stored back in its own dtype, the rows no id touches
stay bit-identical. No ``[V, D]`` temporary: the touched rows are found as distinct ids (a
scatter-min of positions into a ``[V + 1]`` int32 array, :func:`batched_distinct_rows`: no
sort, which is ~30x slower on XLA:CPU), their gradients summed into ``[U, D]`` by scatter-add, and only
those rows gathered, updated and scattered back.

:func:`sorted_segments` is the XLA prologue of the Pallas kernels (FBGEMM's layout): the pairs
sorted by row, and each distinct row's segment of them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

OPTIMIZERS = ("sgd", "rowwise_adagrad")
POOLINGS = ("sum", "mean")


class RowClip(NamedTuple):
    """CowClip on each touched row's gradient, with the row's L2 added first (Zheng et al.,
    AAAI 2023; ``recscale.optim.cowclip``): ``g_r += row_l2 · t_r``, then ``g_r`` scaled to at
    most ``c_r · max(ratio · ‖t_r‖, min_norm)``, ``c_r`` the row's pairs in the batch. ``ratio``
    0: no clipping (the L2 may stay); all 0: nothing."""

    ratio: float = 0.0
    min_norm: float = 0.0
    row_l2: float = 0.0

    @classmethod
    def of(cls, clip) -> RowClip | None:
        """``clip`` (anything with ``ratio``, ``min_norm`` and ``row_l2``, e.g. a ``CowClip``)
        as plain floats; None for None or a clip that does nothing."""
        if clip is None:
            return None
        out = cls(float(clip.ratio), float(clip.min_norm), float(clip.row_l2))
        return None if out.ratio == 0 and out.row_l2 == 0 else out


def check_args(
    table: jax.Array,
    acc: jax.Array | None,
    ids: jax.Array,
    grad: jax.Array,
    optimizer: str,
    pooling: str,
    clip: RowClip | None = None,
) -> None:
    """Raises a ValueError naming what is wrong with the call's shapes or options."""
    if clip is not None and min(clip) < 0:
        raise ValueError(f"embedding_update: clip {clip} must not be negative")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"embedding_update: optimizer {optimizer!r} is not one of {OPTIMIZERS}")
    if pooling not in POOLINGS:
        raise ValueError(f"embedding_update: pooling {pooling!r} is not one of {POOLINGS}")
    if table.ndim != 2 or ids.ndim != 2 or grad.ndim != 2:
        raise ValueError(
            f"embedding_update: table [V, D], ids [N, H], grad [N, D] expected, got "
            f"{table.shape}, {ids.shape}, {grad.shape}"
        )
    if grad.shape != (ids.shape[0], table.shape[1]):
        raise ValueError(
            f"embedding_update: grad {grad.shape} must be [N, D] = "
            f"{(ids.shape[0], table.shape[1])} (ids {ids.shape}, table {table.shape})"
        )
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"embedding_update: ids must be integers, got {ids.dtype}")
    if optimizer == "rowwise_adagrad":
        if acc is None or acc.shape != table.shape[:1]:
            raise ValueError(
                "embedding_update: rowwise_adagrad needs acc [V] = "
                f"{table.shape[:1]}, got {None if acc is None else acc.shape}"
            )
        if acc.dtype != jnp.float32:
            raise ValueError(f"embedding_update: acc must be float32, got {acc.dtype}")


def pair_keys(ids_nh: jax.Array, num_rows: int) -> jax.Array:
    """``[N, H]`` int32 rows read by each (bag, slot), ``V`` for padding (ids outside
    ``[0, V)``)."""
    ids_nh = ids_nh.astype(jnp.int32)
    return jnp.where((ids_nh >= 0) & (ids_nh < num_rows), ids_nh, num_rows)


def weighted_grad(ids_nh: jax.Array, grad_nd: jax.Array, num_rows: int, pooling: str):
    """``[N, D]`` float32: ``w_n · grad[n]`` (the per-bag pooling weight folded in once, so
    that every implementation sums plain rows)."""
    grad_nd = grad_nd.astype(jnp.float32)
    if pooling == "sum":
        return grad_nd
    count_n = jnp.sum((ids_nh >= 0) & (ids_nh < num_rows), axis=1, dtype=jnp.int32)
    return grad_nd / jnp.maximum(count_n, 1).astype(jnp.float32)[:, None]


def batched_distinct_rows(keys_sn: jax.Array, sentinel: int) -> tuple[jax.Array, jax.Array]:
    """Distinct keys of every row of ``keys [S, N]``: buffer rows in ``[0, sentinel)``, disjoint
    between rows of ``keys`` (the engine's slots each read their own rows), ``sentinel`` = none.

    Returns ``uids [S, N]`` (each row's distinct keys in order of first occurrence, then
    ``sentinel``) and ``inv [S, N]`` (each key's index into its row of ``uids``; arbitrary for
    ``sentinel``). No sort: a scatter-min of positions into a ``[sentinel + 1]`` int32 array
    finds each key's first occurrence (XLA's CPU sort is ~30x slower at these sizes; the array
    is 4 bytes per row, a sixteenth of a 16-wide float32 table, and lives for one step), a
    cumsum ranks them. First-occurrence order makes column shards of one table, on different
    devices, list their rows in the same order (the column-wise row-wise-Adagrad reduction
    relies on it).
    """
    s, n = keys_sn.shape
    pos = jnp.arange(s * n, dtype=jnp.int32).reshape(s, n)
    first = jnp.full((sentinel + 1,), s * n, jnp.int32).at[keys_sn].min(pos)
    first_sn = first[keys_sn]  # flat position of each key's first occurrence (same row)
    is_first = (first_sn == pos) & (keys_sn < sentinel)
    rank = jnp.cumsum(is_first, axis=1, dtype=jnp.int32) - 1
    inv = rank.reshape(-1)[first_sn]
    rows = jax.lax.broadcasted_iota(jnp.int32, (s, n), 0)
    slots = jnp.where(is_first, rank, n)
    uids = jnp.full((s, n), sentinel, keys_sn.dtype).at[rows, slots].set(keys_sn, mode="drop")
    return uids, inv


def batched_row_gradients(
    keys_snh: jax.Array, g_snd: jax.Array, sentinel: int, *, counts: bool = False
):
    """The touched rows and their gradients, per row ``s`` of a batch of independent problems
    (the engine's slots): ``keys [S, N, H]`` the rows each (bag, slot) read (``sentinel`` =
    padding), ``g [S, N, D]`` the bags' gradients. A sum-pooled bag's gradient reaches each of
    its rows whole, so a row's gradient is the sum of the gradients of the bags that read it
    (repeats included). Returns ``uids [S, U]`` (``U = N·H``; ``sentinel`` in unused entries)
    and ``grad [S, U, D]`` float32 (zero rows there), and with ``counts`` each row's pairs
    ``[S, U]`` float32 (CowClip's ``c_r``; zero there).

    One scatter-add of ``g`` per bag slot (a ``fori_loop`` over ``H``): a single scatter of all
    slots would first materialise the ``[S, N, H, D]`` repeated gradients.
    """
    s, n, h = keys_snh.shape
    d = g_snd.shape[-1]
    u = n * h
    uids, inv = batched_distinct_rows(keys_snh.reshape(s, u), sentinel)
    flat = inv.reshape(s, n, h) + (jnp.arange(s, dtype=jnp.int32) * u)[:, None, None]
    flat = jnp.where(keys_snh < sentinel, flat, s * u)  # padding: out of range, dropped
    flat_hsn = jnp.moveaxis(flat, 2, 0)
    g_snd = g_snd.astype(jnp.float32)

    def add(j, acc):
        return acc.at[flat_hsn[j]].add(g_snd, mode="drop")

    # The first slot outside the loop: inside shard_map the carry must start device-varying.
    grad = add(0, jnp.zeros((s * u, d), jnp.float32))
    if h > 1:
        grad = jax.lax.fori_loop(1, h, add, grad)
    if not counts:
        return uids, grad.reshape(s, u, d)
    count = jnp.zeros((s * u,), jnp.float32).at[flat.reshape(-1)].add(1.0, mode="drop")
    return uids, grad.reshape(s, u, d), count.reshape(s, u)


def row_gradients(keys_nh: jax.Array, g_nd: jax.Array, num_rows: int, *, counts: bool = False):
    """``uids [U]`` and the row gradients ``[U, D]`` float32 (``U = N·H``; zero rows at the
    ``V`` entries of ``uids``), and with ``counts`` each row's pairs ``[U]``:
    :func:`batched_row_gradients` of one problem."""
    out = batched_row_gradients(
        keys_nh[None].astype(jnp.int32), g_nd[None], num_rows, counts=counts
    )
    return tuple(x[0] for x in out)


def rowwise_adagrad_rows(
    g: jax.Array, acc: jax.Array, row_sq: jax.Array, touched: jax.Array, dim, eps: float
) -> tuple[jax.Array, jax.Array]:
    """Row-wise Adagrad (FBGEMM ``EXACT_ROWWISE_ADAGRAD``) on rows ``g [..., D]`` (float32) with
    accumulators ``acc [...]``: the one copy of its arithmetic, which the XLA update, the
    engine's sparse update and the dense optax transform (``recscale.optim``) all call.

    ``row_sq [...]``: each row's sum of squared gradients and ``touched [...]``: whether it has
    a nonzero gradient, over the whole row (a column-split row's shards sum theirs first);
    ``dim``: the row's full width (broadcastable to ``acc``). Returns ``(g / (sqrt(acc') + eps)
    where touched else 0, acc' = acc + row_sq / dim)``: the preconditioned gradient, to be
    scaled by ``-lr``. An untouched row gains exactly 0 and does not move (the ``where`` on the
    denominator keeps ``0/0`` out when ``acc == eps == 0``).
    """
    acc = acc + row_sq / jnp.asarray(dim, jnp.float32)
    denom = jnp.where(touched, jnp.sqrt(acc) + jnp.float32(eps), 1.0)
    return jnp.where(touched[..., None], g / denom[..., None], 0.0), acc


def clip_scale(
    g_sq: jax.Array, w_sq: jax.Array, count: jax.Array, ratio: float, min_norm: float
) -> jax.Array:
    """Per-row factor ``min(1, cnt · max(r·||w||, ζ) / ||g||)`` (1 where ``g`` is zero) from
    each row's squared gradient norm ``g_sq``, squared weight norm ``w_sq`` and count in the
    batch (float32, any equal shapes): CowClip's one copy (``recscale.optim.cowclip``)."""
    g_sq, w_sq = g_sq.astype(jnp.float32), w_sq.astype(jnp.float32)
    clip = count.astype(jnp.float32) * jnp.maximum(ratio * jnp.sqrt(w_sq), min_norm)
    g_norm = jnp.sqrt(g_sq)
    return jnp.where(g_norm > clip, clip / jnp.where(g_norm > 0, g_norm, 1.0), 1.0)


def clip_rows(g_ud: jax.Array, t_ud: jax.Array, count_u: jax.Array, clip: RowClip) -> jax.Array:
    """:class:`RowClip` on whole rows: row gradients ``g [U, D]`` and rows ``t [U, D]`` (both
    float32), each row's pairs ``count [U]``; rows with no pair keep their gradient."""
    touched = (count_u > 0)[:, None]
    if clip.row_l2:
        g_ud = g_ud + jnp.where(touched, clip.row_l2 * t_ud, 0.0)
    if clip.ratio > 0:
        s_u = clip_scale(
            jnp.sum(g_ud * g_ud, -1), jnp.sum(t_ud * t_ud, -1), count_u, clip.ratio, clip.min_norm
        )
        g_ud = jnp.where(touched, g_ud * s_u[:, None], g_ud)
    return g_ud


def row_step(g_ud: jax.Array, acc_u: jax.Array | None, lr: jax.Array, eps: float, width: int):
    """The optimizer on the row gradients (float32): returns the update ``[U, D]``
    and the new accumulators ``[U]`` (None for SGD). Rows with a zero gradient do not move
    (Adagrad: their accumulator gains zero)."""
    if acc_u is None:
        return g_ud * -lr, None
    row_sq = jnp.sum(g_ud * g_ud, axis=1)
    pre, acc_u = rowwise_adagrad_rows(g_ud, acc_u, row_sq, jnp.any(g_ud != 0, axis=1), width, eps)
    return pre * -lr, acc_u


def update(
    table: jax.Array,
    acc: jax.Array | None,
    ids: jax.Array,
    grad: jax.Array,
    lr,
    *,
    optimizer: str = "rowwise_adagrad",
    eps: float = 1e-8,
    pooling: str = "sum",
    clip: RowClip | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """The XLA implementation; see :func:`recscale.kernels.embedding_update.api.update`.

    Distinct rows + scatter-added row gradients ``[U, D]`` (and, with ``clip``, each row's pair
    count), then a gather of those rows, the clip, the
    float32 step, and a scatter of the new rows (``mode="drop"`` skips the ``V`` padding
    entries). Under ``jit`` with the table and accumulator donated, XLA updates both in place.
    """
    check_args(table, acc, ids, grad, optimizer, pooling, clip)
    v, d = table.shape
    if ids.size == 0:  # nothing read, nothing moves
        return table, acc, jnp.zeros((2,), jnp.float32)
    lr = jnp.asarray(lr, jnp.float32)
    keys_nh = pair_keys(ids, v)
    g_nd = weighted_grad(ids, grad, v, pooling)
    uids_u, g_ud, *count_u = row_gradients(keys_nh, g_nd, v, counts=clip is not None)
    t_ud = table.at[uids_u].get(mode="fill", fill_value=0).astype(jnp.float32)
    g_sq = jnp.sum(g_ud * g_ud)
    if clip is not None:
        g_ud = clip_rows(g_ud, t_ud, count_u[0], clip)
    acc_u = None
    if optimizer == "rowwise_adagrad":
        acc_u = acc.at[uids_u].get(mode="fill", fill_value=0)
    upd_ud, acc_u = row_step(g_ud, acc_u, lr, eps, d)
    new_table = table.at[uids_u].set((t_ud + upd_ud).astype(table.dtype), mode="drop")
    new_acc = acc if acc_u is None else acc.at[uids_u].set(acc_u, mode="drop")
    stats = jnp.stack([jnp.sum(upd_ud * upd_ud), g_sq])
    return new_table, new_acc, stats


class Segments(NamedTuple):
    """The sorted-pairs layout the Pallas kernels read (all int32).

    ``row_u [Ub]``: distinct row ``u`` (``V`` for unused entries ``u >= num_distinct``),
    ``start_u``/``end_u [Ub]``: its segment ``[start, end)`` of the sorted pairs (empty for
    unused entries), ``bag_p [Pb]``: the bag of each sorted pair, ``seg_p [Pb]``: its distinct
    row's index ``u`` (pairs past the valid ones: ``Ub``), ``num_distinct [1]``. ``Ub`` is
    ``P`` rounded up to the kernel's row block, ``Pb`` is ``P`` plus the kernel's over-read.
    """

    row_u: jax.Array
    start_u: jax.Array
    end_u: jax.Array
    bag_p: jax.Array
    seg_p: jax.Array
    num_distinct: jax.Array


def sorted_segments(
    keys_nh: jax.Array, num_rows: int, *, row_block: int = 1, pair_pad: int = 0, pack: int = 1
) -> Segments:
    """FBGEMM's layout of a batch's (row, bag) pairs: sorted by row (padding ``V`` last, a
    row's bags in increasing order: a stable sort), and for each distinct row its segment.

    ``pack`` > 1 (a power of two): the rows are stored ``pack`` to a stored row (the packed
    tables of ``recscale.embeddings.layout``) and the segments are the stored rows'
    (``row_u``: stored row ``key >> log2(pack)``, ``V/pack`` for unused entries), each pair's
    bag given as ``bag · pack + key % pack`` (its row's lane group). ``O(P log P)`` on
    ``P = N·H`` int32 pairs; nothing of size ``V`` or ``D``.
    """
    n, h = keys_nh.shape
    p = n * h
    ub = -(-p // row_block) * row_block
    key_p = keys_nh.reshape(-1)
    bag_p = jnp.arange(p, dtype=jnp.int32) // h
    key_p, bag_p = jax.lax.sort((key_p, bag_p), num_keys=1, is_stable=True)
    if pack > 1:
        shift = pack.bit_length() - 1
        bag_p = bag_p * pack + (key_p & (pack - 1))
        key_p = jnp.where(key_p < num_rows, key_p >> shift, num_rows // pack)
        num_rows //= pack
    valid_p = key_p < num_rows
    prev_p = jnp.concatenate([jnp.full((1,), -1, jnp.int32), key_p[:-1]])
    is_start = (key_p != prev_p) & valid_p
    seg_p = jnp.cumsum(is_start, dtype=jnp.int32) - 1
    num_distinct = jnp.sum(is_start, dtype=jnp.int32)
    num_valid = jnp.sum(valid_p, dtype=jnp.int32)
    pos_p = jnp.arange(p, dtype=jnp.int32)
    dst_p = jnp.where(is_start, seg_p, ub)
    row_u = jnp.full((ub,), num_rows, jnp.int32).at[dst_p].set(key_p, mode="drop")
    start_u = jnp.zeros((ub,), jnp.int32).at[dst_p].set(pos_p, mode="drop")
    u = jnp.arange(ub, dtype=jnp.int32)
    next_start_u = jnp.concatenate([start_u[1:], jnp.zeros((1,), jnp.int32)])
    end_u = jnp.where(u + 1 < num_distinct, next_start_u, jnp.where(u < num_distinct, num_valid, 0))
    seg_p = jnp.where(valid_p, seg_p, ub)
    if pair_pad:
        bag_p = jnp.concatenate([bag_p, jnp.zeros((pair_pad,), jnp.int32)])
        seg_p = jnp.concatenate([seg_p, jnp.full((pair_pad,), ub, jnp.int32)])
    return Segments(row_u, start_u, end_u, bag_p, seg_p, num_distinct.reshape(1))
