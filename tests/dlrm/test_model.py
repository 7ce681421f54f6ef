"""The DLRM network: interaction against NumPy, shapes, every preset builds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlrm.presets  # noqa: F401
from data.batch import FeatureInfo, Schema
from data.criteo.reader import criteo_schema
from dlrm.config import DLRMModelConfig
from dlrm.model import DLRM, build_model
from recscale import sharding
from recscale.config import get_preset, preset_names

SCHEMA = Schema(
    dense_names=("a", "b", "c"),
    features=tuple(
        FeatureInfo(name=f"f{i}", vocab_size=20 + i, max_hotness=1 + i % 2) for i in range(4)
    ),
)


@pytest.mark.parametrize("self_interaction", [False, True])
def test_dot_interaction_matches_numpy(self_interaction):
    cfg = DLRMModelConfig(
        embed_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1), self_interaction=self_interaction
    )
    model = DLRM(cfg, SCHEMA, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(3, 5, 4)).astype(np.float32)
    got = np.asarray(model.interact(jnp.asarray(x)))
    want = []
    for b in range(3):
        z = x[b] @ x[b].T
        want.append([z[i, j] for i in range(5) for j in range(i + (1 if self_interaction else 0))])
    np.testing.assert_allclose(got, np.array(want), rtol=1e-5, atol=1e-6)
    assert got.shape[1] == (15 if self_interaction else 10)


@pytest.mark.parametrize("interaction", ["dot", "cat"])
def test_forward_shapes_and_finite(interaction):
    cfg = DLRMModelConfig(embed_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1), interaction=interaction)
    model = DLRM(cfg, SCHEMA, rngs=nnx.Rngs(0))
    b = SCHEMA.empty_batch(6)
    ids = np.zeros_like(b.ids_bfh)
    logits = model(jnp.ones((6, 3)), jnp.asarray(ids))
    assert logits.shape == (6,)
    assert np.all(np.isfinite(np.asarray(logits)))


def test_dropout_only_with_key():
    cfg = DLRMModelConfig(embed_dim=4, bottom_mlp=(8, 4), top_mlp=(32, 1), dropout=0.5)
    model = DLRM(cfg, SCHEMA, rngs=nnx.Rngs(0))
    dense, ids = jnp.ones((6, 3)), jnp.zeros((6, 4, 2), jnp.int32)
    a, b = model(dense, ids), model(dense, ids)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c = model(dense, ids, dropout_key=jax.random.key(1))
    assert not np.allclose(np.asarray(a), np.asarray(c))


def test_no_dense_features_uses_embeddings_only():
    schema = Schema(dense_names=(), features=SCHEMA.features)
    model = DLRM(
        DLRMModelConfig(embed_dim=4, bottom_mlp=(), top_mlp=(8, 1)), schema, rngs=nnx.Rngs(0)
    )
    assert model.bottom is None
    assert model(jnp.zeros((2, 0)), jnp.zeros((2, 4, 2), jnp.int32)).shape == (2,)


@pytest.mark.parametrize("name", preset_names("dlrm/"))
def test_every_preset_builds(name):
    cfg = get_preset(name)
    if cfg.data.kind == "criteo":
        schema = criteo_schema(cfg.data.criteo.vocab_sizes)
    elif cfg.data.kind == "frappe":
        schema = Schema(
            dense_names=(),
            features=tuple(FeatureInfo(name=f"f{i}", vocab_size=100) for i in range(10)),
        )
    else:
        from data.synthetic import SyntheticGenerator

        schema = SyntheticGenerator(cfg.data.synthetic, seed=0).schema
    # Abstract build: the Criteo presets have billions of parameters.
    # Inside the preset's mesh: a preset with the sharded engine lays its tables out on it.
    with sharding.activate(sharding.make_mesh(cfg.mesh), cfg.mesh):
        model = nnx.eval_shape(lambda: build_model(cfg, schema, nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    emb_rows = sum(f.vocab_size for f in schema.features)
    assert n > emb_rows * cfg.model.embed_dim


def test_dot_concat_all_feeds_every_vector_to_the_top_mlp():
    cfg = DLRMModelConfig(embed_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1), dot_concat="all")
    model = DLRM(cfg, SCHEMA, rngs=nnx.Rngs(0))
    # 5 vectors (dense + 4 features): 10 pairwise dots + 5 * 4 flattened values.
    assert model.top.layers[0].kernel[...].shape == (30, 8)
    logits = model(jnp.ones((2, 3)), jnp.zeros((2, 4, 2), jnp.int32))
    assert logits.shape == (2,)
