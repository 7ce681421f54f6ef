"""Hardware presets: how a trial runs on a machine type (no jax import).

A :class:`LaunchPreset` says what a sweep's trials need from the cluster and the runtime:
hosts and devices, the mesh, the per-device batch, XLA flags and environment, the SLURM
resources submitit asks for, the planner's hardware profile, and the prefix that starts one
process per host. Multi-host trials set ``RECSCALE_DISTRIBUTED=1``, which makes the train
command call ``jax.distributed.initialize()`` (``recscale.launch``): with no arguments, JAX
reads the coordinator, process count and process id from SLURM (``srun``) or the TPU VM
metadata; ``python -m recscale.launch`` (the ``cpu-local-2proc`` prefix) passes them
explicitly for processes on one machine.

Use one in a sweep spec (``SweepSpec.hardware``) or on the command line
(``python -m sweeps.launch SPEC --hardware gpu-h100x8``). The XLA flags are the documented ones
for each platform (JAX GPU performance tips; the Cloud TPU performance guide); the per-device
batches are starting points, to be tuned per model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchPreset:
    name: str
    description: str
    platform: Literal["cpu", "gpu", "tpu"]
    num_hosts: int = 1
    devices_per_host: int = 1
    profile: str = ""
    """The planner's hardware profile of this machine (``tpu_gpu_configs.profiles``: memory,
    bandwidths, FLOP/s). Applied to a trial whose embedding engine is on and names no profile
    (``embeddings.profile``, with ``embeddings.host_size = devices_per_host``); empty: the
    profile of the device the trial runs on, by its JAX device kind
    (``profiles.profile_for_device_kind``)."""
    topology: str = ""
    """TPU slice topology as ``jax.experimental.topologies`` names it (``v5p:2x2x2``): what
    ``python -m recscale.plan --compile`` compiles for (TPU presets)."""
    per_device_batch: int = 0
    """Per-device batch (global = per_device_batch * devices); 0 = the spec's or preset's."""
    data_parallel: int = -1
    """Devices on the mesh's ``data`` axis (``MeshConfig.data_parallel``; -1 = all of them)."""
    xla_flags: tuple[str, ...] = ()
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    slurm: dict[str, Any] = dataclasses.field(default_factory=dict)
    """submitit ``update_parameters`` keywords for one trial worker (nodes, gpus_per_node, ...)."""
    command_prefix: tuple[str, ...] = ()
    """Prepended to each trial command: starts one process per host (e.g. ``srun``).
    ``{python}`` stands for the sweep worker's interpreter."""

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    @property
    def global_batch(self) -> int:
        return self.per_device_batch * self.num_devices

    @property
    def distributed(self) -> bool:
        return self.num_hosts > 1

    def trial_env(self) -> dict[str, str]:
        """Environment of a trial process."""
        env = dict(self.env)
        if self.xla_flags:
            env["XLA_FLAGS"] = " ".join(self.xla_flags)
        if self.distributed:
            env["RECSCALE_DISTRIBUTED"] = "1"
        return env


_GPU_FLAGS = (
    # JAX's GPU performance tips: overlap collectives with compute, latency-hiding scheduler.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_command_buffer=",
)
_TPU_ENV = {
    # Cloud TPU guide: larger async-collective fusion for data-parallel gradient reductions.
    "LIBTPU_INIT_ARGS": "--xla_tpu_enable_async_collective_fusion=true "
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_overlap_compute_collective_tc=true",
}


def _tpu_slice(generation: str, size: int, topology: str, *, per_device_batch: int) -> LaunchPreset:
    """A Cloud TPU slice by its accelerator type (``v5p-16``: v5p counts TensorCores, two per
    chip, so 8 chips; ``v6e-8``: v6e counts chips) and topology."""
    chips = math.prod(int(x) for x in topology.split("x"))
    per_host = {"v5p": 4, "v6e": 8}[generation]
    hosts = max(1, chips // per_host)
    if hosts == 1:
        where, prefix = f"one host x {chips} chips.", ()
    else:
        where = (
            f"{hosts} hosts x {per_host} chips. Run ONE sweep worker (anywhere gcloud reaches "
            "the slice) with RECSCALE_TPU_NAME (and RECSCALE_TPU_ZONE) set: each trial starts on "
            f"all {hosts} workers through gcloud ... ssh --worker=all (python -m recscale.launch "
            "--tpu-vm), in the same path."
        )
        prefix = ("{python}", "-m", "recscale.launch", "--tpu-vm", "env", "--")
    return LaunchPreset(
        name=f"tpu-{generation}-{size}",
        profile=f"tpu-{generation}",
        description=f"TPU {generation}-{size} slice ({topology}): {where}",
        platform="tpu",
        num_hosts=hosts,
        devices_per_host=min(chips, per_host),
        topology=f"{generation}:{topology}",
        per_device_batch=per_device_batch,
        env=_TPU_ENV,
        command_prefix=prefix,
    )


def _h100_hosts(
    name: str,
    description: str,
    *,
    hosts: int,
    gpus: int,
    cpus: int,
    minutes: int,
    profile: str = "gpu-h100",
    **kw: Any,
) -> LaunchPreset:
    """``hosts`` H100 80GB hosts of ``gpus`` GPUs (or another GPU's ``profile``): JAX's GPU
    flags, 8,192 examples per GPU, one SLURM task per host with ``cpus`` CPUs for ``minutes``."""
    return LaunchPreset(
        name=name,
        profile=profile,
        description=description,
        platform="gpu",
        num_hosts=hosts,
        devices_per_host=gpus,
        per_device_batch=8192,
        xla_flags=_GPU_FLAGS,
        slurm={
            "nodes": hosts,
            "tasks_per_node": 1,
            "gpus_per_node": gpus,
            "cpus_per_task": cpus,
            "timeout_min": minutes,
        },
        **kw,
    )


PRESETS: dict[str, LaunchPreset] = {
    p.name: p
    for p in (
        LaunchPreset(
            name="cpu-local",
            description="This machine's CPU, one process, one device (the default; CI, make run).",
            platform="cpu",
            slurm={"nodes": 1, "tasks_per_node": 1, "cpus_per_task": 2, "timeout_min": 60},
        ),
        LaunchPreset(
            name="cpu-local-2proc",
            profile="cpu-2core",
            description="This machine's CPU as 2 JAX processes x 4 simulated devices (one "
            "run, gloo collectives, started by python -m recscale.launch): a multi-host trial "
            "rehearsed on one machine.",
            platform="cpu",
            num_hosts=2,
            devices_per_host=4,
            slurm={"nodes": 1, "tasks_per_node": 1, "cpus_per_task": 2, "timeout_min": 60},
            command_prefix=(
                "{python}",
                "-m",
                "recscale.launch",
                "--processes",
                "2",
                "--devices-per-process",
                "4",
                "--",
            ),
        ),
        _h100_hosts("gpu-h100x1", "One H100 80GB.", hosts=1, gpus=1, cpus=16, minutes=240),
        _h100_hosts(
            "gpu-h200x1",
            "One H200 141GB.",
            hosts=1,
            gpus=1,
            cpus=16,
            minutes=240,
            profile="gpu-h200",
        ),
        _h100_hosts(
            "gpu-h100x8",
            "One 8x H100 host (DGX/HGX); data-parallel mesh over the 8 GPUs.",
            hosts=1,
            gpus=8,
            cpus=96,
            minutes=720,
        ),
        _h100_hosts(
            "gpu-h100x8-4nodes",
            "4 hosts x 8 H100 over InfiniBand: srun starts one process per host, "
            "each calls jax.distributed.initialize() (SLURM auto-detection).",
            hosts=4,
            gpus=8,
            cpus=96,
            minutes=720,
            # --overlap: the trial's step shares the worker job's allocation (Slurm >= 20.11).
            command_prefix=("srun", "--overlap", "--ntasks-per-node=1", "--kill-on-bad-exit=1"),
        ),
        _tpu_slice("v5p", 8, "2x2x1", per_device_batch=16384),
        _tpu_slice("v5p", 16, "2x2x2", per_device_batch=16384),
        _tpu_slice("v5p", 32, "2x2x4", per_device_batch=16384),
        _tpu_slice("v5p", 128, "4x4x4", per_device_batch=16384),
        _tpu_slice("v5p", 512, "4x8x8", per_device_batch=16384),
        _tpu_slice("v6e", 8, "2x4", per_device_batch=8192),
        _tpu_slice("v6e", 256, "16x16", per_device_batch=8192),
    )
}


def get(name: str) -> LaunchPreset:
    if name not in PRESETS:
        raise KeyError(f"unknown hardware preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
