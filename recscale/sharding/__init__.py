"""Logical-axis sharding: a glossary, named rule sets, the mesh, and two helpers for models.

Model code never sees a mesh or a PartitionSpec. It declares each parameter's logical axes
(``param``) and may constrain an activation (``constrain``); the entry point makes the mesh once
and activates it with a rule set (``activate``), and the trainer resolves shardings for whole
states (``state_shardings``). Validation raises on an unknown logical name, a mesh axis that the
mesh lacks, a mesh axis used twice in one tensor, or a dimension the mesh does not divide, and
names the tensor.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from recscale.config import MeshConfig

# The glossary. Any other logical name is an error.
LOGICAL_AXES = {
    "batch": "examples of a batch",
    "feature": "sparse features / embeddings per example (F)",
    "embed": "embedding dimension (D)",
    "vocab": "rows of an embedding table (V)",
    "mlp": "hidden units of an MLP layer",
    "table": "stacked tables (T)",
    "layers": "stacked layers (L)",
    "shard": "device blocks of the embedding engine's buffers (one block per device)",
}

DATA_AXIS = "data"

# Named rule sets: logical name -> mesh axis (or None = replicated along that dimension).
RULE_SETS: dict[str, dict[str, str | None]] = {
    # Pure data parallelism: every parameter replicated, batches split over `data`.
    "replicated": {
        "batch": DATA_AXIS, "feature": None, "embed": None, "vocab": None,
        "mlp": None, "table": None, "layers": None, "shard": DATA_AXIS,
    },
    # Data-parallel dense part, embedding-table rows sharded over the same devices.
    "row_sharded": {
        "batch": DATA_AXIS, "feature": None, "embed": None, "vocab": DATA_AXIS,
        "mlp": None, "table": None, "layers": None, "shard": DATA_AXIS,
    },
}  # fmt: skip

# Table rows are padded to a multiple of this (and of the mesh axis size) so that the same
# parameter shapes arise on 1 or on up to 64 devices: a checkpoint restores onto another mesh.
ROW_PAD_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class _Active:
    mesh: Mesh
    rules: Mapping[str, str | None]


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar(
    "recscale_mesh", default=None
)


def make_mesh(cfg: MeshConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """The run's mesh: one ``data`` axis over ``cfg.data_parallel`` devices (-1 = all)."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices) if cfg.data_parallel == -1 else cfg.data_parallel
    if n < 1 or n > len(devices):
        raise ValueError(f"mesh.data_parallel={cfg.data_parallel} but {len(devices)} devices exist")
    return jax.make_mesh(
        (n,), (DATA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices[:n]
    )


def get_rules(name: str) -> dict[str, str | None]:
    if name not in RULE_SETS:
        raise KeyError(f"unknown rule set {name!r}; known: {sorted(RULE_SETS)}")
    return RULE_SETS[name]


@contextlib.contextmanager
def activate(mesh: Mesh, rules: str | Mapping[str, str | None]) -> Iterator[None]:
    """Makes ``mesh`` and ``rules`` the ones models and the trainer resolve against."""
    rules = get_rules(rules) if isinstance(rules, str) else dict(rules)
    unknown = set(rules) - set(LOGICAL_AXES)
    if unknown:
        raise ValueError(f"rule set names unknown logical axes {sorted(unknown)}")
    token = _ACTIVE.set(_Active(mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_mesh() -> Mesh | None:
    a = _ACTIVE.get()
    return a.mesh if a else None


def active_rules() -> Mapping[str, str | None] | None:
    """The active logical-axis rules (None outside ``activate``)."""
    a = _ACTIVE.get()
    return a.rules if a else None


def logical_to_spec(
    axes: tuple[str | None, ...],
    *,
    shape: tuple[int, ...] | None = None,
    name: str = "tensor",
    mesh: Mesh | None = None,
    rules: Mapping[str, str | None] | None = None,
) -> PartitionSpec:
    """Resolves logical axes to a PartitionSpec under the active (or given) mesh and rules."""
    active = _ACTIVE.get()
    if mesh is None or rules is None:
        if active is None:
            raise RuntimeError(f"{name}: no mesh is active; wrap the call in sharding.activate()")
        mesh, rules = mesh or active.mesh, rules or active.rules
    if shape is not None and len(axes) != len(shape):
        raise ValueError(f"{name}: {len(axes)} logical axes {axes} for a rank-{len(shape)} tensor")
    spec, used = [], set()
    for i, ax in enumerate(axes):
        if ax is None:
            spec.append(None)
            continue
        if ax not in LOGICAL_AXES:
            raise ValueError(
                f"{name}: unknown logical axis {ax!r}; glossary: {sorted(LOGICAL_AXES)}"
            )
        mesh_ax = rules.get(ax)
        if mesh_ax is None:
            spec.append(None)
            continue
        if mesh_ax not in mesh.shape:
            raise ValueError(
                f"{name}: rule maps {ax!r} to mesh axis {mesh_ax!r}, absent from mesh {dict(mesh.shape)}"
            )
        if mesh_ax in used:
            raise ValueError(f"{name}: mesh axis {mesh_ax!r} used twice in axes {axes}")
        if shape is not None and shape[i] % mesh.shape[mesh_ax]:
            raise ValueError(
                f"{name}: dimension {i} ({ax!r}) of size {shape[i]} is not divisible by mesh axis "
                f"{mesh_ax!r} of size {mesh.shape[mesh_ax]}"
            )
        used.add(mesh_ax)
        spec.append(mesh_ax)
    return PartitionSpec(*spec)


def axis_size(logical: str) -> int:
    """Devices a logical axis is split over under the active rules (1 if none is active)."""
    active = _ACTIVE.get()
    if active is None:
        return 1
    mesh_ax = active.rules.get(logical)
    return 1 if mesh_ax is None else int(active.mesh.shape[mesh_ax])


def padded_rows(num_rows: int) -> int:
    """Table rows rounded up so any mesh of up to ROW_PAD_MULTIPLE devices divides them."""
    multiple = math.lcm(ROW_PAD_MULTIPLE, axis_size("vocab"))
    return -(-num_rows // multiple) * multiple


def param(cls: type[nnx.Variable], value: jax.Array, *axes: str | None) -> nnx.Variable:
    """Declares a parameter with its logical axes (the only sharding call parameters need)."""
    if len(axes) != np.ndim(value):
        raise ValueError(f"{len(axes)} logical axes {axes} for a rank-{np.ndim(value)} parameter")
    for ax in axes:
        if ax is not None and ax not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {ax!r}; glossary: {sorted(LOGICAL_AXES)}")
    return cls(value, logical_axes=tuple(axes))


def constrain(x: jax.Array, *axes: str | None) -> jax.Array:
    """Constrains an activation's sharding by logical axes; identity when no mesh is active."""
    active = _ACTIVE.get()
    if active is None:
        return x
    spec = logical_to_spec(tuple(axes), shape=x.shape, name=f"activation{x.shape}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(active.mesh, spec))


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: Any) -> Any:
    """NamedShardings for every Variable of an nnx State, from its ``logical_axes`` metadata.

    Variables without ``logical_axes`` are replicated. The result is a pytree prefix of ``state``
    usable as jit in/out shardings.
    """
    active = _ACTIVE.get()
    if active is None:
        raise RuntimeError("state_shardings needs an active mesh (sharding.activate)")

    def one(path: tuple, v: Any) -> NamedSharding:
        name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        axes = v.get_metadata().get("logical_axes") if _is_var(v) else None
        if axes is None:
            return NamedSharding(active.mesh, PartitionSpec())
        value = v.get_value() if hasattr(v, "get_value") else v.value
        spec = logical_to_spec(tuple(axes), shape=tuple(value.shape), name=name)
        return NamedSharding(active.mesh, spec)

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_var)


def batch_sharding(ndim: int) -> NamedSharding:
    """Sharding of a batch array: leading axis over ``batch``, the rest replicated."""
    active = _ACTIVE.get()
    if active is None:
        raise RuntimeError("batch_sharding needs an active mesh (sharding.activate)")
    spec = logical_to_spec(("batch",) + (None,) * (ndim - 1), name="batch")
    return NamedSharding(active.mesh, spec)


def replicated() -> NamedSharding:
    active = _ACTIVE.get()
    if active is None:
        raise RuntimeError("replicated() needs an active mesh (sharding.activate)")
    return NamedSharding(active.mesh, PartitionSpec())


def map_batch(fn, *args: Any, batched: tuple[bool, ...]) -> Any:
    """``fn(*args)`` run on each device's examples: a kernel boundary. A Pallas or FFI custom
    call is opaque to XLA's partitioner, which would gather its operands whole onto every
    device; inside ``shard_map`` each device runs it on its own block. Arguments flagged in
    ``batched`` are split over the ``batch`` axis (their leading dimension), the others
    replicated; outputs are batch-split. Without an active mesh, or with ``batch`` unsharded,
    ``fn`` is called directly."""
    active = _ACTIVE.get()
    axis = active.rules.get("batch") if active is not None else None
    if axis is None or active.mesh.shape[axis] == 1:
        return fn(*args)
    if len(batched) != len(args):
        raise ValueError(f"map_batch: {len(args)} arguments but {len(batched)} batched flags")
    specs = tuple(PartitionSpec(axis) if b else PartitionSpec() for b in batched)
    # check_vma=False: a pallas_call's outputs carry no varying-axes annotation; the transpose
    # then psums the cotangents of replicated arguments, which is their gradient here.
    return jax.shard_map(
        fn, mesh=active.mesh, in_specs=specs, out_specs=PartitionSpec(axis), check_vma=False
    )(*args)
