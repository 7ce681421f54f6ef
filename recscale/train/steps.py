"""TrainState and the pure train / eval steps.

``train_step(state, batch) -> (state, metrics)`` is a pure function: the dropout key is split
off ``state.rng`` (checkpointed with the rest of the state), data is an argument, so a resumed run
replays bitwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from data.batch import Batch
from recscale import sharding
from recscale.embeddings import EmbeddingTable, engine
from recscale.embeddings.collection import EmbeddingCollection
from recscale.optim import cowclip
from recscale.optim.hessian_free import HessianFreeState


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
    rng: jax.Array
    """The random stream's key data (``jax.random.key_data``; ``initial_rng(seed)`` at step 0):
    each step splits its dropout key off and carries the rest on."""


def initial_rng(seed: int) -> jax.Array:
    """``TrainState.rng`` of a fresh run."""
    return jax.random.key_data(jax.random.key(seed))


def _split_rng(rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the next ``TrainState.rng``, this step's dropout key)."""
    carry, key = jax.random.split(jax.random.wrap_key_data(rng))
    return jax.random.key_data(carry), key


def weighted_bce(logits_b: jax.Array, labels_b: jax.Array, weights_b: jax.Array) -> jax.Array:
    """Mean binary cross-entropy with logits over the weighted (non-padding) examples."""
    per_b = optax.sigmoid_binary_cross_entropy(logits_b, labels_b)
    return jnp.sum(per_b * weights_b) / jnp.maximum(jnp.sum(weights_b), 1.0)


LossFn = Callable[[nnx.Module, Any, jax.Array], tuple[jax.Array, dict]]
"""A train step's loss hook: ``(model, device batch, key) -> (batch-mean loss, metrics)``.
``key`` is the step's key split off ``TrainState.rng`` (the CTR loss's dropout key; a loss that
draws more, e.g. negatives, splits it); ``metrics`` are scalars added to the step's metrics."""


def bce_loss(model: nnx.Module, batch: Batch, key: jax.Array) -> tuple[jax.Array, dict]:
    """The CTR families' loss hook: :func:`weighted_bce` of ``model(dense, ids)``'s logits."""
    logits_b = model(batch.dense_bn, batch.ids_bfh, dropout_key=key)
    return weighted_bce(logits_b, batch.labels_b, batch.weights_b), {}


def _norm(tree: Any) -> jax.Array:
    return optax.tree.norm(tree)


NONFINITE_MODES = ("skip", "raise", "ignore")
"""What a train step does when its loss or a gradient is NaN/Inf (``TrainConfig.nonfinite``):
``skip`` and ``raise`` leave the state unchanged but for ``step``; ``ignore`` applies it."""


def _all_finite(*trees: Any) -> jax.Array:
    """bool scalar: every element of every array of ``trees`` is finite."""
    leaves = jax.tree.leaves(trees)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``ok``, else ``old`` (leaf by leaf; bitwise the old values when not ok)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _check_mode(nonfinite: str) -> None:
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite={nonfinite!r}: expected one of {NONFINITE_MODES}")


@dataclasses.dataclass(frozen=True)
class SparseOptimizer:
    """The optimizer of a model whose tables live in the embedding engine: ``dense`` (optax) on
    every other parameter, the engine's sparse row updates on the table buffers.

    ``init(params)`` gives ``{"dense": optax state of the dense parameters, "embedding":
    {buffer path: {"acc" | "m" | "v": state}}}``.
    """

    dense: optax.GradientTransformation
    embedding_lr: optax.Schedule
    rule: engine.UpdateRule
    initial_accumulator: float = 0.0
    dense_needs_loss: bool = False
    """``dense`` takes ``value_fn=`` the step's loss of the dense parameters (Hessian-free)."""

    def init(self, params: Any) -> dict:
        emb, dense = nnx.split_state(params, EmbeddingTable, ...)
        out = {}
        for path, var in nnx.to_flat_state(emb):
            out[_buffer_path(path)] = engine.init_opt_state_for(
                var, self.rule.optimizer, self.initial_accumulator
            )
        return {"dense": self.dense.init(dense), "embedding": out}


def _buffer_path(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def _split_tables(params: Any, sparse: bool) -> tuple[Any, Any]:
    """``(engine buffers, the rest)`` of ``params`` (``(None, params)`` on the per-table path,
    whose tables are differentiated with the dense parameters)."""
    if sparse:
        return nnx.split_state(params, EmbeddingTable, ...)
    return None, params


def _gradients(graphdef, emb, dense, batch_stats_in, batch: Any, key, loss_fn: LossFn = bce_loss):
    """The batch-mean loss and its gradients: ``(loss, new batch statistics, the engine's
    looked-up keys, gradients of ``dense`` (the per-table path's tables included), gradients of
    the engine lookups' zero deltas, the loss of ``dense``, the loss hook's metrics)``; ``emb``:
    the engine's buffers, or None."""

    def forward(dense_params, deltas):
        # copy=True: fresh Variables at this trace level, so BatchNorm may update its
        # statistics.
        tables = () if emb is None else (emb,)
        dense_params = sharding.gather_fsdp(dense_params)
        model = nnx.merge(graphdef, *tables, dense_params, batch_stats_in, copy=True)
        with engine.step_context(model, deltas) as ctx:
            loss, metrics = loss_fn(model, batch, key)
        return loss, metrics, model, ctx

    deltas = {}
    if emb is not None:  # the deltas' shapes: one per buffer of every engine collection
        shapes = {}

        def discover(dense_params):
            _, _, _, ctx = forward(dense_params, None)
            shapes.update(ctx.shapes)
            return 0.0

        jax.eval_shape(discover, dense)
        deltas = {ck: {bk: _zeros(sds) for bk, sds in per.items()} for ck, per in shapes.items()}

    def value_and_aux(dense_params, deltas):
        loss, metrics, model, ctx = forward(dense_params, deltas)
        return loss, (nnx.state(model, nnx.BatchStat), ctx.keys, metrics)

    (loss, (batch_stats, keys, metrics)), (g_dense, g_delta) = jax.value_and_grad(
        value_and_aux, argnums=(0, 1), has_aux=True
    )(dense, deltas)

    def value_fn(d):
        return value_and_aux(d, deltas)[0]

    return loss, batch_stats, keys, g_dense, g_delta, value_fn, metrics


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation | SparseOptimizer,
    *,
    nonfinite: str = "skip",
    embedding_clip: cowclip.CowClip | None = None,
    loss_fn: LossFn = bce_loss,
):
    """The pure train step of a model ``graphdef`` with optimizer ``tx``, whatever stores its
    tables, minimising ``loss_fn`` (:data:`LossFn`; the CTR families' :func:`bce_loss` by
    default), whose metrics join the step's.

    - ``tx`` an optax transformation (``embeddings.sharding=off``): every parameter, tables
      included (one array each), gets its gradient and goes through ``tx``
      (``recscale.optim.combine`` routes tables to the embedding optimizer).
    - ``tx`` a :class:`SparseOptimizer` (the sharded engine): the dense parameters go through
      ``tx.dense``; the tables are never differentiated. The step takes gradients with respect
      to the engine lookups' zero deltas (the pooled outputs of the slots,
      ``recscale.embeddings.lookup``) and the rows they read are updated in place
      (``recscale.embeddings.update``).

    A step whose loss or gradients are not all finite is, unless ``nonfinite="ignore"``,
    skipped: parameters, optimizer state (Adam's count and moments included) and BatchNorm
    statistics come back bitwise unchanged, only ``step`` and ``rng`` advance;
    ``metrics["nonfinite"]`` is 1.0 for it (0.0 otherwise). Dense parameters, their optimizer
    state and the statistics are kept by selection (the per-table path's whole tables too, as
    its optax update reads them anyway); the engine's update is skipped by turning every
    looked-up row into padding with a zero gradient: no row is touched, so rows and their
    row-wise Adagrad accumulators / lazy Adam moments stay bitwise unchanged and no whole
    table is read. ``optax.apply_if_finite`` is not used: it checks gradients only and leaves
    the BatchNorm statistics a NaN input has already corrupted.

    ``embedding_clip`` (``recscale.optim.cowclip``): CowClip and the touched rows' L2 on the
    per-table path's table gradients, from the batch's id counts, before ``tx`` (the engine
    applies its own, ``tx.rule.clip``, in the sparse update).
    """
    _check_mode(nonfinite)
    sparse = isinstance(tx, SparseOptimizer)
    dense_tx = tx.dense if sparse else tx

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        rng, dropout_key = _split_rng(state.rng)
        emb, dense = _split_tables(state.params, sparse)
        dense_opt = state.opt_state["dense"] if sparse else state.opt_state
        loss, batch_stats, keys, g_dense, g_delta, value_fn, loss_metrics = _gradients(
            graphdef, emb, dense, state.batch_stats, batch, dropout_key, loss_fn
        )
        g_dense = sharding.constrain_state(g_dense)  # FSDP / TP: into the parameters' shards
        if embedding_clip is not None and not sparse:
            g_dense = _clip_tables(
                graphdef, dense, state.batch_stats, g_dense, batch.ids_bfh, embedding_clip
            )
        ok = jnp.isfinite(loss) & _all_finite(g_dense, g_delta)
        skip = nonfinite != "ignore"
        if sparse and tx.dense_needs_loss:
            updates, new_opt = dense_tx.update(g_dense, dense_opt, dense, value_fn=value_fn)
        else:
            updates, new_opt = dense_tx.update(g_dense, dense_opt, dense)
        new_dense = optax.apply_updates(dense, updates)
        if skip:
            new_dense, new_opt, batch_stats = _keep_if(
                ok, (new_dense, new_opt, batch_stats), (dense, dense_opt, state.batch_stats)
            )
        metrics = {"loss": loss, "nonfinite": 1.0 - ok.astype(jnp.float32), **loss_metrics}
        for s in jax.tree.leaves(new_opt, is_leaf=lambda x: isinstance(x, HessianFreeState)):
            if isinstance(s, HessianFreeState):  # the trust region's own account of the step
                metrics.update(
                    hf_radius=s.radius,
                    hf_accepted=s.accepted,
                    hf_ratio=s.ratio,
                    hf_cg_iters=s.cg_iters.astype(jnp.float32),
                    hf_negative_curvature=s.negative_curvature.astype(jnp.float32),
                )
        if not sparse:
            metrics.update(
                grad_norm=_norm(g_dense), update_norm=_norm(updates), param_norm=_norm(new_dense)
            )
            new = TrainState(
                step=state.step + 1,
                params=new_dense,
                opt_state=new_opt,
                batch_stats=batch_stats,
                rng=rng,
            )
            return new, metrics

        lr = tx.embedding_lr(state.step)
        model = nnx.merge(graphdef, state.params, state.batch_stats, copy=True)
        emb_state, emb_sq = {}, []
        for ck, coll in engine.engine_collections(model).items():
            for bl in coll.layout.buffers:
                path = "/".join(p for p in (ck, "buffers", bl.key) if p)
                var = coll.buffers[bl.key]
                k, g = keys[ck][bl.key], g_delta[ck][bl.key]
                if skip:
                    # Row ``bl.rows`` (of a device block, or of a replicated buffer) is the
                    # engine's padding key: the update drops it. [S, B, H] / [S, B, w] only.
                    k = jnp.where(ok, k, bl.rows)
                    g = jnp.where(ok, g, 0.0)
                buf, st, sq = engine.apply_update(
                    coll.layout,
                    bl,
                    var[...],
                    state.opt_state["embedding"][path],
                    k,
                    g,
                    lr,
                    state.step,
                    tx.rule,
                )
                if skip and tx.rule.l2:  # coupled L2 moves every row: keep them by selection
                    old = state.opt_state["embedding"][path]
                    buf, st = _keep_if(ok, (buf, st), (var[...], old))
                var[...] = buf
                emb_state[path] = st
                emb_sq.append(sq)
        nnx.update(model, new_dense, batch_stats)
        metrics.update(
            # The tables' gradient rows (repeats combined), as the dense path's table gradients.
            grad_norm=jnp.sqrt(jnp.square(_norm(g_dense)) + sum(q[1] for q in emb_sq)),
            update_norm=jnp.sqrt(jnp.square(_norm(updates)) + sum(q[0] for q in emb_sq)),
            # The tables' norm would read every table every step; the dense part is cheap.
            dense_param_norm=_norm(new_dense),
        )
        new = TrainState(
            step=state.step + 1,
            params=nnx.state(model, nnx.Param),
            opt_state={"dense": new_opt, "embedding": emb_state},
            batch_stats=batch_stats,
            rng=rng,
        )
        return new, metrics

    return train_step


def _clip_tables(graphdef, params, batch_stats, grads, ids_bfh, clip: cowclip.CowClip):
    """``grads`` with every per-table ``EmbeddingCollection``'s table gradients through CowClip
    (``recscale.optim.cowclip.clip_table``), each row's count taken from the features that read
    its table."""
    model = nnx.merge(graphdef, params, batch_stats)
    g_flat = dict(nnx.to_flat_state(grads))
    w_flat = dict(nnx.to_flat_state(params))
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, EmbeddingCollection) or node.layout is not None or node.int8:
            continue
        specs = {t.name: t for t in node.table_specs}
        counts: dict[str, jax.Array] = {}
        for f, feat in enumerate(node.feature_specs):
            t = specs[feat.table]
            rows = g_flat[(*path, "tables", t.name)][...].shape[0]
            c = cowclip.table_counts(ids_bfh[:, f, : feat.max_hotness], t.num_rows, rows)
            counts[t.name] = counts[t.name] + c if t.name in counts else c
        for name, c in counts.items():
            key = (*path, "tables", name)
            g, w = g_flat[key], w_flat[key]
            g_flat[key] = g.replace(cowclip.clip_table(g[...], w[...], c, clip))
    return nnx.from_flat_state(g_flat)


def make_gradient_sq_norms(graphdef: nnx.GraphDef, *, sparse: bool):
    """``sq_norms(state, batch) -> {"dense": |g|², "embedding": |g|²}``: the squared norms of
    the batch-mean loss's gradient, the dense parameters and the tables apart (the engine's
    tables: their row gradients, as its sparse update sees them). Nothing is updated; for the
    gradient noise scale (``recscale.analysis.noise_scale``)."""

    def sq_norms(state: TrainState, batch: Batch) -> dict:
        _, dropout_key = _split_rng(state.rng)
        emb, dense = _split_tables(state.params, sparse)
        _, _, keys, g_dense, g_delta, _, _ = _gradients(
            graphdef, emb, dense, state.batch_stats, batch, dropout_key
        )
        parts = {"dense": jnp.zeros((), jnp.float32), "embedding": jnp.zeros((), jnp.float32)}
        for _, g in nnx.to_flat_state(g_dense):
            part = "embedding" if isinstance(g, EmbeddingTable) else "dense"
            parts[part] = parts[part] + jnp.sum(jnp.square(g[...].astype(jnp.float32)))
        if sparse:
            model = nnx.merge(graphdef, state.params, state.batch_stats)
            for ck, coll in engine.engine_collections(model).items():
                for bl in coll.layout.buffers:
                    sq = engine.row_gradient_sq(bl, keys[ck][bl.key], g_delta[ck][bl.key])
                    parts["embedding"] = parts["embedding"] + sq
        return parts

    return sq_norms


def _zeros(sds: jax.ShapeDtypeStruct) -> jax.Array:
    z = jnp.zeros(sds.shape, sds.dtype)
    return z if sds.sharding is None else jax.lax.with_sharding_constraint(z, sds.sharding)


def make_eval_step(graphdef: nnx.GraphDef):
    """``eval_step(params, batch_stats, batch) -> logits_b`` (evaluation mode: no dropout,
    BatchNorm with its running statistics)."""

    def eval_step(params, batch_stats, batch: Batch) -> jax.Array:
        model = nnx.merge(graphdef, params, batch_stats)
        return model(batch.dense_bn, batch.ids_bfh)

    return eval_step
