"""Next-item losses at every position of every history, as pure functions of (model, batch).

Supervision (:func:`supervision`): token t of a ``JaggedBatch`` predicts ``targets[t]``, with
weight ``w_t = 1`` where it is a valid token (a sequence's, position ``< N``), its target is an
item (``> 0``) and its sequence is real (``weights[seq] > 0``), else 0. A loss is
``Σ_t w_t ℓ_t / max(Σ_t w_t, 1)``; the sums ``loss_sum`` and ``weight`` are returned too, so
evaluation over many batches is exact. With ``u_t`` the user embedding, ``e_j`` item j's row and
``τ`` the temperature, the similarity is ``s(t, j) = <n(u_t), n(e_j)> / τ`` where ``n`` is the
L2 normalisation ``x / max(|x|, eps)`` (``l2_norm``) or the identity:

* **sampled softmax** (HSTU's retrieval loss; generative-recommenders at
  ``2e81fab69a497fb5e24cd23569adf1e78070e4ec``, ``research/modeling/sequential/losses/
  sampled_softmax.py``): ``K`` negatives ``j_1..j_K`` drawn once per batch (uniform over
  ``1..V``, or from a distribution ``q`` with replacement), shared by every position;
  ``ℓ_t = -s(t, y_t) + log(exp s(t, y_t) + Σ_k [j_k ≠ y_t] exp(s(t, j_k) - c_k))`` with the
  log-Q correction ``c_k = log(K q(j_k))`` (``logq_correction``; else 0). Then
  ``Σ_k exp(s - c_k)`` is an unbiased estimate of ``Σ_{j ≠ y_t} exp s(t, j)`` and the loss
  tends to the full softmax's as ``K`` grows; with ``K = V`` negatives ``1..V`` and uniform
  ``q`` it is the full softmax exactly. A negative equal to the target (an accidental hit) is
  dropped, as the reference's ``-5e4`` does; generative-recommenders' uniform sampler is
  ``logq_correction=False`` (``c = 0``) with one difference: its ``LocalNegativesSampler``
  draws ``K`` negatives per position (``[T, K]`` rows), where these are shared by the batch
  (one ``[K, D]`` gather and a ``[T, D] × [D, K]`` matmul).
* **full softmax**: ``ℓ_t = -s(t, y_t) + log Σ_{j=1..V} exp s(t, j)`` (padding row 0
  excluded); logits ``[T, V]``, for small catalogues and as the sampled softmax's oracle.
* **BCE** (SASRec's, github:kang205/SASRec at ``e3738967fddab206d6eeb4fda433e7a7034dd8b1``,
  ``model.py``): one negative ``z_t`` per position, ``ℓ_t = -log σ(s(t, y_t)) - log(1 -
  σ(s(t, z_t)))`` (SASRec: no normalisation, ``τ = 1``). ``z_t`` is uniform over ``1..V``,
  redrawn (up to ``BCE_TRIES`` draws, else the first is kept) while it is an item of the
  token's sequence, its tokens or targets (``sampler.py``'s ``random_neq`` over the user's
  training items, with ``bce_exclude_history``).

Dimension glossary: ``T`` token slots, ``B`` sequences, ``N`` max_seq_len, ``D`` width, ``V``
items, ``K`` shared negatives.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sequential.config import LossConfig
from sequential.layers import SeqModel, Tokens, to_padded, token_layout

BCE_TRIES = 8


class Supervision(NamedTuple):
    """Each token slot's target and weight (module docstring)."""

    tokens: Tokens
    targets: jax.Array
    """int32 [T] the item each slot predicts (0: none)."""
    weights: jax.Array
    """float32 [T] ``w_t``."""


def supervision(batch: Any, max_seq_len: int) -> Supervision:
    """The :class:`Supervision` of a ``JaggedBatch``."""
    targets = jnp.asarray(batch.targets, jnp.int32)
    tokens = token_layout(jnp.asarray(batch.offsets), targets.shape[0], max_seq_len)
    real = jnp.asarray(batch.weights)[tokens.seq] > 0
    w = (tokens.valid & (targets > 0) & real).astype(jnp.float32)
    return Supervision(tokens, targets, w)


def l2_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x / max(|x|, eps)`` over the last axis, with a finite gradient at ``x = 0`` (a
    padding row's: ``|x|``'s own is 0/0 there, and the engine's sparse update sees the rows'
    gradients before any mask, ``recscale.embeddings.update``)."""
    sq = jnp.sum(x * x, axis=-1, keepdims=True)
    return x / jnp.sqrt(jnp.maximum(sq, eps * eps))


def _reduce(loss_t: jax.Array, w_t: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.sum(jnp.where(w_t > 0, loss_t * w_t, 0.0)), jnp.sum(w_t)


def sampled_softmax(
    user_td: jax.Array,
    pos_td: jax.Array,
    targets_t: jax.Array,
    neg_kd: jax.Array,
    neg_ids_k: jax.Array,
    neg_log_count_k: jax.Array,
    weights_t: jax.Array,
    *,
    temperature: float,
) -> tuple[jax.Array, jax.Array]:
    """``(Σ w ℓ, Σ w)`` of the sampled softmax: user embeddings ``[T, D]``, their targets'
    rows ``[T, D]`` and ids ``[T]``, the shared negatives' rows ``[K, D]``, ids ``[K]`` and
    corrections ``c [K]`` (embeddings already normalised as wanted)."""
    pos_t = jnp.sum(user_td * pos_td, axis=-1) / temperature
    neg_tk = jnp.matmul(user_td, neg_kd.T) / temperature - neg_log_count_k[None, :]
    neg_tk = jnp.where(neg_ids_k[None, :] == targets_t[:, None], -jnp.inf, neg_tk)
    lse_t = jax.nn.logsumexp(jnp.concatenate([pos_t[:, None], neg_tk], axis=1), axis=1)
    return _reduce(lse_t - pos_t, weights_t)


def full_softmax(
    user_td: jax.Array,
    table_vd: jax.Array,
    targets_t: jax.Array,
    weights_t: jax.Array,
    *,
    temperature: float,
) -> tuple[jax.Array, jax.Array]:
    """``(Σ w ℓ, Σ w)`` of the softmax over items ``1..V`` (``table [V + 1, D]``, row 0
    padding)."""
    logits_tv = jnp.matmul(user_td, table_vd.T) / temperature
    logits_tv = jnp.where(jnp.arange(table_vd.shape[0]) == 0, -jnp.inf, logits_tv)
    safe_t = jnp.maximum(jnp.asarray(targets_t), 1)  # padding targets (weight 0): any item
    pos_t = jnp.take_along_axis(logits_tv, safe_t[:, None], axis=1)[:, 0]
    return _reduce(jax.nn.logsumexp(logits_tv, axis=1) - pos_t, weights_t)


def bce(
    user_td: jax.Array,
    pos_td: jax.Array,
    neg_td: jax.Array,
    weights_t: jax.Array,
    *,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """``(Σ w ℓ, Σ w)`` of SASRec's binary cross-entropy: one positive and one negative row per
    token, ``[T, D]`` each."""
    pos_t = jnp.sum(user_td * pos_td, axis=-1) / temperature
    neg_t = jnp.sum(user_td * neg_td, axis=-1) / temperature
    return _reduce(jax.nn.softplus(-pos_t) + jax.nn.softplus(neg_t), weights_t)


def sample_negatives(
    key: jax.Array, cfg: LossConfig, n_items: int, item_log_q: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """``(ids [K] int32, c [K])``: the sampled softmax's shared negatives and their log-Q
    corrections ``log(K q(j))`` (zeros without ``logq_correction``). ``item_log_q [V + 1]`` is
    ``log q`` for the ``popularity`` sampler (``-inf`` at row 0: never drawn)."""
    k = cfg.num_negatives
    if cfg.sampler == "uniform":
        ids = jax.random.randint(key, (k,), 1, n_items + 1, dtype=jnp.int32)
        log_q = jnp.full((k,), -jnp.log(float(n_items)))
    else:
        if item_log_q is None:
            raise ValueError("the popularity sampler needs item_log_q, log q(j) over [V + 1]")
        if item_log_q.shape != (n_items + 1,):
            raise ValueError(
                f"item_log_q must be [V + 1] = [{n_items + 1}], got {item_log_q.shape}"
            )
        ids = jax.random.categorical(key, item_log_q, shape=(k,)).astype(jnp.int32)
        log_q = item_log_q[ids]
    if not cfg.logq_correction:
        return ids, jnp.zeros((k,), jnp.float32)
    return ids, (jnp.log(float(k)) + log_q).astype(jnp.float32)


def bce_negatives(
    key: jax.Array,
    values: jax.Array,
    offsets: jax.Array,
    targets: jax.Array,
    tokens: Tokens,
    *,
    n_items: int,
    max_seq_len: int,
    exclude_history: bool,
) -> jax.Array:
    """int32 [T]: one negative per token slot (module docstring, BCE)."""
    t = values.shape[0]
    cand_rt = jax.random.randint(key, (BCE_TRIES, t), 1, n_items + 1, dtype=jnp.int32)
    if not exclude_history:
        return cand_rt[0]
    vals_bn, _ = to_padded(jnp.asarray(values, jnp.int32), offsets, max_seq_len)
    tgts_bn, _ = to_padded(targets, offsets, max_seq_len)
    seen_tm = jnp.concatenate([vals_bn, tgts_bn], axis=1)[tokens.seq]  # [T, 2N], 0 = none
    chosen, found = cand_rt[0], jnp.zeros((t,), bool)
    for r in range(BCE_TRIES):
        ok = ~jnp.any(cand_rt[r][:, None] == seen_tm, axis=1)
        chosen = jnp.where(found | ~ok, chosen, cand_rt[r])
        found = found | ok
    return chosen


class Negatives(NamedTuple):
    """A pack's negatives: ``ids`` int32 ``[K]`` (the sampled softmax's, shared by its
    tokens), ``[T]`` (the BCE's, one per token slot) or ``[0]`` (the full softmax scores every
    item), and ``log_count`` float32 ``[K]``, the sampled softmax's corrections ``c``
    (``[0]`` otherwise)."""

    ids: jax.Array
    log_count: jax.Array


def draw_negatives(
    batch: Any,
    key: jax.Array | None,
    cfg: LossConfig,
    *,
    n_items: int,
    max_seq_len: int,
    item_log_q: jax.Array | None = None,
) -> Negatives:
    """The :class:`Negatives` loss ``cfg`` draws with ``key`` for a ``JaggedBatch`` (ids only:
    a train step looks up their rows with the batch's tokens and targets, in one lookup)."""
    none = jnp.zeros((0,), jnp.float32)
    if cfg.kind == "full_softmax":
        return Negatives(jnp.zeros((0,), jnp.int32), none)
    if cfg.kind == "sampled_softmax":
        return Negatives(*sample_negatives(key, cfg, n_items, item_log_q))
    sup = supervision(batch, max_seq_len)
    ids = bce_negatives(
        key,
        batch.values,
        batch.offsets,
        sup.targets,
        sup.tokens,
        n_items=n_items,
        max_seq_len=max_seq_len,
        exclude_history=cfg.bce_exclude_history,
    )
    return Negatives(ids, none)


def loss_sums(
    user_td: jax.Array,
    sup: Supervision,
    cfg: LossConfig,
    *,
    pos_td: jax.Array | None = None,
    neg: Negatives | None = None,
    neg_rows: jax.Array | None = None,
    table_vd: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(Σ w ℓ, Σ w)`` of loss ``cfg`` (module docstring) from looked-up rows, before any
    normalisation: the model's output ``[T, D]``, the targets' rows ``pos_td [T, D]`` and the
    negatives' ``neg_rows`` (``[K, D]`` or ``[T, D]``) with their :class:`Negatives`, or the
    whole table ``[V + 1, D]`` for the full softmax."""

    def norm(x):
        return l2_normalize(x, cfg.l2_eps) if cfg.l2_norm else x

    user_td, tau = norm(user_td), cfg.temperature
    if cfg.kind == "full_softmax":
        return full_softmax(user_td, norm(table_vd), sup.targets, sup.weights, temperature=tau)
    if cfg.kind == "sampled_softmax":
        return sampled_softmax(
            user_td,
            norm(pos_td),
            sup.targets,
            norm(neg_rows),
            neg.ids,
            neg.log_count,
            sup.weights,
            temperature=tau,
        )
    return bce(user_td, norm(pos_td), norm(neg_rows), sup.weights, temperature=tau)


def next_item_loss(
    model: SeqModel,
    batch: Any,
    key: jax.Array,
    cfg: LossConfig,
    *,
    item_log_q: jax.Array | None = None,
    dropout_key: jax.Array | None = None,
    user_td: jax.Array | None = None,
    table_vd: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss, {"loss_sum", "weight"})`` of ``model`` on a ``JaggedBatch`` (module
    docstring): the mean over supervised tokens and its two sums. ``key`` draws the negatives;
    ``dropout_key`` makes it a training call; ``item_log_q`` is the popularity sampler's
    ``log q [V + 1]``; ``user_td``: the model's output on the batch, if already computed (an
    evaluation's); ``table_vd``: the whole item table, if already gathered (the full softmax,
    ``SeqModel.item_table``). Jit-able. Rows are looked up here, one call each; the trainer's
    loss hook (``sequential.task``) draws the negatives of all its packs first and looks every
    row up at once."""
    mcfg = model.cfg
    sup = supervision(batch, mcfg.max_seq_len)
    if user_td is None:
        user_td = model(batch.values, batch.offsets, dropout_key=dropout_key)
    neg = draw_negatives(
        batch,
        key,
        cfg,
        n_items=mcfg.n_items,
        max_seq_len=mcfg.max_seq_len,
        item_log_q=item_log_q,
    )
    if cfg.kind == "full_softmax":
        rows = {"table_vd": model.item_table() if table_vd is None else table_vd}
    else:
        rows = {
            "pos_td": model.item_embeddings(sup.targets),
            "neg": neg,
            "neg_rows": model.item_embeddings(neg.ids),
        }
    loss_sum, weight = loss_sums(user_td, sup, cfg, **rows)
    return loss_sum / jnp.maximum(weight, 1.0), {"loss_sum": loss_sum, "weight": weight}
