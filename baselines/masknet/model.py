"""The MaskNet network (Wang, She and Zhang, DLP-KDD 2021, "MaskNet: Introducing Feature-Wise
Multiplication to CTR Ranking Models by Instance-Guided Mask"), as in FuxiCTR's model_zoo/MaskNet.

    V_emb        = concat(e_1, ..., e_F)                                         [B, I]
    V_mask       = ReLU(V_emb W_1 + b_1) W_2 + b_2     instance-guided mask     [B, Z]
    MaskBlock(V_emb, V_hid) = dropout(ReLU(LN((V_mask ⊙ V_hid) W)))   W: [Z, O]   [B, O]
    serial:   h_1 = MaskBlock_1(V_emb, LN_EMB(V_emb)), h_k = MaskBlock_k(V_emb, h_{k-1}),
              logit = w · h_L + b
    parallel: h = concat_k MaskBlock_k(V_emb, LN_EMB(V_emb)), logit = w · MLP(h) + b

LN_EMB LayerNorms each field's embedding on its own (own scale and bias per field, as FuxiCTR);
the mask always reads the raw embeddings V_emb. Each mask's hidden (aggregation) layer has
A = int(r · Z) units (the paper's reduction ratio r = t / z). The MaskBlock's linear layer has no
bias (the paper's equations, FuxiCTR's ``bias=False``), its LayerNorm is optional
(``net_layernorm``). Rows are examples, so the paper's W x is x W here. A dense feature x_j
enters as one more field x_j · w_j (FuxiCTR's numeric-feature embedding, w_j: [D]).

Dimension glossary: ``B`` batch, ``N`` dense features, ``F`` fields (sparse features + N),
``H`` bag slots, ``D`` embedding dim, ``I`` = F·D width of V_emb, ``A`` mask aggregation width,
``Z`` width of the masked layer (I, or the previous block's output), ``O`` MaskBlock output width,
``K`` parallel blocks, ``M`` MLP output width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from baselines.masknet.config import MaskNetModelConfig
from baselines.masknet.flops import aggregation_width
from data.batch import Schema
from recscale import sharding
from recscale.embeddings.family_model import FamilyModel
from recscale.embeddings.layout import EngineSpec
from recscale.nn import MLP, LayerNorm, Linear, dropout, map_stacked, scan_stacked, stacked


def _fold(key: jax.Array | None, i: int) -> jax.Array | None:
    return None if key is None else jax.random.fold_in(key, i)


class InstanceGuidedMask(nnx.Module):
    """V_mask = ReLU(V_emb W_1 + b_1) W_2 + b_2: ``[B, I]`` -> ``[B, Z]`` through ``A`` units."""

    def __init__(self, in_dim: int, masked_dim: int, reduction_ratio: float, *, rngs: nnx.Rngs):
        width = aggregation_width(masked_dim, reduction_ratio)
        self.aggregation = Linear(in_dim, width, rngs=rngs)
        self.projection = Linear(width, masked_dim, rngs=rngs, parallel="row")

    def __call__(self, v_emb_bi: jax.Array) -> jax.Array:
        return self.projection(jax.nn.relu(self.aggregation(v_emb_bi)))


class FieldLayerNorm(nnx.Module):
    """LayerNorm of each field's ``D`` values with that field's own scale and bias (LN_EMB)."""

    def __init__(self, num_fields: int, dim: int, *, eps: float = 1e-5):
        self.scale = sharding.param(
            nnx.Param, jnp.ones((num_fields, dim), jnp.float32), "feature", "embed"
        )
        self.bias = sharding.param(
            nnx.Param, jnp.zeros((num_fields, dim), jnp.float32), "feature", "embed"
        )
        self.eps = eps

    def __call__(self, x_bfd: jax.Array) -> jax.Array:
        mean = x_bfd.mean(-1, keepdims=True)
        var = jnp.square(x_bfd - mean).mean(-1, keepdims=True)
        return (x_bfd - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]


class MaskBlock(nnx.Module):
    """dropout(ReLU(LN((mask(V_emb) ⊙ V_hid) W))): ``V_hid`` ``[B, Z]`` -> ``[B, O]``.

    On the feature embedding ``V_hid`` is LN_EMB(V_emb) (Z = I); on a MaskBlock it is the previous
    block's output.
    """

    def __init__(
        self,
        in_dim: int,
        masked_dim: int,
        out_dim: int,
        *,
        reduction_ratio: float,
        layer_norm: bool,
        dropout: float,
        rngs: nnx.Rngs,
    ):
        self.mask = InstanceGuidedMask(in_dim, masked_dim, reduction_ratio, rngs=rngs)
        # Bias-free, as the paper's V_output = ReLU(LN(W_i V_masked)) and FuxiCTR's bias=False;
        # same init scale as recscale.nn.Linear's kernels.
        std = (2.0 / (masked_dim + out_dim)) ** 0.5
        kernel = std * jax.random.normal(rngs.params(), (masked_dim, out_dim), jnp.float32)
        self.kernel = sharding.param(nnx.Param, kernel, None, "mlp")
        self.norm = LayerNorm(out_dim) if layer_norm else None
        self.dropout = dropout

    def __call__(
        self, v_emb_bi: jax.Array, v_hid_bz: jax.Array, *, dropout_key: jax.Array | None = None
    ) -> jax.Array:
        h_bo = (self.mask(v_emb_bi) * v_hid_bz) @ self.kernel[...]
        if self.norm is not None:
            h_bo = self.norm(h_bo)
        return dropout(jax.nn.relu(h_bo), self.dropout, dropout_key)


def num_fields(schema: Schema) -> int:
    """F: every sparse feature plus one field per dense feature."""
    return schema.num_sparse + schema.num_dense


class MaskNet(FamilyModel):
    def build_layers(
        self, cfg: MaskNetModelConfig, schema: Schema, *, engine: EngineSpec | None, rngs: nnx.Rngs
    ) -> None:
        d = cfg.embed_dim
        # FuxiCTR's numeric embedding: dense feature j is the field x_j · w_j.
        self.dense_embed = (
            sharding.param(
                nnx.Param,
                cfg.embedding_init_scale
                * jax.random.normal(rngs.params(), (schema.num_dense, d), jnp.float32),
                "feature",
                "embed",
            )
            if schema.num_dense
            else None
        )
        f = num_fields(schema)
        self.in_dim = f * d
        self.emb_norm = FieldLayerNorm(f, d) if cfg.emb_layernorm else None
        block = dict(
            reduction_ratio=cfg.reduction_ratio,
            layer_norm=cfg.net_layernorm,
            dropout=cfg.net_dropout,
            rngs=rngs,
        )
        stack = None  # scan_layers: the blocks that share a shape, stacked
        if cfg.model_type == "serial":
            dims = (self.in_dim, *cfg.dnn_hidden_units)
            pairs = list(zip(dims[:-1], dims[1:], strict=True))
            if cfg.scan_layers and len(pairs) > 1:
                z, o = pairs[1]
                stack = stacked(
                    lambda r: MaskBlock(self.in_dim, z, o, **{**block, "rngs": r}),
                    len(pairs) - 1,
                    rngs,
                )
                pairs = pairs[:1]
            self.blocks = nnx.List([MaskBlock(self.in_dim, z, o, **block) for z, o in pairs])
            self.mlp = None
            logit_in = dims[-1]
        else:
            k, o = cfg.parallel_num_blocks, cfg.parallel_block_dim
            if cfg.scan_layers:
                stack = stacked(
                    lambda r: MaskBlock(self.in_dim, self.in_dim, o, **{**block, "rngs": r}),
                    k,
                    rngs,
                )
            self.blocks = nnx.List(
                []
                if cfg.scan_layers
                else [MaskBlock(self.in_dim, self.in_dim, o, **block) for _ in range(k)]
            )
            # Dropout after every hidden layer, the last included (FuxiCTR's MLP_Block): an MLP
            # with a final ReLU plus one more dropout applied in ``parallel_mlp``.
            self.mlp = (
                MLP(
                    k * o, cfg.dnn_hidden_units, final_relu=True, dropout=cfg.net_dropout, rngs=rngs
                )
                if cfg.dnn_hidden_units
                else None
            )
            logit_in = cfg.dnn_hidden_units[-1] if cfg.dnn_hidden_units else k * o
        self.stack = stack
        self.logit = Linear(logit_in, 1, rngs=rngs)

    def embed(self, dense_bn: jax.Array, ids_bfh: jax.Array) -> jax.Array:
        """The field embeddings (dense fields first, then the sparse features), ``[B, F, D]``."""
        emb_bfd = self.embeddings(ids_bfh)
        if self.dense_embed is None:
            return emb_bfd
        dense_bnd = dense_bn.astype(emb_bfd.dtype)[:, :, None] * self.dense_embed[...]
        return jnp.concatenate([dense_bnd, emb_bfd], axis=1)

    def serial(
        self, v_emb_bi: jax.Array, v_hid_bi: jax.Array, dropout_key: jax.Array | None
    ) -> jax.Array:
        """The serial MaskNet's last block output, ``[B, O]``."""

        def step(block, h, i):
            h = block(v_emb_bi, h, dropout_key=_fold(dropout_key, i))
            return sharding.constrain(h, "batch", None)

        h = v_hid_bi
        for i, block in enumerate(self.blocks):
            h = step(block, h, i)
        if self.stack is not None:  # blocks 2..L, in a scan
            h = scan_stacked(self.stack, h, step, first=len(self.blocks))
        return h

    def parallel(
        self, v_emb_bi: jax.Array, v_hid_bi: jax.Array, dropout_key: jax.Array | None
    ) -> jax.Array:
        """The parallel MaskNet's concatenated block outputs, ``[B, K·O]``."""

        def one(block, i):
            return block(v_emb_bi, v_hid_bi, dropout_key=_fold(dropout_key, i))

        if self.stack is not None:  # the K blocks in a scan: [K, B, O] -> [B, K·O]
            outs_kbo = map_stacked(self.stack, one)
            h = jnp.transpose(outs_kbo, (1, 0, 2)).reshape(outs_kbo.shape[1], -1)
            return sharding.constrain(h, "batch", None)
        outs = [one(block, i) for i, block in enumerate(self.blocks)]
        return sharding.constrain(
            jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0], "batch", None
        )

    def parallel_mlp(self, h: jax.Array, dropout_key: jax.Array | None) -> jax.Array:
        """The parallel MaskNet's MLP, dropout after each hidden layer, ``[B, M]``."""
        if self.mlp is None:
            return h
        key = _fold(dropout_key, self.cfg.parallel_num_blocks)  # one past the blocks
        h_bm = self.mlp(h, dropout_key=key)  # final ReLU: every layer drops
        return sharding.constrain(h_bm, "batch", None)

    def __call__(
        self, dense_bn: jax.Array, ids_bfh: jax.Array, *, dropout_key: jax.Array | None = None
    ) -> jax.Array:
        """Logits ``[B]``."""
        emb_bfd = self.embed(dense_bn, ids_bfh)
        b = emb_bfd.shape[0]
        v_emb_bi = sharding.constrain(emb_bfd.reshape(b, -1), "batch", None)
        v_hid_bi = v_emb_bi
        if self.emb_norm is not None:
            v_hid_bi = sharding.constrain(self.emb_norm(emb_bfd).reshape(b, -1), "batch", None)
        if self.cfg.model_type == "serial":
            h = self.serial(v_emb_bi, v_hid_bi, dropout_key)
        else:
            h = self.parallel_mlp(self.parallel(v_emb_bi, v_hid_bi, dropout_key), dropout_key)
        return self.logit(h)[:, 0]


def build_model(cfg, schema: Schema, rngs: nnx.Rngs) -> MaskNet:
    """Trainer hook: the MaskNet of a MaskNetConfig for a dataset schema."""
    return MaskNet.from_config(cfg, schema, rngs)
