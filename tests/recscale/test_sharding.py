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


def test_mesh_with_a_model_axis():
    mesh = sharding.make_mesh(MeshConfig(model_parallel=2))
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert dict(sharding.make_mesh(MeshConfig(data_parallel=2, model_parallel=4)).shape) == {
        "data": 2,
        "model": 4,
    }
    with pytest.raises(ValueError, match="model_parallel=3 does not divide the 8 devices"):
        sharding.make_mesh(MeshConfig(model_parallel=3))
    with pytest.raises(ValueError, match="data_parallel=8 x mesh.model_parallel=2"):
        sharding.make_mesh(MeshConfig(data_parallel=8, model_parallel=2))
    with pytest.raises(ValueError, match="model_parallel must be >= 1"):
        MeshConfig(model_parallel=0)


def test_tensor_parallel_rules_fall_back_where_the_axis_does_not_divide():
    cfg = MeshConfig(model_parallel=2)
    with sharding.activate(sharding.make_mesh(cfg), cfg):
        assert sharding.logical_to_spec((None, "mlp"), shape=(4, 16)) == P(None, "model")
        assert sharding.logical_to_spec((None, "mlp"), shape=(16, 1)) == P(None, None)
        assert sharding.logical_to_spec(("batch", None)) == P("data", None)
        # the data axis stays strict: a table that it does not divide is an error
        with pytest.raises(ValueError, match="not divisible"):
            sharding.logical_to_spec(("vocab", "embed"), shape=(10, 4), name="t")


def test_fsdp_splits_the_largest_dimension_data_divides(mesh):
    class M(nnx.Module):
        def __init__(self):
            self.w = sharding.param(nnx.Param, jnp.zeros((12, 64)), None, "mlp")  # 3 KiB
            self.odd = sharding.param(nnx.Param, jnp.zeros((12, 6)), None, "mlp")  # none divide
            self.tie = sharding.param(nnx.Param, jnp.zeros((16, 16)), None, None)
            self.t = sharding.param(nnx.Param, jnp.zeros((64, 32)), "vocab", None)  # on data
            self.small = sharding.param(nnx.Param, jnp.zeros((8,)), "mlp")  # 32 bytes

    state = nnx.state(nnx.eval_shape(M))
    cfg = MeshConfig(fsdp=True, fsdp_min_bytes=64)
    with sharding.activate(mesh, cfg):
        specs = {k: s.spec for k, s in sharding.state_shardings(state).items()}
    assert specs == {
        "w": P(None, "data"),
        "odd": P(None, None),
        "tie": P("data", None),
        "t": P("data", None),
        "small": P(None),
    }
    with sharding.activate(mesh, MeshConfig(fsdp=False)):
        assert sharding.state_shardings(state)["w"].spec == P(None, None)
