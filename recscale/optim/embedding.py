"""Embedding-table optimizers (row-wise Adagrad, SGD, Adam) and routing tables vs dense params.

Row-wise Adagrad follows FBGEMM / TorchRec (``EmbOptimType.EXACT_ROWWISE_ADAGRAD``): one float32
accumulator per table row holding the running sum of the row's mean squared gradient, which costs
``V`` floats per table instead of Adagrad's ``V * D``. optax has no row-wise variant, hence the
hand-written transform below.

Routing: ``combine`` wraps ``optax.partition`` with the two labels ``"dense"`` and
``"embedding"``; ``embedding_labels`` builds the label tree from an nnx.State (see its docstring
for which nnx.State forms carry the Variable types).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from recscale.config import EmbeddingOptimConfig
from recscale.kernels.embedding_update.reference import rowwise_adagrad_rows
from recscale.optim.schedules import config_schedule

__all__ = [
    "DENSE",
    "EMBEDDING",
    "RowwiseAdagradState",
    "combine",
    "embedding_labels",
    "embedding_optimizer",
    "rowwise_adagrad",
    "scale_by_rowwise_adagrad",
]

DENSE = "dense"
"""Label of parameters updated by the dense optimizer."""
EMBEDDING = "embedding"
"""Label of parameters (embedding tables) updated by the embedding optimizer."""

KeyPath = tuple[Any, ...]


# ------------------------------------------------------------------------------------------------
# Row-wise Adagrad.


class RowwiseAdagradState(NamedTuple):
    """State of ``scale_by_rowwise_adagrad``."""

    sum_of_squares: Any
    """Per-row accumulators: for a table leaf of shape ``[..., V, D]`` a float32 array of shape
    ``[..., V]`` (the table's shape without its last axis). Its sharding is the table's with the
    last (embedding) axis dropped: under jit with Explicit mesh axes it inherits it; on a typed
    nnx.State the leaf is the table's Variable type with ``out_sharding`` metadata trimmed."""


def _rows_with_grad(g: jax.Array) -> jax.Array:
    return jnp.any(g != 0, axis=-1)


def scale_by_rowwise_adagrad(
    *, initial_accumulator: float = 0.0, eps: float = 1e-8
) -> optax.GradientTransformation:
    """Row-wise Adagrad preconditioning (without the learning rate); see ``rowwise_adagrad``."""
    if initial_accumulator < 0:
        raise ValueError(f"initial_accumulator must be >= 0, got {initial_accumulator}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")

    def init_leaf(path: KeyPath, p: Any) -> Any:
        if isinstance(p, nnx.Variable):
            # A typed nnx.State (e.g. nnx.Optimizer's init): keep the Variable type, but drop the
            # table's last logical axis from its sharding metadata, since the accumulator has no
            # embedding axis (else nnx.get_partition_spec would give a [V, D] spec to a [V] array).
            acc = init_leaf(path, p[...])
            trimmed = {}
            for key in ("logical_axes", "out_sharding"):  # recscale's metadata, and flax's
                names = p.get_metadata(key, None)
                if names is not None and len(names) == jnp.ndim(p[...]):
                    trimmed[key] = tuple(names)[:-1]
            return p.replace(acc, **trimmed)
        if jnp.ndim(p) < 2:
            raise ValueError(
                f"row-wise Adagrad needs tables of rank >= 2 ([V, D]); "
                f"{jax.tree_util.keystr(path)} has shape {jnp.shape(p)}"
            )
        # full_like of a row slice: the accumulator inherits the table's row sharding.
        return jnp.full_like(p[..., 0], initial_accumulator, dtype=jnp.float32)

    def init_fn(params):
        return RowwiseAdagradState(jax.tree.map_with_path(init_leaf, params, is_leaf=_is_variable))

    def update_fn(updates, state, params=None):
        del params

        def step(g, acc):
            # The row math shared with the engine and the update kernels' reference. Rows
            # without gradient gain exactly 0.0 and do not move.
            g32 = g.astype(jnp.float32)
            row_sq = jnp.sum(jnp.square(g32), axis=-1)
            u, acc = rowwise_adagrad_rows(
                g32, acc, row_sq, _rows_with_grad(g32), g32.shape[-1], eps
            )
            return u.astype(g.dtype), acc

        # Flat leaves: the accumulator's Variables carry trimmed sharding metadata (no embedding
        # axis), so its treedef differs from the gradients' in metadata though not in layout.
        g_leaves, g_def = jax.tree.flatten(updates)
        acc_leaves, acc_def = jax.tree.flatten(state.sum_of_squares)
        if len(g_leaves) != len(acc_leaves):
            raise ValueError(f"{len(g_leaves)} gradient leaves but {len(acc_leaves)} accumulators")
        out = [step(g, a) for g, a in zip(g_leaves, acc_leaves, strict=True)]
        new_g, new_acc = [u for u, _ in out], [a for _, a in out]
        return g_def.unflatten(new_g), RowwiseAdagradState(acc_def.unflatten(new_acc))

    return optax.GradientTransformation(init_fn, update_fn)


def rowwise_adagrad(
    learning_rate: float | optax.Schedule,
    *,
    initial_accumulator: float = 0.0,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
    """Row-wise Adagrad with FBGEMM / TorchRec semantics, for pytrees of embedding tables.

    For each table leaf ``w`` of shape ``[V, D]`` (or ``[..., V, D]``, e.g. stacked tables
    ``[T, V, D]``; rows are always the second-to-last axis) with gradient ``g``::

        acc[v]      += mean_d(g[v, d] ** 2)                        # float32, shape [V]
        update[v, :] = -lr(step) * g[v, :] / (sqrt(acc[v]) + eps)

    Rows whose gradient is exactly zero (not looked up this step) keep their accumulator bitwise and
    get an update of exactly 0, so their parameters are unchanged. The arithmetic is float32
    whatever the table dtype; the update is cast back to the gradient's dtype. Every row of every
    table is visited each step (dense math over ``[V, D]``); sparse row updates belong to the
    embedding engine.

    Args:
      learning_rate: A float or an ``optax.Schedule`` evaluated at the update count (0 first).
      initial_accumulator: Starting value of every row's accumulator.
      eps: Added to ``sqrt(acc)`` in the denominator.

    Returns:
      An ``optax.GradientTransformation``; its state is ``(RowwiseAdagradState, ScaleByScheduleState
      or EmptyState)``.
    """
    return optax.chain(
        scale_by_rowwise_adagrad(initial_accumulator=initial_accumulator, eps=eps),
        optax.scale_by_learning_rate(learning_rate),
    )


def embedding_optimizer(
    cfg: EmbeddingOptimConfig,
    total_steps: int | jax.Array,
    *,
    peak: float | jax.Array | None = None,
    warmup_steps: int | jax.Array | None = None,
    cooldown: int | jax.Array | None = None,
) -> optax.GradientTransformation:
    """Builds the optimizer of the embedding tables from its config.

    ``sgd``: ``optax.sgd`` (no momentum). ``rowwise_adagrad``: ``rowwise_adagrad`` with
    ``cfg.initial_accumulator`` and ``cfg.eps``. ``adam``: ``optax.adam(b1=cfg.b1, b2=cfg.b2,
    eps=cfg.eps)`` on whole tables (moments of untouched rows still decay and move them; for
    comparison only). All use ``config_schedule(cfg, total_steps)``.
    """
    lr = config_schedule(cfg, total_steps, peak=peak, warmup_steps=warmup_steps, cooldown=cooldown)
    if cfg.name == "sgd":
        tx = optax.sgd(lr)
    elif cfg.name == "rowwise_adagrad":
        tx = rowwise_adagrad(lr, initial_accumulator=cfg.initial_accumulator, eps=cfg.eps)
    elif cfg.name == "adam":
        tx = optax.adam(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    else:
        raise ValueError(f"unknown embedding optimizer {cfg.name!r}")
    if cfg.l2 > 0:
        # Coupled L2 on whole tables (the gradient of (l2/2)·||W||² is added before the
        # optimizer), as FuxiCTR's ``embedding_regularizer``. It touches every row each step.
        tx = optax.chain(optax.add_decayed_weights(cfg.l2), tx)
    return tx


# ------------------------------------------------------------------------------------------------
# Routing tables vs dense parameters.


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def embedding_labels(
    params: Any,
    is_embedding: type | tuple[type, ...] | Callable[[KeyPath, Any], bool],
) -> Any:
    """Label tree for ``combine``: ``"embedding"`` for tables, ``"dense"`` for everything else.

    ``nnx.Variable`` objects are treated as leaves, so the label tree has one string where
    ``params`` has a Variable (or a raw array). Such a tree is a *prefix* of both forms of the same
    nnx.State, which optax accepts:

    * ``nnx.state(model, nnx.Param)`` / ``nnx.split(model, nnx.Param, ...)`` and the gradients of
      ``jax.grad``/``nnx.grad`` with respect to them hold ``Variable`` objects (a Variable is a
      pytree node whose child is its value), so the Variable subclass is visible;
    * ``nnx.as_pure(state)`` (what ``nnx.Optimizer.update`` passes to ``tx.update``) holds raw
      arrays: the type is gone, only the key path remains.

    Hence compute the labels ONCE from a Variable-typed state and pass the resulting tree (not a
    function) to ``combine``; it then works on typed and pure states alike (same key paths, same
    ``State`` container). A plain dict from ``State.to_pure_dict()`` needs labels computed from
    that dict (``dict`` and ``State`` are different pytree nodes).

    Args:
      params: The parameter tree (nnx.State with Variables, pure nnx.State, or nested dict).
      is_embedding: A Variable subclass (or tuple of them), e.g. ``EmbeddingTable``, matched with
        ``isinstance`` against Variable leaves; or a predicate ``(key_path, leaf) -> bool`` where
        ``leaf`` is the Variable or array and ``key_path`` stops at it (identical for typed and
        pure states, e.g. ``(DictKey('tables'), DictKey('user'))``).

    Returns:
      A tree of ``"dense"``/``"embedding"`` strings with ``params``'s container structure.

    Raises:
      ValueError: when ``is_embedding`` is a type but ``params`` holds no ``nnx.Variable`` (a pure
        state: the types are lost, so every leaf would silently be labelled dense).
    """
    if isinstance(is_embedding, type | tuple):
        types = is_embedding
        leaves = jax.tree.leaves(params, is_leaf=_is_variable)
        if not any(_is_variable(x) for x in leaves):
            raise ValueError(
                f"cannot find {types} by type: params holds no nnx.Variable (a pure state? "
                "compute the labels from nnx.state(model, nnx.Param), or pass a key-path predicate)"
            )

        def pred(path: KeyPath, leaf: Any) -> bool:
            del path
            return isinstance(leaf, types)

    else:
        pred = is_embedding
    return jax.tree.map_with_path(
        lambda path, leaf: EMBEDDING if pred(path, leaf) else DENSE, params, is_leaf=_is_variable
    )


def combine(
    dense_tx: optax.GradientTransformation,
    emb_tx: optax.GradientTransformation,
    labels: Any | Callable[[Any], Any],
) -> optax.GradientTransformation:
    """Routes embedding tables to ``emb_tx`` and everything else to ``dense_tx``.

    A thin ``optax.partition({"dense": dense_tx, "embedding": emb_tx}, labels)`` (the successor of
    ``optax.multi_transform``). Each sub-optimizer sees only its own leaves (the others are
    ``optax.MaskedNode``), so e.g. ``clip_by_global_norm`` in ``dense_tx`` clips the dense
    gradients' norm only.

    Args:
      dense_tx: Optimizer of the dense parameters (``dense_optimizer``).
      emb_tx: Optimizer of the tables (``embedding_optimizer``).
      labels: A tree of ``"dense"``/``"embedding"`` with the structure of (or a prefix of) the
        params, e.g. from ``embedding_labels``; or a function ``params -> labels``. Note optax calls
        the function on ``params`` in ``init`` and on the *gradients* in ``update``, so it must
        give the same answer on both (prefer a precomputed tree with nnx; see
        ``embedding_labels``).
    """
    return optax.partition({DENSE: dense_tx, EMBEDDING: emb_tx}, labels)
