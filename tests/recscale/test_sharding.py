"""Logical-axis rules, validation errors, shardings of a model's state."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from recscale import sharding
from recscale.config import MeshConfig


@pytest.fixture
def mesh():
    return sharding.make_mesh(MeshConfig())


def test_mesh_uses_all_eight_simulated_devices(mesh):
    assert jax.device_count() == 8
    assert dict(mesh.shape) == {"data": 8}


def test_rule_sets_resolve(mesh):
    with sharding.activate(mesh, "row_sharded"):
        assert sharding.logical_to_spec(("vocab", "embed"), shape=(64, 4)) == P("data", None)
        assert sharding.logical_to_spec(("batch", None)) == P("data", None)
    with sharding.activate(mesh, "replicated"):
        assert sharding.logical_to_spec(("vocab", "embed"), shape=(64, 4)) == P(None, None)


def test_validation_names_the_tensor(mesh):
    with sharding.activate(mesh, "row_sharded"):
        with pytest.raises(ValueError, match="my_table.*unknown logical axis 'rows'"):
            sharding.logical_to_spec(("rows", "embed"), name="my_table")
        with pytest.raises(ValueError, match="t2.*used twice"):
            sharding.logical_to_spec(("vocab", "batch"), name="t2")
        with pytest.raises(ValueError, match="t3.*not divisible"):
            sharding.logical_to_spec(("vocab", "embed"), shape=(10, 4), name="t3")
    with sharding.activate(mesh, {"vocab": "model"}):
        with pytest.raises(ValueError, match="absent from mesh"):
            sharding.logical_to_spec(("vocab",), name="t4")
    with pytest.raises(ValueError, match="unknown logical axes"):
        with sharding.activate(mesh, {"rows": None}):
            pass


def test_padded_rows_divides_any_small_mesh(mesh):
    assert sharding.padded_rows(1) == 64
    assert sharding.padded_rows(64) == 64
    assert sharding.padded_rows(65) == 128
    with sharding.activate(mesh, "row_sharded"):
        assert sharding.padded_rows(100) % 8 == 0


def test_state_shardings_follow_param_metadata(mesh):
    class M(nnx.Module):
        def __init__(self):
            self.t = sharding.param(nnx.Param, jnp.zeros((64, 4)), "vocab", "embed")
            self.w = nnx.Param(jnp.zeros((4, 2)))

    with sharding.activate(mesh, "row_sharded"):
        shs = sharding.state_shardings(nnx.state(M(), nnx.Param))
        assert shs["t"].spec == P("data", None)
        assert shs["w"].spec == P()


def test_constrain_is_identity_without_mesh_and_shards_with_one(mesh):
    x = jnp.ones((16, 3))
    assert sharding.constrain(x, "batch", None) is x
    with sharding.activate(mesh, "row_sharded"):
        y = jax.jit(lambda a: sharding.constrain(a, "batch", None))(x)
    assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("data", None)), 2)
