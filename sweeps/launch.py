"""``python -m sweeps.launch SPEC [--backend local|ray|slurm] [--max-parallel N] [--dry-run]``.

Resolves the spec (a module path such as ``sweeps.specs.showcase`` or a ``.py`` file defining
``SPEC``), writes the sweep directory, and runs every unfinished trial through the family's
normal train command. Idempotent: a relaunch skips finished trials, takes over trials whose
worker died (their heartbeat went stale) and resumes them from their own checkpoints, and
retries FAILED trials up to ``max_retries``; any number of launchers may run on one sweep.

Backends (every one runs :func:`sweeps.runner.run_worker` loops that pull trials from the
sweep directory, so they need a filesystem all workers share):

* ``local``: ``--max-parallel`` worker threads here, each running one trial subprocess at a time.
* ``ray``: ``--max-parallel`` Ray tasks on the cluster at ``--ray-address`` (``auto`` for the
  one this node belongs to; empty starts a local one, which Ray guards with token
  authentication: :func:`ray_init_kwargs`), ``--ray-cpus-per-trial`` CPUs each.
* ``slurm``: ``--max-parallel`` submitit jobs with the hardware preset's SLURM resources
  (``--slurm-partition``); ``--submitit-cluster local`` runs them as local processes instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Literal

import tyro

import tpu_gpu_configs
from recscale import config as config_lib
from sweeps.progress import SweepProgress
from sweeps.runner import WorkerOptions, new_owner, run_worker
from sweeps.spec import Resolution, SweepSpec, load_spec, resolve
from sweeps.store import SweepStore, atomic_write_text


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchArgs:
    spec: Annotated[str, tyro.conf.Positional]
    """Sweep spec: ``package.module`` or ``path/to/spec.py`` defining ``SPEC``."""
    sweep_dir: str = ""
    """Sweep directory (default ``runs/sweeps/<spec name>``)."""
    backend: Literal["local", "ray", "slurm"] = "local"
    max_parallel: int = 1
    """Trials running at once (worker threads, Ray tasks or SLURM jobs)."""
    dry_run: bool = False
    """Print the resolved trials and their statuses; run nothing (no jax import)."""
    hardware: str = ""
    """``tpu_gpu_configs`` preset (default: the spec's)."""
    heartbeat: float = 10.0
    """Seconds between heartbeats of a running trial."""
    stale_after: float = 60.0
    """Seconds without a heartbeat after which a trial's worker counts as dead."""
    wait: bool = True
    """Wait for trials other launchers are running (and take them over if they die)."""
    isolate_trials: bool = False
    """Run every trial in a fresh process instead of one long-lived Python per worker
    (``sweeps.trial_server``): slower (start-up and imports per trial), for debugging or for
    trials that leak state."""
    progress_every: float = 2.0
    """Seconds between updates of the progress view (done / running / failed / remaining,
    ETA; a line every 30 s when stderr is not a terminal)."""
    ray_address: str = ""
    ray_cpus_per_trial: float = 1.0
    submitit_cluster: Literal["slurm", "local", "debug"] = "slurm"
    slurm_partition: str = ""


def main(argv: list[str] | None = None) -> int:
    args = tyro.cli(LaunchArgs, args=argv, prog="python -m sweeps.launch")
    ray_init = ray_init_kwargs(args.ray_address, os.environ) if args.backend == "ray" else {}
    spec = load_spec(args.spec)
    if args.hardware:
        spec = dataclasses.replace(spec, hardware=args.hardware)
    hw = tpu_gpu_configs.get(spec.hardware)
    sweep_dir = Path(args.sweep_dir or f"runs/sweeps/{spec.name}").absolute()
    res = resolve(spec)
    store = SweepStore(sweep_dir, stale_after=args.stale_after)
    if args.dry_run:
        print_plan(spec, res, store)
        return 0
    write_sweep(store, spec, res)
    opts = WorkerOptions(
        heartbeat_s=args.heartbeat,
        stale_after_s=args.stale_after,
        max_retries=spec.max_retries,
        timeout_s=spec.trial_timeout_s,
        max_takeovers=spec.max_takeovers,
        wait=args.wait,
        env={
            # A model size recurs across budgets and seeds: its programs compile once per sweep
            # (or once per cache, when the environment names one to share between sweeps).
            "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR")
            or str(sweep_dir / "jax_cache"),
            # Eval programs compile in ~0.5 s on CPU, under JAX's 1 s default for caching.
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": os.environ.get(
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1"
            ),
            **hw.trial_env(),
        },
        command_prefix=hw.command_prefix,
        sweep=spec.name,
        code_version=res.code_version,
        data_fingerprints=res.data_fingerprints,
        metric=spec.metric,
        reuse_process=not args.isolate_trials,
    )
    trials = [t.to_dict() for t in res.trials]
    n = max(args.max_parallel, 1)
    print(
        f"sweep {spec.name}: {len(trials)} trials in {sweep_dir} ({args.backend}, {n} at once)",
        file=sys.stderr,
    )
    with SweepProgress(store, trials, poll_s=args.progress_every):
        if args.backend == "local":
            counts = _run_local(str(sweep_dir), trials, opts, n)
        elif args.backend == "ray":
            counts = _run_ray(str(sweep_dir), trials, opts, n, args, hw, ray_init)
        else:
            counts = _run_submitit(str(sweep_dir), trials, opts, n, args, hw)
    rows = {r["trial_id"]: r for r in store.results()}
    statuses = [store.status(t.trial_id, rows) for t in res.trials]
    summary = {s: statuses.count(s) for s in sorted(set(statuses))}
    print(json.dumps({"sweep_dir": str(sweep_dir), "statuses": summary, "workers": counts}))
    return 0 if all(s in ("SUCCESS", "DIVERGED") for s in statuses) else 1


def write_sweep(store: SweepStore, spec: SweepSpec, res: Resolution) -> None:
    """``sweep.json`` and each trial's ``trial.json`` + ``config.json`` (idempotent)."""
    with store.lock():
        summary = {
            "name": spec.name,
            "metric": spec.metric,
            "code_version": res.code_version,
            "data_fingerprints": res.data_fingerprints,
            "trial_ids": [t.trial_id for t in res.trials],
            "skipped": list(res.skipped),
            "spec": config_lib.to_dict(spec),
        }
        atomic_write_text(
            store.root / "sweep.json", json.dumps(summary, indent=2, default=str) + "\n"
        )
        for t in res.trials:
            tdir = store.trial_dir(t.trial_id)
            tdir.mkdir(parents=True, exist_ok=True)
            run_config = t.run_config(store.workdir(t.branch_of)) if t.branch_of else t.config
            # Each written whole (a killed launcher leaves the old file or none), the config
            # first; a missing or unreadable one (a launcher killed before either was atomic)
            # is written again: both are functions of the trial.
            for name, text in (
                ("config.json", json.dumps(run_config, indent=2, sort_keys=True) + "\n"),
                ("trial.json", json.dumps(t.to_dict(), indent=2) + "\n"),
            ):
                if not _readable_json(tdir / name):
                    atomic_write_text(tdir / name, text)


def _readable_json(path: Path) -> bool:
    try:
        json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return True


def print_plan(spec: SweepSpec, res: Resolution, store: SweepStore) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    rows = {r["trial_id"]: r for r in store.results()}
    table = Table(title=f"sweep {spec.name} ({len(res.trials)} trials, code {res.code_version})")
    batch_sweep = bool(spec.batch_sizes or spec.lr_rules)
    cols = [
        "trial",
        "family",
        "rung",
        "budget",
        "FLOPs/ex",
        "steps",
        "examples",
        "lr",
        "dense params",
        "status",
    ]
    if batch_sweep:
        cols[5:5] = ["batch", "recipe"]
    if spec.branches:  # a branch trains from its stable run's step on
        cols.insert(-1, "from step")
    for col in cols:
        table.add_column(col, justify="left" if col in ("trial", "family", "rung") else "right")
    for t in res.trials:
        cells = [
            t.trial_id,
            t.family,
            t.rung,
            f"{t.budget:.3g}",
            f"{t.flops_per_example:.3g}",
            str(t.steps),
            f"{t.examples:,}",
            f"{t.config['dense_optim']['learning_rate']:.3g}",
            f"{t.params_dense:,}",
            store.status(t.trial_id, rows),
        ]
        if batch_sweep:
            cells[5:5] = [f"{t.batch_size:,}", f"{t.lr_rule} x{t.lr_multiplier:g}"]
        if spec.branches:
            cells.insert(-1, f"{t.branch_step} of {t.branch_of[:8]}" if t.branch_of else "0")
        table.add_row(*cells)
    console = Console(width=160)
    console.print(table)
    for s in res.skipped:
        console.print(f"skipped: {s}")


def _run_local(sweep_dir: str, trials: list[dict], opts: WorkerOptions, n: int) -> list[dict]:
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=n) as pool:
        futs = [
            pool.submit(run_worker, sweep_dir, trials, opts, new_owner(), stop) for _ in range(n)
        ]
        try:
            return [f.result() for f in futs]
        except KeyboardInterrupt:
            stop.set()  # workers kill their trials and release the claims
            raise


def ray_task_options(hw: tpu_gpu_configs.LaunchPreset, cpus_per_trial: float) -> dict:
    """Ray resources of one worker task: its CPUs, and the accelerators of the machine a trial
    runs on (the preset's GPUs, or its TPU chips as Ray's ``TPU`` resource), so Ray places each
    worker on a node that has them. A trial spanning several hosts is started by ``srun`` or
    the TPU VM's tooling, not from inside one Ray task: refused."""
    if hw.num_hosts > 1 and "recscale.launch" not in hw.command_prefix:
        raise ValueError(
            f"hardware {hw.name!r} spans {hw.num_hosts} hosts: run it with --backend slurm "
            "(srun starts one process per host); a Ray task runs on one node"
        )
    options: dict = {"num_cpus": cpus_per_trial, "max_retries": 0}
    if hw.platform == "gpu":
        options["num_gpus"] = hw.devices_per_host
    elif hw.platform == "tpu":
        options["resources"] = {"TPU": hw.devices_per_host}
    return options


RAY_AUTH_ENV = "RAY_AUTH_MODE"
RAY_MIN_LOCAL = (2, 59)
"""The oldest Ray that starts a local cluster with token authentication by default."""


def _ray_version() -> str:
    """The installed Ray's ``__version__`` (imported here: the launch uses it next)."""
    try:
        import ray  # noqa: PLC0415
    except ImportError:
        raise SystemExit("error: --backend ray needs Ray: pip install 'recscale[ray]'") from None
    return str(getattr(ray, "__version__", ""))


def ray_init_kwargs(address: str, env: Mapping[str, str], version: str | None = None) -> dict:
    """``ray.init``'s arguments for ``--ray-address`` ``address`` (empty: a cluster this launch
    starts on this machine), checked against the environment ``env``.

    Ray cannot keep a cluster it starts here to 127.0.0.1: its GCS and raylet listen on every
    interface, and ``ray.init(_node_ip_address="127.0.0.1")`` is turned into the machine's
    address (``resolve_ip_for_localhost``; measured with Ray 2.60). What guards that cluster is
    Ray's token authentication, on by default for a new local cluster since Ray 2.59 (the
    oldest this project allows; Ray writes the token to ``~/.ray/auth_token``), so an
    environment that turns it off (``RAY_AUTH_MODE`` other than ``token``) is refused. Its
    dashboard is off, and bound to 127.0.0.1 should a Ray version start it anyway. An older Ray
    (``version``; None: the installed one's) is refused: pyproject's floor binds only installs
    through the ``ray`` extra. A cluster given by address is the user's, with its own settings."""
    if address:
        return {"address": address, "include_dashboard": False, "log_to_driver": False}
    mode = env.get(RAY_AUTH_ENV, "token")
    if mode.lower() != "token":
        raise SystemExit(
            f"error: --backend ray without --ray-address starts a Ray cluster here, which "
            f"listens on every interface: it needs token authentication, but {RAY_AUTH_ENV}="
            f"{mode}; unset it, or start a cluster yourself and pass --ray-address"
        )
    version = _ray_version() if version is None else version
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) < RAY_MIN_LOCAL:
        floor = ".".join(map(str, RAY_MIN_LOCAL))
        raise SystemExit(
            f"error: --backend ray without --ray-address starts a Ray cluster here, which "
            f"listens on every interface: it needs Ray {floor} or later (token authentication "
            f"by default), found Ray {version!r}; pip install 'ray>={floor}', or start a "
            f"cluster yourself and pass --ray-address"
        )
    return {
        "address": None,
        "include_dashboard": False,
        "dashboard_host": "127.0.0.1",
        "log_to_driver": False,
    }


def _run_ray(sweep_dir, trials, opts, n, args, hw, ray_init: dict) -> list[dict]:
    import ray  # noqa: PLC0415

    options = ray_task_options(hw, args.ray_cpus_per_trial)  # before starting anything
    ray.init(**ray_init)
    try:
        remote = ray.remote(**options)(_ray_worker)
        refs = [remote.remote(sweep_dir, trials, opts, i) for i in range(n)]
        return ray.get(refs)
    finally:
        ray.shutdown()


def _ray_worker(sweep_dir: str, trials: list[dict], opts: WorkerOptions, i: int) -> dict:
    return run_worker(sweep_dir, trials, opts, new_owner(f"ray{i}"))


def _submitit_worker(sweep_dir: str, trials: list[dict], opts: WorkerOptions, i: int) -> dict:
    return run_worker(sweep_dir, trials, opts, new_owner(f"slurm{i}"))


def _run_submitit(sweep_dir, trials, opts, n, args, hw) -> list[dict]:
    import submitit  # noqa: PLC0415

    executor = submitit.AutoExecutor(
        folder=str(Path(sweep_dir) / "submitit" / "%j"), cluster=args.submitit_cluster
    )
    params = dict(hw.slurm)
    if args.submitit_cluster == "slurm":
        if args.slurm_partition:
            params["slurm_partition"] = args.slurm_partition
        executor.update_parameters(name=f"sweep-{Path(sweep_dir).name}", **params)
    else:  # local/debug executors take only the generic parameters
        generic = {
            k: v
            for k, v in params.items()
            if k in ("timeout_min", "nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node")
        }
        executor.update_parameters(**generic)
    jobs = [executor.submit(_submitit_worker, sweep_dir, trials, opts, i) for i in range(n)]
    print(f"submitted {[j.job_id for j in jobs]}", file=sys.stderr)
    if not args.wait:
        return []
    return [j.result() for j in jobs]


if __name__ == "__main__":
    sys.exit(main())
