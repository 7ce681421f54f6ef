"""Multi-process JAX: start-up from the environment, and a launcher for one machine.

Every entry point (``python -m dlrm.train``, ``... .evaluate``) calls :func:`initialize_from_env`
first. With ``RECSCALE_DISTRIBUTED=1`` it calls ``jax.distributed.initialize``:

- with ``RECSCALE_COORDINATOR`` (``host:port``), ``RECSCALE_NUM_PROCESSES`` and
  ``RECSCALE_PROCESS_ID`` set, with those (this module's launcher sets them);
- otherwise with no arguments: JAX reads the cluster from SLURM (``srun``), the TPU VM's
  metadata, or its own ``JAX_*`` variables.

CPU processes exchange collectives through JAX's own gloo implementation
(``jax_cpu_collectives_implementation``), set before the runtime starts; GPU and TPU backends
use their own (NCCL, ICI/DCN) and ignore it.

``python -m recscale.launch --processes N [--devices-per-process K] -- COMMAND ...`` starts N
copies of COMMAND on this machine, each one JAX process of one run (a coordinator on
127.0.0.1): what ``srun`` does across hosts, for tests, for debugging a multi-host job on a
laptop, and for the sweep launcher's local multi-process trials. Process 0 writes to this
terminal, the others to ``LOG_DIR/process_<i>.log``. When any process fails, the others are
stopped (a JAX process whose peer died blocks in its next collective) and the launcher exits
with the failed process's code (one killed by a signal first: its peers' errors follow from
it), printing the tail of its log. SIGTERM and SIGINT are passed on
to every process (the trainer checkpoints on SIGTERM). JAX ships no such launcher and
``torchrun`` is PyTorch's; this one only starts processes and sets their environment.

``python -m recscale.launch --tpu-vm NAME [--zone Z] -- COMMAND ...`` starts COMMAND on every
worker of a Cloud TPU VM slice instead, through ``gcloud compute tpus tpu-vm ssh --worker=all``
(``--dry-run`` prints the command); the multi-host TPU hardware presets use it
(``--tpu-vm env``: the name from ``RECSCALE_TPU_NAME``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

DISTRIBUTED_ENV = "RECSCALE_DISTRIBUTED"
COORDINATOR_ENV = "RECSCALE_COORDINATOR"
NUM_PROCESSES_ENV = "RECSCALE_NUM_PROCESSES"
PROCESS_ID_ENV = "RECSCALE_PROCESS_ID"
CPU_DEVICES_ENV = "JAX_NUM_CPU_DEVICES"
"""JAX's own setting (``jax_num_cpu_devices``): CPU devices a process simulates."""


def initialize_from_env() -> bool:
    """Starts JAX's distributed runtime when ``RECSCALE_DISTRIBUTED=1`` (see the module
    docstring); returns whether it did. Must run before any JAX computation."""
    if os.environ.get(DISTRIBUTED_ENV, "") != "1":
        return False
    import jax  # noqa: PLC0415

    try:  # multi-process CPU collectives (all-reduce, all-to-all) through gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, KeyError, ValueError):  # a JAX without the option: its default
        pass
    coordinator = os.environ.get(COORDINATOR_ENV, "")
    if not coordinator:
        jax.distributed.initialize()
        _no_persistent_cache_on_cpu()
        return True
    try:
        num_processes = int(os.environ[NUM_PROCESSES_ENV])
        process_id = int(os.environ[PROCESS_ID_ENV])
    except (KeyError, ValueError) as e:
        raise ValueError(
            f"{COORDINATOR_ENV}={coordinator} needs integer {NUM_PROCESSES_ENV} and "
            f"{PROCESS_ID_ENV}: {e}"
        ) from None
    jax.distributed.initialize(
        coordinator,
        num_processes=num_processes,
        process_id=process_id,
        coordinator_bind_address=local_bind_address(coordinator),
    )
    _no_persistent_cache_on_cpu()
    return True


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def local_bind_address(coordinator: str) -> str | None:
    """Where process 0's coordinator service listens: on the loopback address itself when the
    coordinator is on this machine (``127.0.0.1:PORT``, as this module's launcher sets it), so
    that nothing off the machine can reach that unauthenticated service (JAX's default binds
    every interface, ``[::]:PORT``); None (JAX's default) for a coordinator other hosts reach."""
    host = coordinator.rsplit(":", 1)[0]
    return coordinator if host in LOOPBACK_HOSTS else None


def _no_persistent_cache_on_cpu() -> None:
    """Turns JAX's persistent compilation cache off in a multi-process CPU run.

    Measured here (jax 0.10.2): XLA:CPU's cache keys differ between the processes of one run,
    and only process 0 writes entries, so on a second run process 0 loads its programs from
    the cache while the others compile theirs; a sweep's second trial then hung in its first
    train step. Compiling everywhere costs seconds on CPU; GPU and TPU runs keep the cache.
    """
    import jax  # noqa: PLC0415

    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        jax.config.update("jax_enable_compilation_cache", False)


@contextlib.contextmanager
def exit_at_once_on_error() -> Iterator[None]:
    """Wraps an entry point: in a multi-process run, a process that fails (an exception, or
    ``SystemExit`` with a non-zero code) prints why and exits at once with ``os._exit``.

    Without it, JAX's exit handler waits at the distributed runtime's shutdown barrier for the
    other processes, which are blocked in a collective waiting for this one: every process
    hangs until the barrier times out (minutes). Exiting at once lets the launcher (or
    ``srun --kill-on-bad-exit``) stop the others."""
    try:
        yield
    except SystemExit as e:
        if e.code in (None, 0) or os.environ.get(DISTRIBUTED_ENV, "") != "1":
            raise
        code = e.code
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        _exit_now(code)
    except BaseException:
        if os.environ.get(DISTRIBUTED_ENV, "") != "1":
            raise
        traceback.print_exc()
        _exit_now(1)


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(
    base: dict[str, str],
    *,
    process_id: int,
    num_processes: int,
    port: int,
    devices_per_process: int = 0,
) -> dict[str, str]:
    """The environment of process ``process_id`` of a local run."""
    env = dict(base)
    env.update(
        {
            DISTRIBUTED_ENV: "1",
            COORDINATOR_ENV: f"127.0.0.1:{port}",
            NUM_PROCESSES_ENV: str(num_processes),
            PROCESS_ID_ENV: str(process_id),
        }
    )
    if devices_per_process:
        env[CPU_DEVICES_ENV] = str(devices_per_process)
    return env


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchArgs:
    """``python -m recscale.launch --processes N [...] -- COMMAND ...``"""

    processes: int = 0
    """JAX processes to start on this machine (one run)."""
    devices_per_process: int = 0
    """CPU devices each process simulates (``JAX_NUM_CPU_DEVICES``); 0 = as the environment
    says."""
    port: int = 0
    """Coordinator port on 127.0.0.1 (0 = a free one)."""
    log_dir: str = ""
    """Where processes 1.. write their output (default: a new temporary directory)."""
    grace_s: float = 10.0
    """After a failure or a signal: seconds the other processes get to exit before SIGKILL."""
    tpu_vm: str = ""
    """Instead of local processes: start COMMAND once on every worker of this Cloud TPU VM
    slice (``gcloud compute tpus tpu-vm ssh NAME --worker=all``), in this directory's path,
    with ``RECSCALE_DISTRIBUTED=1`` (JAX reads the slice from the TPU metadata). ``env``:
    ``RECSCALE_TPU_NAME``."""
    zone: str = ""
    """The TPU VM's zone (``--tpu-vm``; default ``RECSCALE_TPU_ZONE``, else gcloud's)."""
    project: str = ""
    """The TPU VM's project (``--tpu-vm``; default ``RECSCALE_TPU_PROJECT``, else gcloud's)."""
    dry_run: bool = False
    """``--tpu-vm``: print the gcloud command instead of running it."""


TPU_ENV_PASSED = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
"""Variables of this environment that ``--tpu-vm`` sets on the workers too (a hardware
preset's flags, e.g. ``tpu_gpu_configs``' LIBTPU_INIT_ARGS)."""


def tpu_vm_command(
    args: LaunchArgs, command: list[str], env: dict[str, str], cwd: str
) -> list[str]:
    """The ``gcloud`` command that runs ``command`` on every worker of ``args.tpu_vm`` (or
    ``env['RECSCALE_TPU_NAME']``): the same path as ``cwd`` on each (a shared or identically
    laid out checkout), ``RECSCALE_DISTRIBUTED=1`` and the variables of :data:`TPU_ENV_PASSED`."""
    name = args.tpu_vm if args.tpu_vm != "env" else env.get("RECSCALE_TPU_NAME", "")
    if not name:
        raise ValueError("--tpu-vm env needs RECSCALE_TPU_NAME (the TPU VM's name)")
    zone = args.zone or env.get("RECSCALE_TPU_ZONE", "")
    project = args.project or env.get("RECSCALE_TPU_PROJECT", "")
    exports = {DISTRIBUTED_ENV: "1", **{k: env[k] for k in TPU_ENV_PASSED if k in env}}
    remote = " ".join(
        ["cd", shlex.quote(cwd), "&&", "env"]
        + [shlex.quote(f"{k}={v}") for k, v in exports.items()]
        + [shlex.quote(c) for c in command]
    )
    # -tt: a terminal per worker, so that ending this command hangs up the workers' commands
    # instead of leaving them running on the slice
    cmd = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", name, "--worker=all", "--ssh-flag=-tt"]
    cmd += [f"--zone={zone}"] if zone else []
    cmd += [f"--project={project}"] if project else []
    return [*cmd, "--command", remote]


def launch(args: LaunchArgs, command: list[str]) -> int:
    """Runs ``command`` as ``args.processes`` JAX processes; returns the run's exit code (0 when
    every process exits 0, else the first failure's)."""
    if not command:
        raise ValueError("no command given: python -m recscale.launch --processes N -- COMMAND")
    if args.tpu_vm:
        cmd = tpu_vm_command(args, command, dict(os.environ), os.getcwd())
        if args.dry_run:
            print(shlex.join(cmd))
            return 0
        proc = subprocess.Popen(cmd)
        old = {
            s: signal.signal(s, lambda signum, _f: proc.send_signal(signum))
            for s in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            return proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    if args.processes < 1:
        raise ValueError(f"--processes must be >= 1, got {args.processes}")
    port = args.port or free_port()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="recscale-launch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    logs = []
    for i in range(args.processes):
        env = process_env(
            dict(os.environ),
            process_id=i,
            num_processes=args.processes,
            port=port,
            devices_per_process=args.devices_per_process,
        )
        out = None
        if i:
            out = open(log_dir / f"process_{i}.log", "wb")  # noqa: SIM115 (closed below)
            logs.append(out)
        procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=out))
    stopping: list[float] = []  # when a signal was passed on

    def forward(signum, _frame):
        stopping.append(time.monotonic())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = _wait(procs, args.grace_s, log_dir, stopping)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for f in logs:
            f.close()
    return code


def _wait(
    procs: list[subprocess.Popen], grace_s: float, log_dir: Path, stopping: list[float]
) -> int:
    while True:
        if stopping and time.monotonic() > stopping[0] + grace_s:
            # A process blocked in a collective never reaches its signal handler's exit.
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            print(
                f"recscale.launch: killed the processes still running {grace_s:g} s after "
                "the signal",
                file=sys.stderr,
            )
            return 128 + signal.SIGKILL
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # A process killed by a signal is the cause; the others' errors ("connection closed
            # by peer") follow from it, and may be reaped first.
            i, code = min(failed, key=lambda f: (f[1] >= 0, f[0]))
            _stop(procs, grace_s)
            where = "" if i == 0 else f"; its log: {log_dir / f'process_{i}.log'}"
            also = "".join(f"; process {j} exited with {c}" for j, c in failed if j != i)
            print(
                f"recscale.launch: process {i} exited with {code}{also}; stopped the others{where}",
                file=sys.stderr,
            )
            if i:
                _print_tail(log_dir / f"process_{i}.log")
            return code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _print_tail(path: Path, lines: int = 20) -> None:
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return
    for line in tail:
        print(f"  | {line}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    import tyro  # noqa: PLC0415

    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit(
            "error: usage: python -m recscale.launch (--processes N | --tpu-vm NAME) [...] "
            "-- COMMAND"
        )
    cut = argv.index("--")
    args = tyro.cli(LaunchArgs, args=argv[:cut], prog="python -m recscale.launch")
    try:
        code = launch(args, argv[cut + 1 :])
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()
