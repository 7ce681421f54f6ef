"""Config machinery: frozen dataclasses, a preset registry, a JSON round trip, a tyro CLI.

No jax import here, so sweeps and launchers can expand configs without it. The JSON round trip
is ``data.strict`` (shared with feature specs): it rebuilds nested frozen dataclasses, tuples
and literals exactly, with a clear error naming the field on a typo; tyro's own serialisation is
YAML of its CLI, not a stable file format. What each field is for (part of a trial's identity,
free to change on resume, ...) is declared on the field with ``data.roles.field``.

The component configs live here, the optimizers' in ``recscale.config_optim``; the preset
registry, the JSON round trip and the CLI live in ``recscale.config_io``. All are imported from
here (``recscale.config`` is their public home).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, ClassVar, Literal, TypeVar

from data.config import DataConfig
from data.roles import ARGUMENT, CADENCE, LAYOUT, RUNTIME, field
from data.strict import to_dict  # noqa: F401 (recscale.config.to_dict, from_dict's inverse)
from recscale.config_io import (  # noqa: F401 (the documented home of these names)
    ConfigError,
    absolute_paths,
    from_dict,
    get_preset,
    load_json,
    parse_preset_cli,
    preset_names,
    register,
    save_json,
)
from recscale.config_optim import (  # noqa: F401 (the documented home of these names)
    DenseOptimConfig,
    EmbeddingOptimConfig,
    cooldown_steps,
    decay_start,
)

T = TypeVar("T")

# ------------------------------------------------------------------------------------------------
# Shared component configs (models define their own in dlrm/config.py, wukong/config.py).


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh and logical-axis rules (see ``recscale/sharding``)."""

    RETIRED: ClassVar[dict[str, Any]] = {"rules": "row_sharded"}
    """Fields no longer set (``data.roles.RETIRED``). ``rules`` chose whether the per-table
    reference's rows were sharded over ``data`` (``row_sharded``, the default) or copied: the
    same computation; the embedding engine's ``embeddings.sharding`` is the one row-sharding
    knob, and the reference's rows are always sharded."""

    data_parallel: int = field(-1, role=RUNTIME)
    """Devices on the ``data`` mesh axis (-1 = all devices left after ``model_parallel``)."""
    model_parallel: int = field(1, role=LAYOUT, identity_default=1)
    """Devices on the ``model`` mesh axis: tensor parallelism of the dense layers (every
    ``mlp``-named dimension, i.e. the output units of each MLP layer, that the axis divides is
    split over it; the others stay replicated). 1: no ``model`` axis. Batches are split over
    ``data`` only; the embedding engine shards over ``data`` and is replicated over ``model``."""
    fsdp: bool = field(False, role=LAYOUT, identity_default=False)
    """Fully sharded data parallelism (ZeRO-3): every dense parameter and its optimizer state
    of at least ``fsdp_min_bytes`` is split over the ``data`` axis along its largest dimension
    that the axis divides (the first of equal ones; arrays already split over ``data``, such as
    sharded tables, are left as they are). XLA gathers each weight where it is used and
    reduce-scatters its gradient."""
    fsdp_min_bytes: int = field(1 << 20, role=LAYOUT, identity_default=1 << 20)
    """Arrays smaller than this stay replicated under ``fsdp`` (gathering them costs more in
    latency than their copies cost in memory)."""

    def __post_init__(self):
        if self.model_parallel < 1:
            raise ValueError(f"mesh.model_parallel must be >= 1, got {self.model_parallel}")
        if self.fsdp_min_bytes < 0:
            raise ValueError(f"mesh.fsdp_min_bytes must be >= 0, got {self.fsdp_min_bytes}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingShardingConfig:
    """The sharded embedding engine (``recscale.embeddings.engine``): how tables are laid out
    over the mesh and updated. Models are unchanged whichever is chosen."""

    sharding: str = field("auto", role=LAYOUT, plan_input="sharding")
    """``auto``: the engine, with a plan from ``recscale.embeddings.planner``. A sharding type
    (``data_parallel``, ``table_wise``, ``row_wise``, ``column_wise``, ``table_row_wise``,
    ``table_column_wise``): the engine with every table pinned to it (placement still from the
    planner). The engine updates only the rows a batch touches (sparse SGD, row-wise Adagrad,
    lazy Adam). ``off``: the per-table reference, one array per table, rows sharded over
    ``data`` and updated by the dense optax optimizers (whole-table gradients): the
    oracle the engine's tests compare against, and what runs recorded before the engine was
    the default used (``sweeps/specs/study_frappe.py``, ``study_lr.py`` pin it)."""
    per_table: tuple[str, ...] = field((), role=LAYOUT, plan_input="per_table")
    """Per-table pins ``TABLE=TYPE`` (e.g. ``C1=row_wise``), over ``sharding``'s choice."""
    profile: str = field("", role=LAYOUT, plan_input="profile")
    """Hardware profile the planner costs plans with (``tpu_gpu_configs.profiles``); empty:
    the device's, by its ``device_kind`` (``TPU v5 lite``: ``tpu-v5e``, ``NVIDIA H200``:
    ``gpu-h200``, CPU: ``cpu-2core``; an unknown kind warns and takes ``gpu-h100`` / ``tpu-v5p``).
    A hardware preset (``--hardware``) sets its machine's."""
    host_size: int = field(0, role=LAYOUT, plan_input="host_size")
    """Devices per host for ``table_row_wise`` / ``table_column_wise`` (0: the profile's)."""
    storage_dtype: Literal["float32", "bfloat16", "float16"] = field(
        "float32", plan_input="storage_dtype"
    )
    """Table storage; lookups and updates compute in float32."""
    comm_dtype: Literal["float32", "bfloat16", "float16"] = field(
        "float32", plan_input="comm_dtype"
    )
    """Dtype of the pooled embeddings (and their gradients) in the all-to-all exchanges."""
    comm_compression: Literal["none", "error_bounded", "fp8_e4m3", "fp8_e5m2"] = field(
        "none", identity_default="none"
    )
    """Compression of those exchanges (``recscale.embeddings.compress``): ``error_bounded``
    quantises each block (a table slot's outputs for one destination device) to within
    ``comm_error_bound`` of its range, packing the codes densely; ``fp8_*`` scales each block
    to the format and casts. Needs ``comm_dtype`` float32."""
    comm_error_bound: float = field(0.0, identity_default=0.0)
    """error_bounded: the bound ε of each pooled value, relative to its block's range
    (0: sent as float32; 0.002: 8-bit codes, 4x fewer bytes; 0.0081: 6 bits; 0.036: 4 bits)."""
    comm_error_bound_grad: float = field(0.0, identity_default=0.0)
    """error_bounded: the same for the gradients sent back (0: float32)."""
    comm_error_bound_schedule: tuple[str, ...] = field((), identity_default=())
    """error_bounded, per iteration: ``STEP:EPS:EPS_GRAD`` entries (steps increasing), each
    bound from its step on (before the first: ``comm_error_bound{,_grad}``; evaluations keep
    those). E.g. ``0:0.036:0.036 2000:0.002:0.002``: 4-bit codes early, 8-bit late. Each
    distinct pair is its own compiled step; train rows log the bounds in force."""
    comm_error_bound_tables: tuple[str, ...] = field(
        (), identity_default=(), plan_input="bound_scales"
    )
    """Per table: ``TABLE=SCALE[:SCALE_GRAD]`` entries, that table's bounds (the schedule's
    included) being the bounds above times SCALE forward and SCALE_GRAD (default SCALE) back; 0
    sends that direction uncompressed (float32; with ``fp8_*`` only 0 and 1, the same both
    ways). Tables of one pair share buffers (one code width per all-to-all).
    ``python -m FAMILY.evaluate --workdir DIR --comm-sensitivity`` proposes them from each
    table's measured sensitivity."""
    tiers: tuple[str, ...] = field((), identity_default=())
    """Tables kept beyond device memory, ``TABLE=TIER:CACHE_ROWS`` (e.g. ``C1=ssd:65536``):
    the whole table in host RAM (``dram``) or in a memory-mapped file (``ssd``), and a cache
    of its hot rows in the engine (``recscale.embeddings.tiers``; ``python -m recscale.plan
    --tiers`` proposes a placement from the data's access counts)."""
    tier_dir: str = field("", role=RUNTIME)
    """Where the tiered tables' files go (empty: ``WORKDIR/tiers``)."""
    tier_policy: Literal["lru", "lfu"] = field("lru", identity_default="lru")
    """Which cached rows make room for a batch's missed rows: least recently or least
    frequently used."""
    zipf_exponents: tuple[str, ...] = field(
        (), role=LAYOUT, identity_default=(), plan_input="zipf_exponents"
    )
    """Id skew per table, ``TABLE=S`` entries (``P(rank r) ~ (r + 1)^-S``; a table not named is
    taken as uniform): the planner loads a row-wise table's busiest shard with its hottest
    row's share of the lookups. ``measure_skew`` fills in the tables not named."""
    measure_skew: int = field(0, role=LAYOUT, identity_default=0)
    """Training batches (the first ones) whose ids the trainer counts at start to fit each
    table's Zipf exponent into ``zipf_exponents`` (``recscale.embeddings.plan_inputs``; the
    values go into config.json, so evaluation and resume plan the same); 0: not measured."""
    calibrate: bool = field(False, role=LAYOUT, identity_default=False)
    """At start, time the embedding-bag kernel on this device and record the planner's lookup
    factor in ``cost_lookup_factor`` (and the profile it is relative to in ``profile``)."""
    cost_lookup_factor: float = field(
        0.0, role=LAYOUT, identity_default=0.0, plan_input="lookup_factor"
    )
    """The planner's lookup cost relative to the profile's peak memory bandwidth (measured
    lookup time over the peak's; ``planner.CostModel.calibrated``); 0: uncalibrated (1).
    These four are the planner's: with ``sharding`` off they do nothing."""
    planner: Literal["analytic", "learned"] = field(
        "analytic", role=LAYOUT, identity_default="analytic", plan_input="planner"
    )
    """``analytic``: the planner's cost formulas (``recscale.embeddings.planner``). ``learned``:
    NeuroShard's search over a cost model trained on measured shard sets
    (``recscale.embeddings.learned_planner``; the model shipped for the profile, or
    ``cost_model_path``)."""
    cost_model_path: str = field("", role=LAYOUT, identity_default="", plan_input="cost_model")
    """The learned planner's model file (``python -m recscale.embeddings.fit_cost_model``);
    empty: ``recscale/embeddings/cost_models/<profile>.npz``."""
    cost_model_digest: str = field(
        "", role=LAYOUT, identity_default="", plan_input="cost_model_digest"
    )
    """The learned model's digest, recorded at start (``plan_inputs.resolve``): a resumed run
    whose model file changed refuses to plan (its plan, and so its buffers, would differ)."""

    def __post_init__(self):
        types = (
            "data_parallel",
            "table_wise",
            "row_wise",
            "column_wise",
            "table_row_wise",
            "table_column_wise",
        )
        if self.sharding not in ("off", "auto", *types):
            raise ValueError(
                f"embeddings.sharding={self.sharding!r}: expected off, auto or one of {types}"
            )
        for item in self.per_table:
            name, sep, kind = item.partition("=")
            if not sep or not name or kind not in types:
                raise ValueError(
                    f"embeddings.per_table entry {item!r}: expected TABLE=TYPE, TYPE one of {types}"
                )
        if self.per_table and self.sharding == "off":
            raise ValueError("embeddings.per_table needs the engine (sharding auto or a type)")
        if self.host_size < 0:
            raise ValueError(f"embeddings.host_size must be >= 0, got {self.host_size}")
        bounds = (self.comm_error_bound, self.comm_error_bound_grad)
        if self.comm_compression != "none" and self.comm_dtype != "float32":
            raise ValueError(
                f"embeddings.comm_compression={self.comm_compression} compresses "
                f"float32 exchanges: set comm_dtype float32, not {self.comm_dtype}"
            )
        if self.comm_compression == "error_bounded" and not all(
            b == 0 or 2.0**-16 <= b < 0.5 for b in bounds
        ):
            raise ValueError(
                f"embeddings.comm_error_bound{{,_grad}}={bounds}: each must be 0 "
                "(float32) or in [1.5e-05, 0.5) (relative to a block's range)"
            )
        for item in self.tiers:
            name, _, rest = item.partition("=")
            tier, _, rows = rest.partition(":")
            if not name or tier not in ("dram", "ssd") or not rows.isdigit() or int(rows) < 1:
                raise ValueError(
                    f"embeddings.tiers entry {item!r}: expected TABLE=TIER:CACHE_ROWS "
                    "with TIER dram or ssd (e.g. C1=ssd:65536)"
                )
        if self.tiers and self.sharding == "off":
            raise ValueError(
                "embeddings.tiers needs the engine (embeddings.sharding auto or a type)"
            )
        last = -1
        for item in self.comm_error_bound_schedule:
            parts = item.split(":")
            try:
                step, eps, eps_g = int(parts[0]), float(parts[1]), float(parts[2])
                ok = (
                    len(parts) == 3
                    and step > last
                    and all(b == 0 or 2.0**-16 <= b < 0.5 for b in (eps, eps_g))
                )
            except (ValueError, IndexError):
                ok = False
            if not ok:
                raise ValueError(
                    f"embeddings.comm_error_bound_schedule entry {item!r}: expected "
                    "STEP:EPS:EPS_GRAD, steps increasing, each bound 0 or in "
                    "[1.5e-05, 0.5)"
                )
            last = step
        if self.comm_error_bound_schedule and self.comm_compression != "error_bounded":
            raise ValueError(
                "embeddings.comm_error_bound_schedule needs comm_compression "
                f"error_bounded, not {self.comm_compression}"
            )
        self._check_table_bounds()
        self._check_plan_inputs()
        if self.comm_compression != "error_bounded" and any(bounds):
            raise ValueError(
                "embeddings.comm_error_bound{,_grad} need comm_compression "
                f"error_bounded, not {self.comm_compression}"
            )

    def _check_plan_inputs(self) -> None:
        for item in self.zipf_exponents:
            name, _, value = item.partition("=")
            try:
                ok = bool(name) and math.isfinite(float(value)) and float(value) >= 0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(
                    f"embeddings.zipf_exponents entry {item!r}: expected TABLE=S with S a "
                    "finite number >= 0 (e.g. C1=1.05)"
                )
        if self.measure_skew < 0:
            raise ValueError(f"embeddings.measure_skew must be >= 0, got {self.measure_skew}")
        if not (math.isfinite(self.cost_lookup_factor) and self.cost_lookup_factor >= 0):
            raise ValueError(
                f"embeddings.cost_lookup_factor must be finite and >= 0 (0: uncalibrated), "
                f"got {self.cost_lookup_factor}"
            )

    def _check_table_bounds(self) -> None:
        base = [(self.comm_error_bound, self.comm_error_bound_grad)]
        base += [tuple(map(float, item.split(":")[1:])) for item in self.comm_error_bound_schedule]
        seen = set()
        for item in self.comm_error_bound_tables:
            name, sep, value = item.partition("=")
            fwd, _, grad = value.partition(":")
            try:
                pair = (float(fwd), float(grad or fwd))
            except ValueError:
                pair = (-1.0, -1.0)
            if not sep or not name or not all(0 <= x < float("inf") for x in pair) or name in seen:
                raise ValueError(
                    f"embeddings.comm_error_bound_tables entry {item!r}: expected "
                    "TABLE=SCALE[:SCALE_GRAD], scales >= 0, each table once (e.g. "
                    "C3=0.5 or C3=0.5:1)"
                )
            seen.add(name)
            if self.comm_compression == "none" or self.sharding == "off":
                raise ValueError(
                    "embeddings.comm_error_bound_tables needs the engine and a "
                    f"comm_compression, not {self.comm_compression}"
                )
            if self.comm_compression != "error_bounded" and (
                pair[0] != pair[1] or pair[0] not in (0.0, 1.0)
            ):
                raise ValueError(
                    f"embeddings.comm_error_bound_tables entry {item!r}: "
                    f"{self.comm_compression} has no bound to scale (0 sends the "
                    "table uncompressed both ways, 1 as the others)"
                )
            for b, g in base if self.comm_compression == "error_bounded" else ():
                for bound, scale in ((b, pair[0]), (g, pair[1])):
                    if bound and scale and not 2.0**-16 <= bound * scale < 0.5:
                        raise ValueError(
                            f"embeddings.comm_error_bound_tables entry {item!r}: "
                            f"bound {bound * scale:.3g} (a base bound times "
                            f"{scale:g}) is outside [1.5e-05, 0.5)"
                        )


KernelImpl = Literal["auto", "xla", "pallas_gpu", "pallas_tpu"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Which implementation runs each hot op (``recscale/kernels/<op>/api.py``). ``auto``: on
    CPU the fastest path (XLA; the C++ kernels for multi-id embedding bags and for float32 dot
    interactions of width 4, 8 or 16 on AVX-512 CPUs), on GPU and TPU the Pallas kernel if it is
    verified on that hardware (``recscale.kernels.common.HARDWARE_VERIFIED``), else XLA;
    ``xla``: the plain-jnp reference; ``pallas_gpu`` / ``pallas_tpu``: that kernel (on another
    backend in Pallas interpret mode: for tests, slow). A kernel that does not support a call's
    shape or dtype falls back to the reference and says so."""

    embedding_bag: Literal["auto", "xla", "cpu_ffi", "pallas_gpu", "pallas_tpu"] = "auto"
    """Pooled lookups of the embedding engine (``embeddings.sharding`` not ``off``)."""
    embedding_update: Literal["auto", "xla", "cpu_ffi", "pallas_gpu", "pallas_tpu"] = "auto"
    """The engine's backward fused with the SGD / row-wise Adagrad row update."""
    dot_interaction: Literal["auto", "xla", "cpu_ffi", "pallas_gpu", "pallas_tpu"] = "auto"
    """DLRM's dot interaction (lower triangle of X·Xᵀ)."""
    fm_interaction: KernelImpl = "auto"
    """Wukong's FMB core X·(Xᵀ·Y)."""
    hstu_attention: KernelImpl = field("auto", identity_default="auto")
    """HSTU's jagged SiLU attention (``recscale.kernels.hstu_attention``)."""

    def __post_init__(self):
        for name, tp in typing.get_type_hints(type(self)).items():
            allowed = typing.get_args(tp)
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"kernels.{name}={getattr(self, name)!r}: expected one of {allowed}"
                )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The training loop."""

    num_steps: int = field(1000, role=ARGUMENT)
    """Training steps."""
    seed: int = field(0, role=ARGUMENT)
    """Seed of parameter init and of the random stream the steps split their dropout keys off
    (``TrainState.rng``, checkpointed); in ``[0, 2**31)``."""
    eval_every: int = field(0, role=CADENCE)
    """Evaluate every N steps (0 = only at the end)."""
    eval_max_batches: int = field(0, role=CADENCE)
    """Cap on evaluation batches during training (0 = the whole evaluation set)."""
    noise_scale_every: int = field(0, role=CADENCE)
    """Measure the gradient noise scale every N steps (0 = never): the step's batch in
    ``noise_scale_micro_batches`` micro-batches and whole, dense parameters and tables apart
    (``recscale.analysis.noise_scale``), before the step's update; ``split="noise_scale"``
    rows in metrics.jsonl. Costs ``noise_scale_micro_batches + 1`` extra gradients."""
    noise_scale_micro_batches: int = field(4, role=CADENCE)
    """Micro-batches of the noise scale's small-batch gradients (>= 2, dividing the batch)."""
    checkpoint_every: int = field(0, role=CADENCE)
    """Save a checkpoint every N steps (0 = only at the end)."""
    max_checkpoints: int = field(3, role=CADENCE)
    """Checkpoints kept."""
    async_checkpoint: bool = field(True, role=CADENCE)
    """Save checkpoints asynchronously (training continues during the write)."""
    checkpoint_fallback: bool = field(False, role=RUNTIME)
    """On resume, a latest checkpoint that fails its checks (unreadable, or a fingerprint
    mismatch: ``CheckpointCorruptError``) makes the run fall back to the one before it with a
    warning, instead of stopping with the error. Corrupt steps stay on disk."""
    log_every: int = field(50, role=CADENCE)
    """Append train metrics to metrics.jsonl every N steps."""
    progress: bool = field(True, role=CADENCE)
    """Show a progress bar."""
    # ARGUMENT: what it restores is the state the compiled steps take as their argument, so runs
    # that differ only in it (a stable run's cooldown branches) share their programs.
    init_from: str = field("", role=ARGUMENT)
    """Initialise parameters (not optimizer state) from another run's latest checkpoint (its
    workdir). Used only when this run has no checkpoint of its own: restore order is the run's
    own latest checkpoint, then ``init_from``, then fresh init."""
    init_step: int = field(0, role=ARGUMENT, identity_default=0)
    """With ``init_from``: 0 = its latest checkpoint's parameters only; S > 0 = the whole
    training state of its checkpoint at step S (parameters, optimizer state, step counter,
    random stream, data position), continued here to ``num_steps``: a cooldown branch of a
    warmup-stable-decay run (``recscale.train.branches``), equal bitwise to the one-piece run of
    this config. The two configs may differ only in ``num_steps`` and fields free on resume, and
    every learning rate before S must be the same in both (``decay`` wsd or constant, S at or
    before both runs' decay starts)."""
    branch_steps: tuple[int, ...] = field((), role=CADENCE)
    """Also checkpoint at these steps and keep those checkpoints (beside the latest
    ``max_checkpoints``): the points cooldown branches start from (``init_step``)."""
    nonfinite: Literal["skip", "raise", "ignore"] = "skip"
    """A step whose loss or gradients hold a NaN/Inf: ``skip`` leaves the parameters, optimizer
    and embedding state bitwise unchanged (only the step advances) and counts it
    (``nonfinite_steps`` in metrics.jsonl); ``raise`` skips it too, then stops the run with
    ``FloatingPointError`` at the next log row; ``ignore`` applies it (the run stops when a
    logged loss is non-finite)."""
    nonfinite_rollback: int = 0
    """``skip``: after this many non-finite steps in a row, restore the latest checkpoint from
    before them and replay, skipping those steps' batches (0 = never)."""
    nonfinite_max_consecutive: int = 10
    """``skip``: stop the run (``FloatingPointError``, a diverged run) after this many
    non-finite steps in a row (0 = never); must exceed ``nonfinite_rollback`` when both are
    set, so the rollback is tried first."""
    early_stopping_metric: Literal["", "auc", "logloss"] = field("", identity_default="")
    """'' = off. Else early stopping with best-checkpoint selection (the BARS protocol): at
    every evaluation (``eval_every``) the parameters with the best validation value of this
    metric so far are kept in ``checkpoints_best/``; the run stops after
    ``early_stopping_patience`` evaluations in a row without an improvement; its result is the
    best parameters evaluated on the whole evaluation set (``evaluate --best`` repeats it)."""
    early_stopping_patience: int = field(2, identity_default=2)
    """Evaluations without improvement before the run stops."""
    early_stopping_min_delta: float = field(0.0, identity_default=0.0)
    """An evaluation improves on the best only by more than this."""

    def __post_init__(self):
        if self.num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {self.num_steps}")
        if not 0 <= self.seed < 2**31:  # an int32 argument of the compiled init
            raise ValueError(f"seed must be in [0, 2**31), got {self.seed}")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
        for name in (
            "eval_every",
            "eval_max_batches",
            "checkpoint_every",
            "nonfinite_rollback",
            "nonfinite_max_consecutive",
            "noise_scale_every",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.noise_scale_every and self.noise_scale_micro_batches < 2:
            raise ValueError(
                f"noise_scale_micro_batches must be >= 2, got {self.noise_scale_micro_batches}"
            )
        if self.early_stopping_metric and not self.eval_every:
            raise ValueError(
                f"early_stopping_metric={self.early_stopping_metric!r} needs eval_every > 0 "
                "(the evaluations it compares)"
            )
        if self.early_stopping_patience < 1 or self.early_stopping_min_delta < 0:
            raise ValueError("early_stopping_patience must be >= 1 and min_delta >= 0")
        if self.init_step < 0 or (self.init_step and not self.init_from):
            raise ValueError(
                f"train.init_step={self.init_step}: must be >= 0, and > 0 only with init_from"
            )
        if self.init_step > self.num_steps:
            raise ValueError(
                f"train.init_step={self.init_step} is past train.num_steps={self.num_steps}"
            )
        bad = [s for s in self.branch_steps if not 0 < s < self.num_steps]
        if bad:
            raise ValueError(
                f"train.branch_steps {bad}: each must be in (0, num_steps={self.num_steps})"
            )
        if self.max_checkpoints < 1:
            raise ValueError(f"max_checkpoints must be >= 1, got {self.max_checkpoints}")
        if self.nonfinite not in ("skip", "raise", "ignore"):
            raise ValueError(f"nonfinite={self.nonfinite!r}: expected skip, raise or ignore")
        if self.nonfinite_rollback and self.nonfinite != "skip":
            raise ValueError(
                f"nonfinite_rollback={self.nonfinite_rollback} needs nonfinite='skip', "
                f"got {self.nonfinite!r}"
            )
        if 0 < self.nonfinite_max_consecutive <= self.nonfinite_rollback:
            raise ValueError(
                f"nonfinite_max_consecutive={self.nonfinite_max_consecutive} must exceed "
                f"nonfinite_rollback={self.nonfinite_rollback} (or be 0), else no rollback runs"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """What every family's run config holds besides its ``model`` (families subclass this and add
    a ``model`` field), i.e. what the shared trainer reads."""

    data: DataConfig = DataConfig()
    """Dataset and batching."""
    dense_optim: DenseOptimConfig = DenseOptimConfig()
    """Optimizer of every parameter that is not an embedding table."""
    embedding_optim: EmbeddingOptimConfig = EmbeddingOptimConfig()
    """Optimizer of the embedding tables."""
    train: TrainConfig = TrainConfig()
    """Training loop."""
    mesh: MeshConfig = MeshConfig()
    """Device mesh and sharding rules."""
    embeddings: EmbeddingShardingConfig = EmbeddingShardingConfig()
    """The embedding engine: table sharding and sparse updates."""
    kernels: KernelConfig = KernelConfig()
    """Implementations of the hot ops (Pallas kernels, C++ CPU kernels or the XLA reference)."""
