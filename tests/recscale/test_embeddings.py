"""Pooled multi-hot lookups against a NumPy reference; specs; sharded tables."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recscale import sharding
from recscale.config import MeshConfig
from recscale.embeddings import EmbeddingCollection, EmbeddingTable, FeatureSpec, TableSpec


def _reference(tables, feats, ids_bfh):
    out = []
    for f, feat in enumerate(feats):
        t = tables[feat.table]
        rows = []
        for b in range(ids_bfh.shape[0]):
            bag = [i for i in ids_bfh[b, f, : feat.max_hotness] if i >= 0]
            v = np.zeros(t.shape[1], np.float64)
            for i in bag:
                v += t[i]
            if feat.pooling == "mean" and bag:
                v /= len(bag)
            rows.append(v)
        out.append(np.stack(rows))
    return out


def _collection():
    tables = (
        TableSpec(name="a", num_rows=10, dim=4),
        TableSpec(name="b", num_rows=7, dim=4, init="normal", init_scale=0.5),
    )
    feats = (
        FeatureSpec(name="x", table="a", max_hotness=3, pooling="sum"),
        FeatureSpec(name="y", table="b", max_hotness=2, pooling="mean"),
        FeatureSpec(name="z", table="a", max_hotness=1),  # shares table a
    )
    return tables, feats


def test_lookup_matches_numpy_with_padding_and_shared_tables():
    tables, feats = _collection()
    coll = EmbeddingCollection(tables, feats, rngs=nnx.Rngs(0))
    ids = np.array(
        [
            [[1, 2, 2], [0, 6, -1], [9, -1, -1]],
            [[-1, -1, -1], [-1, -1, -1], [0, -1, -1]],  # empty bags pool to zero
            [[3, -1, -1], [5, -1, -1], [-1, -1, -1]],
        ],
        np.int32,
    )
    got = coll.lookup(jnp.asarray(ids))
    np_tables = {k: np.asarray(v[...]) for k, v in coll.tables.items()}
    want = _reference(np_tables, feats, ids)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-7)
    stacked = coll(jnp.asarray(ids))
    assert stacked.shape == (3, 3, 4)
    assert np.all(np.asarray(stacked[1, :2]) == 0)


def test_tables_are_padded_zero_and_typed():
    tables, feats = _collection()
    coll = EmbeddingCollection(tables, feats, rngs=nnx.Rngs(0))
    a = coll.tables["a"]
    assert isinstance(a, EmbeddingTable)
    assert a[...].shape == (64, 4)
    assert np.all(np.asarray(a[...][10:]) == 0)
    assert np.all(np.abs(np.asarray(a[...][:10])) <= 1 / np.sqrt(10))
    assert a.get_metadata()["logical_axes"] == ("vocab", "embed")


def test_bad_specs_and_shapes_raise():
    with pytest.raises(ValueError, match="unknown table 'c'"):
        EmbeddingCollection(
            (TableSpec(name="a", num_rows=3, dim=2),),
            (FeatureSpec(name="x", table="c"),),
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(ValueError, match="duplicate"):
        EmbeddingCollection((TableSpec(name="a", num_rows=3, dim=2),) * 2, (), rngs=nnx.Rngs(0))
    tables, feats = _collection()
    coll = EmbeddingCollection(tables, feats, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"\[B, F=3, H\]"):
        coll.lookup(jnp.zeros((2, 2, 3), jnp.int32))


def test_row_sharded_lookup_equals_unsharded():
    tables, feats = _collection()
    mesh = sharding.make_mesh(MeshConfig())
    rng = np.random.default_rng(0)
    ids = rng.integers(-1, 7, size=(16, 3, 3)).astype(np.int32)
    ref = EmbeddingCollection(tables, feats, rngs=nnx.Rngs(0))
    want = np.asarray(ref(jnp.asarray(ids)))
    with sharding.activate(mesh, "row_sharded"):
        coll = EmbeddingCollection(tables, feats, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(coll, nnx.Param)
        shs = sharding.state_shardings(params)
        params = jax.device_put(params, shs)
        assert params["tables"]["a"][...].sharding.spec == jax.sharding.PartitionSpec("data", None)
        got = jax.jit(lambda p, i: nnx.merge(graphdef, p)(i))(params, jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
