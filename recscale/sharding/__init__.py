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
MODEL_AXIS = "model"

# Named rule sets: logical name -> mesh axis (or None = replicated along that dimension).
RULE_SETS: dict[str, dict[str, str | None]] = {
    # Pure data parallelism: every parameter replicated, batches split over `data`.
    "replicated": {
        "batch": DATA_AXIS,
        "feature": None,
        "embed": None,
        "vocab": None,
        "mlp": None,
        "table": None,
        "layers": None,
        "shard": DATA_AXIS,
    },
    # Data-parallel dense part, embedding-table rows sharded over the same devices.
    "row_sharded": {
        "batch": DATA_AXIS,
        "feature": None,
        "embed": None,
        "vocab": DATA_AXIS,
        "mlp": None,
        "table": None,
        "layers": None,
        "shard": DATA_AXIS,
    },
}

# Table rows are padded to a multiple of this (and of the mesh axis size) so that the same
# parameter shapes arise on 1 or on up to 64 devices: a checkpoint restores onto another mesh.
ROW_PAD_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class _Active:
    mesh: Mesh
    rules: Mapping[str, str | None]
    # Mesh axes that a dimension they do not divide falls back from (replicated) instead of
    # raising: tensor parallelism splits every MLP layer's outputs where it can, and a 1-unit
    # output layer stays whole.
    soft_axes: frozenset[str] = frozenset()
    # ZeRO-3: arrays of at least this many bytes not yet split over ``data`` are split over it
    # along their largest dimension it divides (None: off).
    fsdp_min_bytes: int | None = None


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar(
    "recscale_mesh", default=None
)


def make_mesh(cfg: MeshConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """The run's mesh: a ``data`` axis over ``cfg.data_parallel`` devices (-1 = all that
    ``model_parallel`` leaves), and a ``model`` axis of ``cfg.model_parallel`` when above 1.
    ``jax.make_mesh`` orders the devices by the physical topology (a TPU slice's torus)."""
    devices = list(jax.devices() if devices is None else devices)
    shape, names = mesh_shape(cfg, len(devices))
    m = cfg.model_parallel
    if m > 1 and jax.process_count() > 1 and jax.local_device_count() % m:
        raise ValueError(
            f"mesh.model_parallel={m} must divide the {jax.local_device_count()} devices of each "
            "process: a model group spans one process, which feeds its examples"
        )
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=auto, devices=devices[: math.prod(shape)])


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The axis sizes and names :func:`make_mesh` gives ``cfg`` over ``num_devices``."""
    m = cfg.model_parallel
    if num_devices % m:
        raise ValueError(f"mesh.model_parallel={m} does not divide the {num_devices} devices")
    n = num_devices // m if cfg.data_parallel == -1 else cfg.data_parallel
    if n < 1 or n * m > num_devices:
        raise ValueError(
            f"mesh.data_parallel={cfg.data_parallel} x mesh.model_parallel={m} but "
            f"{num_devices} devices exist"
        )
    return ((n,), (DATA_AXIS,)) if m == 1 else ((n, m), (DATA_AXIS, MODEL_AXIS))


def abstract_mesh(
    cfg: MeshConfig, num_devices: int, *, platform: str, device_kind: str
) -> jax.sharding.AbstractMesh:
    """:func:`make_mesh`'s mesh without devices: shapes, shardings and plans of a machine this
    host cannot describe (a TPU slice without libtpu); nothing compiles on it."""
    shape, names = mesh_shape(cfg, num_devices)
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform=platform)
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.sharding.AbstractMesh(shape, names, auto, abstract_device=device)


def get_rules(name: str) -> dict[str, str | None]:
    if name not in RULE_SETS:
        raise KeyError(f"unknown rule set {name!r}; known: {sorted(RULE_SETS)}")
    return RULE_SETS[name]


@contextlib.contextmanager
def activate(mesh: Mesh, rules: str | Mapping[str, str | None] | MeshConfig) -> Iterator[None]:
    """Makes ``mesh`` and ``rules`` the ones models and the trainer resolve against.

    ``rules``: a named rule set, a mapping, or a run's ``MeshConfig``, which adds to its named
    set the dense layout it chooses: ``mlp`` over ``model`` (tensor parallelism) when
    ``model_parallel`` > 1, and ``fsdp``."""
    soft, fsdp = frozenset(), None
    if isinstance(rules, MeshConfig):
        cfg = rules
        rules = dict(get_rules("row_sharded"))  # the per-table reference's rows: sharded
        if cfg.model_parallel > 1:
            rules["mlp"], soft = MODEL_AXIS, frozenset({MODEL_AXIS})
        fsdp = cfg.fsdp_min_bytes if cfg.fsdp else None
    rules = get_rules(rules) if isinstance(rules, str) else dict(rules)
    unknown = set(rules) - set(LOGICAL_AXES)
    if unknown:
        raise ValueError(f"rule set names unknown logical axes {sorted(unknown)}")
    token = _ACTIVE.set(_Active(mesh, rules, soft, fsdp))
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
    soft = active.soft_axes if active is not None else frozenset()
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
        if shape is not None and shape[i] % mesh.shape[mesh_ax] and mesh_ax in soft:
            spec.append(None)
            continue
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
        value = (v.get_value() if hasattr(v, "get_value") else v.value) if _is_var(v) else v
        shape = tuple(getattr(value, "shape", ()))
        if axes is None:
            spec = PartitionSpec()
        else:
            spec = logical_to_spec(tuple(axes), shape=shape, name=name)
        if active.fsdp_min_bytes is not None and shape:
            spec = _fsdp_spec(spec, shape, np.dtype(value.dtype).itemsize, active)
        return NamedSharding(active.mesh, spec)

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_var)


def constrain_state(tree: Any) -> Any:
    """``tree`` (e.g. the dense gradients, an nnx State of Variables) constrained to the
    shardings :func:`state_shardings` gives it, when the active rules split dense parameters
    (FSDP, or a ``model`` axis): the gradients are then reduce-scattered into their
    parameters' shards instead of all-reduced whole. Identity otherwise."""
    active = _ACTIVE.get()
    if active is None or (active.fsdp_min_bytes is None and not active.soft_axes):
        return tree
    return jax.lax.with_sharding_constraint(tree, state_shardings(tree))


def gather_fsdp(tree: Any) -> Any:
    """``tree`` (the dense parameters inside a step) gathered over ``data`` where it is used
    (ZeRO-3): constrained to its shardings without FSDP, so that no weight stays split along a
    dimension a matmul contracts (where XLA would all-reduce the activations instead); and its
    gradient constrained back to the FSDP shards, so that it is reduce-scattered rather than
    all-reduced whole. Identity unless FSDP is on."""
    active = _ACTIVE.get()
    if active is None or active.fsdp_min_bytes is None:
        return tree
    token = _ACTIVE.set(dataclasses.replace(active, fsdp_min_bytes=None))
    try:
        gathered = state_shardings(tree)
    finally:
        _ACTIVE.reset(token)
    sharded = state_shardings(tree)
    # A stack of layers (``stack_axes``) stays in its shards here: its scan gathers one layer
    # at a time (``unstack_axes`` then this, inside the loop).
    stacked = jax.tree.map(_is_stacked, tree, is_leaf=_is_var)
    gathered = jax.tree.map(lambda g, s, st: s if st else g, gathered, sharded, stacked)

    @jax.custom_vjp
    def gather(t):
        return jax.lax.with_sharding_constraint(t, gathered)

    def fwd(t):
        return gather(t), None

    def bwd(_, g):
        return (jax.lax.with_sharding_constraint(g, sharded),)

    gather.defvjp(fwd, bwd)
    return gather(tree)


STACK_AXIS = "layers"


def _is_stacked(v: Any) -> bool:
    axes = v.get_metadata().get("logical_axes") if _is_var(v) else None
    return bool(axes) and axes[0] == STACK_AXIS


def stack_axes(module: Any) -> Any:
    """``module``, made under ``nnx.vmap`` (every array with a leading axis of stacked layers),
    with the logical axis ``layers`` put before each Variable's own axes (its shardings then
    follow the rules' ``layers``: replicated along the stack)."""
    for _, v in nnx.iter_graph(module):
        axes = v.get_metadata().get("logical_axes") if _is_var(v) else None
        if axes is not None:
            v.set_metadata(logical_axes=(STACK_AXIS, *axes))
    return module


def unstack_axes(tree: Any) -> Any:
    """One layer's slice of a :func:`stack_axes` state (inside its scan): each Variable's
    logical axes without the leading ``layers``."""

    def one(v):
        if not _is_stacked(v):
            return v
        return v.replace(logical_axes=v.get_metadata()["logical_axes"][1:])

    return jax.tree.map(one, tree, is_leaf=_is_var)


def _fsdp_spec(
    spec: PartitionSpec, shape: tuple[int, ...], itemsize: int, active: _Active
) -> PartitionSpec:
    """``spec`` with the largest free dimension that ``data`` divides split over ``data``
    (big_vision's ``fsdp`` rule), for arrays of at least ``fsdp_min_bytes`` not yet on it."""
    n = int(active.mesh.shape[DATA_AXIS])
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)}
    if n == 1 or DATA_AXIS in used or math.prod(shape) * itemsize < active.fsdp_min_bytes:
        return spec
    for i in sorted(range(len(shape)), key=lambda i: -shape[i]):  # stable: first of equals
        if entries[i] is None and shape[i] % n == 0:
            entries[i] = DATA_AXIS
            return PartitionSpec(*entries)
    return spec


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
