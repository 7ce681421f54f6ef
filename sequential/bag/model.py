"""A DLRM-style baseline that sees a history as a bag: no order, no positions.

Each token's user embedding is a function of the *set with multiplicities* of the items up to
and including it (its causal prefix), not of their order: on the packed tokens,

    b_t = LN(mean_{s <= t} sqrt(D) · E[x_s])         the prefix bag (mean pooling), per sequence
    u_t = W_L+1 ReLU(... ReLU(W_1 b_t + c_1) ...) + c_L+1      DLRM's top MLP, L hidden layers

``LN`` is a LayerNorm without scale or bias (eps 1e-6): a mean of ``t`` rows shrinks as
``1/sqrt(t)``, and the MLP should see one scale whatever the length. Kernels Glorot-uniform,
biases zero (``sequential.layers.Dense``); dropout (``cfg.dropout``) on the input and after
each hidden layer, training calls only. The output is scored against the item table by the
sequential losses, as HSTU's and SASRec's are (``sequential.losses``).

Such a model can infer a user's taste from the items it has seen, but not which item came last
or ``lag`` steps back: on ``data.sequences.planted`` histories its loss is bounded below by
what the bag reveals (the generator's ``bag`` baseline counts the taste part only; a bag model
can also give some weight to the successors of every item it holds).

Dimension glossary: ``T`` token slots, ``B`` sequences, ``N`` max_seq_len, ``D`` model width,
``F`` hidden width, ``L`` hidden layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from recscale.embeddings.layout import EngineSpec
from recscale.nn import dropout
from sequential.config import BagConfig
from sequential.layers import (
    Dense,
    SeqModel,
    Tokens,
    engine_spec,
    fold,
    layer_norm,
    to_jagged,
    to_padded,
)

LN_EPS = 1e-6


class Bag(SeqModel):
    """The bag over a ``JaggedBatch``: ``model(values [T], offsets [B + 1]) -> [T, D]`` user
    embeddings (``sequential.layers.SeqModel``, without a positional embedding)."""

    positional = False

    def __init__(self, cfg: BagConfig, *, engine: EngineSpec | None = None, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs, engine=engine)
        widths = [cfg.d_model] + [cfg.hidden_width] * cfg.num_layers + [cfg.d_model]
        self.mlp = nnx.List(
            [Dense(a, b, rngs=rngs) for a, b in zip(widths[:-1], widths[1:], strict=True)]
        )

    def encode(
        self, x_td: jax.Array, offsets: jax.Array, tokens: Tokens, dropout_key: jax.Array | None
    ) -> jax.Array:
        n = self.cfg.max_seq_len
        # Per sequence, padded: a cumulative sum within [B, N] rows reads no other sequence.
        x_bnd, _ = to_padded(x_td, offsets, n)
        count_n = jnp.arange(1, n + 1, dtype=x_bnd.dtype)
        bag_td = to_jagged(jnp.cumsum(x_bnd, axis=1) / count_n[None, :, None], tokens)
        h_td = layer_norm(bag_td, LN_EPS)
        last = len(self.mlp) - 1
        for i, layer in enumerate(self.mlp):
            h_td = layer(h_td)
            if i < last:
                h_td = dropout(jax.nn.relu(h_td), self.cfg.dropout, fold(dropout_key, i))
        return h_td


def build_model(cfg, schema, rngs: nnx.Rngs) -> Bag:
    """The trainer's hook (``recscale.families``): the bag of a run config
    (``sequential.run_config.BagRunConfig``), its item table in the sharded engine unless
    ``embeddings.sharding`` is off."""
    del schema  # the item count is the config's (``sequential.source`` checks the data's)
    return Bag(cfg.model, engine=engine_spec(cfg), rngs=rngs)
