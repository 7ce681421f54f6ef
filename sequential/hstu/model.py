"""HSTU (Zhai et al., "Actions Speak Louder than Words: Trillion-Parameter Sequential
Transducers for Generative Recommendations", ICML 2024) over jagged tokens.

The research form of github:facebookresearch/generative-recommenders at commit
``2e81fab69a497fb5e24cd23569adf1e78070e4ec``, ``generative_recommenders/research/modeling/
sequential/hstu.py`` (``SequentialTransductionUnitJagged`` with ``linear_config="uvqk"``,
``linear_activation="silu"``, ``normalization="rel_bias"``, ``concat_ua=False``), the model of
the paper's public-dataset experiments. Per layer, on the packed tokens ``x [T, D]``:

    U, V, Q, K = split(SiLU(LN(x) W_uvqk))                      f1 (no bias), φ1 = SiLU
    A          = hstu_attention(Q, K, V, offsets, rab)           SiLU(α q·k + rab(|i-j|)) / N, causal
    x         <- x + Dropout(U ⊙ LN(A)) W_o + b_o                f2 (with bias), residual

``LN`` is a LayerNorm without scale or bias (eps 1e-6), the second over all ``H · d_v`` values
of a token, as the research code's ``F.layer_norm``. ``W_uvqk ~ N(0, 0.02²)`` and ``W_o``
Glorot-uniform as there; ``b_o`` starts at zero (torch's Linear default is uniform). The
attention is ``recscale.kernels.hstu_attention`` (its ``reference.py`` states it exactly); its
relative bias is one learned table per layer, ``[1 or H, R]`` over bucketed distances, init
``N(0, 0.02²)``, where the research code has one weight per distance (``2N - 1``) and optional
timestamp buckets. No final norm: the output's L2 normalisation is the losses' (the research
code's ``L2NormEmbeddingPostprocessor``). Dropout (``cfg.dropout``) on the input and before
``W_o`` (``linear_dropout_rate``), active only in training calls.

The kernel's ``num_targets`` (ranking targets appended to a sequence) is not used: a
``JaggedBatch``'s ``num_targets`` counts supervision targets, a different thing.

Dimension glossary: ``T`` token slots, ``B`` sequences, ``N`` max_seq_len, ``D`` model width,
``H`` heads, ``A`` q/k width per head (``d_qk``), ``E`` v/u width per head (``d_v``), ``R``
bias buckets, ``L`` layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from recscale import sharding
from recscale.embeddings.layout import EngineSpec
from recscale.kernels.hstu_attention import api as hstu_api
from recscale.nn import dropout
from sequential.config import HSTUConfig
from sequential.layers import (
    SeqModel,
    Tokens,
    engine_spec,
    fold,
    glorot_uniform,
    layer_norm,
)

LN_EPS = 1e-6


class HSTULayer(nnx.Module):
    """One HSTU layer (module docstring): ``x [T, D] -> [T, D]``."""

    def __init__(self, cfg: HSTUConfig, *, impl: str, rngs: nnx.Rngs):
        d, h = cfg.d_model, cfg.num_heads
        width = h * (2 * cfg.d_v + 2 * cfg.d_qk)
        self.uvqk = sharding.param(
            nnx.Param, 0.02 * jax.random.normal(rngs.params(), (d, width)), None, "mlp"
        )
        self.out_kernel = sharding.param(
            nnx.Param, glorot_uniform(rngs, (h * cfg.d_v, d)), "mlp", None
        )
        self.out_bias = sharding.param(nnx.Param, jnp.zeros((d,), jnp.float32), None)
        self.rel_bias = nnx.data(None)
        if cfg.num_buckets:
            rows = h if cfg.bias_per_head else 1
            bias = 0.02 * jax.random.normal(rngs.params(), (rows, cfg.num_buckets))
            self.rel_bias = sharding.param(nnx.Param, bias, None, None)
        self.cfg = nnx.static(cfg)
        self.impl = nnx.static(impl)

    def __call__(
        self, x_td: jax.Array, offsets: jax.Array, *, dropout_key: jax.Array | None
    ) -> jax.Array:
        cfg = self.cfg
        t, h, a, e = x_td.shape[0], cfg.num_heads, cfg.d_qk, cfg.d_v
        uvqk = jax.nn.silu(layer_norm(x_td, LN_EPS) @ self.uvqk[...])
        u_te, v_te, q_ta, k_ta = jnp.split(uvqk, [h * e, 2 * h * e, 2 * h * e + h * a], axis=1)
        attn_the = hstu_api.hstu_attention(
            q_ta.reshape(t, h, a),
            k_ta.reshape(t, h, a),
            v_te.reshape(t, h, e),
            offsets,
            None,
            None if self.rel_bias is None else self.rel_bias[...],
            max_seq_len=cfg.max_seq_len,
            alpha=cfg.alpha,
            contextual_seq_len=cfg.contextual_seq_len,
            max_attn_len=cfg.max_attn_len,
            impl=self.impl,
        )
        y_te = u_te * layer_norm(attn_the.reshape(t, h * e), LN_EPS)
        y_te = dropout(y_te, cfg.dropout, dropout_key)
        return x_td + y_te @ self.out_kernel[...] + self.out_bias[...]


class HSTU(SeqModel):
    """HSTU over a ``JaggedBatch``: ``model(values [T], offsets [B + 1]) -> [T, D]`` user
    embeddings (``sequential.layers.SeqModel``). ``impl``: the attention kernel's
    implementation (``auto``, ``xla``, ``pallas_gpu``, ``pallas_tpu``; ``KernelConfig``'s
    convention); ``engine``: the item table's storage (``SeqModel``)."""

    def __init__(
        self,
        cfg: HSTUConfig,
        *,
        impl: str = "auto",
        engine: EngineSpec | None = None,
        rngs: nnx.Rngs,
    ):
        super().__init__(cfg, rngs=rngs, engine=engine)
        self.layers = nnx.List(
            [HSTULayer(cfg, impl=impl, rngs=rngs) for _ in range(cfg.num_layers)]
        )

    def encode(
        self, x_td: jax.Array, offsets: jax.Array, tokens: Tokens, dropout_key: jax.Array | None
    ) -> jax.Array:
        del tokens  # the kernel finds each token's sequence from the offsets
        for i, layer in enumerate(self.layers):
            x_td = layer(x_td, offsets, dropout_key=fold(dropout_key, i))
        return x_td


def build_model(cfg, schema, rngs: nnx.Rngs) -> HSTU:
    """The trainer's hook (``recscale.families``): the HSTU of a run config
    (``sequential.run_config.HSTURunConfig``), its attention kernel from ``kernels``, its item
    table in the sharded engine unless ``embeddings.sharding`` is off."""
    del schema  # the item count is the config's (``sequential.source`` checks the data's)
    return HSTU(cfg.model, impl=cfg.kernels.hstu_attention, engine=engine_spec(cfg), rngs=rngs)
