"""The engine's layout: tables cut into shards by a plan and packed into per-width buffers.

A plan (``recscale.embeddings.planner``) cuts every table into shards ``(device, rows,
columns)``. Shards of equal width and storage dtype share one **buffer**: a ``[N·R, w]`` array
sharded over the mesh's ``data`` axis, whose device block ``d`` (rows ``[d·R, (d+1)·R)``) holds
that device's shards one after another (each at an ``offset``). That one layout expresses every
sharding type: table-wise is one shard on one device, row-wise a row range on every device,
column-wise a column range on each of ``k`` devices, the hybrids the same within a host's
devices. Data-parallel tables live in a replicated ``[R, w]`` buffer instead. Each device's
shards are its **slots** (padded to the same count ``S`` on every device, as SPMD needs).

:class:`EngineSpec` says what to plan for (the trainer builds it from the config and models pass
it to their embedding collections); :func:`build_layout` plans and lays out; :func:`init_buffers`
and :func:`export_tables` copy tables into and out of the buffers. Host-side and static: nothing
here runs inside a step.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from recscale import sharding
from recscale.embeddings import learned_cost, learned_planner
from recscale.embeddings import planner as planner_lib
from recscale.embeddings.compress import Compression
from recscale.embeddings.spec import FeatureSpec, TableSpec
from tpu_gpu_configs import profiles
from tpu_gpu_configs.profiles import get_profile

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
COLUMN_TYPES = planner_lib.COLUMN_TYPES
LANES = 128
"""A TPU vector register's lanes: narrow buffers are stored this wide, packed."""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What embedding collections need to lay their tables out (set by the trainer)."""

    sharding: str
    per_table: tuple[str, ...]
    profile: str
    host_size: int
    storage_dtype: str
    comm_dtype: str
    optimizer: str
    batch_size: int
    bag_kernel: str = "auto"
    """Implementation of the pooled lookups (``recscale.kernels.embedding_bag``)."""
    update_kernel: str = "auto"
    """Implementation of the fused backward + row update (``recscale.kernels.embedding_update``)."""
    compression: Compression = Compression()
    """How the pooled outputs' all-to-all is compressed (not a plan input: placement ignores it)."""
    tiered: tuple[str, ...] = ()
    """Tables whose engine table is a cache of a larger one (``recscale.embeddings.tiers``):
    placed whole rows at a time (never column-split) unless pinned."""
    l2: float = 0.0
    """Coupled L2 of whole tables (``embedding_optim.l2``): every table is data-parallel, where
    the update of every row every step is local (``recscale.embeddings.update``)."""
    bound_scales: tuple[str, ...] = ()
    """``TABLE=SCALE[:SCALE_GRAD]`` pins (``embeddings.comm_error_bound_tables``): the table's
    exchange bounds are :attr:`compression`'s times SCALE forward and SCALE_GRAD (default:
    SCALE) back (0: uncompressed). Tables of one pair share buffers, since an all-to-all has one
    code width."""
    zipf_exponents: tuple[str, ...] = ()
    """``TABLE=S`` entries (``embeddings.zipf_exponents``): each table's id skew for the
    planner's row-wise load (tables not named: uniform)."""
    lookup_factor: float = 0.0
    """The planner's lookup calibration (``embeddings.cost_lookup_factor``; 0: uncalibrated)."""
    planner: str = "analytic"
    """``analytic`` (``recscale.embeddings.planner``) or ``learned``
    (``recscale.embeddings.learned_planner``, ``embeddings.planner``)."""
    cost_model: str = ""
    """The learned planner's model file (empty: the one shipped for the profile)."""
    cost_model_digest: str = ""
    """That file's digest as the run recorded it (``learned_cost.file_digest``; empty: unchecked)."""

    @property
    def pack_rows(self) -> bool:
        """Whether buffers narrower than :data:`LANES` are stored packed, ``LANES / w`` rows a
        stored row: when a TPU kernel reads them (``pallas_tpu``; XLA:TPU keeps a narrow
        ``[R, w]`` column-major, and a kernel's row-major copy of it would pad each row to 128
        lanes), float32 storage (the only one those kernels take) and no tiered table (whose
        cache moves logical rows). Name both kernels: a path that is not a TPU kernel reads a
        packed buffer as rows, which on a TPU is a relayout copy each step."""
        tpu = "pallas_tpu" in (self.bag_kernel, self.update_kernel)
        return tpu and self.storage_dtype == "float32" and not self.tiered

    @classmethod
    def from_config(cls, cfg: Any) -> EngineSpec | None:
        """The spec of an experiment config (None when ``embeddings.sharding`` is ``off``)."""
        e = cfg.embeddings
        if e.sharding == "off":
            return None
        comp = Compression(
            kind=e.comm_compression, eps=e.comm_error_bound, eps_grad=e.comm_error_bound_grad
        )
        return cls(
            e.sharding,
            tuple(e.per_table),
            e.profile,
            e.host_size,
            e.storage_dtype,
            e.comm_dtype,
            cfg.embedding_optim.name,
            cfg.data.batch_size,
            cfg.kernels.embedding_bag,
            cfg.kernels.embedding_update,
            comp,
            tiered=tuple(t.split("=", 1)[0] for t in e.tiers),
            l2=cfg.embedding_optim.l2,
            bound_scales=tuple(e.comm_error_bound_tables),
            zipf_exponents=tuple(e.zipf_exponents),
            lookup_factor=e.cost_lookup_factor,
            planner=e.planner,
            cost_model=e.cost_model_path,
            cost_model_digest=e.cost_model_digest,
        )


@dataclasses.dataclass(frozen=True)
class BufferLayout:
    """One buffer: its shape, and per device (outer) and slot (inner) what each slot holds."""

    key: str
    width: int
    dtype: str
    replicated: bool
    rows: int
    """R: rows per device block (replicated: rows of the buffer)."""
    feature: tuple[tuple[int, ...], ...]
    row_start: tuple[tuple[int, ...], ...]
    row_count: tuple[tuple[int, ...], ...]
    """Rows of the shard (0: a padding slot)."""
    offset: tuple[tuple[int, ...], ...]
    col_start: tuple[tuple[int, ...], ...]
    table_dim: tuple[tuple[int, ...], ...]
    cw_group: tuple[tuple[int, ...], ...]
    """Index of the slot's table among column-split tables (``num_cw_groups``: not split)."""
    owner: tuple[tuple[int, ...], ...]
    """The first slot over the same rows: a table read by several features has a slot per
    feature on each of its shards, all at one offset (the slot itself when unshared)."""
    bound_scale: float = 1.0
    """Its tables' forward exchange bound relative to the layout's (``EngineSpec.bound_scales``)."""
    bound_scale_grad: float = 1.0
    """The same for the gradients' exchange."""
    pack: int = 1
    """Rows per stored row (:attr:`EngineSpec.pack_rows`): the buffer is stored as ``[N·R/pack,
    pack·w]``, the row-major ``[N·R, w]`` reshaped (:func:`rows_view`, :func:`stored_view`);
    ``R`` is then a multiple of ``8·pack``."""

    @property
    def shared(self) -> bool:
        """Whether several of a device's slots read the same rows (a shared table)."""
        return any(o != s for per in self.owner for s, o in enumerate(per))

    def update_groups(self) -> np.ndarray:
        """``[N, G, K]`` int32: per device, the slots over each distinct set of rows (``G`` of
        them, the most on any device), ``K`` slots each at most; ``S`` (one past the last
        slot) pads. A sparse update combines a group's gradients before its optimizer step."""
        per_device = []
        for owners in self.owner:
            groups: dict[int, list[int]] = {}
            for s, o in enumerate(owners):
                groups.setdefault(o, []).append(s)
            per_device.append(list(groups.values()))
        g = max(len(d) for d in per_device)
        k = max(len(m) for d in per_device for m in d)
        pad = len(self.owner[0])
        out = np.full((len(per_device), g, k), pad, np.int32)
        for d, groups_d in enumerate(per_device):
            for i, members in enumerate(groups_d):
                out[d, i, : len(members)] = members
        return out

    @property
    def scaled(self) -> bool:
        return (self.bound_scale, self.bound_scale_grad) != (1.0, 1.0)

    def arr(self, name: str) -> np.ndarray:
        return np.asarray(getattr(self, name), np.int32)


@dataclasses.dataclass(frozen=True)
class Layout:
    num_devices: int
    buffers: tuple[BufferLayout, ...]
    feature_dims: tuple[int, ...]
    feature_hotness: tuple[int, ...]
    feature_pooling: tuple[str, ...]
    num_cw_groups: int
    comm_dtype: str
    plan_text: str
    plan_memory_bytes: float = 0.0
    """The plan's memory of the fullest device (tables and their optimizer state)."""
    plan_all_to_all_bytes: float = 0.0
    """The plan's bytes moved by all-to-alls per step, all devices (``Plan.all_to_all_bytes``)."""
    bag_kernel: str = "auto"
    """Implementation of the pooled lookups (``kernels.embedding_bag``, from the kernel config)."""
    update_kernel: str = "auto"
    """Implementation of the fused backward + row update (``kernels.embedding_update``)."""
    compression: Compression = Compression()
    """The pooled outputs' all-to-all compression (``recscale.embeddings.compress``)."""
    lookup_batch: int = 0
    """Bags of a step's lookup the plan was costed for (``EngineSpec.batch_size``: a CTR
    batch's examples, a sequential step's item ids)."""

    def buffer(self, key: str) -> BufferLayout:
        return next(b for b in self.buffers if b.key == key)

    def compression_of(self, bl: BufferLayout) -> Compression:
        """How buffer ``bl``'s exchange is compressed: :attr:`compression` with its bounds
        times ``bl.bound_scale`` (scale 0: uncompressed)."""
        c = self.compression
        s, g = bl.bound_scale, bl.bound_scale_grad
        if not bl.scaled or c.kind == "none":
            return c
        if s == g == 0.0:
            return Compression()
        return dataclasses.replace(c, eps=c.eps * s, eps_grad=c.eps_grad * g)

    def exchange_bytes(self, batch_size: int) -> dict[str, float]:
        """Bytes the all-to-alls of one step move, all devices: ``forward`` (pooled outputs)
        and ``backward`` (their gradients) as :attr:`compression` sends them, and
        ``float32`` (both ways uncompressed, for the ratio). Every device sends each of its
        slots' outputs for the whole batch in one block per destination (``B / n`` examples
        of the slot's width); replicated buffers exchange nothing."""
        n = self.num_devices
        out = {"forward": 0.0, "backward": 0.0, "float32": 0.0}
        for bl in self.buffers:
            if bl.replicated:
                continue
            blocks = n * len(bl.feature[0]) * n  # (device, slot, destination)
            m = (batch_size // n) * bl.width
            comp = self.compression_of(bl)
            if comp.kind == "none":  # as comm_dtype says
                size = jnp.dtype(DTYPES[self.comm_dtype]).itemsize
                out["forward"] += blocks * size * m
                out["backward"] += blocks * size * m
            else:
                out["forward"] += blocks * comp.payload_bytes(m)
                out["backward"] += blocks * comp.payload_bytes(m, grad=True)
            out["float32"] += 2 * blocks * 4.0 * m
        return out


# ------------------------------------------------------------------------------------------------
# Planning.


_WARNED: set[str] = set()


def default_profile(device: Any = None) -> str:
    """The hardware profile of ``device`` (default: the first device) by its ``device_kind``
    (``tpu_gpu_configs.profiles.profile_for_device_kind``); a kind not in the table takes its
    platform's default (``PLATFORM_DEFAULTS``), with a warning naming it (printed once)."""
    device = jax.devices()[0] if device is None else device
    name = profiles.profile_for_device_kind(device.device_kind)
    if name is not None:
        return name
    name = profiles.PLATFORM_DEFAULTS.get(device.platform, "cpu-2core")
    if device.device_kind not in _WARNED:
        _WARNED.add(device.device_kind)
        print(
            f"warning: no hardware profile for device kind {device.device_kind!r}; the "
            f"embedding planner costs plans as {name} (set --embeddings.profile)",
            file=sys.stderr,
        )
    return name


def _bound_scales(spec: EngineSpec) -> dict[str, tuple[float, float]]:
    """``{table: (forward scale, gradient scale)}`` of ``spec.bound_scales``."""
    out = {}
    for item in spec.bound_scales:
        name, value = item.split("=", 1)
        fwd, _, grad = value.partition(":")
        out[name] = (float(fwd), float(grad or fwd))
    return out


def plan_engine(
    tables: tuple[TableSpec, ...],
    features: tuple[FeatureSpec, ...],
    num_devices: int,
    spec: EngineSpec,
) -> planner_lib.Plan:
    """The plan of ``tables`` on ``num_devices`` devices by ``spec.planner``, as
    :func:`build_layout` lays it out (``python -m recscale.plan`` prints it)."""
    ptables, profile, cost = planner_inputs(tables, features, num_devices, spec)
    if spec.planner == "learned":
        model = learned_cost.CostPredictor.for_profile(
            profile.name, spec.cost_model, digest=spec.cost_model_digest
        )
        return learned_planner.plan(
            ptables,
            profile,
            num_devices,
            batch_size=spec.batch_size,
            predictor=model,
            cost_model=cost,
        )
    return planner_lib.plan(
        ptables, profile, num_devices, batch_size=spec.batch_size, cost_model=cost
    )


def compare_planners(
    tables: tuple[TableSpec, ...],
    features: tuple[FeatureSpec, ...],
    num_devices: int,
    spec: EngineSpec,
) -> tuple[str, dict]:
    """Both planners' plans side by side (``learned_planner.side_by_side``): ``(text, data)``;
    without a learned model for the profile, one line saying so and ``{"learned": reason}``."""
    ptables, profile, cost = planner_inputs(tables, features, num_devices, spec)
    try:
        model = learned_cost.CostPredictor.for_profile(profile.name, spec.cost_model)
        return learned_planner.side_by_side(
            ptables,
            profile,
            num_devices,
            batch_size=spec.batch_size,
            cost_model=cost,
            predictor=model,
        )
    except ValueError as e:
        return f"learned planner not compared: {e}\n", {"learned": str(e)}


def planner_inputs(
    tables: tuple[TableSpec, ...],
    features: tuple[FeatureSpec, ...],
    num_devices: int,
    spec: EngineSpec,
) -> tuple[list[planner_lib.PlannerTable], Any, planner_lib.CostModel]:
    """``(planner tables, hardware profile, cost model)`` of an engine spec: what both
    planners take."""
    by_table: dict[str, list[int]] = {t.name: [] for t in tables}
    for i, f in enumerate(features):
        by_table[f.table].append(i)
    unused = [name for name, fs in by_table.items() if not fs]
    if unused:
        raise ValueError(
            f"embedding engine: tables {unused} are read by no feature; remove them from the "
            "collection (the engine stores only what a feature looks up)"
        )
    pins = dict(item.split("=", 1) for item in spec.per_table)
    unknown = set(pins) - set(by_table)
    if unknown:
        raise ValueError(f"embeddings.per_table names unknown tables {sorted(unknown)}")
    scales = _bound_scales(spec)
    unknown = set(scales) - set(by_table)
    if unknown:
        raise ValueError(
            f"embeddings.comm_error_bound_tables names unknown tables {sorted(unknown)}"
        )
    skew = {k: float(v) for k, v in (item.split("=", 1) for item in spec.zipf_exponents)}
    unknown = set(skew) - set(by_table)
    if unknown:
        raise ValueError(f"embeddings.zipf_exponents names unknown tables {sorted(unknown)}")
    profile = get_profile(spec.profile or default_profile())
    if spec.host_size:
        profile = dataclasses.replace(profile, devices_per_host=spec.host_size)
    itemsize = jnp.dtype(DTYPES[spec.storage_dtype]).itemsize
    default = () if spec.sharding == "auto" else (spec.sharding,)
    # a shared table serves every feature that reads it: its ids per example add up
    hot = {t.name: sum(features[i].max_hotness for i in by_table[t.name]) for t in tables}

    def allowed(name: str) -> tuple[str, ...]:
        kinds = (pins[name],) if name in pins else default
        if spec.l2:  # every row updated every step: a local update only where it is whole
            if kinds not in ((), ("data_parallel",)) or name in spec.tiered:
                raise ValueError(
                    f"embedding_optim.l2={spec.l2} (coupled L2 of whole tables) keeps every "
                    f"table data-parallel; table {name!r} is asked to be "
                    f"{'tiered' if name in spec.tiered else kinds[0]} (use "
                    "embedding_optim.row_l2, the L2 of the rows a batch touches, instead)"
                )
            return ("data_parallel",)
        if name in spec.tiered and name not in pins:  # a cache swaps whole rows
            every = planner_lib.ShardingType.__args__
            kinds = tuple(k for k in kinds or every if k not in COLUMN_TYPES)
        if num_devices == 1 and kinds and kinds != ("data_parallel",):
            return ("table_wise",)  # on one device every split is the whole table there
        return kinds

    ptables = [
        planner_lib.PlannerTable(
            name=t.name,
            num_rows=t.num_rows,
            dim=t.dim,
            bytes_per_element=itemsize,
            pooling_factor=float(hot[t.name]),
            zipf_exponent=skew.get(t.name, 0.0),
            optimizer=spec.optimizer,
            allowed=allowed(t.name),
        )
        for t in tables
    ]
    comm_bytes = jnp.dtype(DTYPES[spec.comm_dtype]).itemsize
    cost = planner_lib.CostModel.for_profile(profile, comm_bytes)
    if spec.lookup_factor:
        cost = dataclasses.replace(cost, lookup=spec.lookup_factor)
    return ptables, profile, cost


def build_layout(
    tables: tuple[TableSpec, ...],
    features: tuple[FeatureSpec, ...],
    num_devices: int,
    spec: EngineSpec,
) -> Layout:
    """Plans ``tables`` on ``num_devices`` devices and lays the shards out in buffers."""
    plan = plan_engine(tables, features, num_devices, spec)
    by_table: dict[str, list[int]] = {t.name: [] for t in tables}
    for i, f in enumerate(features):
        by_table[f.table].append(i)
    scales = _bound_scales(spec)
    table_plans = plan.by_table()
    cw_tables = [t.name for t in tables if table_plans[t.name].sharding in COLUMN_TYPES]
    cw_index = {name: i for i, name in enumerate(cw_tables)}
    # groups: (width, replicated, bound scales) -> per device list of (feature, row_start,
    # row_count, col_start, dim, cw); a replicated buffer exchanges nothing (scales 1)
    groups: dict[tuple[int, bool, tuple[float, float]], list[list[tuple]]] = {}
    for t in tables:
        tp = table_plans[t.name]
        fs = tuple(by_table[t.name])
        replicated = tp.sharding == "data_parallel"
        shards = tp.shards[:1] if replicated else tp.shards
        for sh in shards:
            r0, r1 = sh.rows
            c0, c1 = sh.cols[0], min(sh.cols[1], t.dim)
            if r1 <= r0 or c1 <= c0:
                continue
            scale = (1.0, 1.0) if replicated else scales.get(t.name, (1.0, 1.0))
            devs = groups.setdefault((c1 - c0, replicated, scale), [[] for _ in range(num_devices)])
            cw = cw_index.get(t.name, len(cw_tables))
            devs[0 if replicated else sh.device].append((fs, r0, r1 - r0, c0, t.dim, cw))
    buffers = []
    for (width, replicated, scale), devs in sorted(groups.items()):
        if replicated:
            devs = devs[:1]
        # a shard of a table read by k features is k slots over the same rows (one offset)
        num_slots = max(sum(len(fs) for fs, *_ in d) for d in devs)
        names = ("feature", "row_start", "row_count", "offset", "col_start", "table_dim")
        fields: dict[str, list[list[int]]] = {k: [] for k in (*names, "cw_group", "owner")}
        rows = 1
        for slots in devs:
            off, per = 0, {k: [] for k in fields}
            for fs, r0, count, c0, dim, cw in slots:
                owner = len(per["feature"])
                for f in fs:
                    for k, v in zip(fields, (f, r0, count, off, c0, dim, cw, owner), strict=True):
                        per[k].append(v)
                off += count
            while len(per["feature"]) < num_slots:  # padding slots: no rows
                pad = (0, 0, 0, off, 0, 1, len(cw_tables), len(per["feature"]))
                for k, v in zip(fields, pad, strict=True):
                    per[k].append(v)
            rows = max(rows, off)
            for k in fields:
                fields[k].append(tuple(per[k]))
        pack = LANES // width if spec.pack_rows and width < LANES and LANES % width == 0 else 1
        rows = -(-rows // (8 * pack)) * 8 * pack
        kind = "replicated" if replicated else "sharded"

        # the default scales keep the key checkpoints have always had; 0.25 -> "_eb0p25",
        # 0.25 forward and 1 back -> "_eb0p25_g1"
        def fmt(x: float) -> str:
            return f"{x:g}".replace(".", "p").replace("-", "m")

        tag = "" if scale == (1.0, 1.0) else "_eb" + fmt(scale[0])
        tag += "" if scale[1] == scale[0] else "_g" + fmt(scale[1])
        buffers.append(
            BufferLayout(
                key=f"{kind}_w{width}_{spec.storage_dtype}{tag}",
                width=width,
                dtype=spec.storage_dtype,
                replicated=replicated,
                rows=rows,
                **{k: tuple(v) for k, v in fields.items()},
                bound_scale=scale[0],
                bound_scale_grad=scale[1],
                pack=pack,
            )
        )
    return Layout(
        num_devices=num_devices,
        buffers=tuple(buffers),
        feature_dims=tuple(next(t.dim for t in tables if t.name == f.table) for f in features),
        feature_hotness=tuple(f.max_hotness for f in features),
        feature_pooling=tuple(f.pooling for f in features),
        num_cw_groups=len(cw_tables),
        comm_dtype=spec.comm_dtype,
        plan_text=plan.render(),
        plan_memory_bytes=float(plan.device_memory_bytes.max()),
        plan_all_to_all_bytes=plan.all_to_all_bytes,
        bag_kernel=spec.bag_kernel,
        update_kernel=spec.update_kernel,
        compression=spec.compression,
        lookup_batch=spec.batch_size,
    )


def init_buffers(layout: Layout, make_table, table_of_feature: list[int], num_tables: int):
    """Buffers holding the tables as the layout places them. ``make_table(t)`` returns table
    ``t`` (``[V_t, D_t]``); tables are made one at a time and copied into their shards, so the
    peak is the buffers plus one table."""
    out = {}
    for bl in layout.buffers:
        n_blocks = 1 if bl.replicated else layout.num_devices
        out[bl.key] = jnp.zeros((n_blocks * bl.rows, bl.width), DTYPES[bl.dtype])
    for t in range(num_tables):
        value = None
        for bl in layout.buffers:
            for d in range(1 if bl.replicated else layout.num_devices):
                for s in range(len(bl.feature[d])):
                    count = bl.row_count[d][s]
                    if not count or table_of_feature[bl.feature[d][s]] != t:
                        continue
                    value = make_table(t) if value is None else value
                    r0, c0 = bl.row_start[d][s], bl.col_start[d][s]
                    piece = value[r0 : r0 + count, c0 : c0 + bl.width].astype(out[bl.key].dtype)
                    start = (d * bl.rows + bl.offset[d][s], 0)
                    out[bl.key] = jax.lax.dynamic_update_slice(out[bl.key], piece, start)
    return {bl.key: stored_view(bl, out[bl.key]) for bl in layout.buffers}


def rows_view(bl: BufferLayout, arr):
    """Buffer ``bl``'s array (or a device block of it) as rows ``[X, w]``: a packed one
    reshaped (row-major: free on CPU and GPU, a relayout copy on TPU); others as they are."""
    if bl.pack > 1 and arr.ndim == 2 and arr.shape[1] == bl.pack * bl.width:
        return arr.reshape(arr.shape[0] * bl.pack, bl.width)
    return arr


def stored_view(bl: BufferLayout, arr):
    """Rows ``[X, w]`` of buffer ``bl`` as it is stored (packed ``[X/pack, pack·w]``)."""
    if bl.pack > 1 and arr.ndim == 2 and arr.shape[1] == bl.width:
        return arr.reshape(arr.shape[0] // bl.pack, bl.pack * bl.width)
    return arr


def export_tables(
    layout: Layout, buffers: dict, tables: tuple[TableSpec, ...], features: tuple[FeatureSpec, ...]
) -> dict[str, np.ndarray]:
    """The tables ``{name: [V, D]}`` reassembled from the buffers (host numpy)."""
    out = {t.name: np.zeros((t.num_rows, t.dim), np.float32) for t in tables}
    for bl in layout.buffers:
        buf = rows_view(bl, np.asarray(jax.device_get(buffers[bl.key]), np.float32))
        for d in range(1 if bl.replicated else layout.num_devices):
            for s in range(len(bl.feature[d])):
                count = bl.row_count[d][s]
                if count:
                    name = features[bl.feature[d][s]].table
                    r0, c0, base = bl.row_start[d][s], bl.col_start[d][s], d * bl.rows
                    rows = buf[base + bl.offset[d][s] : base + bl.offset[d][s] + count]
                    out[name][r0 : r0 + count, c0 : c0 + bl.width] = rows
    return out


def generated_rows(num_rows: int) -> int:
    """Rows a table is generated with (as the per-table path pads them), so both paths draw
    the same initial values."""
    return math.ceil(num_rows / sharding.ROW_PAD_MULTIPLE) * sharding.ROW_PAD_MULTIPLE
