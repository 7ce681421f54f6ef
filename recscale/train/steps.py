"""TrainState and the pure train / eval steps.

``train_step(state, batch) -> (state, metrics)`` is a pure function: the dropout key is
``fold_in(key(seed), step)``, data is an argument, so a resumed run replays bitwise.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from data.batch import Batch


@struct.dataclass
class TrainState:
    """Everything that changes during training (checkpointed whole)."""

    step: jax.Array
    """int32 scalar: steps taken."""
    params: Any
    """nnx.State of the model's parameters (dense layers and embedding tables)."""
    opt_state: Any
    """optax state of the combined dense + embedding optimizer."""
    batch_stats: Any
    """nnx.State of the model's non-trained statistics (``nnx.BatchStat``: BatchNorm running
    mean/variance), updated by the forward pass; an empty State for models without any."""


def weighted_bce(logits_b: jax.Array, labels_b: jax.Array, weights_b: jax.Array) -> jax.Array:
    """Mean binary cross-entropy with logits over the weighted (non-padding) examples."""
    per_b = optax.sigmoid_binary_cross_entropy(logits_b, labels_b)
    return jnp.sum(per_b * weights_b) / jnp.maximum(jnp.sum(weights_b), 1.0)


def _norm(tree: Any) -> jax.Array:
    return optax.tree.norm(tree)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, seed: int):
    """The pure train step for a model ``graphdef`` and optimizer ``tx``."""
    base_key = jax.random.key(seed)

    def loss_fn(params, batch_stats, batch: Batch, dropout_key):
        # copy=True: fresh Variables at this trace level, so BatchNorm may update its statistics.
        model = nnx.merge(graphdef, params, batch_stats, copy=True)
        logits_b = model(batch.dense_bn, batch.ids_bfh, dropout_key=dropout_key)
        loss = weighted_bce(logits_b, batch.labels_b, batch.weights_b)
        return loss, nnx.state(model, nnx.BatchStat)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        dropout_key = jax.random.fold_in(base_key, state.step)
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, state.batch_stats, batch, dropout_key
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": _norm(grads),
            "update_norm": _norm(updates),
            "param_norm": _norm(params),
        }
        new = TrainState(
            step=state.step + 1, params=params, opt_state=opt_state, batch_stats=batch_stats
        )
        return new, metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef):
    """``eval_step(params, batch_stats, batch) -> logits_b`` (evaluation mode: no dropout,
    BatchNorm with its running statistics)."""

    def eval_step(params, batch_stats, batch: Batch) -> jax.Array:
        model = nnx.merge(graphdef, params, batch_stats)
        return model(batch.dense_bn, batch.ids_bfh)

    return eval_step
