"""Hardware profiles for the embedding planner: per-device memory, bandwidths and FLOP/s.

A literal table of vendor spec-sheet numbers (peak, per chip / GPU), except ``cpu-2core``, which
is this repository's 2-core CI-class VM as measured (matmul and memory stream). Peaks are
upper bounds, so the planner's estimated times, computed from them with calibration factors of 1
(``recscale.embeddings.planner.CostModel``), are optimistic and not measured seconds.
``CostModel.calibrated`` can fit the lookup factor to measured lookup times, but no command
calls it (only ``tests/recscale/test_planner.py`` does); the planner's *ranking* of plans only
needs the ratios between these numbers.

Sources: Google Cloud TPU system-architecture pages (v4, v5e, v5p, v6e/Trillium: HBM capacity
and bandwidth, ICI bandwidth per chip, bf16 peak); NVIDIA A100/H100/H200 SXM datasheets (HBM,
NVLink per GPU, dense bf16 peak).

A device finds its profile by its JAX ``device_kind`` (:func:`profile_for_device_kind`): the
strings XLA reports (its ``GetDeviceMemoryInBytes`` table and JAX's Pallas TPU tests name ``TPU
v4``, ``TPU v5 lite`` (v5e), ``TPU v5`` (v5p), ``TPU v6 lite`` (v6e); CUDA names GPUs ``NVIDIA
H100 80GB HBM3``, ``NVIDIA H200``, ``NVIDIA A100-SXM4-40GB``, ...). A GPU takes its chip's SXM
profile whatever its form factor (PCIe, NVL), except the 40 GB A100s, whose memory is half.
"""

from __future__ import annotations

import dataclasses
import re

GiB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    name: str
    memory_bytes: float
    """Device memory (HBM, or host RAM for the CPU profile)."""
    memory_bandwidth: float
    """Bytes/s between device memory and compute."""
    interconnect_bandwidth: float
    """Bytes/s one device can send to its peers (ICI / NVLink; memory copy for the CPU)."""
    flops: float
    """Peak FLOP/s (dense bf16 for accelerators, float32 for the CPU)."""
    devices_per_host: int
    """Devices sharing a host (the group a table-row-wise shard spans)."""
    cross_host_bandwidth: float
    """Bytes/s per device between hosts (DCN / InfiniBand)."""


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile(name="tpu-v4", memory_bytes=32 * GiB, memory_bandwidth=1.2e12,
                        interconnect_bandwidth=2.7e11, flops=275e12, devices_per_host=4,
                        cross_host_bandwidth=2.7e11),
        HardwareProfile(name="tpu-v5e", memory_bytes=16 * GiB, memory_bandwidth=8.19e11,
                        interconnect_bandwidth=2.0e11, flops=197e12, devices_per_host=8,
                        cross_host_bandwidth=2.0e11),
        HardwareProfile(name="tpu-v5p", memory_bytes=95 * GiB, memory_bandwidth=2.765e12,
                        interconnect_bandwidth=6.0e11, flops=459e12, devices_per_host=4,
                        cross_host_bandwidth=6.0e11),
        HardwareProfile(name="tpu-v6e", memory_bytes=32 * GiB, memory_bandwidth=1.64e12,
                        interconnect_bandwidth=4.48e11, flops=918e12, devices_per_host=8,
                        cross_host_bandwidth=4.48e11),
        HardwareProfile(name="gpu-a100", memory_bytes=80 * GiB, memory_bandwidth=2.039e12,
                        interconnect_bandwidth=3.0e11, flops=312e12, devices_per_host=8,
                        cross_host_bandwidth=2.5e10),
        HardwareProfile(name="gpu-a100-40gb", memory_bytes=40 * GiB, memory_bandwidth=1.555e12,
                        interconnect_bandwidth=3.0e11, flops=312e12, devices_per_host=8,
                        cross_host_bandwidth=2.5e10),
        HardwareProfile(name="gpu-h100", memory_bytes=80 * GiB, memory_bandwidth=3.35e12,
                        interconnect_bandwidth=4.5e11, flops=989e12, devices_per_host=8,
                        cross_host_bandwidth=5.0e10),
        HardwareProfile(name="gpu-h200", memory_bytes=141 * GiB, memory_bandwidth=4.8e12,
                        interconnect_bandwidth=4.5e11, flops=989e12, devices_per_host=8,
                        cross_host_bandwidth=5.0e10),
        # Measured on the CI-class VM: float32 matmul 120-150 GFLOP/s on both cores, memory
        # streams 16-29 GB/s; "devices" are simulated CPU devices sharing that memory.
        HardwareProfile(name="cpu-2core", memory_bytes=24 * GiB, memory_bandwidth=2.0e10,
                        interconnect_bandwidth=2.0e10, flops=1.3e11, devices_per_host=8,
                        cross_host_bandwidth=1.25e9),
    )
}  # fmt: skip


_TPU_KINDS = {
    "tpu v4": "tpu-v4",
    "tpu v5 lite": "tpu-v5e",
    "tpu v5e": "tpu-v5e",
    "tpu v5": "tpu-v5p",
    "tpu v5p": "tpu-v5p",
    "tpu v6 lite": "tpu-v6e",
    "tpu v6e": "tpu-v6e",
}
# First match wins (a 40 GB A100 before the 80 GB one); ``\b`` keeps "GH200" from matching
# "H200" (a Grace Hopper superchip's GPU is an H100 or an H200 by its memory: not told here).
_GPU_KINDS = (
    (r"\bh200\b", "gpu-h200"),
    (r"\bh100\b", "gpu-h100"),
    (r"\ba100\b.*\b40gb\b", "gpu-a100-40gb"),
    (r"\ba100\b", "gpu-a100"),
)
PLATFORM_DEFAULTS = {"cpu": "cpu-2core", "gpu": "gpu-h100", "tpu": "tpu-v5p"}
"""The profile of a device whose kind is not in the table, by platform."""


def profile_for_device_kind(device_kind: str) -> str | None:
    """The profile of a JAX device by its ``device_kind`` (``TPU v5 lite`` -> ``tpu-v5e``,
    ``NVIDIA H100 80GB HBM3`` -> ``gpu-h100``, ``cpu`` -> ``cpu-2core``); None when unknown."""
    kind = " ".join(device_kind.lower().split())
    if kind == "cpu":
        return "cpu-2core"
    if kind in _TPU_KINDS:
        return _TPU_KINDS[kind]
    return next((name for pattern, name in _GPU_KINDS if re.search(pattern, kind)), None)


def get_profile(name: str) -> HardwareProfile:
    if name not in PROFILES:
        raise KeyError(f"unknown hardware profile {name!r}; known: {', '.join(sorted(PROFILES))}")
    return PROFILES[name]
