"""How the kernels run a population's members: ``jax.vmap`` over a leading member axis
(``recscale.train.population``), each kind of kernel by its own batching rule, never a Python
loop:

- the C++ CPU kernels: one call for all members, which the kernel runs one after another
  (``native.VMAP``);
- the Pallas dot and FM interactions: ``pallas_call``'s own rule, a member axis in the grid;
- the Pallas pooled lookups: :func:`stacked_rows`, one kernel over the members' tables seen as
  one table of ``K·V`` rows, each member's ids offset by ``m·V``. (``pallas_call``'s rule would
  index the HBM table's block spec by member, which Mosaic refuses for a table it reads by DMA;
  a contiguous ``[K, V, w]`` is ``[K·V, w]`` without a copy.)
- the Pallas fused row updates: :func:`one_by_one`, ``lax.map`` over the members, one kernel per
  member inside the one program: a single call would need each member's learning rate and
  statistics inside the kernel (per-member SMEM scalars and outputs), not built yet.

``tests/recscale/kernels/test_vmap.py`` checks every one against the members' own calls.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _broadcast(x: jax.Array, batched: bool, k: int) -> jax.Array:
    return x if batched else jnp.broadcast_to(x, (k, *x.shape))


def stacked_rows(forward: Callable, num_rows: int) -> Callable:
    """``forward(table [V, ...], ids [N, H]) -> [N, ...]`` (ids outside ``[0, V)`` padding) that
    under ``jax.vmap`` runs once over the members' tables stacked into ``[K·V, ...]``, member
    ``m``'s ids offset by ``m·V`` and its padding kept padding (id ``K·V``): each bag sums the
    same rows in the same order as the member's own call."""

    @jax.custom_batching.custom_vmap
    def op(table, ids):
        return forward(table, ids)

    @op.def_vmap
    def _members(k, in_batched, table, ids):
        table, ids = (_broadcast(x, b, k) for x, b in zip((table, ids), in_batched, strict=True))
        n, h = ids.shape[1:]
        valid = (ids >= 0) & (ids < num_rows)
        offset = (jnp.arange(k, dtype=jnp.int32) * num_rows)[:, None, None]
        stacked = jnp.where(valid, ids + offset, k * num_rows).reshape(k * n, h)
        # [K, V', ...] as [K·V', ...]: V' = V stored rows, or V/p for a packed table
        out = forward(table.reshape(k * table.shape[1], *table.shape[2:]), stacked)
        return out.reshape(k, n, *out.shape[1:]), True

    return op


def one_by_one(fn: Callable) -> Callable:
    """``fn(*arrays)`` that under ``jax.vmap`` maps over the members with ``lax.map`` (an
    unbatched operand shared by all): one call of ``fn`` per member, in one program."""

    @jax.custom_batching.custom_vmap
    def op(*args):
        return fn(*args)

    @op.def_vmap
    def _members(k, in_batched, *args):
        args = [_broadcast(x, b, k) for x, b in zip(args, in_batched, strict=True)]
        out = jax.lax.map(lambda xs: fn(*xs), args)
        return out, jax.tree.map(lambda _: True, out)

    return op
