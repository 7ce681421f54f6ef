"""The DCNv2 network: cross layer against NumPy (full and low-rank), structures, presets build."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import baselines.dcnv2.presets  # noqa: F401
from baselines.dcnv2.config import DCNv2Config, DCNv2ModelConfig
from baselines.dcnv2.model import CrossLayer, DCNv2, build_model
from data.batch import FeatureInfo, Schema
from recscale import sharding
from recscale.config import from_dict, get_preset, preset_names, to_dict

SCHEMA = Schema(
    dense_names=("a", "b", "c"),
    features=tuple(
        FeatureInfo(name=f"f{i}", vocab_size=20 + i, max_hotness=1 + i % 2) for i in range(4)
    ),
)
CFG = DCNv2ModelConfig(embed_dim=4, num_cross_layers=2, deep_mlp=(8, 6))
IN_DIM = 3 + 4 * 4  # raw dense features + F * D


def _x(b=3, i=IN_DIM, seed=0):
    return np.random.default_rng(seed).normal(size=(b, i)).astype(np.float32)


def _perturb_bias(layer, seed=1):
    # A fresh bias is zero; give it values so the test would catch a dropped or misplaced b.
    layer.bias[...] = jnp.asarray(np.random.default_rng(seed).normal(size=layer.bias.shape))


@pytest.mark.parametrize("rank", [0, 3])
def test_cross_layer_matches_numpy(rank):
    layer = CrossLayer(IN_DIM, rank, rngs=nnx.Rngs(0))
    _perturb_bias(layer)
    x0, xl = _x(seed=0), _x(seed=1)
    if rank:
        assert layer.kernel is None
        u = np.asarray(layer.u[...]).T  # the paper's U: [I, R]
        v = np.asarray(layer.v[...])  # the paper's V: [I, R]
        assert u.shape == v.shape == (IN_DIM, rank)
        w = u @ v.T  # W = U Vᵀ, acting on column vectors
    else:
        w = np.asarray(layer.kernel[...]).T
        assert w.shape == (IN_DIM, IN_DIM)
    b = np.asarray(layer.bias[...])
    # x_{l+1} = x_0 ⊙ (W x_l + b) + x_l, one example (column vector) at a time.
    want = np.stack([x0[n] * (w @ xl[n] + b) + xl[n] for n in range(3)])
    got = np.asarray(layer(jnp.asarray(x0), jnp.asarray(xl)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_low_rank_has_fewer_parameters():
    def count(rank):
        layer = CrossLayer(IN_DIM, rank, rngs=nnx.Rngs(0))
        return sum(x.size for x in jax.tree.leaves(nnx.state(layer, nnx.Param)))

    assert count(0) == IN_DIM * IN_DIM + IN_DIM
    assert count(2) == 2 * 2 * IN_DIM + IN_DIM


def test_cross_network_matches_numpy():
    model = DCNv2(CFG, SCHEMA, rngs=nnx.Rngs(0))
    for layer in model.cross:
        _perturb_bias(layer)
    x0 = _x()
    x = x0
    for layer in model.cross:
        w, b = np.asarray(layer.kernel[...]), np.asarray(layer.bias[...])
        x = x0 * (x @ w + b) + x
    got = np.asarray(model.cross_network(jnp.asarray(x0)))
    np.testing.assert_allclose(got, x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("structure", "num_cross", "deep", "logit_in"),
    [
        ("stacked", 2, (8, 6), 6),  # cross -> deep -> logit
        ("parallel", 2, (8, 6), IN_DIM + 6),  # [cross, deep] -> logit
        ("stacked", 2, (), IN_DIM),  # cross network only
        ("parallel", 0, (8, 6), 6),  # deep network only
    ],
)
def test_structures_shapes_and_finite(structure, num_cross, deep, logit_in):
    cfg = dataclasses.replace(CFG, structure=structure, num_cross_layers=num_cross, deep_mlp=deep)
    model = DCNv2(cfg, SCHEMA, rngs=nnx.Rngs(0))
    dense, ids = jnp.ones((6, 3)), jnp.zeros((6, 4, 2), jnp.int32)
    assert model.embed(dense, ids).shape == (6, IN_DIM)
    assert len(model.cross) == num_cross
    assert model.logit.kernel[...].shape == (logit_in, 1)
    if deep:
        # Stacked: the deep MLP reads the cross network's output, of x_0's width either way.
        assert model.deep.layers[0].kernel[...].shape == (IN_DIM, deep[0])
    logits = model(dense, ids)
    assert logits.shape == (6,)
    assert np.all(np.isfinite(np.asarray(logits)))


def test_stacked_and_parallel_differ():
    dense = jnp.asarray(_x(b=6, i=3))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 20, size=(6, 4, 2)), jnp.int32)
    a = DCNv2(dataclasses.replace(CFG, structure="stacked"), SCHEMA, rngs=nnx.Rngs(0))
    b = DCNv2(dataclasses.replace(CFG, structure="parallel"), SCHEMA, rngs=nnx.Rngs(0))
    assert not np.allclose(np.asarray(a(dense, ids)), np.asarray(b(dense, ids)))


def test_dense_features_pass_through_or_mlp():
    model = DCNv2(CFG, SCHEMA, rngs=nnx.Rngs(0))
    dense = jnp.asarray(_x(b=2, i=3))
    ids = jnp.zeros((2, 4, 2), jnp.int32)
    x0 = np.asarray(model.embed(dense, ids))
    np.testing.assert_array_equal(x0[:, :3], np.asarray(dense))  # the paper: fed as they are
    model = DCNv2(dataclasses.replace(CFG, dense_mlp=(7, 5)), SCHEMA, rngs=nnx.Rngs(0))
    assert model.embed(dense, ids).shape == (2, 5 + 16)
    no_dense = Schema(dense_names=(), features=SCHEMA.features)
    model = DCNv2(CFG, no_dense, rngs=nnx.Rngs(0))
    assert model(jnp.zeros((2, 0)), ids).shape == (2,)
    with pytest.raises(ValueError, match="no dense features"):
        DCNv2(dataclasses.replace(CFG, dense_mlp=(4,)), no_dense, rngs=nnx.Rngs(0))


def test_dropout_only_with_key():
    model = DCNv2(dataclasses.replace(CFG, dropout=0.5), SCHEMA, rngs=nnx.Rngs(0))
    dense, ids = jnp.ones((6, 3)), jnp.zeros((6, 4, 2), jnp.int32)
    a, b = model(dense, ids), model(dense, ids)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c = model(dense, ids, dropout_key=jax.random.key(1))
    assert not np.allclose(np.asarray(a), np.asarray(c))


def test_config_is_checked():
    with pytest.raises(ValueError, match="num_cross_layers"):
        DCNv2ModelConfig(num_cross_layers=0, deep_mlp=())
    with pytest.raises(ValueError, match="cross_rank"):
        DCNv2ModelConfig(cross_rank=-1)
    with pytest.raises(ValueError, match="dropout"):
        DCNv2ModelConfig(dropout=1.0)
    with pytest.raises(TypeError):
        DCNv2ModelConfig(num_cross_layer=3)


def _schema(cfg) -> Schema:
    if cfg.data.kind == "frappe":
        return Schema(
            dense_names=(),
            features=tuple(FeatureInfo(name=f"f{i}", vocab_size=100) for i in range(10)),
        )
    from data.synthetic import SyntheticGenerator

    return SyntheticGenerator(cfg.data.synthetic, seed=0).schema


DCNV2_PRESETS = preset_names("dcnv2/")


def test_preset_names():
    assert {"dcnv2/tiny", "dcnv2/frappe"} <= set(DCNV2_PRESETS)


@pytest.mark.parametrize("name", DCNV2_PRESETS)
def test_every_preset_builds(name):
    cfg = get_preset(name)
    assert isinstance(cfg, DCNv2Config)
    assert from_dict(DCNv2Config, to_dict(cfg)) == cfg  # what config.json round-trips
    schema = _schema(cfg)
    # Inside the preset's mesh: a preset with the sharded engine lays its tables out on it.
    with sharding.activate(sharding.make_mesh(cfg.mesh), cfg.mesh):
        model = nnx.eval_shape(lambda: build_model(cfg, schema, nnx.Rngs(0)))
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    tables = sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model.embeddings, nnx.Param))
    )
    # Tables may be padded to a multiple of the devices (row-sharded rules).
    assert tables >= sum(f.vocab_size for f in schema.features) * cfg.model.embed_dim
    assert total > tables
    assert len(model.cross) == cfg.model.num_cross_layers


# FLOPs and parameters (the conventions and tolerances of tests/recscale/test_flops.py).

FRAPPE = Schema(
    dense_names=(), features=tuple(FeatureInfo(name=f"f{i}", vocab_size=37 + i) for i in range(10))
)
COST_CASES = {
    "dcnv2/tiny": (lambda: get_preset("dcnv2/tiny").model, SCHEMA),
    "dcnv2/frappe-like": (lambda: get_preset("dcnv2/frappe").model, FRAPPE),
    "dcnv2/stacked-low-rank": (
        lambda: dataclasses.replace(CFG, structure="stacked", cross_rank=3),
        SCHEMA,
    ),
    "dcnv2/batch-norm-dense-mlp": (
        lambda: dataclasses.replace(CFG, batch_norm=True, dense_mlp=(5,)),
        SCHEMA,
    ),
    "dcnv2/cross-only": (lambda: dataclasses.replace(CFG, deep_mlp=()), SCHEMA),
}


@pytest.mark.parametrize("name", sorted(COST_CASES))
def test_param_counts_match_the_model(name):
    from baselines.dcnv2.flops import dcnv2_cost
    from recscale.embeddings import EmbeddingTable

    make_cfg, schema = COST_CASES[name]
    cfg = make_cfg()
    model = nnx.eval_shape(lambda: DCNv2(cfg, schema, rngs=nnx.Rngs(0)))
    size = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))  # noqa: E731
    cost = dcnv2_cost(cfg, schema)
    assert cost.dense_params == size(nnx.state(model, nnx.All(nnx.Param, nnx.Not(EmbeddingTable))))
    assert cost.sparse_params == sum(f.vocab_size for f in schema.features) * cfg.embed_dim


# XLA counts bias adds, ReLUs, the x_0 ⊙ products and the pooling on top of the matmuls:
# measured XLA/analytic at B=64 (jax 0.10, CPU) 1.005 for the Frappe-sized model and
# 1.14-1.28 for the tiny ones; bounds as tests/recscale/test_flops.py.
@pytest.mark.parametrize("name", sorted(COST_CASES))
def test_forward_flops_match_xla(name):
    from baselines.dcnv2.flops import dcnv2_cost
    from tests.cost_analysis import xla_forward_flops

    make_cfg, schema = COST_CASES[name]
    cfg = make_cfg()
    want = dcnv2_cost(cfg, schema).forward_flops * 64
    got = xla_forward_flops(DCNv2(cfg, schema, rngs=nnx.Rngs(0)), schema, 64)
    ratio = got / want
    assert 1.0 <= ratio <= (1.05 if name == "dcnv2/frappe-like" else 1.35), (
        f"{name}: ratio {ratio:.3f}"
    )


def test_cost_conventions():
    from baselines.dcnv2.flops import dcnv2_cost

    parts = dict(dcnv2_cost(CFG, SCHEMA).components)
    assert parts["cross"] == 2 * 2 * IN_DIM * IN_DIM
    assert parts["deep_mlp"] == 2 * (IN_DIM * 8 + 8 * 6)
    assert parts["logit"] == 2 * (IN_DIM + 6)  # parallel: cross output and deep output
    low = dict(dcnv2_cost(dataclasses.replace(CFG, cross_rank=3), SCHEMA).components)
    assert low["cross"] == 2 * 4 * IN_DIM * 3


def test_criteo_terabyte_preset_matches_the_wukong_papers_table3_dcnv2():
    import wukong.presets  # noqa: F401
    from data.criteo.reader import criteo_schema

    cfg = get_preset("dcnv2/criteo-terabyte")
    schema = criteo_schema(cfg.data.criteo.vocab_sizes)
    cost = cfg.model.cost(schema)
    # Paper Table 3 (Criteo): 26,179,364,097 parameters, 262.35 MFLOP/example (training FLOPs).
    assert abs(cost.params - 26_179_364_097) / 26_179_364_097 < 1e-6
    assert abs(cost.train_flops / 1e6 - 262.35) / 262.35 < 1e-3
    # The same data, optimizers and schedule as the paper's Wukong Criteo TB setup.
    wk = get_preset("wukong/criteo-terabyte")
    assert (cfg.data, cfg.dense_optim, cfg.embedding_optim, cfg.train) == (
        wk.data,
        wk.dense_optim,
        wk.embedding_optim,
        wk.train,
    )


@pytest.mark.parametrize("rank", [0, 3])
def test_scanned_cross_layers_compute_the_unrolled_network(rank):
    """``scan_layers``: the cross layers stacked and run by a scan give the unrolled network's
    logits and gradients when they hold its weights."""
    cfg = dataclasses.replace(CFG, num_cross_layers=3, cross_rank=rank, structure="stacked")
    plain = DCNv2(cfg, SCHEMA, rngs=nnx.Rngs(0))
    for layer in plain.cross:
        _perturb_bias(layer)
    scanned = DCNv2(dataclasses.replace(cfg, scan_layers=True), SCHEMA, rngs=nnx.Rngs(1))
    assert scanned.cross.bias[...].shape == (3, IN_DIM)
    state = nnx.state(plain)
    cross = state.pop("cross")
    stack = jax.tree.map(lambda *xs: jnp.stack(xs), *(cross[i] for i in range(3)))
    nnx.update(scanned, {**state, "cross": stack})
    dense = jax.random.normal(jax.random.key(2), (5, 3))
    ids = jax.random.randint(jax.random.key(3), (5, 4, 2), 0, 20)

    def loss(model):
        return jnp.sum(model(dense, ids) ** 2)

    np.testing.assert_allclose(np.asarray(loss(scanned)), np.asarray(loss(plain)), rtol=1e-6)
    g_plain, g_scan = nnx.grad(loss)(plain), nnx.grad(loss)(scanned)
    want = jnp.stack([g_plain["cross"][i]["bias"][...] for i in range(3)])
    np.testing.assert_allclose(g_scan["cross"]["bias"][...], want, rtol=1e-5, atol=1e-7)
