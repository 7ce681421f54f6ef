"""Config machinery: frozen dataclasses, a preset registry, a JSON round trip, a tyro CLI.

No jax import here, so sweeps and launchers can expand configs without it. The JSON round trip
is hand-written (about 60 lines) because it must rebuild nested frozen dataclasses, tuples and
literals exactly, with a clear error naming the field on a typo; ``dataclasses.asdict`` only goes
one way and tyro's own serialisation is YAML of its CLI, not a stable file format.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from data.config import DataConfig

T = TypeVar("T")

# ------------------------------------------------------------------------------------------------
# Shared component configs (models define their own in dlrm/config.py, wukong/config.py).


class ConfigError(ValueError):
    """A config whose fields contradict each other across sections (found when a run is set
    up, not by one section's checks); the CLIs print it as one line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseOptimConfig:
    """Optimizer of the dense (MLP) parameters, built with optax."""

    name: Literal["adam", "adamw", "sgd", "adagrad", "lamb", "lars", "hessian_free"] = "adam"
    """Optimizer family. ``hessian_free``: truncated Newton with Steihaug-CG in a trust region
    (``recscale.optim.hessian_free``; the learning rate scales its step, 1.0 is Newton's; it
    needs the embedding engine, whose tables keep their sparse optimizer)."""
    learning_rate: float = 1e-3
    """Peak learning rate."""
    warmup_steps: int = 0
    """Linear warmup from 0 to the peak over this many steps."""
    decay: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warmup, down to ``end_lr_fraction * learning_rate`` at the last step."""
    end_lr_fraction: float = 0.0
    """Final learning rate as a fraction of the peak (cosine/linear decay)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (adamw, lamb, lars)."""
    b1: float = 0.9
    """First-moment decay (adam, adamw, lamb); momentum (sgd, lars)."""
    b2: float = 0.999
    """Second-moment decay (adam, adamw, lamb)."""
    eps: float = 1e-8
    """Numerical epsilon."""
    grad_clip_norm: float = 0.0
    """Clip the dense gradients' global norm to this (0 = off)."""
    hf_cg_iters: int = 20
    """hessian_free: CG iterations (Hessian-vector products) per step, at most."""
    hf_damping: float = 1e-4
    """hessian_free: Tikhonov damping λ of the curvature products (H + λI)."""
    hf_radius: float = 1.0
    """hessian_free: the trust region's initial radius (then adapted)."""

    def __post_init__(self):
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.name == "hessian_free" and (
            self.grad_clip_norm > 0 or self.warmup_steps or self.decay != "constant"
        ):
            raise ValueError(
                "dense_optim.name=hessian_free: its trust region sets the step; set "
                "grad_clip_norm 0, warmup_steps 0 and decay constant"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingOptimConfig:
    """Optimizer of the embedding tables (their own, as in DLRM and TorchRec)."""

    name: Literal["sgd", "rowwise_adagrad", "adam"] = "rowwise_adagrad"
    """``sgd``; ``rowwise_adagrad`` (one accumulator per row, the mean of its squared grads);
    ``adam`` (dense Adam on the tables, for comparison)."""
    learning_rate: float = 0.01
    """Learning rate of the tables."""
    warmup_steps: int = 0
    """Linear warmup from 0 over this many steps."""
    decay: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warmup, down to ``end_lr_fraction * learning_rate`` at the last step."""
    end_lr_fraction: float = 0.0
    """Final learning rate as a fraction of the peak (cosine/linear decay)."""
    initial_accumulator: float = 0.0
    """Initial value of the row-wise Adagrad accumulator."""
    eps: float = 1e-8
    """Numerical epsilon of row-wise Adagrad / Adam."""
    l2: float = 0.0
    """Coupled L2 regularisation of whole tables: adds ``l2 * W`` to the gradient (FuxiCTR's
    ``embedding_regularizer``); it makes every row's update dense."""
    row_l2: float = 0.0
    """L2 of the rows a batch touches (lazy, as sparse optimizers apply it): adds
    ``row_l2 * w_j`` to each touched row's gradient, before CowClip; engine and per-table
    tables alike."""
    cowclip_ratio: float = 0.0
    """CowClip (``recscale.optim.cowclip``): clips each touched row's gradient to
    ``cnt · max(r · ||w||, ζ)``, ``cnt`` its occurrences in the batch; this is ``r``
    (0: off; the paper uses 1)."""
    cowclip_min_norm: float = 1e-5
    """CowClip's ``ζ``: the threshold's floor per occurrence, for rows still near zero."""

    def __post_init__(self):
        for name in ("l2", "row_l2", "cowclip_ratio", "cowclip_min_norm"):
            if getattr(self, name) < 0:
                raise ValueError(f"embedding_optim.{name}={getattr(self, name)}: must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh and logical-axis rules (see ``recscale/sharding``)."""

    data_parallel: int = -1
    """Devices on the ``data`` mesh axis (-1 = all devices left after ``model_parallel``)."""
    model_parallel: int = 1
    """Devices on the ``model`` mesh axis: tensor parallelism of the dense layers (every
    ``mlp``-named dimension, i.e. the output units of each MLP layer, that the axis divides is
    split over it; the others stay replicated). 1: no ``model`` axis. Batches are split over
    ``data`` only; the embedding engine shards over ``data`` and is replicated over ``model``."""
    rules: Literal["replicated", "row_sharded"] = "row_sharded"
    """Named rule set: ``row_sharded`` shards table rows over ``data``; ``replicated`` copies them."""
    fsdp: bool = False
    """Fully sharded data parallelism (ZeRO-3): every dense parameter and its optimizer state
    of at least ``fsdp_min_bytes`` is split over the ``data`` axis along its largest dimension
    that the axis divides (the first of equal ones; arrays already split over ``data``, such as
    sharded tables, are left as they are). XLA gathers each weight where it is used and
    reduce-scatters its gradient."""
    fsdp_min_bytes: int = 1 << 20
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

    sharding: str = "off"
    """``off``: one array per table, sharded by ``mesh.rules``, updated by the dense optax
    optimizers (the reference path). ``auto``: the engine, with a plan from
    ``recscale.embeddings.planner``. A sharding type (``data_parallel``, ``table_wise``,
    ``row_wise``, ``column_wise``, ``table_row_wise``, ``table_column_wise``): the engine with
    every table pinned to it (placement still from the planner). The engine updates only the
    rows a batch touches (sparse SGD, row-wise Adagrad, lazy Adam)."""
    per_table: tuple[str, ...] = ()
    """Per-table pins ``TABLE=TYPE`` (e.g. ``C1=row_wise``), over ``sharding``'s choice."""
    profile: str = ""
    """Hardware profile the planner costs plans with (``tpu_gpu_configs.profiles``); empty:
    ``cpu-2core`` on CPU, ``gpu-h100`` on GPU, ``tpu-v5p`` on TPU."""
    host_size: int = 0
    """Devices per host for ``table_row_wise`` / ``table_column_wise`` (0: the profile's)."""
    storage_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Table storage; lookups and updates compute in float32."""
    comm_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the pooled embeddings (and their gradients) in the all-to-all exchanges."""
    comm_compression: Literal["none", "error_bounded", "fp8_e4m3", "fp8_e5m2"] = "none"
    """Compression of those exchanges (``recscale.embeddings.compress``): ``error_bounded``
    quantises each block (a table slot's outputs for one destination device) to within
    ``comm_error_bound`` of its range, packing the codes densely; ``fp8_*`` scales each block
    to the format and casts. Needs ``comm_dtype`` float32."""
    comm_error_bound: float = 0.0
    """error_bounded: the bound ε of each pooled value, relative to its block's range
    (0: sent as float32; 0.002: 8-bit codes, 4x fewer bytes; 0.0081: 6 bits; 0.036: 4 bits)."""
    comm_error_bound_grad: float = 0.0
    """error_bounded: the same for the gradients sent back (0: float32)."""
    comm_error_bound_schedule: tuple[str, ...] = ()
    """error_bounded, per iteration: ``STEP:EPS:EPS_GRAD`` entries (steps increasing), each
    bound from its step on (before the first: ``comm_error_bound{,_grad}``; evaluations keep
    those). E.g. ``0:0.036:0.036 2000:0.002:0.002``: 4-bit codes early, 8-bit late. Each
    distinct pair is its own compiled step; train rows log the bounds in force."""
    comm_error_bound_tables: tuple[str, ...] = ()
    """Per table: ``TABLE=SCALE[:SCALE_GRAD]`` entries, that table's bounds (the schedule's
    included) being the bounds above times SCALE forward and SCALE_GRAD (default SCALE) back; 0
    sends that direction uncompressed (float32; with ``fp8_*`` only 0 and 1, the same both
    ways). Tables of one pair share buffers (one code width per all-to-all).
    ``python -m FAMILY.evaluate --workdir DIR --comm-sensitivity`` proposes them from each
    table's measured sensitivity."""
    tiers: tuple[str, ...] = ()
    """Tables kept beyond device memory, ``TABLE=TIER:CACHE_ROWS`` (e.g. ``C1=ssd:65536``):
    the whole table in host RAM (``dram``) or in a memory-mapped file (``ssd``), and a cache
    of its hot rows in the engine (``recscale.embeddings.tiers``; ``python -m recscale.plan
    --tiers`` proposes a placement from the data's access counts)."""
    tier_dir: str = ""
    """Where the tiered tables' files go (empty: ``WORKDIR/tiers``)."""
    tier_policy: Literal["lru", "lfu"] = "lru"
    """Which cached rows make room for a batch's missed rows: least recently or least
    frequently used."""

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
        if self.comm_compression != "error_bounded" and any(bounds):
            raise ValueError(
                "embeddings.comm_error_bound{,_grad} need comm_compression "
                f"error_bounded, not {self.comm_compression}"
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
    CPU the fastest path (XLA; the C++ kernels for multi-id embedding bags), on GPU and TPU the
    Pallas kernel if it is verified on that hardware (``recscale.kernels.common
    .HARDWARE_VERIFIED``), else XLA; ``xla``: the plain-jnp reference; ``pallas_gpu`` /
    ``pallas_tpu``: that kernel (on another backend in Pallas interpret mode: for tests, slow).
    A kernel that does not support a call's shape or dtype falls back to the reference and
    says so."""

    embedding_bag: Literal["auto", "xla", "cpu_ffi", "pallas_gpu", "pallas_tpu"] = "auto"
    """Pooled lookups of the embedding engine (``embeddings.sharding`` not ``off``)."""
    embedding_update: Literal["auto", "xla", "cpu_ffi", "pallas_gpu", "pallas_tpu"] = "auto"
    """The engine's backward fused with the SGD / row-wise Adagrad row update."""
    dot_interaction: KernelImpl = "auto"
    """DLRM's dot interaction (lower triangle of X·Xᵀ)."""
    fm_interaction: KernelImpl = "auto"
    """Wukong's FMB core X·(Xᵀ·Y)."""

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

    num_steps: int = 1000
    """Training steps."""
    seed: int = 0
    """Seed of parameter init and of the random stream the steps split their dropout keys off
    (``TrainState.rng``, checkpointed); in ``[0, 2**31)``."""
    eval_every: int = 0
    """Evaluate every N steps (0 = only at the end)."""
    eval_max_batches: int = 0
    """Cap on evaluation batches during training (0 = the whole evaluation set)."""
    noise_scale_every: int = 0
    """Measure the gradient noise scale every N steps (0 = never): the step's batch in
    ``noise_scale_micro_batches`` micro-batches and whole, dense parameters and tables apart
    (``recscale.analysis.noise_scale``), before the step's update; ``split="noise_scale"``
    rows in metrics.jsonl. Costs ``noise_scale_micro_batches + 1`` extra gradients."""
    noise_scale_micro_batches: int = 4
    """Micro-batches of the noise scale's small-batch gradients (>= 2, dividing the batch)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0 = only at the end)."""
    max_checkpoints: int = 3
    """Checkpoints kept."""
    async_checkpoint: bool = True
    """Save checkpoints asynchronously (training continues during the write)."""
    checkpoint_fallback: bool = False
    """On resume, a latest checkpoint that fails its checks (unreadable, or a fingerprint
    mismatch: ``CheckpointCorruptError``) makes the run fall back to the one before it with a
    warning, instead of stopping with the error. Corrupt steps stay on disk."""
    log_every: int = 50
    """Append train metrics to metrics.jsonl every N steps."""
    progress: bool = True
    """Show a progress bar."""
    init_from: str = ""
    """Initialise parameters (not optimizer state) from another run's latest checkpoint (its
    workdir). Used only when this run has no checkpoint of its own: restore order is the run's
    own latest checkpoint, then ``init_from``, then fresh init."""
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
    early_stopping_metric: Literal["", "auc", "logloss"] = ""
    """'' = off. Else early stopping with best-checkpoint selection (the BARS protocol): at
    every evaluation (``eval_every``) the parameters with the best validation value of this
    metric so far are kept in ``checkpoints_best/``; the run stops after
    ``early_stopping_patience`` evaluations in a row without an improvement; its result is the
    best parameters evaluated on the whole evaluation set (``evaluate --best`` repeats it)."""
    early_stopping_patience: int = 2
    """Evaluations without improvement before the run stops."""
    early_stopping_min_delta: float = 0.0
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


# Fields that do not change what a run computes (logging, evaluation cadence, checkpoint
# cadence): a run may resume with them changed, and they stay out of trial identities.
NON_SEMANTIC_FIELDS = frozenset(
    {
        "train.progress",
        "train.log_every",
        "train.eval_every",
        "train.eval_max_batches",
        "embeddings.tier_dir",
        "train.checkpoint_every",
        "train.max_checkpoints",
        "train.async_checkpoint",
        "train.checkpoint_fallback",
        "train.noise_scale_every",
        "train.noise_scale_micro_batches",
        "data.eval_batch_size",
        "data.eval_path",
        "mesh.data_parallel",
        "data.tabular.prepared_dir",
        "data.tabular.workers",
    }
)


# Fields that only lay the same computation out differently (the embedding plan, the dense
# layout; the device count, ``mesh.data_parallel``, is non-semantic): a run may resume with them changed (its
# checkpoint is re-laid out, ``recscale.embeddings.relayout``), but they stay in trial identities, as a
# sweep may compare layouts.
LAYOUT_FIELDS = frozenset(
    {
        "embeddings.sharding",
        "embeddings.per_table",
        "embeddings.profile",
        "embeddings.host_size",
        "mesh.model_parallel",
        "mesh.fsdp",
        "mesh.fsdp_min_bytes",
    }
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


# ------------------------------------------------------------------------------------------------
# Preset registry.

_PRESETS: dict[str, Callable[[], Any]] = {}


def register(name: str) -> Callable[[Callable[[], T]], Callable[[], T]]:
    """Decorator registering a zero-argument preset function under ``name`` (e.g. ``dlrm/tiny``)."""

    def deco(fn: Callable[[], T]) -> Callable[[], T]:
        if name in _PRESETS:
            raise ValueError(f"preset {name!r} registered twice")
        _PRESETS[name] = fn
        return fn

    return deco


def preset_names(prefix: str = "") -> list[str]:
    return sorted(n for n in _PRESETS if n.startswith(prefix))


def get_preset(name: str) -> Any:
    if name not in _PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(preset_names())}")
    return _PRESETS[name]()


# ------------------------------------------------------------------------------------------------
# JSON round trip.


def to_dict(cfg: Any) -> Any:
    """Config dataclass -> JSON-able nested dict (tuples become lists)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (tuple, list)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def from_dict(cls: type[T], data: Any, *, path: str = "config") -> T:
    """Inverse of ``to_dict``; raises naming the field path on unknown or ill-typed fields."""
    return _build(cls, data, path)


def _build(tp: Any, data: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise TypeError(f"{path}: expected an object for {tp.__name__}, got {data!r}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp) if f.init}
        unknown = set(data) - names
        if unknown:
            raise TypeError(f"{path}: unknown field(s) {sorted(unknown)} for {tp.__name__}")
        kwargs = {k: _build(hints[k], v, f"{path}.{k}") for k, v in data.items()}
        return tp(**kwargs)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(data, (list, tuple)):
            raise TypeError(f"{path}: expected a list, got {data!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
        return tuple(
            _build(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data, strict=True))
        )
    if origin is Literal:
        if data not in typing.get_args(tp):
            raise ValueError(f"{path}: {data!r} is not one of {typing.get_args(tp)}")
        return data
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _build(a, data, path)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        raise TypeError(f"{path}: {data!r} matches none of {args}: {errors}")
    if tp is float and isinstance(data, int) and not isinstance(data, bool):
        return float(data)
    if tp in (int, float, str, bool) and not isinstance(data, tp):
        raise TypeError(f"{path}: expected {tp.__name__}, got {data!r}")
    return data


def absolute_paths(cfg: T) -> T:
    """``cfg`` with every non-empty ``*_path``/``*_dir``/``init_from``/``spec`` (a tabular feature
    spec file) field made absolute.

    Runs store absolute paths in ``config.json``, so evaluation works from any directory.
    """
    if not dataclasses.is_dataclass(cfg):
        return cfg
    changes = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            changes[f.name] = absolute_paths(v)
        elif (
            isinstance(v, str)
            and v
            and (f.name.endswith(("_path", "_dir")) or f.name in ("init_from", "spec"))
        ):
            changes[f.name] = str(Path(v).expanduser().absolute())
    return dataclasses.replace(cfg, **changes)


def save_json(cfg: Any, path: str | Path) -> None:
    """Writes ``cfg`` atomically (a temporary file renamed over ``path``): the other processes
    of a multi-process run read the file while process 0 rewrites it on a resume."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(to_dict(cfg), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def load_json(cls: type[T], path: str | Path) -> T:
    return from_dict(cls, json.loads(Path(path).read_text()), path=str(path))


# ------------------------------------------------------------------------------------------------
# CLI: ``python -m dlrm.train PRESET --workdir DIR [--train.num-steps 100 ...]``.


def parse_preset_cli(
    prefix: str, argv: list[str] | None = None, *, prog: str = ""
) -> tuple[str, Any]:
    """Parses ``PRESET --workdir DIR [overrides]``; returns ``(workdir, config)``.

    ``PRESET`` is a registered name or a ``*.json`` config file (as ``save_json`` writes it).
    The preset is looked up in the registry (``prefix`` is prepended when the name has no ``/``);
    every config field can then be overridden with tyro's typed flags, e.g. ``--train.num-steps``.
    """
    import tyro  # noqa: PLC0415  (entry points only)

    argv = list(sys.argv[1:] if argv is None else argv)
    names = preset_names(prefix)
    if not argv or argv[0].startswith("-"):
        usage = f"usage: {prog or 'python -m ' + prefix.rstrip('/') + '.train'} PRESET --workdir DIR [--field.sub value ...]"
        if argv and argv[0] in ("-h", "--help"):
            print(usage + "\npresets: " + ", ".join(names))
            raise SystemExit(0)
        raise SystemExit(usage + "\npresets: " + ", ".join(names))
    if argv[0].endswith(".json"):
        # A resolved config file (what sweeps write per trial); the class is the family's.
        if not names:
            raise SystemExit(f"no presets registered under {prefix!r}")
        name = argv[0]
        default = load_json(type(get_preset(names[0])), argv[0])
    else:
        name = argv[0] if "/" in argv[0] else prefix + argv[0]
        if name not in names:
            raise SystemExit(f"unknown preset {argv[0]!r}; known: {', '.join(names)}")
        default = get_preset(name)

    # Built with make_dataclass because the field type (the preset's class) is only known here.
    args_cls = dataclasses.make_dataclass(
        "Args",
        [
            ("workdir", str),
            (
                "config",
                typing.Annotated[type(default), tyro.conf.arg(name="")],
                dataclasses.field(default=default),
            ),
        ],
        frozen=True,
        kw_only=True,
    )
    args = tyro.cli(args_cls, args=argv[1:], prog=f"{prog} {name}".strip())
    return args.workdir, args.config
