"""Pooled embedding-bag lookup in plain jnp: the spec, the oracle and the XLA fallback.

Dimension glossary: ``V`` table rows, ``D`` embedding dim, ``N`` bags, ``H`` bag slots (the
bag's maximum number of ids).

Forward, for bag ``n`` with valid slots ``S_n = {h : 0 <= ids[n, h] < V}``::

    out[n, :] = sum_{h in S_n} table[ids[n, h], :]                       (pooling="sum")
    out[n, :] = sum_{h in S_n} table[ids[n, h], :] / max(|S_n|, 1)       (pooling="mean")

Ids outside ``[0, V)`` are padding (models pad with -1, the sharded engine with V). The sum is
accumulated in float32 whatever the table's dtype, and the output is float32.

Backward (w.r.t. the table; ids are not differentiable)::

    d_table[v, :] = sum_{(n, h) : ids[n, h] = v} g[n, :] * w[n]      (w = 1, or 1 / max(|S_n|, 1))

a scatter-add of the bag gradients into a table-shaped array (repeated ids add up).

This is the production path on CPU (and wherever a kernel does not apply), so it is written for
XLA: a loop over the ``H`` bag slots, each one row gather masked and added to a float32
accumulator. XLA does not fuse gather + sum, so ``jnp.take(table, ids).sum(1)`` would
materialise ``[N, H, D]``; and a ``fori_loop`` rather than an unrolled Python loop, because
unrolled XLA fuses the index arithmetic into each of the ``H`` gathers and recomputes it ``H``
times. This matches ``recscale.embeddings.lookup._pool`` (and ``EmbeddingCollection.lookup``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

POOLINGS = ("sum", "mean")


def valid_ids(ids_nh: jax.Array, num_rows: int) -> jax.Array:
    """``[N, H]`` bool: which slots hold an id of the table (the rest are padding)."""
    return (ids_nh >= 0) & (ids_nh < num_rows)


def bag_counts(ids_nh: jax.Array, num_rows: int) -> jax.Array:
    """``[N, 1]`` float32: ``max(number of valid ids, 1)`` per bag, the mean's divisor."""
    count_n1 = jnp.sum(valid_ids(ids_nh, num_rows), axis=1, keepdims=True, dtype=jnp.int32)
    return jnp.maximum(count_n1, 1).astype(jnp.float32)


def slot_loop(num_slots: int, one, empty_nd: jax.Array) -> jax.Array:
    """``sum_h one(h)`` over the ``H`` bag slots (``one(h)``: ``[N, D]`` float32), ``empty``
    when there are none.

    Shared with the quantized lookup's reference. A ``fori_loop`` (see the module docstring);
    the first slot initialises the accumulator so one-id bags are a single gather.
    """
    if num_slots == 0:
        return empty_nd
    acc_nd = one(0)
    if num_slots == 1:
        return acc_nd
    return jax.lax.fori_loop(1, num_slots, lambda h, acc: acc + one(h), acc_nd)


def pool(table_vd: jax.Array, ids_nh: jax.Array, *, pooling: str = "sum") -> jax.Array:
    """``[N, D]`` float32: the sum (or mean) of rows ``table[ids[n, h]]`` over the valid slots.

    Args:
      table_vd: ``[V, D]`` table, any float dtype (rows are upcast to float32 when gathered).
      ids_nh: ``[N, H]`` integer ids; ids outside ``[0, V)`` are padding.
      pooling: ``"sum"`` or ``"mean"`` (divides by ``max(number of valid ids, 1)``).
    """
    num_rows, dim = table_vd.shape
    n, h = ids_nh.shape
    valid_nh = valid_ids(ids_nh, num_rows)
    ids_hn, valid_hn = ids_nh.T, valid_nh.T  # slot-major: each step reads one contiguous row

    def one(j):
        rows_nd = jnp.take(table_vd, ids_hn[j], axis=0, mode="clip").astype(jnp.float32)
        return jnp.where(valid_hn[j][:, None], rows_nd, 0.0)

    out_nd = slot_loop(h, one, jnp.zeros((n, dim), jnp.float32))
    if pooling == "mean":
        out_nd = out_nd / bag_counts(ids_nh, num_rows)
    return out_nd


def pool_bwd(
    ids_nh: jax.Array, g_nd: jax.Array, num_rows: int, dtype, *, pooling: str = "sum"
) -> jax.Array:
    """``[V, D]`` in ``dtype``: the table's cotangent, a scatter-add of the bag gradients.

    One scatter per bag slot into a float32 accumulator (XLA updates the loop carry in place;
    scattering all slots at once would materialise ``[N·H, D]`` updates), cast to the table's
    dtype once at the end, so repeated ids are summed in float32. Padding ids are sent to row
    ``V``, which ``mode="drop"`` skips.
    """
    g_nd = g_nd.astype(jnp.float32)
    if pooling == "mean":
        g_nd = g_nd / bag_counts(ids_nh, num_rows)
    keys_hn = jnp.where(valid_ids(ids_nh, num_rows), ids_nh, num_rows).T
    grad_vd = jnp.zeros((num_rows, g_nd.shape[1]), jnp.float32)

    def one(j, acc_vd):
        return acc_vd.at[keys_hn[j]].add(g_nd, mode="drop")

    grad_vd = jax.lax.fori_loop(0, keys_hn.shape[0], one, grad_vd)
    return grad_vd.astype(dtype)
