"""Hardware presets, and the train command's multi-host start."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import tpu_gpu_configs
from recscale import launch
from sweeps.spec import FamilySpec, SweepSpec, dlrm_ladder, resolve


def test_presets_are_consistent():
    for name, p in tpu_gpu_configs.PRESETS.items():
        assert p.name == name and p.num_devices >= 1
        env = p.trial_env()
        assert ("RECSCALE_DISTRIBUTED" in env) == (p.num_hosts > 1)
        if p.xla_flags:
            assert env["XLA_FLAGS"].split() == list(p.xla_flags)
        if "--tpu-vm" in p.command_prefix:  # every worker of a TPU slice, through gcloud
            assert p.platform == "tpu" and p.num_hosts > 1 and p.topology
        elif "recscale.launch" in p.command_prefix:  # processes on one machine
            args = p.command_prefix
            assert args[args.index("--processes") + 1] == str(p.num_hosts)
            assert args[args.index("--devices-per-process") + 1] == str(p.devices_per_host)
            assert p.platform == "cpu" and p.slurm.get("nodes", 1) == 1
        elif p.slurm and p.num_hosts > 1:
            assert p.slurm["nodes"] == p.num_hosts and p.command_prefix[0] == "srun"
    with pytest.raises(KeyError, match="known: "):
        tpu_gpu_configs.get("gpu-nonexistent")


def test_hardware_sets_the_global_batch_and_mesh():
    fam = FamilySpec(
        family="dlrm",
        preset="dlrm/tiny",
        ladder=dlrm_ladder(((4, (8, 4), (8, 1)),)),
        # the per-table reference: with the engine the machine's profile is part of the plan,
        # and the plan of a trial's identity (test_a_preset_plans_the_engine_for_its_machine)
        overrides={"embeddings.sharding": "off"},
    )
    spec = SweepSpec(
        name="t", families=(fam,), budgets=(1e12,), code_version="x", hardware="gpu-h100x8"
    )
    (t,) = resolve(spec).trials
    hw = tpu_gpu_configs.get("gpu-h100x8")
    assert t.batch_size == hw.per_device_batch * 8 == t.config["data"]["batch_size"]
    assert t.config["mesh"]["data_parallel"] == -1
    # a preset's mesh is not part of the trial's identity (same run on another mesh)
    (cpu,) = resolve(
        dataclasses.replace(spec, hardware="cpu-local", batch_size=t.batch_size)
    ).trials
    assert cpu.trial_id == t.trial_id


def test_distributed_env_initialises_jax_distributed(monkeypatch):
    import jax

    calls, updates = [], []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(jax.config, "update", lambda *a: updates.append(a))
    for name in (launch.DISTRIBUTED_ENV, launch.COORDINATOR_ENV):
        monkeypatch.delenv(name, raising=False)
    assert not launch.initialize_from_env()
    assert calls == []
    monkeypatch.setenv(launch.DISTRIBUTED_ENV, "1")
    assert launch.initialize_from_env()
    assert calls == [((), {})]  # no arguments: JAX reads SLURM / TPU / JAX_* settings
    assert updates[-1] == ("jax_cpu_collectives_implementation", "gloo")
    # The local launcher's variables: an explicit coordinator, count and id.
    env = launch.process_env({}, process_id=1, num_processes=2, port=4242, devices_per_process=3)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert env[launch.CPU_DEVICES_ENV] == "3"
    launch.initialize_from_env()
    # A coordinator on this machine listens on the loopback address only (issue 35).
    bind = {"coordinator_bind_address": "127.0.0.1:4242"}
    assert calls[-1] == (("127.0.0.1:4242",), {"num_processes": 2, "process_id": 1, **bind})
    monkeypatch.setenv(launch.COORDINATOR_ENV, "10.1.2.3:4242")  # one other hosts reach
    launch.initialize_from_env()
    assert calls[-1][1]["coordinator_bind_address"] is None  # JAX's default: every interface
    monkeypatch.setenv(launch.COORDINATOR_ENV, "127.0.0.1:4242")
    monkeypatch.setenv(launch.PROCESS_ID_ENV, "one")
    with pytest.raises(ValueError, match="RECSCALE_PROCESS_ID"):
        launch.initialize_from_env()


@pytest.mark.skipif(not Path("/proc/net/tcp6").exists(), reason="reads Linux's socket table")
def test_the_local_coordinator_listens_on_loopback_only():
    """The launcher's coordinator (``127.0.0.1:PORT``) is a real JAX distributed service bound
    to 127.0.0.1, not to every interface (JAX's default, ``[::]:PORT``): the socket table holds
    one listening socket on its port, on the loopback address."""
    code = textwrap.dedent(
        """
        import json, os
        from recscale import launch
        assert launch.initialize_from_env()
        port = int(os.environ[launch.COORDINATOR_ENV].rsplit(":", 1)[1])
        found = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in open(table).read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # LISTEN
                    found.append(local.rsplit(":", 1)[0])
        print(json.dumps(found))
        import jax
        jax.distributed.shutdown()
        """
    )
    env = launch.process_env(
        dict(os.environ), process_id=0, num_processes=1, port=launch.free_port()
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    # /proc/net/tcp{,6} spell addresses in hex words: 127.0.0.1, ::ffff:127.0.0.1 (gRPC's
    # IPv6 socket for an IPv4 address), ::1; every interface is 0.0.0.0 or :: (all zeros).
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    found = json.loads(res.stdout.strip().splitlines()[-1])
    assert found and set(found) <= loopback, found


def test_a_malformed_distributed_setting_is_a_one_line_cli_error(monkeypatch, tmp_path):
    import dlrm.train

    monkeypatch.setenv(launch.DISTRIBUTED_ENV, "1")
    monkeypatch.setenv(launch.COORDINATOR_ENV, "127.0.0.1:1")
    monkeypatch.setenv(launch.NUM_PROCESSES_ENV, "2")
    monkeypatch.setenv(launch.PROCESS_ID_ENV, "one")
    with pytest.raises(
        SystemExit,
        match=r"^error: RECSCALE_COORDINATOR=127.0.0.1:1 needs .*"
        r"RECSCALE_PROCESS_ID",
    ):
        dlrm.train.main(["dlrm/tiny", "--workdir", str(tmp_path / "run")])


def test_a_preset_plans_the_engine_for_its_machine():
    """A v6e preset plans with the v6e profile (32 GB, 8 chips per host), not the v5p's
    (95 GB) that the TPU backend's default would give; an engine-off trial is unchanged."""
    fam = FamilySpec(
        family="dlrm",
        preset="dlrm/tiny",
        ladder=dlrm_ladder(((4, (8, 4), (8, 1)),)),
        overrides={"embeddings.sharding": "auto"},
    )
    spec = SweepSpec(
        name="t", families=(fam,), budgets=(1e12,), code_version="x", hardware="tpu-v6e-8"
    )
    (t,) = resolve(spec).trials
    assert t.config["embeddings"]["profile"] == "tpu-v6e"
    assert t.config["embeddings"]["host_size"] == 8
    off = dataclasses.replace(
        spec,
        families=(dataclasses.replace(fam, overrides={"embeddings.sharding": "off"}),),
    )
    (t_off,) = resolve(off).trials
    assert t_off.config["embeddings"]["profile"] == ""


def test_ray_tasks_request_the_presets_accelerators():
    from sweeps.launch import ray_task_options

    gpu = ray_task_options(tpu_gpu_configs.get("gpu-h100x8"), 8.0)
    assert gpu == {"num_cpus": 8.0, "max_retries": 0, "num_gpus": 8}
    tpu = ray_task_options(tpu_gpu_configs.get("tpu-v6e-8"), 1.0)
    assert tpu["resources"] == {"TPU": 8} and "num_gpus" not in tpu
    assert ray_task_options(tpu_gpu_configs.get("cpu-local-2proc"), 2.0) == {
        "num_cpus": 2.0,
        "max_retries": 0,
    }
    with pytest.raises(ValueError, match="--backend slurm"):
        ray_task_options(tpu_gpu_configs.get("gpu-h100x8-4nodes"), 1.0)


FAKE_GCLOUD = """#!/bin/bash
# Records its arguments, then runs --command on 2 "workers" as a TPU VM's ssh --worker=all would.
printf '%s\\n' "$@" > "$FAKE_GCLOUD_LOG"
while [ "$1" != "--command" ]; do shift; done
for w in 0 1; do WORKER=$w bash -c "$2" || exit $?; done
"""


def test_multi_host_tpu_trials_start_on_every_worker_through_gcloud(tmp_path, monkeypatch):
    """The multi-host TPU presets start each trial with ``recscale.launch --tpu-vm env``: one
    gcloud ssh to every worker of the slice, in the same path, with RECSCALE_DISTRIBUTED=1 and
    the preset's libtpu flags. Rehearsed with a fake gcloud that runs the remote command on 2
    local "workers"."""
    import subprocess
    import sys

    hw = tpu_gpu_configs.get("tpu-v5p-128")
    assert hw.num_hosts == 16 and hw.topology == "v5p:4x4x4"
    assert hw.command_prefix[1:] == ("-m", "recscale.launch", "--tpu-vm", "env", "--")
    fake = tmp_path / "bin" / "gcloud"
    fake.parent.mkdir()
    fake.write_text(FAKE_GCLOUD)
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    probe = (
        f"import os; open(os.path.join({str(out)!r}, 'w' + os.environ['WORKER']), 'w')"
        ".write(os.getcwd() + ' ' + os.environ['RECSCALE_DISTRIBUTED'] + ' ' "
        "+ os.environ['LIBTPU_INIT_ARGS'])"
    )
    cmd = [sys.executable if p == "{python}" else p for p in hw.command_prefix]
    env = {
        **os_environ_without_recscale(),
        **hw.env,
        "PATH": f"{fake.parent}:/usr/bin:/bin",
        "FAKE_GCLOUD_LOG": str(tmp_path / "args"),
        "RECSCALE_TPU_NAME": "my-slice",
        "RECSCALE_TPU_ZONE": "us-east5-a",
    }
    repo = str(tpu_gpu_configs.__file__).rsplit("/tpu_gpu_configs", 1)[0]
    subprocess.run([*cmd, sys.executable, "-c", probe], cwd=repo, env=env, check=True, timeout=60)
    args = (tmp_path / "args").read_text().splitlines()
    assert args[:8] == [
        "compute",
        "tpus",
        "tpu-vm",
        "ssh",
        "my-slice",
        "--worker=all",
        "--ssh-flag=-tt",
        "--zone=us-east5-a",
    ]
    for w in ("w0", "w1"):
        cwd, distributed, flags = (out / w).read_text().split(" ", 2)
        assert (cwd, distributed, flags) == (repo, "1", hw.env["LIBTPU_INIT_ARGS"])
    dry = subprocess.run(
        [*cmd[:-1], "--dry-run", "--", "train", "a b"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert dry.stdout.startswith(
        "gcloud compute tpus tpu-vm ssh my-slice --worker=all --ssh-flag=-tt"
    )
    assert "RECSCALE_DISTRIBUTED=1" in dry.stdout and "'a b'" in dry.stdout
    env.pop("RECSCALE_TPU_NAME")
    bad = subprocess.run(
        [*cmd, "train"], cwd=repo, env=env, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0 and "RECSCALE_TPU_NAME" in bad.stderr
    assert "Traceback" not in bad.stderr


def os_environ_without_recscale() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("RECSCALE_")}


class _FakeRay(types.ModuleType):
    """Records ``ray.init``; its tasks return a worker's counts without running anything."""

    def __init__(self, version: str = "2.60.0"):
        super().__init__("ray")
        self.__version__ = version
        self.inits: list[dict] = []

    def init(self, **kw):
        self.inits.append(kw)

    def remote(self, **options):
        return lambda fn: types.SimpleNamespace(remote=lambda *a: {"ran": 0})

    def get(self, refs):
        return refs

    def shutdown(self):
        pass


def _ray_spec(tmp_path) -> Path:
    spec = tmp_path / "spec.py"
    spec.write_text(
        "from sweeps.spec import FamilySpec, SweepSpec, dlrm_ladder\n"
        "SPEC = SweepSpec(name='t', families=(FamilySpec(family='dlrm', preset='dlrm/tiny', "
        "ladder=dlrm_ladder(((4, (8, 4), (8, 1)),))),), budgets=(2e7,), min_steps=5, "
        "code_version='x')\n"
    )
    return spec


def test_a_local_ray_cluster_needs_a_ray_with_token_auth_by_default(tmp_path, monkeypatch):
    """A Ray older than 2.59 starts a local cluster without token authentication, listening on
    every interface: ``--backend ray`` without an address refuses it in one line, before
    anything is written (pyproject's floor binds only installs through the ``ray`` extra). A
    cluster given by address is the user's, whatever the Ray here."""
    from sweeps import launch as sweep_launch

    spec = _ray_spec(tmp_path)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    argv = [str(spec), "--backend", "ray", "--progress-every", "60"]
    for version in ("2.58.1", "1.13.0", "", "nightly"):
        fake = _FakeRay(version)
        monkeypatch.setitem(sys.modules, "ray", fake)
        with pytest.raises(SystemExit) as e:
            sweep_launch.main([*argv, "--sweep-dir", str(tmp_path / "a")])
        msg = str(e.value)
        assert msg.startswith("error: ") and "\n" not in msg, msg
        assert f"Ray {version!r}" in msg and "2.59 or later" in msg, msg
        assert fake.inits == [] and not (tmp_path / "a").exists()
    for version in ("2.59.0", "2.60.0", "3.0.0.dev0"):
        monkeypatch.setitem(sys.modules, "ray", fake := _FakeRay(version))
        sweep_launch.main([*argv, "--sweep-dir", str(tmp_path / version)])
        assert fake.inits[-1]["address"] is None
    monkeypatch.setitem(sys.modules, "ray", fake := _FakeRay("2.40.0"))
    sweep_launch.main([*argv, "--sweep-dir", str(tmp_path / "c"), "--ray-address", "h:6379"])
    assert fake.inits[-1]["address"] == "h:6379"


def test_a_local_ray_cluster_is_started_with_token_auth_and_no_open_dashboard(
    tmp_path, monkeypatch
):
    """``--backend ray`` without an address starts a Ray cluster here; Ray binds it to every
    interface whatever it is told, so the launcher keeps Ray's token authentication on (an
    environment that turns it off is refused, before anything is written) and the dashboard
    off and on 127.0.0.1. A cluster given by address is left to its own settings."""
    from sweeps import launch as sweep_launch

    spec = _ray_spec(tmp_path)
    fake = _FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    argv = [str(spec), "--backend", "ray", "--progress-every", "60"]
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(SystemExit, match=r"^error: --backend ray without --ray-address .*"):
        sweep_launch.main([*argv, "--sweep-dir", str(tmp_path / "a")])
    assert fake.inits == [] and not (tmp_path / "a").exists()
    monkeypatch.delenv("RAY_AUTH_MODE")
    sweep_launch.main([*argv, "--sweep-dir", str(tmp_path / "b")])
    assert fake.inits[-1] == {
        "address": None,
        "include_dashboard": False,
        "dashboard_host": "127.0.0.1",
        "log_to_driver": False,
    }
    assert "RAY_AUTH_MODE" not in os.environ  # Ray's own default (token, since 2.59) decides
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's cluster: its own settings
    sweep_launch.main([*argv, "--sweep-dir", str(tmp_path / "c"), "--ray-address", "h:6379"])
    assert fake.inits[-1] == {
        "address": "h:6379",
        "include_dashboard": False,
        "log_to_driver": False,
    }
