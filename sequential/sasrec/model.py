"""SASRec (Kang & McAuley, "Self-Attentive Sequential Recommendation", ICDM 2018) over jagged
tokens.

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

Layout: every layer but the attention acts on each token alone, so it runs on the jagged
``[T, D]`` slots (a pack's real tokens and its tail), never on a padded ``[B, N, D]`` (most of
whose ``B·N`` rows are padding when histories are short); the attention scores chunks of the
slots (:func:`local_attention`). The outputs equal the padded form's to float32 rounding
(``tests/sequential/test_sasrec_layout.py``); a training call's dropout masks are drawn over
this layout, so its random stream is not the padded form's.

Dimension glossary: ``T`` token slots, ``B`` sequences, ``N`` max_seq_len, ``D`` model width,
``H`` heads, ``P`` width per head (``D / H``), ``F`` FFN width, ``L`` blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from recscale import jagged
from recscale.embeddings.layout import EngineSpec
from recscale.nn import LayerNorm, dropout
from sequential.config import SASRecConfig
from sequential.layers import Dense, SeqModel, Tokens, engine_spec, fold

LN_EPS = 1e-8


def local_attention(
    q_thp: jax.Array,
    k_thp: jax.Array,
    v_thp: jax.Array,
    tokens: Tokens,
    *,
    max_seq_len: int,
    rate: float,
    dropout_key: jax.Array | None,
) -> jax.Array:
    """``softmax(mask(Q Kᵀ / sqrt(P))) V`` over jagged tokens, ``[T, H, P]`` each: token t
    attends to the tokens of its own sequence at or before it, and dropout (``rate``) drops
    attention weights; ``[T, H, P]`` out (any value at invalid slots: callers zero them).

    Scores are ``[G, H, C, W]`` over the slots' local windows (``recscale.jagged``: a token
    sees at most its ``N - 1`` predecessors), not the padded layout's ``[B, H, N, N]``. The
    mask keeps a key of the query's own sequence at or before it (a valid slot); every other
    score gets the float32 floor, whose weight underflows to exactly 0, so the valid rows equal
    the padded layout's to float32 rounding."""
    t, h, p = q_thp.shape
    win = jagged.Windows.of(t, max_seq_len)
    seq = jnp.where(tokens.valid, tokens.seq, -1)
    same = win.window(seq, -1)[:, None, :] == win.chunks(seq, -1)[:, :, None]
    allowed = same & (win.distance() >= 0)  # [G, C, W]
    s_ghij = jnp.einsum("gihp,gjhp->ghij", win.chunks(q_thp), win.window(k_thp)) / p**0.5
    s_ghij = jnp.where(allowed[:, None], s_ghij, jnp.finfo(s_ghij.dtype).min)
    w_ghij = dropout(jax.nn.softmax(s_ghij, axis=-1), rate, dropout_key)
    return win.unchunk(jnp.einsum("ghij,gjhp->gihp", w_ghij, win.window(v_thp)))


class SASRecBlock(nnx.Module):
    """One self-attention block (module docstring) on jagged tokens: ``x [T, D] -> [T, D]``
    (zero at invalid slots). Every per-token layer (LayerNorms, projections, FFN, dropout) runs
    on the ``T`` slots, the attention on chunks of them (:func:`local_attention`)."""

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
        self.max_seq_len = cfg.max_seq_len
        self.rate = cfg.dropout

    def __call__(
        self, x_td: jax.Array, tokens: Tokens, *, dropout_key: jax.Array | None
    ) -> jax.Array:
        t, d = x_td.shape
        h = self.num_heads
        q_td = self.ln_attn(x_td)
        a_thp = local_attention(
            self.query(q_td).reshape(t, h, d // h),
            self.key(x_td).reshape(t, h, d // h),
            self.value(x_td).reshape(t, h, d // h),
            tokens,
            max_seq_len=self.max_seq_len,
            rate=self.rate,
            dropout_key=fold(dropout_key, 0),
        )
        x_td = a_thp.reshape(t, d) + q_td
        y_td = self.ln_ffn(x_td)
        hid = dropout(jax.nn.relu(self.ffn_in(y_td)), self.rate, fold(dropout_key, 1))
        x_td = dropout(self.ffn_out(hid), self.rate, fold(dropout_key, 2)) + y_td
        return jnp.where(tokens.valid[:, None], x_td, 0.0)


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
        del offsets  # the attention finds each token's sequence from ``tokens``
        for i, block in enumerate(self.blocks):
            x_td = block(x_td, tokens, dropout_key=fold(dropout_key, i))
        return self.ln_out(x_td)


def build_model(cfg, schema, rngs: nnx.Rngs) -> SASRec:
    """The trainer's hook (``recscale.families``): the SASRec of a run config
    (``sequential.run_config.SASRecRunConfig``), its item table in the sharded engine unless
    ``embeddings.sharding`` is off."""
    del schema  # the item count is the config's (``sequential.source`` checks the data's)
    return SASRec(cfg.model, engine=engine_spec(cfg), rngs=rngs)
