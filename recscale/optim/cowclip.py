"""CowClip: adaptive column-wise clipping of embedding gradients (Zheng et al., AAAI 2023,
"CowClip: Reducing CTR Prediction Model Training Time from 12 hours to 10 minutes on 1 GPU").

Large batches break embedding training in a particular way: an id's gradient is the sum over
its occurrences in the batch, so frequent ids get gradients that grow with the batch while
rare ids keep theirs, and one learning rate cannot suit both. CowClip clips every id's
gradient ("column" in the paper's layout, a table row here) to a threshold proportional to
its count in the batch and to the norm of its own embedding:

    clip_j = cnt_j · max(r · ||w_j||, ζ)
    g_j   <- g_j · min(1, clip_j / ||g_j||)

``cnt_j``: occurrences of row ``j`` in the (global) batch; ``r``: the ratio; ``ζ``: a floor
for rows whose norm is still near zero (freshly initialised). The paper pairs it with a
scaling rule for a batch ``s`` times the base one (:func:`scale_hparams`): embedding learning
rate unchanged, dense learning rate times ``sqrt(s)``, embedding L2 times ``s``, and a linear
warmup of the dense learning rate.

The one copy of the row math (:func:`clip_scale`, which lives with the embedding-update
kernels' reference, ``recscale.kernels.embedding_update.reference``, as their row-wise Adagrad
does) serves the per-table path (whole-table gradients, ``recscale.train.steps``), the engine's
sparse update (``recscale.embeddings.update``, rows of column-split tables with their
statistics summed over the shards first) and the update kernels, which clip whole rows. All
apply it to the gradient of the batch-mean loss, before the embedding optimizer, with the
optional L2 of touched rows (``row_l2``) added first, as the L2 term of the loss is part of the
gradient the reference implementation clips.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from recscale.kernels.embedding_update.reference import clip_scale


@dataclasses.dataclass(frozen=True)
class CowClip:
    """The clipping of embedding row gradients (and the touched rows' L2) a train step applies
    before the embedding optimizer. ``ratio`` 0 turns the clipping off (``row_l2`` may stay)."""

    ratio: float = 1.0
    min_norm: float = 1e-5
    row_l2: float = 0.0

    @property
    def clips(self) -> bool:
        return self.ratio > 0


def from_config(cfg) -> CowClip | None:
    """The ``CowClip`` of an ``EmbeddingOptimConfig`` (None: neither clipping nor row L2)."""
    if cfg.cowclip_ratio == 0 and cfg.row_l2 == 0:
        return None
    return CowClip(ratio=cfg.cowclip_ratio, min_norm=cfg.cowclip_min_norm, row_l2=cfg.row_l2)


def clip_table(g_vd: jax.Array, w_vd: jax.Array, count_v: jax.Array, cfg: CowClip) -> jax.Array:
    """CowClip (and ``row_l2``) on a whole table's gradient ``[V, D]``: rows with no occurrence
    (``count == 0``) keep their gradient (zero, unless a whole-table L2 put something there)."""
    g = g_vd.astype(jnp.float32)
    w = w_vd.astype(jnp.float32)
    touched = (count_v > 0)[:, None]
    if cfg.row_l2:
        g = g + jnp.where(touched, cfg.row_l2 * w, 0.0)
    if cfg.clips:
        s = clip_scale(jnp.sum(g * g, -1), jnp.sum(w * w, -1), count_v, cfg.ratio, cfg.min_norm)
        g = jnp.where(touched, g * s[:, None], g)
    return g.astype(g_vd.dtype)


def table_counts(ids_nh: jax.Array, num_rows: int, padded_rows: int | None = None) -> jax.Array:
    """``[padded_rows]`` float32 occurrences of each row among ``ids [N, H]`` (ids outside
    ``[0, num_rows)`` are padding and count nothing)."""
    ids = ids_nh.reshape(-1).astype(jnp.int32)
    valid = (ids >= 0) & (ids < num_rows)
    out = padded_rows or num_rows
    return jnp.zeros((out,), jnp.float32).at[jnp.where(valid, ids, out)].add(1.0, mode="drop")


def scale_hparams(
    base_batch: int, batch: int, *, dense_lr: float, embedding_lr: float, l2: float
) -> dict[str, float]:
    """CowClip's scaling rule from ``base_batch`` to ``batch`` (``s = batch / base_batch``):
    dense learning rate times ``sqrt(s)``, embedding learning rate unchanged, L2 times ``s``
    (the paper's Criteo and Avazu tables: 1K to 128K)."""
    s = batch / base_batch
    return {"dense_lr": dense_lr * math.sqrt(s), "embedding_lr": embedding_lr, "l2": l2 * s}
