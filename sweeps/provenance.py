"""What produced an ``analysis.json`` (``sweeps.analyze``): the settings a regeneration must
reuse (bootstrap replicates, their seed, the reference sweep of a surface check) and what its
numbers' last bits depend on (library versions, the host's CPU). No jax: an analysis runs on a
laptop."""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path
from typing import Any

BOOTSTRAP_SEED = 0
"""Seed of every bootstrap of an analysis (``numpy.random.default_rng``): fits, holdouts,
optimal-size laws and loss surfaces each draw their replicates from a generator of this seed."""

DEFAULT_N_BOOT = 1000
"""Bootstrap replicates of a fresh analysis (one whose folder records no count)."""

LIBRARIES = ("numpy", "scipy", "pandas", "matplotlib")
"""The libraries whose versions an analysis's numbers and plots depend on (with the Python and
the CPU: numpy and OpenBLAS pick their kernels by instruction set)."""


def host_cpu() -> str:
    """The host's CPU model (``/proc/cpuinfo``'s model name, else ``platform.processor()``), as
    results rows record it (``recscale.train.run_files.host_cpu``, which imports jax)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def produced_by(n_boot: int, surface_from: str | None) -> dict[str, Any]:
    """The ``produced_by`` entry of an analysis written now."""
    return {
        "n_boot": int(n_boot),
        "bootstrap_seed": BOOTSTRAP_SEED,
        "surface_from": surface_from or None,
        "python": platform.python_version(),
        "versions": {lib: importlib.metadata.version(lib) for lib in LIBRARIES},
        "host_cpu": host_cpu(),
    }


def recorded_n_boot(analysis: dict[str, Any]) -> int | None:
    """The bootstrap replicates an analysis was made with: its ``produced_by``, or, for one
    written before it recorded them, the count its fits report (a loss surface's ``n_boot`` are
    its converged replicates, so its ``replicates_dropped`` are added back). None when it has no
    bootstrap; ValueError when its fits disagree."""
    if rec := analysis.get("produced_by"):
        return int(rec["n_boot"])
    counts: set[int] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("n_boot"), int):
                counts.add(node["n_boot"] + int(node.get("replicates_dropped") or 0))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(analysis)
    if len(counts) > 1:
        raise ValueError(f"the analysis's fits report different n_boot: {sorted(counts)}")
    return counts.pop() if counts else None


def same_environment(recorded: dict[str, Any] | None) -> bool:
    """Whether this process runs where ``recorded`` (a ``produced_by``) was written: same CPU
    model, Python and library versions; there an analysis regenerates bit for bit."""
    if not recorded or not recorded.get("versions"):
        return False
    now = produced_by(recorded.get("n_boot", 0), recorded.get("surface_from"))
    return all(recorded.get(k) == now[k] for k in ("python", "versions", "host_cpu"))
