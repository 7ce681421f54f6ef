"""SASRec (Kang & McAuley, "Self-Attentive Sequential Recommendation", ICDM 2018) over jagged
tokens, padded to ``[B, N, D]`` inside.

As the official code, github:kang205/SASRec at commit
``e3738967fddab206d6eeb4fda433e7a7034dd8b1`` (``model.py``, ``modules.py``): per block, on
``x [B, N, D]`` (zero at padding),

    q  = LN(x)
    a  = softmax(mask(Q Kᵀ / sqrt(d_h))) V,  Q = q W_q + b_q,  K = x W_k + b_k,  V = x W_v + b_v
    x  = a + q                                          (heads concatenated; no output projection)
    y  = LN(x);   x = Dropout(Dropout(ReLU(y W_1 + b_1)) W_2 + b_2) + y
    x  = x · mask

and a final ``LN`` after the last block. Keys and values are read from the un-normalised
``x`` and the attention's residual is the normalised ``q``, as ``multihead_attention(queries=
normalize(seq), keys=seq)`` does (the paper writes ``x + Dropout(g(LN(x)))``). LayerNorms have
a learned scale and bias, eps 1e-8; dense kernels Glorot-uniform and biases zero (TF's
defaults). The mask is causal and drops padded keys (the official code's key masking); dropout
(``cfg.dropout``) on the input, the attention weights and both FFN layers, training calls only.
The output is the last LN's, unnormalised: the BCE loss scores it by plain dot products, the
softmax losses L2-normalise it (generative-recommenders' SASRec).

Dimension glossary: ``T`` token slots, ``B`` sequences, ``N`` max_seq_len, ``D`` model width,
``H`` heads, ``P`` width per head (``D / H``), ``F`` FFN width, ``L`` blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from recscale.embeddings.layout import EngineSpec
from recscale.nn import LayerNorm, dropout
from sequential.config import SASRecConfig
from sequential.layers import (
    Dense,
    SeqModel,
    Tokens,
    engine_spec,
    fold,
    to_jagged,
    to_padded,
)

LN_EPS = 1e-8


class SASRecBlock(nnx.Module):
    """One self-attention block (module docstring): ``x [B, N, D] -> [B, N, D]``."""

    def __init__(self, cfg: SASRecConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.ffn_width
        self.ln_attn = LayerNorm(d, eps=LN_EPS)
        self.query = Dense(d, d, rngs=rngs)
        self.key = Dense(d, d, rngs=rngs)
        self.value = Dense(d, d, rngs=rngs)
        self.ln_ffn = LayerNorm(d, eps=LN_EPS)
        self.ffn_in = Dense(d, f, rngs=rngs)
        self.ffn_out = Dense(f, d, rngs=rngs)
        self.num_heads = cfg.num_heads
        self.rate = cfg.dropout

    def __call__(
        self, x_bnd: jax.Array, mask_bn: jax.Array, *, dropout_key: jax.Array | None
    ) -> jax.Array:
        b, n, d = x_bnd.shape
        h = self.num_heads
        p = d // h
        q_bnd = self.ln_attn(x_bnd)
        q_bnhp = self.query(q_bnd).reshape(b, n, h, p)
        k_bnhp = self.key(x_bnd).reshape(b, n, h, p)
        v_bnhp = self.value(x_bnd).reshape(b, n, h, p)
        s_bhnn = jnp.einsum("bihp,bjhp->bhij", q_bnhp, k_bnhp) / p**0.5
        pos = jnp.arange(n)
        allowed = (pos[None, :] <= pos[:, None])[None, None] & mask_bn[:, None, None, :]
        # A finite floor, not -inf: a padded query row has no allowed key (its output is
        # masked below), and a softmax over only -inf would be NaN.
        s_bhnn = jnp.where(allowed, s_bhnn, jnp.finfo(s_bhnn.dtype).min)
        w_bhnn = dropout(jax.nn.softmax(s_bhnn, axis=-1), self.rate, fold(dropout_key, 0))
        a_bnd = jnp.einsum("bhij,bjhp->bihp", w_bhnn, v_bnhp).reshape(b, n, d)
        x_bnd = a_bnd + q_bnd
        y_bnd = self.ln_ffn(x_bnd)
        hid = dropout(jax.nn.relu(self.ffn_in(y_bnd)), self.rate, fold(dropout_key, 1))
        x_bnd = dropout(self.ffn_out(hid), self.rate, fold(dropout_key, 2)) + y_bnd
        return x_bnd * mask_bn[:, :, None]


class SASRec(SeqModel):
    """SASRec over a ``JaggedBatch``: ``model(values [T], offsets [B + 1]) -> [T, D]`` user
    embeddings (``sequential.layers.SeqModel``; ``engine``: the item table's storage)."""

    def __init__(self, cfg: SASRecConfig, *, engine: EngineSpec | None = None, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs, engine=engine)
        self.blocks = nnx.List([SASRecBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.ln_out = LayerNorm(cfg.d_model, eps=LN_EPS)

    def encode(
        self, x_td: jax.Array, offsets: jax.Array, tokens: Tokens, dropout_key: jax.Array | None
    ) -> jax.Array:
        x_bnd, mask_bn = to_padded(x_td, offsets, self.cfg.max_seq_len)
        for i, block in enumerate(self.blocks):
            x_bnd = block(x_bnd, mask_bn, dropout_key=fold(dropout_key, i))
        return to_jagged(self.ln_out(x_bnd), tokens)


def build_model(cfg, schema, rngs: nnx.Rngs) -> SASRec:
    """The trainer's hook (``recscale.families``): the SASRec of a run config
    (``sequential.run_config.SASRecRunConfig``), its item table in the sharded engine unless
    ``embeddings.sharding`` is off."""
    del schema  # the item count is the config's (``sequential.source`` checks the data's)
    return SASRec(cfg.model, engine=engine_spec(cfg), rngs=rngs)
