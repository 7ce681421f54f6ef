"""One v5p chip as a compile target on this host (libtpu's Mosaic and XLA:TPU, no TPU): the
tests that compile Pallas TPU kernels past lowering share it."""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="needs the TPU compiler: pip install -e '.[tpu-aot]'",
)


def replicated_on_a_v5p_chip(monkeypatch) -> jax.sharding.NamedSharding:
    """A sharding that places arrays on one v5p chip of an abstract 2x2x1 slice (libtpu told
    the slice, so it starts quietly)."""
    from jax.experimental import topologies  # noqa: PLC0415 (imports libtpu)

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-8")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
    devices = topologies.get_topology_desc("v5p:2x2x1", "tpu").devices[:1]
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
