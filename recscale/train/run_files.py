"""A run's files in its workdir, beside its checkpoints: ``config.json`` and ``command.txt``
(before step 0), ``run_info.json`` (every start), ``metrics.jsonl`` (train, eval and event rows),
``embedding_plan.txt`` and ``data_stats.json`` (the setup), ``timings.jsonl`` and
``data_reads.jsonl`` (one row per start). Process 0 writes them."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from data import roles
from data.roles import config_diffs
from data.sources import DataSource
from recscale import config as config_lib
from recscale.train.experiment import Experiment


def _has_checkpoints(workdir: Path) -> bool:
    d = workdir / "checkpoints"
    return d.is_dir() and any(p.name.isdigit() for p in d.iterdir())


def write_run_files(workdir: Path, cfg: Any, argv: list[str] | None) -> None:
    """``config.json`` (the resolved config) and ``command.txt`` (every invocation, appended).

    When the workdir already holds checkpoints, the saved config must match ``cfg`` except for
    non-semantic fields (checked on every process, so all of them stop together).
    """
    cfg_path = workdir / "config.json"
    if cfg_path.is_file() and _has_checkpoints(workdir):
        # Resuming: the checkpoints belong to the saved config; a changed one would silently mix.
        old = config_lib.to_dict(config_lib.load_json(type(cfg), cfg_path))
        diffs = config_diffs(old, config_lib.to_dict(cfg), roles.paths(type(cfg), resume_free=True))
        if diffs:
            raise ValueError(
                f"{workdir} holds a run with another config ({'; '.join(diffs)}); resume it with the "
                "same config or use a new --workdir"
            )
    if jax.process_index() != 0:
        return
    workdir.mkdir(parents=True, exist_ok=True)
    config_lib.save_json(cfg, cfg_path)
    args = sys.argv if argv is None else argv
    cmd = f"cd {shlex.quote(os.getcwd())} && " + shlex.join([Path(sys.executable).name, *args])
    with open(workdir / "command.txt", "a") as f:
        f.write(cmd + "\n")


def host_cpu() -> str:
    """The host's CPU model (``/proc/cpuinfo``'s model name, else ``platform.processor()``).

    XLA:CPU compiles for the host's instruction set, so runs on two CPU models may differ in
    the last bits of a step and, over a long training run, visibly (BENCHMARKS.md, the Frappe
    arm re-run): results rows record it so such differences can be told from a bug.
    """
    import platform  # noqa: PLC0415

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_run_info(workdir: Path, start_step: int) -> None:
    """``run_info.json``: the devices and library versions of every (re)start of the run."""
    if jax.process_index() != 0:
        return
    import importlib.metadata as md  # noqa: PLC0415

    path = workdir / "run_info.json"
    info = json.loads(path.read_text()) if path.is_file() else {"starts": []}
    devices = jax.devices()
    info["starts"].append(
        {
            "start_step": start_step,
            "time": time.time(),
            "device_kind": devices[0].device_kind,
            "platform": devices[0].platform,
            "host_cpu": host_cpu(),
            "device_count": len(devices),
            "process_count": jax.process_count(),
            "versions": {
                "python": sys.version.split()[0],
                **{p: md.version(p) for p in ("jax", "jaxlib", "flax", "optax", "numpy")},
            },
        }
    )
    path.write_text(json.dumps(info, indent=2) + "\n")


class MetricsWriter:
    """Appends JSON rows to ``<workdir>/metrics.jsonl`` (process 0 only)."""

    def __init__(self, path: Path):
        self.path = path
        self.enabled = jax.process_index() == 0

    def write(self, row: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")


def reads_per_process(source: DataSource) -> list[dict[str, int]]:
    """Examples each process read in this start (``data.sources.ReadCounts``), gathered from
    every process (a collective: all of them call it)."""
    mine = source.reads.as_dict()
    if jax.process_count() == 1:
        return [mine]
    keys = sorted(mine)
    # int32 halves (JAX arrays are 32-bit here): counts pass 2^31 in long runs.
    local = np.asarray([[mine[k] >> 31, mine[k] & 0x7FFFFFFF] for k in keys], np.int32)
    every = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(keys), 2)
    every = (every[..., 0].astype(np.int64) << 31) | every[..., 1]
    return [dict(zip(keys, map(int, row), strict=True)) for row in every]


def write_run_notes(workdir: Path, exp: Experiment) -> None:
    """``embedding_plan.txt`` (also printed) and ``data_stats.json``: the reader's counters
    (rows read / kept / rejected by reason, OOV counts), so nothing is dropped without a count."""
    if jax.process_index() != 0:
        return
    plans = exp.embedding_plans()
    if plans:
        text = "\n\n".join(f"{path or 'model'}:\n{plan}" for path, plan in plans.items())
        (workdir / "embedding_plan.txt").write_text(text + "\n")
        print(text, file=sys.stderr)
    if getattr(exp.source, "stats", None):
        (workdir / "data_stats.json").write_text(
            json.dumps(exp.source.stats, indent=2, default=str) + "\n"
        )


def append_row(path: Path, row: dict) -> None:
    """Appends ``row`` as one JSON line to ``path`` (process 0 only)."""
    if jax.process_index() == 0:
        with open(path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
