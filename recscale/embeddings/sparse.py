"""Sparse embedding updates: differentiate with respect to the rows a batch looks up, never the
whole table, and update only those rows in place.

The trick that keeps models unchanged: a batch touches at most ``U = B·F·H`` distinct rows of a
table, so :func:`unique_rows` maps the batch's ids to a sorted, padded list of distinct ids
``uids [U]`` and remaps each id to its position in that list; :func:`gather_rows` builds the
**sub-table** ``table[uids]`` of shape ``[U, D]``. The model runs unchanged on the sub-table and
the remapped ids, and ``jax.grad`` with respect to the sub-table is exactly the table gradient's
touched rows, with duplicate ids already combined (the transpose of the gather sums them). The
optimizers below then scatter the update into those rows (``mode="drop"`` skips the padding
slots), so with the table donated no ``[V, D]`` temporary is ever built.

Semantics equal the dense optimizers in ``recscale.optim.embedding`` row for row (the same
float32 expressions in the same order): rows not in the batch keep their values and
accumulators bitwise; touched rows agree to float rounding, and bitwise where a row occurs once
in the batch (with repeats, the two paths may sum the repeats' gradients in different orders).

Dimension glossary: ``V`` rows of a table, ``D`` its width, ``U`` the padded number of distinct
ids of one batch (a static bound: ``ids.size`` by default).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from data.batch import PAD_ID


def unique_rows(
    ids: jax.Array, num_rows: int, size: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Distinct ids of ``ids`` (any shape, ``PAD_ID`` = no id) and the ids remapped to them.

    Ids must lie in ``[0, num_rows)`` (the data layer validates them against the schema); one
    beyond would read zeros and have its update dropped.

    Returns:
      ``uids [U]``: the distinct valid ids in increasing order, then ``num_rows`` (an out-of-range
      row, dropped by the scatters) in the unused slots; ``local`` (the shape of ``ids``): each
      id's index into ``uids``, ``PAD_ID`` where ``ids`` is padding.
    """
    size = ids.size if size is None else size
    if size < ids.size:  # fewer slots than ids could drop distinct ids without a trace
        raise ValueError(f"size={size} < {ids.size} ids: every batch's distinct ids must fit")
    flat = ids.reshape(-1)
    valid = flat >= 0
    keyed = jnp.where(valid, flat, num_rows)  # padding sorts last and lands on the fill value
    uids, inverse = jnp.unique(keyed, size=size, fill_value=num_rows, return_inverse=True)
    local = jnp.where(valid, inverse.reshape(-1), PAD_ID).reshape(ids.shape)
    return uids, local.astype(ids.dtype)


def gather_rows(table_vd: jax.Array, uids_u: jax.Array) -> jax.Array:
    """The sub-table ``[U, D]``: rows ``uids`` of the table, zeros in the padding slots."""
    return table_vd.at[uids_u].get(mode="fill", fill_value=0)


def sparse_sgd(table_vd: jax.Array, uids_u: jax.Array, grad_ud: jax.Array, lr) -> jax.Array:
    """``table[uids] += -lr · grad`` (``optax.sgd`` on the touched rows)."""
    update_ud = (-lr * grad_ud).astype(table_vd.dtype)
    return table_vd.at[uids_u].add(update_ud, mode="drop")


def sparse_rowwise_adagrad(
    table_vd: jax.Array,
    acc_v: jax.Array,
    uids_u: jax.Array,
    grad_ud: jax.Array,
    lr,
    *,
    eps: float = 1e-8,
) -> tuple[jax.Array, jax.Array]:
    """Row-wise Adagrad (``recscale.optim.rowwise_adagrad``) on the touched rows only::

        acc[v]  += mean_d(g[v, d] ** 2)
        w[v, :] += -lr · g[v, :] / (sqrt(acc[v]) + eps)       (rows with g[v] == 0: no change)

    Returns the new ``(table, acc)``; pass both donated to keep the update in place.
    """
    g32 = grad_ud.astype(jnp.float32)
    acc_u = acc_v.at[uids_u].get(mode="fill", fill_value=0) + jnp.mean(jnp.square(g32), axis=-1)
    touched_u = jnp.any(g32 != 0, axis=-1)
    denom_u = jnp.where(touched_u, jnp.sqrt(acc_u) + eps, 1.0)
    u_ud = jnp.where(touched_u[:, None], g32 / denom_u[:, None], 0.0).astype(grad_ud.dtype)
    update_ud = (-lr * u_ud).astype(table_vd.dtype)
    table_vd = table_vd.at[uids_u].add(update_ud, mode="drop")
    acc_v = acc_v.at[uids_u].set(acc_u, mode="drop")
    return table_vd, acc_v
