"""Optimizers: dense optax chains, embedding-table optimizers, LR schedules and LR/batch rules.

Typical use (labels computed once from a Variable-typed state; see ``embedding_labels``)::

    params = nnx.state(model, nnx.Param)
    tx = combine(
        dense_optimizer(cfg.dense_optim, total_steps),
        embedding_optimizer(cfg.embedding_optim, total_steps),
        embedding_labels(params, EmbeddingTable),
    )
    opt_state = tx.init(params)
"""

from recscale.optim import cowclip
from recscale.optim.dense import default_decay_mask, dense_optimizer
from recscale.optim.embedding import (
    DENSE,
    EMBEDDING,
    RowwiseAdagradState,
    combine,
    embedding_labels,
    embedding_optimizer,
    rowwise_adagrad,
    scale_by_rowwise_adagrad,
)
from recscale.optim.schedules import (
    config_schedule,
    cooldown_steps,
    decay_start,
    learning_rate_schedule,
    lr_for_batch_size,
)

__all__ = [
    "DENSE",
    "EMBEDDING",
    "RowwiseAdagradState",
    "combine",
    "config_schedule",
    "cooldown_steps",
    "cowclip",
    "decay_start",
    "default_decay_mask",
    "dense_optimizer",
    "embedding_labels",
    "embedding_optimizer",
    "learning_rate_schedule",
    "lr_for_batch_size",
    "rowwise_adagrad",
    "scale_by_rowwise_adagrad",
]
