"""The MaskNet network: MaskBlock against NumPy from the paper's equations, serial and parallel
structures, mask widths, config checks, FLOP accounting against the model and XLA, presets."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import baselines.masknet.presets  # noqa: F401
from baselines.masknet.config import MaskNetConfig, MaskNetModelConfig
from baselines.masknet.flops import masknet_cost
from baselines.masknet.model import FieldLayerNorm, MaskBlock, MaskNet, build_model
from data.batch import FeatureInfo, Schema
from recscale import sharding
from recscale.config import from_dict, get_preset, preset_names, to_dict
from recscale.embeddings.collection import EmbeddingTable
from tests.cost_analysis import xla_forward_flops

SCHEMA = Schema(
    dense_names=("a", "b", "c"),
    features=tuple(
        FeatureInfo(name=f"f{i}", vocab_size=20 + i, max_hotness=1 + i % 2) for i in range(4)
    ),
)
NO_DENSE = Schema(dense_names=(), features=SCHEMA.features)
D = 4
F = 3 + 4  # a field per dense feature + the sparse features
IN_DIM = F * D
SERIAL = MaskNetModelConfig(embed_dim=D, model_type="serial", dnn_hidden_units=(8, 6))
PARALLEL = MaskNetModelConfig(
    embed_dim=D,
    model_type="parallel",
    parallel_num_blocks=3,
    parallel_block_dim=5,
    dnn_hidden_units=(12, 7),
    reduction_ratio=2.0,
)


def _x(b=3, i=IN_DIM, seed=0):
    return np.random.default_rng(seed).normal(size=(b, i)).astype(np.float32)


def _inputs(b=6, schema=SCHEMA, seed=0):
    rng = np.random.default_rng(seed)
    dense = jnp.asarray(rng.normal(size=(b, schema.num_dense)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 20, size=(b, schema.num_sparse, 2)), jnp.int32)
    return dense, ids


def _randomize(module, seed=1):
    """Gives every parameter random values, so LayerNorm scales (ones) and biases (zeros) are
    exercised: a dropped or misplaced term then changes the output."""
    state = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    new = [jnp.asarray(rng.normal(size=x.shape) * 0.5, x.dtype) for x in leaves]
    nnx.update(module, jax.tree.unflatten(treedef, new))


def _ln(x, scale, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


def _np(v):
    return np.asarray(v[...], np.float64)


def _mask_block_reference(block, v_emb, v_hid):
    """The paper's equations, one example (column vector) at a time:
    V_mask = W_d2 ReLU(W_d1 V_emb + β_d1) + β_d2;  V_out = ReLU(LN(W_i (V_mask ⊙ V_hid)))."""
    w1, b1 = _np(block.mask.aggregation.kernel).T, _np(block.mask.aggregation.bias)
    w2, b2 = _np(block.mask.projection.kernel).T, _np(block.mask.projection.bias)
    wi = _np(block.kernel).T
    out = []
    for e, h in zip(v_emb.astype(np.float64), v_hid.astype(np.float64), strict=True):
        v_mask = w2 @ np.maximum(w1 @ e + b1, 0) + b2
        y = wi @ (v_mask * h)
        if block.norm is not None:
            y = _ln(y, _np(block.norm.scale), _np(block.norm.bias))
        out.append(np.maximum(y, 0))
    return np.stack(out)


@pytest.mark.parametrize("layer_norm", [True, False])
@pytest.mark.parametrize(("masked", "out", "ratio"), [(IN_DIM, 6, 1.0), (9, 5, 2.0), (8, 8, 0.5)])
def test_mask_block_matches_the_equations(layer_norm, masked, out, ratio):
    # masked = IN_DIM: a MaskBlock on the feature embedding; otherwise one on a MaskBlock.
    block = MaskBlock(
        IN_DIM,
        masked,
        out,
        reduction_ratio=ratio,
        layer_norm=layer_norm,
        dropout=0.0,
        rngs=nnx.Rngs(0),
    )
    _randomize(block)
    v_emb, v_hid = _x(seed=0), _x(i=masked, seed=1)
    got = np.asarray(block(jnp.asarray(v_emb), jnp.asarray(v_hid)))
    want = _mask_block_reference(block, v_emb, v_hid)
    assert got.shape == (3, out)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert (block.norm is not None) == layer_norm


def test_mask_block_has_no_linear_bias():
    block = MaskBlock(
        IN_DIM, 9, 5, reduction_ratio=1.0, layer_norm=True, dropout=0.0, rngs=nnx.Rngs(0)
    )
    count = sum(x.size for x in jax.tree.leaves(nnx.state(block, nnx.Param)))
    mask = IN_DIM * 9 + 9 + 9 * 9 + 9  # W_1, b_1 (A = 9), W_2, b_2
    assert count == mask + 9 * 5 + 2 * 5  # bias-free W, LayerNorm scale and bias


@pytest.mark.parametrize(
    ("ratio", "z", "want"), [(1.0, 28, 28), (2.0, 28, 56), (0.5, 9, 4), (1.5, 5, 7)]
)
def test_mask_reduction_widths(ratio, z, want):
    block = MaskBlock(
        IN_DIM, z, 3, reduction_ratio=ratio, layer_norm=True, dropout=0.0, rngs=nnx.Rngs(0)
    )
    assert block.mask.aggregation.kernel[...].shape == (IN_DIM, want)  # A = int(r · Z)
    assert block.mask.projection.kernel[...].shape == (want, z)


def test_reduction_leaving_no_units_is_an_error():
    with pytest.raises(ValueError, match="aggregation layer"):
        MaskBlock(IN_DIM, 4, 3, reduction_ratio=0.2, layer_norm=True, dropout=0.0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="aggregation layer"):
        masknet_cost(
            dataclasses.replace(SERIAL, dnn_hidden_units=(3, 2), reduction_ratio=0.3), SCHEMA
        )


def test_field_layer_norm_normalizes_each_field_with_its_own_parameters():
    norm = FieldLayerNorm(F, D)
    _randomize(norm)
    x = np.random.default_rng(0).normal(size=(2, F, D)).astype(np.float32)
    scale, bias = _np(norm.scale), _np(norm.bias)
    want = np.stack([_ln(x[:, f], scale[f], bias[f]) for f in range(F)], axis=1)
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), want, rtol=1e-4, atol=1e-4)


def _model_reference(model, dense, ids):
    """The whole network from the block reference, the field LayerNorm and numpy MLP layers."""
    emb = np.asarray(model.embed(dense, ids), np.float64)  # [B, F, D]
    b = emb.shape[0]
    v_emb = emb.reshape(b, -1)
    v_hid = v_emb
    if model.emb_norm is not None:
        scale, bias = _np(model.emb_norm.scale), _np(model.emb_norm.bias)
        v_hid = _ln(emb, scale, bias).reshape(b, -1)
    if model.cfg.model_type == "serial":
        h = v_hid
        for block in model.blocks:
            h = _mask_block_reference(block, v_emb, h)
    else:
        h = np.concatenate([_mask_block_reference(blk, v_emb, v_hid) for blk in model.blocks], 1)
        if model.mlp is not None:
            for layer in model.mlp.layers:
                h = np.maximum(h @ _np(layer.kernel) + _np(layer.bias), 0)
    return (h @ _np(model.logit.kernel) + _np(model.logit.bias))[:, 0]


@pytest.mark.parametrize("cfg", [SERIAL, PARALLEL], ids=["serial", "parallel"])
@pytest.mark.parametrize("emb_layernorm", [True, False])
def test_network_matches_reference(cfg, emb_layernorm):
    model = MaskNet(dataclasses.replace(cfg, emb_layernorm=emb_layernorm), SCHEMA, rngs=nnx.Rngs(0))
    _randomize(model)
    dense, ids = _inputs()
    got = np.asarray(model(dense, ids))
    np.testing.assert_allclose(got, _model_reference(model, dense, ids), rtol=1e-3, atol=1e-3)


def test_serial_shapes():
    model = MaskNet(SERIAL, SCHEMA, rngs=nnx.Rngs(0))
    assert model.in_dim == IN_DIM and model.mlp is None
    # Block 1 masks the embeddings (Z = I), block 2 the first block's output (Z = 8); every mask
    # reads V_emb.
    kernels = [blk.kernel[...].shape for blk in model.blocks]
    assert kernels == [(IN_DIM, 8), (8, 6)]
    assert [blk.mask.aggregation.kernel[...].shape for blk in model.blocks] == [
        (IN_DIM, IN_DIM),
        (IN_DIM, 8),
    ]
    assert [blk.mask.projection.kernel[...].shape[1] for blk in model.blocks] == [IN_DIM, 8]
    assert model.logit.kernel[...].shape == (6, 1)
    dense, ids = _inputs()
    logits = model(dense, ids)
    assert logits.shape == (6,) and np.all(np.isfinite(np.asarray(logits)))


def test_parallel_shapes():
    model = MaskNet(PARALLEL, SCHEMA, rngs=nnx.Rngs(0))
    assert len(model.blocks) == 3
    for blk in model.blocks:  # every block masks the embeddings
        assert blk.kernel[...].shape == (IN_DIM, 5)
        assert blk.mask.aggregation.kernel[...].shape == (IN_DIM, 2 * IN_DIM)
    dense, ids = _inputs()
    v = model.embed(dense, ids).reshape(6, -1)
    assert model.parallel(v, v, None).shape == (6, 15)
    assert [layer.kernel[...].shape for layer in model.mlp.layers] == [(15, 12), (12, 7)]
    assert model.logit.kernel[...].shape == (7, 1)
    assert model(dense, ids).shape == (6,)
    # No MLP: the logit reads the concatenated blocks.
    bare = MaskNet(dataclasses.replace(PARALLEL, dnn_hidden_units=()), SCHEMA, rngs=nnx.Rngs(0))
    assert bare.mlp is None and bare.logit.kernel[...].shape == (15, 1)
    assert np.all(np.isfinite(np.asarray(bare(dense, ids))))


def test_serial_and_parallel_differ():
    dense, ids = _inputs()
    a = MaskNet(dataclasses.replace(PARALLEL, model_type="serial"), SCHEMA, rngs=nnx.Rngs(0))
    b = MaskNet(PARALLEL, SCHEMA, rngs=nnx.Rngs(0))
    assert len(a.blocks) == 2 and len(b.blocks) == 3
    assert not np.allclose(np.asarray(a(dense, ids)), np.asarray(b(dense, ids)))


def test_dense_features_are_fields():
    model = MaskNet(SERIAL, SCHEMA, rngs=nnx.Rngs(0))
    dense, ids = _inputs(b=2)
    emb = np.asarray(model.embed(dense, ids))
    assert emb.shape == (2, F, D)
    want = np.asarray(dense)[:, :, None] * np.asarray(model.dense_embed[...])[None]
    np.testing.assert_allclose(emb[:, :3], want, rtol=1e-6)  # x_j · w_j
    np.testing.assert_array_equal(emb[:, 3:], np.asarray(model.embeddings(ids)))
    model = MaskNet(SERIAL, NO_DENSE, rngs=nnx.Rngs(0))
    assert model.dense_embed is None and model.in_dim == 4 * D
    assert model(jnp.zeros((2, 0)), ids).shape == (2,)


@pytest.mark.parametrize("cfg", [SERIAL, PARALLEL], ids=["serial", "parallel"])
def test_dropout_only_with_key(cfg):
    model = MaskNet(dataclasses.replace(cfg, net_dropout=0.5), SCHEMA, rngs=nnx.Rngs(0))
    dense, ids = _inputs()
    a, b = model(dense, ids), model(dense, ids)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c = model(dense, ids, dropout_key=jax.random.key(1))
    c2 = model(dense, ids, dropout_key=jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(c), np.asarray(c2))  # a function of the key
    assert not np.allclose(np.asarray(a), np.asarray(c))
    # Only parameters: the trainer rejects any other nnx state (no implicit RNG streams).
    _, _, rest = nnx.split(model, nnx.Param, ...)
    assert not jax.tree.leaves(rest)


def test_config_is_checked():
    with pytest.raises(ValueError, match="serial MaskNet needs"):
        MaskNetModelConfig(model_type="serial", dnn_hidden_units=())
    MaskNetModelConfig(model_type="parallel", dnn_hidden_units=())  # the logit on the blocks
    with pytest.raises(ValueError, match="model_type"):
        MaskNetModelConfig(model_type="stacked")
    with pytest.raises(ValueError, match="dnn_hidden_units"):
        MaskNetModelConfig(dnn_hidden_units=(8, 0))
    with pytest.raises(ValueError, match="parallel_num_blocks"):
        MaskNetModelConfig(parallel_num_blocks=0)
    with pytest.raises(ValueError, match="parallel_block_dim"):
        MaskNetModelConfig(parallel_block_dim=0)
    with pytest.raises(ValueError, match="reduction_ratio"):
        MaskNetModelConfig(reduction_ratio=0.0)
    with pytest.raises(ValueError, match="net_dropout"):
        MaskNetModelConfig(net_dropout=1.0)
    with pytest.raises(ValueError, match="embed_dim"):
        MaskNetModelConfig(embed_dim=0)
    with pytest.raises(TypeError):
        MaskNetModelConfig(num_blocks=3)


# ------------------------------------------------------------------------------------------------
# FLOPs and parameters (the conventions and tolerances of tests/recscale/test_flops.py).

# Frappe's shape: no dense features, 10 one-hot fields.
FRAPPE = Schema(
    dense_names=(), features=tuple(FeatureInfo(name=f"f{i}", vocab_size=37 + i) for i in range(10))
)


def _case(name):
    """(model config, schema) of a named cost case."""
    if name == "masknet/tiny":
        return get_preset(name).model, SCHEMA
    if name == "masknet/tiny-serial":
        return dataclasses.replace(get_preset("masknet/tiny").model, model_type="serial"), SCHEMA
    if name == "masknet/frappe-like":
        return get_preset("masknet/frappe").model, FRAPPE
    if name == "masknet/frappe-serial":
        cfg = dataclasses.replace(
            get_preset("masknet/frappe").model,
            model_type="serial",
            emb_layernorm=True,
            net_layernorm=False,
            dnn_hidden_units=(400, 400, 400),
            reduction_ratio=1.0,
        )
        return cfg, FRAPPE
    if name == "masknet/parallel-no-mlp":
        return dataclasses.replace(PARALLEL, dnn_hidden_units=()), SCHEMA
    raise KeyError(name)


CASES = [
    "masknet/tiny",
    "masknet/tiny-serial",
    "masknet/frappe-like",
    "masknet/frappe-serial",
    "masknet/parallel-no-mlp",
]


def _size(tree):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", CASES)
def test_param_counts_match_the_model(name):
    cfg, schema = _case(name)
    model = nnx.eval_shape(lambda: MaskNet(cfg, schema, rngs=nnx.Rngs(0)))
    dense = _size(nnx.state(model, nnx.All(nnx.Param, nnx.Not(EmbeddingTable))))
    tables = _size(nnx.state(model, EmbeddingTable))
    assert tables >= sum(f.vocab_size for f in schema.features) * cfg.embed_dim
    cost = masknet_cost(cfg, schema)
    assert cost.dense_params == dense, name
    assert cost.sparse_params == sum(f.vocab_size for f in schema.features) * cfg.embed_dim


def test_frappe_preset_dense_parameters_by_hand():
    # Per block: mask 100 -> 200 -> 100 with biases (20,200 + 20,100), bias-free 100 -> 50
    # (5,000), LayerNorm(50) (100); MLP 150 -> 400 -> 400 -> 400 and logit 400 -> 1 with biases.
    # (BARS MaskNet_frappe_x1 logs 571,691 parameters in all, tables included: 53,890 = 10 x 5,389
    # rows left for its Frappe_x1 tables, so FuxiCTR's network has the same dense size.)
    blocks = 3 * (20_200 + 20_100 + 5_000 + 100)
    mlp = 150 * 400 + 400 + 2 * (400 * 400 + 400) + 400 + 1
    cost = masknet_cost(get_preset("masknet/frappe").model, FRAPPE)
    assert cost.dense_params == blocks + mlp == 517_801


# The bounds of tests/recscale/test_flops.py: analytic counts are matmul-only, so XLA's count is
# higher by the elementwise share (mask products, LayerNorms, ReLUs, biases): 1.05 for the
# matmul-dominated Frappe-sized models, 1.35 for the tiny ones.
XLA_TOLERANCE = {"masknet/frappe-like": 1.05, "masknet/frappe-serial": 1.05}
XLA_TOLERANCE_TINY = 1.35


@pytest.mark.parametrize("name", CASES)
def test_forward_flops_match_xla(name):
    cfg, schema = _case(name)
    batch = 64
    want = masknet_cost(cfg, schema).forward_flops * batch
    got = xla_forward_flops(MaskNet(cfg, schema, rngs=nnx.Rngs(0)), schema, batch)
    ratio = got / want
    assert 1.0 <= ratio <= XLA_TOLERANCE.get(name, XLA_TOLERANCE_TINY), (
        f"{name}: XLA {got:.4g} vs analytic {want:.4g} (ratio {ratio:.3f})"
    )


def test_cost_conventions():
    cost = masknet_cost(SERIAL, SCHEMA)
    parts = dict(cost.components)
    # Masks: I -> A -> Z with A = Z (r = 1); masked linears I -> 8 -> 6; logit 6 -> 1.
    assert parts["mask"] == 2 * (IN_DIM * IN_DIM * 2) + 2 * (IN_DIM * 8 + 8 * 8)
    assert parts["mask_block_linear"] == 2 * (IN_DIM * 8 + 8 * 6)
    assert parts["logit"] == 2 * 6
    assert cost.forward_flops == sum(f for _, f in cost.components)
    pooled_rows = 1 + 2 + 1 + 2  # max_hotness per sparse feature
    assert cost.backward_flops == 2 * cost.forward_flops + pooled_rows * D
    assert cost.embedding_bytes_read == pooled_rows * D * 4
    par = dict(masknet_cost(PARALLEL, SCHEMA).components)
    assert par["mlp"] == 2 * (15 * 12 + 12 * 7)


# ------------------------------------------------------------------------------------------------
# Presets.


def _schema(cfg) -> Schema:
    if cfg.data.kind == "frappe":
        return Schema(
            dense_names=(),
            features=tuple(FeatureInfo(name=f"f{i}", vocab_size=100) for i in range(10)),
        )
    from data.synthetic import SyntheticGenerator

    return SyntheticGenerator(cfg.data.synthetic, seed=0).schema


MASKNET_PRESETS = preset_names("masknet/")


def test_preset_names():
    assert {"masknet/tiny", "masknet/frappe"} <= set(MASKNET_PRESETS)


@pytest.mark.parametrize("name", MASKNET_PRESETS)
def test_every_preset_builds(name):
    cfg = get_preset(name)
    assert isinstance(cfg, MaskNetConfig)
    assert from_dict(MaskNetConfig, to_dict(cfg)) == cfg  # what config.json round-trips
    schema = _schema(cfg)
    # Inside the preset's mesh: the sharded engine lays its tables out on it.
    with sharding.activate(sharding.make_mesh(cfg.mesh), cfg.mesh):
        model = nnx.eval_shape(lambda: build_model(cfg, schema, nnx.Rngs(0)))
    tables = _size(nnx.state(model, EmbeddingTable))
    dense = _size(nnx.state(model, nnx.All(nnx.Param, nnx.Not(EmbeddingTable))))
    # Tables may be padded to a multiple of the devices (row-sharded rules).
    assert tables >= sum(f.vocab_size for f in schema.features) * cfg.model.embed_dim
    assert dense == masknet_cost(cfg.model, schema).dense_params
    m = cfg.model
    want = len(m.dnn_hidden_units) if m.model_type == "serial" else m.parallel_num_blocks
    assert len(model.blocks) == want


def test_frappe_preset_is_the_bars_tuned_parallel_masknet():
    m = get_preset("masknet/frappe").model
    assert (m.model_type, m.parallel_num_blocks, m.parallel_block_dim) == ("parallel", 3, 50)
    assert (m.embed_dim, m.dnn_hidden_units, m.reduction_ratio) == (10, (400, 400, 400), 2.0)
    assert (m.emb_layernorm, m.net_layernorm, m.net_dropout) == (False, True, 0.1)


@pytest.mark.parametrize(
    "cfg",
    [
        dataclasses.replace(SERIAL, dnn_hidden_units=(8, 8, 8), net_dropout=0.3),
        dataclasses.replace(PARALLEL, net_dropout=0.3),
    ],
    ids=["serial", "parallel"],
)
def test_scanned_blocks_compute_the_unrolled_network(cfg):
    """``scan_layers``: a serial MaskNet's blocks 2..L (a parallel one's K blocks) stacked and
    run by a scan give the unrolled network's logits and gradients, dropout included, when they
    hold its weights."""
    plain = MaskNet(cfg, SCHEMA, rngs=nnx.Rngs(0))
    _randomize(plain)
    scanned = MaskNet(dataclasses.replace(cfg, scan_layers=True), SCHEMA, rngs=nnx.Rngs(1))
    first = 1 if cfg.model_type == "serial" else 0
    n = len(plain.blocks) - first
    assert len(scanned.blocks) == first and scanned.stack.kernel[...].shape[0] == n
    state = nnx.state(plain, nnx.Param)
    blocks = state.pop("blocks")
    stack = jax.tree.map(lambda *xs: jnp.stack(xs), *(blocks[first + i] for i in range(n)))
    state["stack"] = stack
    state["blocks"] = {i: blocks[i] for i in range(first)}
    nnx.update(scanned, state)
    dense, ids = _inputs()
    key = jax.random.key(7)

    def loss(model):
        return jnp.sum(model(dense, ids, dropout_key=key) ** 2)

    np.testing.assert_allclose(np.asarray(loss(scanned)), np.asarray(loss(plain)), rtol=1e-6)
    g_plain, g_scan = nnx.grad(loss)(plain), nnx.grad(loss)(scanned)
    want = jnp.stack([g_plain["blocks"][first + i]["kernel"][...] for i in range(n)])
    # the scan's rematerialised backward sums in another order: float32 rounding, measured
    # below 5e-6 of the largest gradient
    atol = 1e-5 * float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(g_scan["stack"]["kernel"][...], want, rtol=1e-5, atol=atol)


def test_scanning_a_serial_masknet_needs_equal_blocks():
    with pytest.raises(ValueError, match="dnn_hidden_units must be equal"):
        MaskNetModelConfig(model_type="serial", dnn_hidden_units=(8, 6), scan_layers=True)
