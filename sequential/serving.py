"""Export of a next-item model (HSTU, SASRec) as a serving artifact: the task's
``serving_parts`` hook (``sequential.task``) that ``python -m recscale.export`` calls.

The artifact is the CTR models' (``recscale.serving.export``: the same folder, manifest,
weights and checks) with two programs over histories in place of ``forward.jax``, loaded by
``recscale.serving.next_item.NextItemModel`` (whose docstring states their inputs and outputs):
``top_k.jax``, each history's best ``max_k`` next items over the whole catalogue, and
``score.jax``, its scores of given candidates.

A history ``items [N]`` (left-aligned, 0 past ``length``) is the model's one-sequence jagged
batch (``values = items``, ``offsets = [0, length]``: the packer's layout, tail padding 0);
its user embedding is the output at its last event, as ``sequential.metrics`` queries it. The
programs take a batch of histories by ``jax.vmap`` of that one-history function: the models'
jagged layout (``searchsorted`` over the offsets) needs a static number of sequences, which a
symbolic batch of packed sequences would not have.

Ranking is ``sequential.metrics.rank_full``'s: items ``1..V`` by ``<u, n(e_j)>`` (``n``: the
training loss's L2 normalisation, or none), the history's items left out where asked. The
running top-K over chunks of ``CHUNK`` item rows keeps memory at ``[B, CHUNK + K]`` scores for
any V, and it is exact: each chunk's scores are merged with the best K so far by ``top_k``,
which puts the lower index, here the lower item id, first among ties. The reported score is the
ranking score times ``1 / (max(|u|, eps) · temperature)`` (the loss's logit; a positive factor
per history, so the order is unchanged).

Dimension glossary: ``B`` histories, ``N`` max_seq_len, ``D`` width, ``V`` items, ``K`` the
top-K size, ``C`` candidates or item rows per chunk.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from recscale.serving import next_item
from recscale.serving.artifact import ArtifactParts
from recscale.serving.export import float_tables, host_weights, lower, merged
from sequential.layers import ITEM_TABLE, SeqModel
from sequential.losses import l2_normalize
from sequential.metrics import HIGHEST

MAX_K = 100
"""The most items a top-K request may ask for (the program's static K; at most V)."""
CHUNK = 8192
"""Item rows scored at once by the top-K."""


def user_embedding(model: SeqModel, items_n: jax.Array, length: jax.Array) -> jax.Array:
    """``[D]``: the model's output at the last event of one history ``items [N]`` of
    ``length`` events (clipped to ``1..N``)."""
    n = model.cfg.max_seq_len
    length = jnp.clip(length, 1, n).astype(jnp.int32)
    values = jnp.where(jnp.arange(n) < length, items_n, 0)
    offsets = jnp.stack([jnp.zeros((), jnp.int32), length])
    return model(values, offsets)[length - 1]


class _Scorer:
    """The ranking and reported scores of one model (module docstring)."""

    def __init__(self, model: SeqModel, l2_norm: bool, eps: float, temperature: float):
        self.model, self.l2_norm, self.eps, self.temperature = model, l2_norm, eps, temperature

    def items(self, rows: jax.Array) -> jax.Array:
        return l2_normalize(rows, self.eps) if self.l2_norm else rows

    def scale(self, user_d: jax.Array) -> jax.Array:
        """The factor from a ranking score to the loss's logit."""
        norm = jnp.maximum(jnp.linalg.norm(user_d), self.eps) if self.l2_norm else 1.0
        return 1.0 / (norm * self.temperature)

    def top_k(self, items_n, length, exclude, k: int) -> tuple[jax.Array, jax.Array]:
        model = self.model
        v = model.cfg.n_items
        user_d = user_embedding(model, items_n, length)
        table = model.item_table()  # [V + 1, D], row 0 padding
        c = min(CHUNK, v + 1)
        chunks = -(-(v + 1) // c)
        table = jnp.pad(table, ((0, chunks * c - (v + 1)), (0, 0)))
        n = model.cfg.max_seq_len
        seen_n = jnp.where(exclude & (jnp.arange(n) < jnp.clip(length, 1, n)), items_n, 0)

        def merge(best, i):
            best_s, best_i = best
            start = i * c
            ids_c = start + jnp.arange(c, dtype=jnp.int32)
            block_cd = self.items(jax.lax.dynamic_slice_in_dim(table, start, c))
            s_c = jnp.einsum("d,cd->c", user_d, block_cd, precision=HIGHEST)
            # a history item's row in the chunk; c (dropped) for none or another chunk's (a
            # negative index would wrap around)
            rel = seen_n - start
            rel = jnp.where((seen_n > 0) & (rel >= 0) & (rel < c), rel, c)
            seen_c = jnp.zeros(c, bool).at[rel].set(True, mode="drop")
            ok = (ids_c >= 1) & (ids_c <= v) & ~seen_c
            s = jnp.concatenate([best_s, jnp.where(ok, s_c, -jnp.inf)])
            top_s, pos = jax.lax.top_k(s, k)
            return (top_s, jnp.concatenate([best_i, ids_c])[pos]), None

        init = (jnp.full(k, -jnp.inf, jnp.float32), jnp.zeros(k, jnp.int32))
        (top_s, top_i), _ = jax.lax.scan(merge, init, jnp.arange(chunks))
        top_i = jnp.where(jnp.isfinite(top_s), top_i, 0)
        return top_i, top_s * self.scale(user_d)

    def score(self, items_n, length, cands_c) -> jax.Array:
        user_d = user_embedding(self.model, items_n, length)
        e_cd = self.items(self.model.item_table()[cands_c])  # as rank_full reads a target
        s_c = jnp.einsum("d,cd->c", user_d, e_cd, precision=HIGHEST) * self.scale(user_d)
        return jnp.where(cands_c > 0, s_c, -jnp.inf)


def per_table(model: SeqModel) -> SeqModel:
    """``model`` with its item table as one ``[V + 1, D]`` array: itself on the per-table path;
    for a run that trained the table in the sharded engine, a twin built without the engine
    holding the same weights and the engine's buffers gathered into one table
    (``recscale.serving.export.float_tables``), so the artifact depends on no mesh or plan."""
    if model.embeddings.layout is None:
        return model
    (table,) = float_tables(model.embeddings).values()
    layers = getattr(model, "layers", None)  # HSTU's layers name their attention kernel
    kw = {"impl": layers[0].impl} if layers is not None and hasattr(layers[0], "impl") else {}
    graphdef, state = nnx.split(type(model)(model.cfg, rngs=nnx.Rngs(params=0), **kw))
    mine = dict(nnx.to_flat_state(nnx.state(model)))
    pairs = []
    for path, var in nnx.to_flat_state(state):
        value = var[...] if path[0] == "embeddings" else mine[path][...]
        if path[-1] == ITEM_TABLE:
            value = jnp.asarray(value).at[: table.shape[0]].set(table)
        pairs.append((path, value))
    return nnx.merge(graphdef, nnx.from_flat_state(pairs))


def serving_parts(r: Any, args: Any) -> ArtifactParts:
    """The task's part of the artifact of restored run ``r`` (``recscale.train.evaluation.
    Restored``) for ``ExportArgs`` ``args``: the programs, the weights and the manifest's
    fields. The item table is exported in float32 (the top-K scores every row of it)."""
    if args.precision != "float32" or args.table_precision:
        raise ValueError(
            f"--precision {args.precision} / --table-precision: a next-item model's item table "
            "is exported in float32 (its top-K scores every row); leave them at their defaults"
        )
    cfg = r.cfg
    lcfg, mcfg = cfg.loss, cfg.model
    model = per_table(nnx.merge(r.exp.graphdef, r.params, r.batch_stats))
    graphdef, weights, paths = host_weights(model)
    k = min(MAX_K, mcfg.n_items)
    eps = lcfg.l2_eps

    def scorer(w):
        return _Scorer(merged(graphdef, paths, w), lcfg.l2_norm, eps, lcfg.temperature)

    def top_k(w, items_bn, lengths_b, exclude_b):
        return jax.vmap(lambda i, n, x: scorer(w).top_k(i, n, x, k))(items_bn, lengths_b, exclude_b)

    def score(w, items_bn, lengths_b, cands_bc):
        return jax.vmap(scorer(w).score)(items_bn, lengths_b, cands_bc)

    b, c = jax.export.symbolic_shape("b, c")
    n = mcfg.max_seq_len
    hist = (jax.ShapeDtypeStruct((b, n), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
    platforms = tuple(args.platforms)
    programs = {
        next_item.TOP_K: lower(
            top_k, weights, (*hist, jax.ShapeDtypeStruct((b,), bool)), platforms
        ),
        next_item.SCORE: lower(
            score, weights, (*hist, jax.ShapeDtypeStruct((b, c), jnp.int32)), platforms
        ),
    }
    table = int(model.embeddings.tables[ITEM_TABLE][...].nbytes)
    manifest = {
        "task": next_item.TASK,
        "inputs": {
            "n_items": mcfg.n_items,
            "max_seq_len": n,
            "max_k": k,
            "pad_id": 0,
            "history": "item ids 1..n_items, oldest first, left-aligned in [B, max_seq_len] "
            "with lengths [B]; longer histories cut to their most recent max_seq_len",
        },
        "output": "top_k.jax: (items int32 [B, max_k], scores float32 [B, max_k]), best first; "
        "score.jax: scores float32 [B, C] of candidates [B, C]",
        "scoring": {
            "l2_norm": lcfg.l2_norm,
            "temperature": lcfg.temperature,
            "score": "<n(u), n(e_j)> / temperature (n: L2 normalisation where l2_norm)",
        },
        "tables": {"item": {"precision": "float32", "dim": mcfg.d_model, "bytes": table}},
        "table_bytes": table,
    }
    return ArtifactParts(manifest=manifest, weights=weights, programs=programs)
