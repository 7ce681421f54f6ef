"""Ranking metrics of next-item prediction: HR@K, NDCG@K and MRR, over the full item set and
under SASRec's sampled protocol (reported separately: the two are not comparable).

**Queries** (:func:`last_token_queries`): one per sequence of a ``JaggedBatch``, its last token
(at most position ``N - 1``) scored against its target, counted where the sequence is real and
the target an item. Built for ``Packer(..., targets="final")`` batches of held-out items, as
both references evaluate: one held-out item per user, after the whole history.

**Rank** of the target ``y`` among candidates ``C`` with scores ``s``: ``rank = 1 + #{j ∈ C,
j ≠ y : s_j >= s_y}``. Ties count against the target (pessimistic): a model that scores every
item alike ranks its targets last, not first. (SASRec ranks by numpy's unstable
``argsort().argsort()``, generative-recommenders by ``torch.topk``: both leave ties to the sort.)
Then per query ``HR@K = [rank <= K]``, ``NDCG@K = [rank <= K] / log2(rank + 1)`` (one relevant
item; SASRec's ``1 / log2(rank0 + 2)`` with its 0-based rank) and ``MRR = 1 / rank``; a target
that is not a candidate has rank ``inf`` (0 for all three). :func:`metric_sums` returns sums
and the query count, mergeable over batches; :func:`finalize` divides.

**Full ranking** (:func:`full_metrics`), generative-recommenders' evaluation (commit
``2e81fab69a497fb5e24cd23569adf1e78070e4ec``, ``research/data/eval.py``,
``eval_metrics_v2_from_tensors`` with its default ``filter_invalid_ids=True``): candidates are
every item ``1..V`` (padding excluded) scored by ``<u, n(e_j)>`` (``n`` the L2 normalisation of
the training loss, ``l2_norm``), minus the items of the query's history (``exclude_history``;
the reference's ``invalid_ids=past_ids``). As there, a target that is itself in the history
is excluded with it: a miss. The reference takes a top-``min(2500, V)`` and gives ranks beyond
it ``2501``; here ranks are exact: the count above is taken over item chunks of ``chunk`` rows
(scores ``[B, chunk]`` at a time, so memory is bounded for any V), which is exact brute-force
top-K for every K at once (``rank <= K`` iff the target is in the top K).

**Sampled protocol** (SASRec's ``evaluate``, github:kang205/SASRec at
``e3738967fddab206d6eeb4fda433e7a7034dd8b1``, ``util.py``): the target among 100 negatives
drawn uniformly from ``1..V`` with replacement, each redrawn while it is in the user's rated
set (there: ``set(train[u]) ∪ {0}``; here the rows of a ``Histories`` the caller passes, e.g.
the training split). One deviation: the target itself is also excluded, where SASRec's code can
draw it (it is not in ``rated``) and then ties it with itself. Drawn on the host
(:func:`sasrec_negatives`), a pure function of ``(seed, user row, slot)``, so the negatives of a
user do not depend on the batching; scored on device by :func:`sampled_metrics` (raw dot
products as SASRec's ``predict``, or cosines with ``l2_norm``).

Dimension glossary: ``T`` token slots, ``B`` sequences (queries), ``N`` max_seq_len, ``D``
width, ``V`` items, ``C`` item chunk, ``M`` history length, ``S`` sampled negatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from data import counter_rng as rng
from data.sequences.histories import Histories
from sequential.layers import SeqModel, table_rows, to_padded
from sequential.losses import l2_normalize

HIGHEST = jax.lax.Precision.HIGHEST
SASREC_NEGATIVES = 100
_S_NEG = 0x5A5  # stream id of the sampled protocol's negatives


class Queries(NamedTuple):
    """One query per sequence: ``index`` int32 [B] its token slot, ``target`` int32 [B],
    ``valid`` bool [B]."""

    index: jax.Array
    target: jax.Array
    valid: jax.Array


def last_token_queries(batch: Any, max_seq_len: int) -> Queries:
    """The :class:`Queries` of a ``JaggedBatch`` (module docstring)."""
    offs = jnp.asarray(batch.offsets, jnp.int32)
    n_b = jnp.minimum(jnp.diff(offs), max_seq_len)
    index = jnp.maximum(offs[:-1] + n_b - 1, 0)
    target = jnp.asarray(batch.targets, jnp.int32)[index]
    valid = (n_b > 0) & (target > 0) & (jnp.asarray(batch.weights) > 0)
    return Queries(index, target, valid)


def rank_full(
    user_bd: jax.Array,
    table_vd: jax.Array,
    target_b: jax.Array,
    history_bm: jax.Array | None,
    *,
    l2_norm: bool,
    eps: float = 1e-6,
    chunk: int = 8192,
) -> jax.Array:
    """float32 [B]: each target's rank among items ``1..V`` (``table [V + 1, D]``, row 0
    padding), less the items of ``history [B, M]`` (0 = none; None: nothing excluded), by
    exact counting over chunks of ``chunk`` rows (module docstring)."""
    rows = table_vd.shape[0]
    c = min(chunk, rows)
    n_chunks = -(-rows // c)

    def norm(x):
        return l2_normalize(x, eps) if l2_norm else x

    s_b = jnp.einsum("bd,bd->b", user_bd, norm(table_vd[target_b]), precision=HIGHEST)
    b_idx = jnp.arange(target_b.shape[0])[:, None]

    def count(i, acc_b):
        # The last chunk is shifted back to end at row V (a dynamic slice of fixed size);
        # rows below i·c were counted by the chunk before.
        start = jnp.minimum(i * c, rows - c)
        block_cd = norm(jax.lax.dynamic_slice_in_dim(table_vd, start, c))
        ids_c = start + jnp.arange(c)
        s_bc = jnp.einsum("bd,cd->bc", user_bd, block_cd, precision=HIGHEST)
        take = (ids_c >= i * c) & (ids_c > 0)
        beats = (s_bc >= s_b[:, None]) & take[None, :] & (ids_c[None, :] != target_b[:, None])
        if history_bm is not None:  # scatter the chunk's history items: [B, C], not [B, C, M]
            rel = history_bm - start
            rel = jnp.where((history_bm > 0) & (rel >= 0) & (rel < c), rel, c)
            seen = jnp.zeros(beats.shape, bool).at[b_idx, rel].set(True, mode="drop")
            beats = beats & ~seen
        return acc_b + beats.sum(axis=1, dtype=jnp.int32)

    above_b = jax.lax.fori_loop(0, n_chunks, count, jnp.zeros(target_b.shape, jnp.int32))
    rank_b = (1 + above_b).astype(jnp.float32)
    if history_bm is None:
        return rank_b
    return jnp.where(jnp.any(history_bm == target_b[:, None], axis=1), jnp.inf, rank_b)


def rank_sampled(user_bd: jax.Array, cand_bsd: jax.Array) -> jax.Array:
    """float32 [B]: the rank of candidate 0 (the target) among ``cand [B, 1 + S, D]``."""
    s_bs = jnp.einsum("bd,bsd->bs", user_bd, cand_bsd, precision=HIGHEST)
    return (1 + jnp.sum(s_bs[:, 1:] >= s_bs[:, :1], axis=1)).astype(jnp.float32)


def metric_sums(rank_b: jax.Array, valid_b: jax.Array, ks: Sequence[int]) -> dict[str, jax.Array]:
    """``{"hr@K", "ndcg@K" for K in ks, "mrr": sums over valid queries, "count"}``."""
    w = valid_b.astype(jnp.float32)
    out = {}
    for k in ks:
        hit = (rank_b <= k).astype(jnp.float32) * w
        out[f"hr@{k}"] = hit.sum()
        out[f"ndcg@{k}"] = jnp.sum(hit / jnp.log2(jnp.where(rank_b <= k, rank_b, 1.0) + 1.0))
    out["mrr"] = jnp.sum(w / rank_b)
    out["count"] = w.sum()
    return out


def finalize(sums: dict[str, Any]) -> dict[str, float]:
    """Means of (summed) :func:`metric_sums` outputs; ``count`` is kept."""
    n = float(sums["count"])
    return {k: (float(v) / max(n, 1.0) if k != "count" else n) for k, v in sums.items()}


def _user_rows(model: SeqModel, batch: Any, user_td: jax.Array | None, q: Queries) -> jax.Array:
    """``[B, D]``: the model's output at each query's token."""
    if user_td is None:
        user_td = model(batch.values, batch.offsets)
    return user_td[q.index]


def full_metrics(
    model: SeqModel,
    batch: Any,
    *,
    ks: Sequence[int] = (10, 50),
    l2_norm: bool = True,
    exclude_history: bool = True,
    chunk: int = 8192,
    user_td: jax.Array | None = None,
    table_vd: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """:func:`metric_sums` of the full ranking of each sequence's held-out target (module
    docstring). ``l2_norm`` must match the training loss's ``LossConfig.l2_norm``;
    ``user_td``: ``model(batch.values, batch.offsets)``, if already computed; ``table_vd``:
    ``model.item_table()``, if already gathered."""
    n = model.cfg.max_seq_len
    q = last_token_queries(batch, n)
    user_bd = _user_rows(model, batch, user_td, q)
    history = None
    if exclude_history:
        history, _ = to_padded(jnp.asarray(batch.values, jnp.int32), batch.offsets, n)
    table_vd = model.item_table() if table_vd is None else table_vd
    rank = rank_full(user_bd, table_vd, q.target, history, l2_norm=l2_norm, chunk=chunk)
    return metric_sums(rank, q.valid, ks)


def sampled_metrics(
    model: SeqModel,
    batch: Any,
    negatives_bs: jax.Array,
    *,
    ks: Sequence[int] = (10,),
    l2_norm: bool = False,
    user_td: jax.Array | None = None,
    table_vd: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """:func:`metric_sums` of SASRec's sampled protocol: each sequence's target against its
    negatives ``[B, S]`` (:func:`sasrec_negatives` of the batch's ``user_rows``); ``user_td``
    and ``table_vd`` as :func:`full_metrics`' (with the table, candidates are its rows)."""
    q = last_token_queries(batch, model.cfg.max_seq_len)
    user_bd = _user_rows(model, batch, user_td, q)
    cand_ids = jnp.concatenate([q.target[:, None], negatives_bs], axis=1)
    if table_vd is None:
        cand = model.item_embeddings(cand_ids)
    else:
        cand = table_rows(table_vd, cand_ids)
    if l2_norm:
        cand = l2_normalize(cand, 1e-6)
    return metric_sums(rank_sampled(user_bd, cand), q.valid, ks)


def sasrec_negatives(
    rated: Histories,
    rows: np.ndarray,
    targets: np.ndarray,
    *,
    seed: int,
    num: int = SASREC_NEGATIVES,
) -> np.ndarray:
    """int32 [len(rows), num]: for user row ``rows[i]`` of ``rated`` (-1: padding, all 0),
    ``num`` items drawn uniformly from ``1..V`` with replacement, each redrawn while it is in
    that user's history or is ``targets[i]`` (module docstring). Draw ``r`` of slot ``s`` is a
    hash of ``(seed, row, s, r)``: a user's negatives do not depend on the batch.

    Raises:
        ValueError: a user has no item left to draw.
    """
    rows = np.asarray(rows, np.int64)
    targets = np.asarray(targets, np.int64)
    v = rated.n_items
    lengths = rated.lengths()
    user = np.repeat(np.arange(rated.num_users, dtype=np.int64), lengths)
    seen = np.unique(user * (v + 1) + rated.items)  # sorted keys row·(V+1) + item
    real = rows >= 0
    blocked = np.zeros(rows.shape, np.int64)  # distinct items a user may not draw
    if real.any():
        lo = np.searchsorted(seen, rows[real] * (v + 1))
        hi = np.searchsorted(seen, rows[real] * (v + 1) + v + 1)
        tkey = rows[real] * (v + 1) + targets[real]
        t_seen = (targets[real] > 0) & np.isin(tkey, seen)
        blocked[real] = hi - lo + ((targets[real] > 0) & ~t_seen)
    if (blocked[real] >= v).any():
        bad = int(rows[real][blocked[real] >= v][0])
        raise ValueError(f"sasrec_negatives: user row {bad} has rated every one of {v} items")
    out = np.zeros((rows.shape[0], num), np.int64)
    pending = np.broadcast_to(real[:, None], out.shape).copy()
    base = rows.astype(np.uint64)[:, None] * rng.U64_GOLDEN + np.arange(num, dtype=np.uint64)
    r = 0
    while pending.any():
        u = rng.uniform(rng.mix(base ^ np.uint64(rng.salt(_S_NEG, seed, r))))
        cand = np.minimum((u * v).astype(np.int64), v - 1) + 1
        bad = np.isin(rows[:, None] * (v + 1) + cand, seen) | (cand == targets[:, None])
        take = pending & ~bad
        out[take] = cand[take]
        pending &= ~take
        r += 1
    return out.astype(np.int32)
