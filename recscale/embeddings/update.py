"""The engine's sparse updates: the rows a batch read, updated in place (never a table gradient).

The train step differentiates with respect to the lookups' zero deltas
(``recscale.embeddings.lookup``): exactly the touched rows' gradients, duplicate ids combined by
the transpose of the gather. :func:`apply_update` then updates those rows in place (buffers
donated; ``mode="drop"`` skips the padding slots): SGD, row-wise Adagrad (FBGEMM's
``EXACT_ROWWISE_ADAGRAD``; a column-split table's per-row sum of squares is summed over its
column shards with a ``psum``, so it equals the unsharded update) and lazy Adam (moments and
rows of touched rows only, bias correction by the global step, as TF's LazyAdam). SGD and
row-wise Adagrad of whole rows run in the configured update kernel
(``recscale.kernels.embedding_update``), CowClip and the rows' L2 included; the row math is that
package's reference, shared.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from recscale import sharding
from recscale.embeddings.layout import BufferLayout, Layout, rows_view, stored_view
from recscale.kernels.embedding_update import api as update_api
from recscale.kernels.embedding_update import reference as ref
from recscale.optim import cowclip
from recscale.optim.cowclip import CowClip, clip_scale

AXIS = sharding.DATA_AXIS


class EngineOptState(nnx.Variable):
    """Optimizer state of an engine buffer (row-wise Adagrad accumulators, Adam moments)."""


def init_opt_state_for(buffer: nnx.Variable, optimizer: str, initial_accumulator: float) -> dict:
    """Optimizer state of one buffer Variable, as Variables carrying the buffer's sharding:
    shaped by its rows ``[X, w]`` (a packed buffer's, ``pack`` in its metadata, unpacked)."""
    shape = buffer[...].shape
    pack = buffer.get_metadata().get("pack", 1)
    if pack > 1:
        shape = (shape[0] * pack, shape[1] // pack)
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
    clip: CowClip | None = None
    """CowClip and the touched rows' L2, applied to the row gradients before the optimizer."""
    l2: float = 0.0
    """Coupled L2 of whole tables (``embedding_optim.l2``): ``l2 · W`` added to every row's
    gradient every step, so every row is updated (the optimizer dense over the buffer, as the
    per-table reference and TorchRec's data-parallel tables run it). The layout keeps such
    tables data-parallel (``EngineSpec.l2``), where a whole-buffer update is a local one."""

    @classmethod
    def from_config(cls, e: Any) -> UpdateRule:
        """The rule of an ``EmbeddingOptimConfig``."""
        return cls(e.name, eps=e.eps, b1=e.b1, b2=e.b2, clip=cowclip.from_config(e), l2=e.l2)


def apply_update(
    layout: Layout,
    bl: BufferLayout,
    buf,
    state: dict,
    keys,
    grad_pooled,
    lr,
    step,
    rule: UpdateRule,
):
    """Updates the rows read at ``keys [S, B, H]`` given the gradients of the slots' pooled
    outputs ``[S, B, w]``; returns ``(buf, state, [sum of squared updates, sum of squared row
    gradients])``."""
    values = {k: v[...] for k, v in state.items()}
    names = sorted(values)
    slot = {k: jnp.asarray(bl.arr(k)) for k in ("cw_group", "table_dim")}
    groups = 0 if bl.replicated else layout.num_cw_groups
    split = groups and bool((bl.arr("cw_group") < groups).any())
    # SGD and row-wise Adagrad run in the update kernel (recscale.kernels.embedding_update),
    # with the clip; a column-split table's row statistics (Adagrad's and CowClip's norms) need
    # a psum across its column shards (SGD without CowClip has none: its column shards update
    # in the kernel too), lazy Adam keeps per-column moments, and coupled L2 updates every row
    # of a (data-parallel) buffer, so those stay here.
    if rule.l2 and not bl.replicated:
        raise AssertionError(f"coupled L2 needs data-parallel tables; {bl.key} is sharded")
    row_stats = rule.optimizer == "rowwise_adagrad" or (rule.clip is not None and rule.clip.clips)
    kernel = rule.optimizer in ("sgd", "rowwise_adagrad") and not (split and row_stats)
    kernel = kernel and not rule.l2
    impl = layout.update_kernel

    def body(buf_rw, keys_sbh, g_sbw, cw, tdim, lr, step, *vals):
        st = dict(zip(names, vals, strict=True))
        if kernel:  # a packed buffer as it is stored: the kernel or its fallback unpacks it
            s, b, h = keys_sbh.shape
            new_buf, acc, sq = update_api.update(
                buf_rw,
                st.get("acc"),
                keys_sbh.reshape(s * b, h),
                g_sbw.reshape(s * b, -1),
                lr,
                optimizer=rule.optimizer,
                eps=rule.eps,
                clip=rule.clip,
                impl=impl,
                pack=bl.pack,
            )
            new_st = {"acc": acc} if "acc" in st else {}
        else:
            buf_rw = rows_view(bl, buf_rw)  # the row math reads rows [R, w]
            count = None
            cw_s, tdim_s = cw[0], tdim[0]
            if bl.shared:  # slots over the same rows (a shared table) update them as one
                keys_sbh, g_sbw, cw_s, tdim_s = _grouped(
                    bl, keys_sbh, g_sbw, cw_s, tdim_s, buf_rw.shape[0], groups
                )
            if rule.clip is not None:
                # Each row's occurrences in the batch, by the same scatter as its gradient (a
                # column of ones beside the bags' gradients).
                ones = jnp.ones(g_sbw.shape[:-1] + (1,), jnp.float32)
                g_sbw = jnp.concatenate([g_sbw.astype(jnp.float32), ones], axis=-1)
            uids, grad = ref.batched_row_gradients(keys_sbh, g_sbw, buf_rw.shape[0])
            if rule.clip is not None:
                grad, count = grad[..., :-1], grad[..., -1]
            update = _update_dense if rule.l2 else _update_rows
            new_buf, new_st, sq = update(
                buf_rw, st, uids, grad, cw_s, tdim_s, lr, step, rule, groups, count
            )
            sq = jnp.stack([sq, jnp.sum(jnp.square(grad))])  # padding slots: zero gradients
            new_buf = stored_view(bl, new_buf)
        if not bl.replicated:
            sq = jax.lax.psum(sq, AXIS)
        return new_buf, tuple(new_st[k] for k in names), sq

    args = (
        buf,
        keys,
        grad_pooled,
        slot["cw_group"],
        slot["table_dim"],
        lr,
        step,
        *(values[k] for k in names),
    )
    if bl.replicated:
        new_buf, new_vals, sq = body(*args)
    else:
        specs = {"acc": P(AXIS), "m": P(AXIS, None), "v": P(AXIS, None)}
        new_buf, new_vals, sq = jax.shard_map(
            body,
            mesh=sharding.active_mesh(),
            in_specs=(
                P(AXIS, None),
                P(AXIS),
                P(AXIS),
                P(AXIS),
                P(AXIS),
                P(),
                P(),
                *(specs[k] for k in names),
            ),
            out_specs=(P(AXIS, None), tuple(specs[k] for k in names), P()),
            check_vma=False,
        )(*args)
    new_state = {k: state[k].replace(v) for k, v in zip(names, new_vals, strict=True)}
    return new_buf, new_state, sq


def row_gradient_sq(bl: BufferLayout, keys, grad_pooled) -> jax.Array:
    """The squared norm of the row gradients that ``keys [S, B, H]`` and the slots' pooled
    gradients ``[S, B, w]`` give a buffer (repeats combined, as :func:`apply_update` sees
    them; a column-split row's shards add up to its whole norm), without updating anything."""

    def body(keys_sbh, g_sbw):
        if bl.shared:
            keys_sbh, g_sbw = _grouped(bl, keys_sbh, g_sbw, None, None, bl.rows, 0)[:2]
        _, grad = ref.batched_row_gradients(keys_sbh, g_sbw, bl.rows)
        sq = jnp.sum(jnp.square(grad))
        return sq if bl.replicated else jax.lax.psum(sq, AXIS)

    if bl.replicated:
        return body(keys, grad_pooled)
    return jax.shard_map(
        body,
        mesh=sharding.active_mesh(),
        in_specs=(P(AXIS), P(AXIS)),
        out_specs=P(),
        check_vma=False,
    )(keys, grad_pooled)


def _grouped(bl: BufferLayout, keys_sbh, g_sbw, cw_s, tdim_s, sentinel: int, groups: int):
    """The slots of a device that read the same rows (a table shared by several features)
    merged into one: keys ``[G, K·B, H]`` and gradients ``[G, K·B, w]`` (``K`` slots of ``B``
    bags each, padded with bags of no ids), and each group's column-split index and table
    width. The row gradients of a group then combine every feature's, so row-wise Adagrad and
    lazy Adam take one step per touched row, as the per-table optimizer does."""
    members_ngk = bl.update_groups()
    members_gk = jnp.asarray(members_ngk)[0 if bl.replicated else jax.lax.axis_index(AXIS)]
    g, k = members_ngk.shape[1:]
    s, b, h = keys_sbh.shape
    keys = jnp.concatenate([keys_sbh, jnp.full((1, b, h), sentinel, keys_sbh.dtype)])
    grads = jnp.concatenate([g_sbw, jnp.zeros((1, b, g_sbw.shape[-1]), g_sbw.dtype)])
    keys, grads = keys[members_gk].reshape(g, k * b, h), grads[members_gk].reshape(g, k * b, -1)
    if cw_s is None:
        return keys, grads, None, None
    first = members_gk[:, 0]  # a padding group's is S: not column-split, width 1
    cw_g = jnp.concatenate([cw_s, jnp.full((1,), groups, cw_s.dtype)])[first]
    tdim_g = jnp.concatenate([tdim_s, jnp.ones((1,), tdim_s.dtype)])[first]
    return keys, grads, cw_g, tdim_g


def _full_rows(x_su: jax.Array, cw_s: jax.Array, groups: int) -> jax.Array:
    """Per-row statistics ``[S, U, ...]`` (several stacked on trailing axes: one ``psum``)
    summed over a column-split table's shards (other devices; they list their rows in the
    same order), unchanged for whole rows."""
    if not groups:
        return x_su
    tot = jnp.zeros((groups + 1, *x_su.shape[1:]), jnp.float32).at[cw_s].add(x_su)
    tot = jax.lax.psum(tot, AXIS)
    split = (cw_s < groups).reshape((-1,) + (1,) * (x_su.ndim - 1))
    return jnp.where(split, tot[cw_s], x_su)


def _clip_rows(buf, uids_su, g, count_su, cw_s, groups: int, clip: CowClip):
    """CowClip (``recscale.optim.cowclip``) and the touched rows' L2 on row gradients."""
    w = buf.at[uids_su].get(mode="clip").astype(jnp.float32)  # [S, U, w]
    touched = (count_su > 0)[..., None]
    if clip.row_l2:
        g = g + jnp.where(touched, clip.row_l2 * w, 0.0)
    if clip.clips:
        sq = _full_rows(jnp.stack([jnp.sum(g * g, -1), jnp.sum(w * w, -1)], -1), cw_s, groups)
        scale = clip_scale(sq[..., 0], sq[..., 1], count_su, clip.ratio, clip.min_norm)
        g = jnp.where(touched, g * scale[..., None], g)
    return g


def _update_rows(
    buf, st, uids_su, g_suw, cw_s, tdim_s, lr, step, rule: UpdateRule, groups: int, count_su=None
):
    s, u, w = g_suw.shape
    flat_u = uids_su.reshape(-1)
    g = g_suw.astype(jnp.float32)
    if rule.clip is not None:
        g = _clip_rows(buf, uids_su, g, count_su, cw_s, groups, rule.clip)
    if rule.optimizer == "sgd":
        upd = -lr * g
        new_st = st
    elif rule.optimizer == "rowwise_adagrad":
        # A column-split table's row statistics span all its column shards (other devices).
        stats = jnp.stack(
            [jnp.sum(jnp.square(g), axis=-1), jnp.any(g != 0, axis=-1).astype(jnp.float32)], -1
        )
        stats = _full_rows(stats, cw_s, groups)
        sq_su, nz_su = stats[..., 0], stats[..., 1]
        acc_su = st["acc"].at[uids_su].get(mode="clip")
        pre, acc_su = ref.rowwise_adagrad_rows(
            g, acc_su, sq_su, nz_su > 0, tdim_s[:, None], rule.eps
        )
        upd = pre * -lr
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


def _update_dense(
    buf, st, uids_su, g_suw, cw_s, tdim_s, lr, step, rule: UpdateRule, groups: int, count_su=None
):
    """The optimizer on every row of a data-parallel buffer, with coupled L2: the row
    gradients (CowClip'd as the sparse update does) scattered into ``[R, w]``, ``l2 · W`` added,
    then SGD, row-wise Adagrad or Adam over the whole buffer, as ``optax`` runs the per-table
    reference (``recscale.optim.embedding_optimizer``). Padding rows are zero with zero
    gradients and state, so they stay zero."""
    del tdim_s  # a data-parallel buffer holds whole tables: its width is theirs
    rows, w = buf.shape
    g = g_suw.astype(jnp.float32)
    if rule.clip is not None:
        g = _clip_rows(buf, uids_su, g, count_su, cw_s, groups, rule.clip)
    flat = (
        jnp.zeros((rows, w), jnp.float32).at[uids_su.reshape(-1)].add(g.reshape(-1, w), mode="drop")
    )
    table = buf.astype(jnp.float32)
    full = flat + rule.l2 * table
    if rule.optimizer == "sgd":
        upd, new_st = -lr * full, st
    elif rule.optimizer == "rowwise_adagrad":
        row_sq = jnp.sum(jnp.square(full), axis=-1)
        pre, acc = ref.rowwise_adagrad_rows(
            full, st["acc"], row_sq, jnp.any(full != 0, -1), w, rule.eps
        )
        upd, new_st = pre * -lr, {"acc": acc}
    elif rule.optimizer == "adam":
        t = (step + 1).astype(jnp.float32)
        m = rule.b1 * st["m"] + (1 - rule.b1) * full
        v = rule.b2 * st["v"] + (1 - rule.b2) * full * full
        upd = -lr * (m / (1 - rule.b1**t)) / (jnp.sqrt(v / (1 - rule.b2**t)) + rule.eps)
        new_st = {"m": m, "v": v}
    else:
        raise ValueError(f"unknown embedding optimizer {rule.optimizer!r}")
    new_buf = (table + upd).astype(buf.dtype)
    return new_buf, new_st, jnp.sum(jnp.square(upd))
