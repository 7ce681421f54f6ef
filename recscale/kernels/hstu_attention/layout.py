"""What both Pallas kernels share: the block-aligned layout of the jagged sequences, the
schedule of which blocks meet, and the scores / mask / bias of one tile.

Layout. Jagged ``[T, H, D]`` is scattered (by XLA, once per tensor per call) into a head-major
``[H, NB·blk, D_p]`` where every sequence starts at a multiple of the block size ``blk``: its
``ceil(n/blk)`` blocks are consecutive, the rows past its end are zero, and ``NB = cdiv(T, blk)
+ B`` (each sequence wastes less than one block; unused blocks at the end belong to the
sentinel sequence ``B`` of length 0). So every tile a kernel touches is a whole, aligned block
of one sequence: plain BlockSpecs and unmasked loads, and no two programs ever write the same
rows. The cost is the scatter/gather of q, k, v, out (and g, dq, dk, dv): O(T·H·D) bytes
against the attention's O(T·N·H·D) flops. Per block the kernels read the sequence it belongs
to (``seq_of_block [NB]``) and per sequence its first block, length and target count
(``[B+1]`` each): scalars (SMEM on TPU).

Schedule. For a query block at position ``q0`` of a sequence, :func:`k_range` gives the key
blocks that may hold a valid pair (a superset: the mask decides), and for a key block
:func:`q_steps` the query blocks, as a prefix part (the contextual rows' blocks) and a main
range; both follow ``reference.valid_mask``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from recscale.kernels import common
from recscale.kernels.hstu_attention import reference


@dataclasses.dataclass(frozen=True)
class Static:
    """The call's static configuration."""

    max_seq_len: int
    alpha: float
    contextual_seq_len: int
    max_attn_len: int
    block: int
    num_buckets: int  # 0: no relative bias
    bias_heads: int  # 1 (shared) or H

    @property
    def boundaries(self) -> tuple[int, ...]:
        return reference.bucket_boundaries(self.num_buckets) if self.num_buckets else ()

    @property
    def max_blocks(self) -> int:
        """Blocks of the longest sequence."""
        return common.round_up(self.max_seq_len, self.block) // self.block


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Blocks:
    """Where each sequence lies in the block-aligned layout (int32 arrays)."""

    seq_of_block: jax.Array  # [NB]: the sequence block r belongs to (B: none)
    first_block: jax.Array  # [B+1]: its first block (0 for the sentinel B)
    length: jax.Array  # [B+1]: n_b = min(offsets[b+1] - offsets[b], N); 0 for B
    targets: jax.Array  # [B+1]: num_targets[b] (0 without targets, and for B)
    dest: jax.Array  # [T]: row of token t in the layout (NB·blk: dropped)

    @property
    def scalars(self) -> tuple[jax.Array, ...]:
        return self.seq_of_block, self.first_block, self.length, self.targets


def num_blocks(num_tokens: int, num_seqs: int, block: int) -> int:
    return -(-num_tokens // block) + num_seqs


def blocks(seq_offsets, num_targets, num_tokens: int, st: Static) -> Blocks:
    offsets = seq_offsets.astype(jnp.int32)
    b = offsets.shape[0] - 1
    nb = num_blocks(num_tokens, b, st.block)
    n = reference.lengths(offsets, st.max_seq_len)
    per_seq = -(-n // st.block)
    first = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(per_seq, dtype=jnp.int32)])
    seq_of_block = jnp.searchsorted(first, jnp.arange(nb, dtype=jnp.int32), side="right") - 1
    seq_of_block = jnp.minimum(seq_of_block, b).astype(jnp.int32)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    tok_seq = jnp.clip(jnp.searchsorted(offsets, t, side="right") - 1, 0, max(b - 1, 0))
    pos = t - offsets[tok_seq]
    ok = (pos >= 0) & (pos < n[tok_seq]) & (t < offsets[-1])
    dest = jnp.where(ok, first[tok_seq] * st.block + pos, nb * st.block).astype(jnp.int32)
    zero = jnp.zeros(1, jnp.int32)
    nt = jnp.zeros_like(n) if num_targets is None else num_targets.astype(jnp.int32)
    return Blocks(
        seq_of_block=seq_of_block,
        first_block=first.at[-1].set(0),
        length=jnp.concatenate([n, zero]),
        targets=jnp.concatenate([nt, zero]),
        dest=dest,
    )


def to_blocks(x_thd: jax.Array, lay: Blocks, num_rows: int, width: int) -> jax.Array:
    """Jagged ``[T, H, D]`` -> ``[H, num_rows, width]`` (zero rows and columns as padding)."""
    t, h, d = x_thd.shape
    x = jnp.pad(x_thd, ((0, 0), (0, 0), (0, width - d)))
    out = jnp.zeros((num_rows, h, width), x.dtype).at[lay.dest].set(x, mode="drop")
    return out.transpose(1, 0, 2)


def from_blocks(y_hrw: jax.Array, lay: Blocks, width: int) -> jax.Array:
    """``[H, rows, W]`` -> jagged ``[T, H, width]`` (tokens outside every sequence: zero)."""
    rows = jnp.take(y_hrw.transpose(1, 0, 2), lay.dest, axis=0, mode="fill", fill_value=0)
    return rows[:, :, :width]


def bias_deltas(rel_bias: jax.Array) -> jax.Array:
    """Table ``[Hb, R]`` -> float32 ``[Hb·R]`` of ``w[0], w[1] - w[0], ..., w[R-1] - w[R-2]``:
    the kernels add ``delta[m]`` where ``|i - j| >= boundaries[m-1]`` (one select per bucket
    edge, no gather)."""
    w = rel_bias.astype(jnp.float32)
    return jnp.concatenate([w[:, :1], jnp.diff(w, axis=1)], axis=1).reshape(-1)


def bias_grad(d_delta: jax.Array, rel_bias: jax.Array) -> jax.Array:
    """Gradient of the table from the gradient ``[Hb, R]`` of its deltas (``d_delta[m]``: the
    sum of dS over ``|i - j| >= boundaries[m-1]``; ``d_delta[0]``: over all pairs)."""
    nxt = jnp.concatenate([d_delta[:, 1:], jnp.zeros_like(d_delta[:, :1])], axis=1)
    return (d_delta - nxt).astype(rel_bias.dtype)


def k_range(q0, n, nt, st: Static):
    """Key blocks ``[lo, hi)`` (relative to the sequence's first block) that may meet the query
    block at position ``q0`` of a sequence of length ``n`` with ``nt`` targets."""
    blk, c, m_len = st.block, st.contextual_seq_len, st.max_attn_len
    hi = (jnp.minimum(q0 + blk, n) + blk - 1) // blk
    lo = jnp.zeros_like(q0)
    if m_len > 0:
        # Rows attend at most M back from their id (targets from the first target's).
        lo_pos = jnp.maximum(jnp.minimum(q0, n - nt) - m_len, 0)
        if c > 0:  # the prefix columns share id 0: all visible once column c-1 is
            lo_pos = jnp.where(lo_pos < c, 0, lo_pos)
        lo = lo_pos // blk
    if c > 0:  # contextual rows attend to every non-target token
        full = q0 < c
        hi = jnp.where(full, (n + blk - 1) // blk, hi)
        lo = jnp.where(full, 0, lo)
    return lo, jnp.maximum(hi, lo)


def q_steps(k0, n, nt, st: Static):
    """The query blocks that may meet the key block at position ``k0``: ``(prefix, lo, hi)``,
    blocks ``[0, prefix)`` (the contextual rows') then ``[lo, hi)``; ``prefix + hi - lo`` steps
    in all (:func:`q_block_at`)."""
    blk, c, m_len = st.block, st.contextual_seq_len, st.max_attn_len
    prefix = min(-(-c // blk), st.max_blocks) if c > 0 else 0
    lo = jnp.maximum(k0 // blk, prefix)
    hi_pos = n
    if m_len > 0:
        reach = jnp.minimum(n, jnp.maximum(k0 + blk, c) + m_len)
        hi_pos = jnp.where(nt > 0, n, reach)
    hi = jnp.maximum((hi_pos + blk - 1) // blk, lo)
    prefix = jnp.minimum(prefix, (n + blk - 1) // blk)
    return prefix, lo, hi


def q_block_at(step, prefix, lo):
    """The query block of step ``step`` of :func:`q_steps`'s schedule."""
    return jnp.where(step < prefix, step, lo + step - prefix)


def max_q_steps(st: Static) -> int:
    """An upper bound of :func:`q_steps`'s count (TPU grid extent)."""
    return st.max_blocks


def tile_span(q0, k0, block: int):
    """``(lo, hi)``: the least and greatest ``|i - j|`` of the tile of query rows ``[q0, q0 +
    block)`` and key columns ``[k0, k0 + block)`` (int32 scalars)."""
    lo = jnp.maximum(jnp.maximum(q0 - k0, k0 - q0) - (block - 1), 0)
    return lo, jnp.abs(q0 - k0) + block - 1


def tile_scores(q_bd, k_bd, i, j, n, nt, bias_scalars, st: Static, dot, span):
    """``(s, valid)`` of one tile: ``s = alpha q·kᵀ + rab`` (float32) and the mask, for query
    positions ``i [bq, 1]`` and key positions ``j [1, bk]``. ``bias_scalars``: the head's
    :func:`bias_deltas` as scalars; ``dot(a, b)`` contracts the last dims in float32; ``span``:
    the tile's :func:`tile_span`."""
    s = dot(q_bd, k_bd) * st.alpha
    if bias_scalars:
        d = jnp.abs(i - j)
        # Edges every pair of the tile is past add a scalar; one elementwise select (under a
        # cond) only for the edges that cut the tile: a dozen near the diagonal, one or two
        # off it, where a select per edge would cost more than the tile's matmul.
        lo, hi = span
        base = bias_scalars[0]
        for edge, delta in zip(st.boundaries, bias_scalars[1:], strict=True):
            base = base + jnp.where(lo >= edge, delta, 0.0)
        s = s + base
        for edge, delta in zip(st.boundaries, bias_scalars[1:], strict=True):
            s = lax.cond(
                (lo < edge) & (hi >= edge),
                lambda x, e=edge, w=delta: x + jnp.where(d >= e, w, 0.0),
                lambda x: x,
                s,
            )
    valid = reference.valid_mask(
        i, j, n, nt, contextual_seq_len=st.contextual_seq_len, max_attn_len=st.max_attn_len
    )
    return s, valid


def add_bias_sums(sums, ds, i, j, st: Static, span) -> tuple[jax.Array, ...]:
    """``sums`` plus the tile's contribution to the delta gradients, ``[Σ ds, Σ ds·[|i-j| >=
    edge] ...]``, reducing under a cond only at the edges that cut the tile (``span``:
    :func:`tile_span`; the others add the tile's total or nothing)."""
    lo, hi = span
    d = jnp.abs(i - j)
    total = jnp.sum(ds)
    out = [sums[0] + total]
    for acc, edge in zip(sums[1:], st.boundaries, strict=True):
        acc = acc + jnp.where(lo >= edge, total, 0.0)
        out.append(
            lax.cond(
                (lo < edge) & (hi >= edge),
                lambda a, e=edge: a + jnp.sum(jnp.where(d >= e, ds, 0.0)),
                lambda a: a,
                acc,
            )
        )
    return tuple(out)
