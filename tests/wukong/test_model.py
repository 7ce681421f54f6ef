"""The Wukong network: FMB, LCB and layer against NumPy, shapes, every preset builds."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import wukong.presets  # noqa: F401
from data.batch import FeatureInfo, Schema
from data.criteo.reader import criteo_schema
from recscale import sharding
from recscale.config import from_dict, get_preset, preset_names, to_dict
from wukong.config import WukongConfig, WukongModelConfig
from wukong.model import FactorizationMachineBlock, Wukong, WukongLayer, build_model
from wukong.presets import TABLE5

SCHEMA = Schema(
    dense_names=("a", "b", "c"),
    features=tuple(
        FeatureInfo(name=f"f{i}", vocab_size=20 + i, max_hotness=1 + i % 2) for i in range(4)
    ),
)
CFG = WukongModelConfig(
    embed_dim=4,
    dense_mlp=(8,),
    num_layers=2,
    n_fmb=3,
    n_lcb=2,
    fmb_rank=3,
    fmb_mlp_width=8,
    fmb_mlp_depth=1,
    attentive_mlp=(8,),
    top_mlp=(8, 1),
)


def _x(b=3, e=5, d=4, seed=0):
    return np.random.default_rng(seed).normal(size=(b, e, d)).astype(np.float32)


def _layer_norm(x):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)


def test_fmb_optimized_fm_matches_numpy():
    fmb = FactorizationMachineBlock(5, CFG, rngs=nnx.Rngs(0))
    x = _x()
    y_ek = np.asarray(fmb.projection[...])
    assert y_ek.shape == (5, 3)
    got = np.asarray(fmb.interact(jnp.asarray(x)))
    # The paper's FM (X Xᵀ) projected by Y: the optimized X (Xᵀ Y) must equal (X Xᵀ) Y.
    want = np.stack([(x[b] @ x[b].T) @ y_ek for b in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    out = fmb(jnp.asarray(x))
    assert out.shape == (3, CFG.n_fmb, CFG.embed_dim)


def test_attentive_projection_depends_on_each_example():
    cfg = dataclasses.replace(CFG, fmb_projection="attentive")
    fmb = FactorizationMachineBlock(5, cfg, rngs=nnx.Rngs(0))
    assert fmb.projection is None
    x = _x()
    y_bek = np.asarray(fmb.projection_y(jnp.asarray(x)))
    assert y_bek.shape == (3, 5, 3)
    assert not np.allclose(y_bek[0], y_bek[1])
    # Y of an example depends only on that example.
    y0 = np.asarray(fmb.projection_y(jnp.asarray(x[:1])))
    np.testing.assert_allclose(y0[0], y_bek[0], rtol=1e-5, atol=1e-6)
    got = np.asarray(fmb.interact(jnp.asarray(x)))
    want = np.stack([x[b] @ (x[b].T @ y_bek[b]) for b in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer_norm", ["embedding", "flattened"])
@pytest.mark.parametrize(("num_in", "n_fmb", "n_lcb"), [(5, 3, 2), (7, 3, 2), (5, 4, 4)])
def test_layer_matches_numpy(num_in, n_fmb, n_lcb, layer_norm):
    cfg = dataclasses.replace(CFG, n_fmb=n_fmb, n_lcb=n_lcb, layer_norm=layer_norm)
    layer = WukongLayer(num_in, cfg, rngs=nnx.Rngs(1))
    x = _x(e=num_in)
    out = np.asarray(layer(jnp.asarray(x)))
    assert out.shape == (3, n_fmb + n_lcb, 4)

    # The residual is projected iff the embedding count changes.
    assert (layer.residual is None) == (num_in == n_fmb + n_lcb)
    w_lcb = np.asarray(layer.lcb[...])
    assert w_lcb.shape == (n_lcb, num_in)
    lcb = np.stack([w_lcb @ x[b] for b in range(3)])
    np.testing.assert_allclose(np.einsum("ce,bed->bcd", w_lcb, x), lcb, rtol=1e-6)
    residual = (
        x
        if layer.residual is None
        else np.stack([np.asarray(layer.residual[...]) @ x[b] for b in range(3)])
    )
    fmb = np.asarray(layer.fmb(jnp.asarray(x)))
    pre = np.concatenate([fmb, lcb], axis=1) + residual
    if layer_norm == "embedding":
        want = _layer_norm(pre)
    else:
        want = _layer_norm(pre.reshape(3, -1)).reshape(pre.shape)
    # Fresh LayerNorm: scale 1, bias 0.
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_layer_with_only_lcb_or_only_fmb():
    for n_fmb, n_lcb in ((0, 5), (5, 0)):
        layer = WukongLayer(5, dataclasses.replace(CFG, n_fmb=n_fmb, n_lcb=n_lcb), rngs=nnx.Rngs(0))
        assert (layer.fmb is None) == (n_fmb == 0) and (layer.lcb is None) == (n_lcb == 0)
        assert layer(jnp.asarray(_x())).shape == (3, 5, 4)


@pytest.mark.parametrize("projection", ["learned", "attentive"])
def test_forward_shapes_and_finite(projection):
    model = Wukong(dataclasses.replace(CFG, fmb_projection=projection), SCHEMA, rngs=nnx.Rngs(0))
    dense, ids = jnp.ones((6, 3)), jnp.zeros((6, 4, 2), jnp.int32)
    assert model.embed(dense, ids).shape == (6, 4 + 1, 4)
    # First layer maps 5 embeddings to n_F + n_L = 5 (identity residual); the top MLP reads 5 x d.
    assert model.layers[0].residual is None
    assert model.top.layers[0].kernel[...].shape == (5 * 4, 8)
    logits = model(dense, ids)
    assert logits.shape == (6,)
    assert np.all(np.isfinite(np.asarray(logits)))


def test_number_of_dense_embeddings():
    model = Wukong(dataclasses.replace(CFG, num_dense_embeddings=3), SCHEMA, rngs=nnx.Rngs(0))
    x = model.embed(jnp.ones((2, 3)), jnp.zeros((2, 4, 2), jnp.int32))
    assert x.shape == (2, 3 + 4, 4)
    assert model.layers[0].residual[...].shape == (5, 7)
    no_dense = Schema(dense_names=(), features=SCHEMA.features)
    model = Wukong(CFG, no_dense, rngs=nnx.Rngs(0))
    assert model.dense is None
    assert model(jnp.zeros((2, 0)), jnp.zeros((2, 4, 2), jnp.int32)).shape == (2,)
    with pytest.raises(ValueError, match="no dense features"):
        Wukong(dataclasses.replace(CFG, num_dense_embeddings=2), no_dense, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="ignore"):
        Wukong(dataclasses.replace(CFG, num_dense_embeddings=0), SCHEMA, rngs=nnx.Rngs(0))


def test_dropout_only_with_key():
    model = Wukong(dataclasses.replace(CFG, dropout=0.5, fmb_dropout=0.5), SCHEMA, rngs=nnx.Rngs(0))
    dense, ids = jnp.ones((6, 3)), jnp.zeros((6, 4, 2), jnp.int32)
    a, b = model(dense, ids), model(dense, ids)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c = model(dense, ids, dropout_key=jax.random.key(1))
    assert not np.allclose(np.asarray(a), np.asarray(c))


def test_config_is_checked():
    with pytest.raises(ValueError, match="top_mlp"):
        WukongModelConfig(top_mlp=(8, 2))
    with pytest.raises(ValueError, match="n_fmb"):
        WukongModelConfig(n_fmb=0, n_lcb=0)
    with pytest.raises(TypeError):
        WukongModelConfig(num_layer=3)


def _schema(cfg) -> Schema:
    if cfg.data.kind == "criteo":
        return criteo_schema(cfg.data.criteo.vocab_sizes)
    if cfg.data.kind == "frappe":
        return Schema(
            dense_names=(),
            features=tuple(FeatureInfo(name=f"f{i}", vocab_size=100) for i in range(10)),
        )
    from data.synthetic import SyntheticGenerator

    return SyntheticGenerator(cfg.data.synthetic, seed=0).schema


def _param_counts(cfg) -> tuple[int, int]:
    """(all parameters, parameters outside the embedding tables), from an abstract build."""
    schema = _schema(cfg)
    # Inside the preset's mesh: a preset with the sharded engine lays its tables out on it.
    with sharding.activate(sharding.make_mesh(cfg.mesh), cfg.mesh):
        model = nnx.eval_shape(lambda: build_model(cfg, schema, nnx.Rngs(0)))
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    tables = sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model.embeddings, nnx.Param))
    )
    return total, total - tables


WUKONG_PRESETS = preset_names("wukong/")


def test_preset_names():
    assert {"wukong/tiny", "wukong/synthetic", "wukong/frappe", "wukong/criteo-terabyte"} <= set(
        WUKONG_PRESETS
    )
    assert {f"wukong/table5-{i}" for i in range(1, 8)} <= set(WUKONG_PRESETS)


@pytest.mark.parametrize("name", WUKONG_PRESETS)
def test_every_preset_builds(name):
    cfg = get_preset(name)
    assert isinstance(cfg, WukongConfig)
    assert from_dict(WukongConfig, to_dict(cfg)) == cfg  # what config.json round-trips
    total, dense = _param_counts(cfg)
    schema = _schema(cfg)
    assert total - dense >= sum(f.vocab_size for f in schema.features) * cfg.model.embed_dim
    assert dense > 0


def test_table5_rows_grow_monotonically():
    rows = [get_preset(f"wukong/table5-{i}") for i in range(1, 8)]
    first, last = rows[0].model, rows[-1].model
    assert (first.num_layers, first.n_fmb, first.n_lcb, first.fmb_rank) == (2, 8, 8, 24)
    assert (first.fmb_mlp_depth, first.fmb_mlp_width) == (3, 2048)
    assert (last.num_layers, last.n_fmb, last.n_lcb, last.fmb_rank) == (8, 192, 192, 192)
    assert (last.fmb_mlp_depth, last.fmb_mlp_width) == (3, 16384)
    assert len(TABLE5) == 7
    counts = [_param_counts(cfg)[1] for cfg in rows]
    assert all(a < b for a, b in zip(counts, counts[1:], strict=False)), counts


def test_scanned_layers_compute_the_unrolled_network():
    """``scan_layers``: layers 2..l stacked and run by a scan give the unrolled network's logits
    and gradients when they hold its weights (dropout included: each layer's key is the one the
    unrolled form gives it); the stacked arrays carry the ``layers`` axis; batch_norm refused."""
    cfg = dataclasses.replace(CFG, num_layers=4, fmb_dropout=0.3, dropout=0.2)
    plain = Wukong(cfg, SCHEMA, rngs=nnx.Rngs(0))
    scanned = Wukong(dataclasses.replace(cfg, scan_layers=True), SCHEMA, rngs=nnx.Rngs(1))
    assert len(scanned.layers) == 1 and scanned.stack.lcb[...].shape == (3, 2, 5)
    assert scanned.stack.lcb.get_metadata()["logical_axes"] == ("layers", None, "feature")
    # The unrolled weights, layers 2..4 stacked, into the scanned model
    state = nnx.state(plain)
    layers = state.pop("layers")
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(layers[i] for i in (1, 2, 3)))
    nnx.update(scanned, {**state, "layers": {0: layers[0]}, "stack": stacked})
    dense = jax.random.normal(jax.random.key(2), (6, 3))
    ids = jax.random.randint(jax.random.key(3), (6, 4, 2), 0, 20)
    key = jax.random.key(4)

    def loss(model):
        return jnp.sum(model(dense, ids, dropout_key=key) ** 2)

    want, got = loss(plain), loss(scanned)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    g_plain, g_scan = nnx.grad(loss)(plain), nnx.grad(loss)(scanned)
    g_layers = g_plain.pop("layers")
    np.testing.assert_allclose(
        g_scan["stack"]["lcb"][...],
        jnp.stack([g_layers[i]["lcb"][...] for i in (1, 2, 3)]),
        rtol=1e-5,
        atol=1e-7,
    )
    np.testing.assert_allclose(
        g_scan["top"]["layers"][0]["kernel"][...],
        g_plain["top"]["layers"][0]["kernel"][...],
        rtol=1e-5,
        atol=1e-7,
    )
    with pytest.raises(ValueError, match="scan_layers: not with batch_norm"):
        WukongModelConfig(scan_layers=True, batch_norm=True)
