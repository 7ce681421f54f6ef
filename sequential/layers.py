"""What the sequential models (HSTU, SASRec, the bag) share: the jagged token layout, the item
table and the input embedding, and the output convention.

Every model reads packed tokens (``data.sequences.JaggedBatch``'s ``values`` and ``offsets``)
and returns one user embedding per token slot, ``[T, D]``, zero for slots that are not a token
of a sequence within its first ``N`` positions; a user embedding is scored against item
embeddings of the same table the input reads (``item_embeddings``, ``item_table``), after an
optional L2 normalisation (``sequential.losses``, ``sequential.metrics``). The table is an
``EmbeddingCollection``'s, one array or laid out by the sharded embedding engine
(:func:`engine_spec`); the model can be handed rows looked up beforehand (``items_td``), as a
train step looks up all of its ids at once (``sequential.task``).

Input (generative-recommenders' ``LearnablePositionalEmbeddingInputFeaturesPreprocessor``, as
SASRec's official ``model.py``): ``x_t = sqrt(D) · E[item_t] + P[pos_t]``, dropout, zero at
invalid slots; positions count from each sequence's first token (SASRec's official code
left-pads to ``maxlen`` and so counts back from the last one; from the first token, a prefix's
outputs do not depend on how long its sequence is).

Dimension glossary: ``T`` token slots (``T_pad``), ``B`` sequences, ``N`` max_seq_len, ``D``
model width, ``V`` items (table rows ``V + 1``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from data.sequences import PackConfig
from recscale import sharding
from recscale.embeddings.collection import EmbeddingCollection
from recscale.embeddings.layout import EngineSpec
from recscale.embeddings.spec import FeatureSpec, TableSpec
from recscale.nn import dropout
from sequential.config import SeqModelConfig

ITEM_TABLE = "item"


class Tokens(NamedTuple):
    """Where every token slot sits: ``seq`` int32 [T] its sequence (clipped to ``B - 1`` for
    slots of none), ``pos`` int32 [T] its position in it, ``valid`` bool [T] whether it is a
    token of a sequence at a position ``< N``."""

    seq: jax.Array
    pos: jax.Array
    valid: jax.Array


def token_layout(offsets: jax.Array, num_slots: int, max_seq_len: int) -> Tokens:
    """The :class:`Tokens` of ``num_slots`` packed slots with sequence boundaries ``offsets``
    ``[B + 1]`` (empty sequences allowed; the tail past ``offsets[B]`` is padding)."""
    offs = jnp.asarray(offsets, jnp.int32)
    t = jnp.arange(num_slots, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(offs, t, side="right") - 1, 0, offs.shape[0] - 2)
    pos = t - offs[seq]
    valid = (t < offs[-1]) & (pos >= 0) & (pos < max_seq_len)
    return Tokens(seq.astype(jnp.int32), pos, valid)


def to_padded(x_t: jax.Array, offsets: jax.Array, max_seq_len: int) -> tuple[jax.Array, jax.Array]:
    """Jagged ``[T, ...]`` -> ``([B, N, ...]`` zero past each sequence's ``min(n_b, N)``
    tokens, ``mask [B, N]`` bool)."""
    offs = jnp.asarray(offsets, jnp.int32)
    n_b = jnp.minimum(jnp.diff(offs), max_seq_len)
    pos = jnp.arange(max_seq_len, dtype=jnp.int32)
    mask = pos[None, :] < n_b[:, None]
    rows = jnp.take(x_t, jnp.where(mask, offs[:-1, None] + pos[None, :], 0), axis=0, mode="clip")
    keep = mask.reshape(mask.shape + (1,) * (x_t.ndim - 1))
    return jnp.where(keep, rows, jnp.zeros((), x_t.dtype)), mask


def to_jagged(x_bn: jax.Array, tokens: Tokens) -> jax.Array:
    """``[B, N, ...]`` -> jagged ``[T, ...]`` (zero at invalid slots)."""
    rows = x_bn[tokens.seq, jnp.clip(tokens.pos, 0, x_bn.shape[1] - 1)]
    keep = tokens.valid.reshape(tokens.valid.shape + (1,) * (rows.ndim - 1))
    return jnp.where(keep, rows, jnp.zeros((), x_bn.dtype))


def layer_norm(x: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis without scale or bias (``F.layer_norm`` without weights)."""
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps)


def glorot_uniform(rngs: nnx.Rngs, shape: tuple[int, int]) -> jax.Array:
    """``U(±sqrt(6 / (fan_in + fan_out)))``: TF's default kernel init, torch's xavier_uniform."""
    bound = (6.0 / sum(shape)) ** 0.5
    return jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound)


class Dense(nnx.Module):
    """``y = x W + b`` with a Glorot-uniform kernel and a zero bias (TF's ``tf.layers.dense``)."""

    def __init__(self, in_dim: int, out_dim: int, *, rngs: nnx.Rngs):
        self.kernel = sharding.param(
            nnx.Param, glorot_uniform(rngs, (in_dim, out_dim)), None, "mlp"
        )
        self.bias = sharding.param(nnx.Param, jnp.zeros((out_dim,), jnp.float32), "mlp")

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...] + self.bias[...]


def fold(key: jax.Array | None, i: int) -> jax.Array | None:
    return None if key is None else jax.random.fold_in(key, i)


def lookup_ids_per_step(cfg: Any) -> int:
    """Item ids a training step of run config ``cfg`` looks up (``sequential.task``): per pack
    its ``T_pad`` token slots, their ``T_pad`` targets and the negatives (``K`` shared ones of
    the sampled softmax, ``T_pad`` of the BCE, none of the full softmax), times the packs;
    plus the ``V + 1`` rows of the whole table for the full softmax."""
    t = PackConfig(
        token_budget=cfg.data.token_budget, block_size=cfg.data.block_size
    ).max_tokens_padded
    loss = cfg.loss
    negatives = {"sampled_softmax": loss.num_negatives, "bce": t}.get(loss.kind, 0)
    table = cfg.model.n_items + 1 if loss.kind == "full_softmax" else 0
    return cfg.data.batch_size * (2 * t + negatives) + table


def engine_spec(cfg: Any) -> EngineSpec | None:
    """The item table's ``EngineSpec`` of run config ``cfg`` (None: the per-table path): the
    config's, with the planner's batch the ids a step looks up (:func:`lookup_ids_per_step`)
    instead of the packs ``data.batch_size`` counts."""
    spec = EngineSpec.from_config(cfg)
    if spec is None:
        return None
    return dataclasses.replace(spec, batch_size=lookup_ids_per_step(cfg))


def table_rows(table_vd: jax.Array, ids: jax.Array) -> jax.Array:
    """``[..., D]``: rows ``ids`` (``[...]`` int) of a whole item table ``[V + 1, D]``, zero
    for padding (id 0) and ids past ``V``, as :meth:`SeqModel.item_embeddings` reads them."""
    ids = jnp.asarray(ids, jnp.int32)
    ok = (ids > 0) & (ids < table_vd.shape[0])
    rows = jnp.take(table_vd, jnp.where(ok, ids, 0), axis=0)
    return jnp.where(ok[..., None], rows, 0.0)


class SeqModel(nnx.Module):
    """The base of HSTU, SASRec and the bag: the item table (an ``EmbeddingCollection`` of one
    table ``item`` ``[V + 1, D]``, so optimizers see an ``EmbeddingTable``), the positional
    embedding ``[N, D]`` (where ``positional``), the input, and the call ``(values, offsets) ->
    user embeddings [T, D]``.

    ``engine``: the item table lives in the sharded embedding engine
    (``recscale.embeddings.engine``; :func:`engine_spec`), laid out by its planner and looked
    up by its ``shard_map`` collectives; None: one ``[V + 1, D]`` array (the per-table path).
    Either way :meth:`item_embeddings` is one lookup of the collection, the one a train step
    may make (the engine records the rows it read for its sparse update)."""

    positional = True
    """Whether the input adds a learned positional embedding (an order-free model has none)."""

    def __init__(self, cfg: SeqModelConfig, *, rngs: nnx.Rngs, engine: EngineSpec | None = None):
        self.cfg = nnx.static(cfg)
        d = cfg.d_model
        table = TableSpec(
            name=ITEM_TABLE,
            num_rows=cfg.n_items + 1,
            dim=d,
            init="normal",
            init_scale=cfg.embedding_init_scale,
        )
        self.embeddings = EmbeddingCollection(
            (table,), (FeatureSpec(name=ITEM_TABLE, table=ITEM_TABLE),), rngs=rngs, engine=engine
        )
        if self.positional:
            pos_nd = jax.random.truncated_normal(rngs.params(), -2.0, 2.0, (cfg.max_seq_len, d))
            self.positions = sharding.param(nnx.Param, pos_nd * (1.0 / d) ** 0.5, None, "embed")

    def item_embeddings(self, ids: jax.Array) -> jax.Array:
        """``[..., D]``: the rows of items ``ids`` (``[...]`` int), zero for padding (id 0),
        in one lookup of the item table (each id a bag of one)."""
        flat = jnp.asarray(ids, jnp.int32).reshape(-1)
        flat = jnp.where((flat > 0) & (flat <= self.cfg.n_items), flat, -1)  # -1: not read
        # The lookup splits its bags evenly over the batch devices (the engine's over its own).
        layout = self.embeddings.layout
        split = math.lcm(sharding.axis_size("batch"), layout.num_devices if layout else 1)
        n = flat.shape[0]
        flat = jnp.pad(flat, (0, -n % split), constant_values=-1)
        emb = self.embeddings(flat[:, None, None])[:n, 0]
        return emb.reshape(*ids.shape, self.cfg.d_model)

    def item_table(self) -> jax.Array:
        """``[V + 1, D]``: the whole item table (row 0 is padding: callers exclude it). The
        engine's is gathered by a lookup of every item (row 0 then zero), which serves every
        layout alike; it is not a train step's lookup (that one is :meth:`item_embeddings`)."""
        if self.embeddings.layout is not None:
            return self.item_embeddings(jnp.arange(self.cfg.n_items + 1, dtype=jnp.int32))
        return self.embeddings.tables[ITEM_TABLE][...][: self.cfg.n_items + 1]

    def embed(
        self,
        values_t: jax.Array,
        tokens: Tokens,
        dropout_key: jax.Array | None,
        items_td: jax.Array | None = None,
    ) -> jax.Array:
        """``x [T, D] = sqrt(D) · E[item] + P[pos]`` (no ``P`` without ``positional``),
        dropout, zero at invalid slots (``items_td``: the rows ``E[item]``, if already looked
        up)."""
        cfg = self.cfg
        if items_td is None:
            items_td = self.item_embeddings(values_t)
        x = items_td * cfg.d_model**0.5
        if self.positional:
            x = x + self.positions[...][jnp.clip(tokens.pos, 0, cfg.max_seq_len - 1)]
        x = dropout(x, cfg.dropout, dropout_key)
        return jnp.where(tokens.valid[:, None], x, 0.0)

    def encode(
        self, x_td: jax.Array, offsets: jax.Array, tokens: Tokens, dropout_key: jax.Array | None
    ) -> jax.Array:
        """The family's layers: embedded tokens ``[T, D]`` -> outputs ``[T, D]``."""
        raise NotImplementedError

    def __call__(
        self,
        values: jax.Array,
        offsets: jax.Array,
        *,
        dropout_key: jax.Array | None = None,
        items_td: jax.Array | None = None,
    ) -> jax.Array:
        """User embeddings ``[T, D]`` of packed tokens ``values [T]`` with boundaries
        ``offsets [B + 1]``: row t summarises its sequence up to and including token t; zero
        at invalid slots (the tail, positions ``>= N``). A training call passes
        ``dropout_key``; ``items_td [T, D]``: the tokens' item rows, if already looked up (a
        train step looks up every id it needs at once, ``sequential.task``)."""
        values, offsets = jnp.asarray(values, jnp.int32), jnp.asarray(offsets, jnp.int32)
        tokens = token_layout(offsets, values.shape[0], self.cfg.max_seq_len)
        x_td = self.embed(values, tokens, fold(dropout_key, 0), items_td)
        out_td = self.encode(x_td, offsets, tokens, fold(dropout_key, 1))
        return jnp.where(tokens.valid[:, None], out_td, 0.0)
