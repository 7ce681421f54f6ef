"""A preset's train step on a machine it may not have: the planner's predictions and, with
``--compile``, what the compiler says (memory per chip, collective bytes from the HLO).

    python -m recscale.plan wukong/table5-7 --hardware tpu-v5p-512 --compile --mesh.fsdp
    python -m recscale.plan dlrm/criteo-mlperf --hardware tpu-v6e-256 --compile

GPU presets are lowered for CUDA only (CPU devices stand in for the GPUs; no CUDA compiler
here), which checks that the step and its Pallas (Triton) kernels lower at those shapes. TPU
targets compile on this CPU host through ``libtpu`` (``pip install -e '.[tpu-aot]'``):
``jax.experimental.topologies`` describes the slice (``LaunchPreset.topology``), the run's mesh
is made over its devices, and the whole train step (the embedding engine, its kernels chosen
for TPU, the dense layers sharded as ``mesh.*`` says) is lowered and compiled for it, as
``jax.jit(...).lower(...).compile()`` would on the pod; nothing is allocated. Without
``--compile`` a TPU slice needs no libtpu: the plan is made on an abstract mesh of its chips
(``sharding.abstract_mesh``). CPU presets compile for this host's devices. Overrides are the
train CLI's (``--mesh.model-parallel 4``).

When the predicted state (parameters, optimizer state, the batch) overflows a chip, the report
says so and plans the other meshes of :data:`MESH_CANDIDATES` (FSDP, tensor parallelism, both):
each one's state per chip, or why the planner cannot place its tables.

The predictions are the planner's (``recscale.embeddings.planner``: the tables' memory per
device and the bytes the engine's all-to-alls move per step) and the dense state's bytes per
chip from its shardings; ``benchmarks/pod_compile.py`` tabulates them against the compiler's.
The report shows the embedding plan itself too: each table's sharding and placement, and each
device's predicted step time by term (lookup, communication, compute), in ``--json`` as
``plans``. A preset that sets ``embeddings.measure_skew`` has its tables' skew measured first,
as the trainer does (its ``embeddings.calibrate`` is not run: this host is not the target).
``--hlo FILE`` writes the compiled step's HLO text there, to see where its temporaries and
collectives come from.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from rich.console import Console
from rich.progress import track

import tpu_gpu_configs
from data.schemas import schema_of
from recscale import config as config_lib
from recscale import families, hlo, optim, sharding
from recscale.embeddings import EmbeddingTable, engine, plan_inputs
from recscale.flops import model_cost
from recscale.kernels import common
from recscale.plan_report import StepReport, render
from recscale.plan_tiers import plan_tiers
from recscale.train.experiment import state_parts
from recscale.train.steps import make_train_step
from tpu_gpu_configs.profiles import get_profile


def topology_devices(hw: tpu_gpu_configs.LaunchPreset) -> list[Any]:
    """The devices of ``hw``: a TPU slice's from its topology (libtpu, no TPU needed), this
    host's for CPU (as many as the preset has), and for a GPU preset this host's GPUs when it
    has them (the step then compiles for them), else CPU devices standing in."""
    if hw.platform == "tpu":
        try:
            from jax.experimental import topologies  # noqa: PLC0415
        except ImportError as e:  # pragma: no cover - part of jax
            raise SystemExit(f"jax.experimental.topologies is missing: {e}") from None
        if not hw.topology:
            raise SystemExit(f"hardware preset {hw.name!r} names no TPU topology")
        # Compiling needs no chip: let several processes load libtpu (it locks by default).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        for k, v in hw.env.items():  # the preset's compiler flags (LIBTPU_INIT_ARGS), as a
            os.environ.setdefault(k, v)  # trial runs with them; read when libtpu loads
        # Off a TPU VM libtpu looks for the VM's slice and workers and prints five lines of
        # warnings and a spurious INVALID_ARGUMENT when it finds none; naming the slice and one
        # local worker silences them (the topology compiled for is the one named below).
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", hw.name.removeprefix("tpu-"))
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        try:
            return list(topologies.get_topology_desc(hw.topology, "tpu").devices)
        except Exception as e:  # noqa: BLE001 - libtpu missing or the name unknown
            raise SystemExit(
                f"cannot describe TPU topology {hw.topology!r} ({type(e).__name__}: {e}); "
                "install the compiler with: pip install -e '.[tpu-aot]'"
            ) from None
    if hw.platform == "gpu" and jax.default_backend() == "gpu":  # on the GPUs themselves
        devices = jax.devices()
        if len(devices) < hw.num_devices:
            raise SystemExit(f"{hw.name} has {hw.num_devices} GPUs, this host {len(devices)}")
        return devices[: hw.num_devices]
    if hw.platform in ("cpu", "gpu"):  # a GPU preset: CPU devices stand in (lowering only)
        devices = jax.devices("cpu")
        if len(devices) < hw.num_devices:
            raise SystemExit(
                f"{hw.name} has {hw.num_devices} devices but this host simulates "
                f"{len(devices)} (set JAX_NUM_CPU_DEVICES)"
            )
        return devices[: hw.num_devices]
    raise SystemExit(f"planning for {hw.platform} presets from this host is not supported")


def _profile(hw: tpu_gpu_configs.LaunchPreset) -> str:
    """``hw``'s hardware profile; a preset naming none (``cpu-local``) runs on this host's."""
    return hw.profile or engine.default_profile()


def for_hardware(cfg: Any, hw: tpu_gpu_configs.LaunchPreset, *, global_batch: int = 0) -> Any:
    """``cfg`` as a sweep would run it on ``hw``: its global batch (``global_batch`` if given,
    else the preset's per-device batch times its devices, else the config's), and the engine
    planned with the machine's profile and host size."""
    batch = global_batch or hw.global_batch or cfg.data.batch_size
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=batch))
    if hw.profile and cfg.embeddings.sharding != "off" and not cfg.embeddings.profile:
        emb = dataclasses.replace(cfg.embeddings, profile=hw.profile, host_size=hw.devices_per_host)
        cfg = dataclasses.replace(cfg, embeddings=emb)
    return cfg


def _bytes_per_chip(abstract: Any, shardings: Any, keep=lambda var: True) -> float:
    """Bytes one device holds of the arrays of ``abstract`` (a state of Variables) laid out by
    ``shardings`` (a same-structured tree of shardings), for the Variables ``keep`` admits."""
    from flax import nnx  # noqa: PLC0415

    def is_var(x):
        return isinstance(x, nnx.Variable)

    variables = jax.tree.leaves(abstract, is_leaf=is_var)
    shards = jax.tree.leaves(shardings)
    total = 0.0
    for v, s in zip(variables, shards, strict=True):
        if is_var(v) and not keep(v):
            continue
        a = v.get_value() if is_var(v) else v
        shard = s.shard_shape(a.shape) if a.shape else ()
        total += math.prod(shard) * np.dtype(a.dtype).itemsize
    return total


def _layout_name(cfg: Any) -> str:
    m = cfg.mesh
    parts = [f"embeddings={cfg.embeddings.sharding}"]
    if m.model_parallel > 1:
        parts.append(f"tp={m.model_parallel}")
    if m.fsdp:
        parts.append("fsdp")
    if getattr(cfg.model, "scan_layers", False):
        parts.append("scan_layers")
    named = sorted({v for v in dataclasses.asdict(cfg.kernels).values() if v != "auto"})
    if named:
        parts.append(f"kernels={'+'.join(named)}")
    return ", ".join(parts)


def plan_step(
    cfg: Any,
    build_model: Any,
    hw: tpu_gpu_configs.LaunchPreset,
    *,
    preset: str,
    compile: bool = False,
    global_batch: int = 0,
    hlo_path: str | None = None,
) -> StepReport:
    """The planner's predictions for ``cfg``'s train step on ``hw`` and, with ``compile``, the
    compiler's numbers (see the module docstring); ``hlo_path``: where to write the compiled
    step's HLO text (where its memory and collectives come from)."""
    abstract_tpu = hw.platform == "tpu" and not compile
    devices = None if abstract_tpu else topology_devices(hw)
    cfg = for_hardware(cfg, hw, global_batch=global_batch)
    cfg = plan_inputs.resolve(cfg, calibrate=False)
    schema = schema_of(cfg.data)
    if abstract_tpu:  # no compiler needed, none asked for (libtpu may be absent)
        generation = hw.topology.split(":")[0]
        mesh = sharding.abstract_mesh(
            cfg.mesh, hw.num_devices, platform="tpu", device_kind=f"TPU {generation}"
        )
    else:
        mesh = sharding.make_mesh(cfg.mesh, devices=devices)
    target = hw.platform if hw.platform in ("gpu", "tpu") else None
    with (
        sharding.activate(mesh, cfg.mesh),
        common.target_backend(target) if target else contextlib.nullcontext(),
    ):
        graphdef, tx, state_sharding, init = state_parts(cfg, build_model, schema)
        abstract = jax.eval_shape(init, jax.ShapeDtypeStruct((), np.int32))
        batch = schema.empty_batch(cfg.data.batch_size)
        batch_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
        batch_sharding = jax.tree.map(lambda x: sharding.batch_sharding(np.ndim(x)), batch)
        model = nnx_merge(graphdef, abstract)
        colls = engine.engine_collections(model)
        spec = engine.EngineSpec.from_config(cfg)
        plans = {
            path: engine.plan_engine(c.table_specs, c.feature_specs, c.layout.num_devices, spec)
            for path, c in colls.items()
        }
        compared = {
            path: engine.compare_planners(
                c.table_specs, c.feature_specs, c.layout.num_devices, spec
            )
            for path, c in colls.items()
        }
        planner_mem = sum(c.layout.plan_memory_bytes for c in colls.values())
        # the planner's float32/bf16 costing, or the compressed payloads when compressed
        a2a = sum(
            c.layout.plan_all_to_all_bytes
            if c.layout.compression.kind == "none"
            else sum(
                c.layout.exchange_bytes(cfg.data.batch_size)[k] for k in ("forward", "backward")
            )
            for c in colls.values()
        )
        dense, _ = _split_params(abstract.params)
        n_dense = sum(math.prod(x.shape) for x in jax.tree.leaves(dense))
        dense_bytes = _bytes_per_chip(
            abstract.params, state_sharding.params, lambda v: not isinstance(v, EmbeddingTable)
        )
        rows = sum(f.vocab_size for f in schema.features)
        state_bytes = _bytes_per_chip(abstract, state_sharding)
        batch_bytes = sum(x.nbytes for x in batch) / sharding.axis_size("batch")
        report = StepReport(
            preset=preset,
            hardware=hw.name,
            topology=hw.topology or hw.platform,
            chips=hw.num_devices if devices is None else len(devices),
            mesh=dict(mesh.shape),
            global_batch=cfg.data.batch_size,
            layout=_layout_name(cfg),
            dense_params=int(n_dense),
            table_rows=int(rows),
            memory_bytes=get_profile(_profile(hw)).memory_bytes,
            predicted={
                "state_bytes_per_chip": state_bytes,
                "batch_bytes_per_chip": batch_bytes,
                "dense_state_bytes_per_chip": dense_bytes * (1 + _opt_slots(cfg)),
                "table_bytes_per_chip": float(planner_mem),
                # every model replica runs the data axis's exchange
                "all_to_all_bytes_per_chip": float(a2a) / mesh.shape[sharding.DATA_AXIS],
            },
            plans={path: p.to_dict() for path, p in plans.items()},
            plan_text="\n".join(
                (f"{path}:\n" if path else "") + p.render() + compared[path][0]
                for path, p in plans.items()
            ),
            planners={path: c[1] for path, c in compared.items()},
        )
        if not compile:
            return report
        step = jax.jit(
            make_train_step(
                graphdef,
                tx,
                nonfinite=cfg.train.nonfinite,
                embedding_clip=optim.cowclip.from_config(cfg.embedding_optim),
            ),
            in_shardings=(state_sharding, batch_sharding),
            out_shardings=(state_sharding, None),
            donate_argnums=(0,),
        )
        t0 = time.perf_counter()
        before = collections.Counter(common.FALLBACKS)
        if hw.platform == "gpu" and devices[0].platform != "gpu":
            # No CUDA compiler here: lower the step for CUDA (the Pallas GPU kernels through
            # Triton included) and stop there.
            traced = step.trace(abstract, batch_abstract)
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            report.compile_s = time.perf_counter() - t0
            report.lowered = {
                "stablehlo_bytes": len(text),
                "triton_kernels": text.count("__gpu$xla.gpu.triton"),
            }
            report.fallbacks = _new_fallbacks(before)
            return report
        lowered = step.lower(abstract, batch_abstract)
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:  # e.g. RESOURCE_EXHAUSTED: more than the HBM
            report.error = " ".join(str(e).split())[:400]
            report.compile_s = time.perf_counter() - t0
            return report
        report.compile_s = time.perf_counter() - t0
        report.fallbacks = _new_fallbacks(before)
    mem = compiled.memory_analysis()
    arg, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
    alias, temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
    report.compiled = {
        "argument_bytes": float(arg),
        "output_bytes": float(out),
        "alias_bytes": float(alias),
        "temp_bytes": float(temp),
        "code_bytes": float(mem.generated_code_size_in_bytes),
        "peak_bytes": float(arg + out - alias + temp),
    }
    text = compiled.as_text()  # read once: it can be 100s of MB
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(text)
    colls = hlo.collectives(text)
    memory_bytes = hlo.hbm_bytes(text)
    del text
    report.collectives = hlo.collective_bytes(colls)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # older jax: one dict per module
    report.xla_flops_per_chip = float((cost or {}).get("flops", 0.0))
    prof = get_profile(_profile(hw))
    with contextlib.suppress(TypeError):  # a model without a FLOP count: no MFU
        per_example = model_cost(cfg, schema).train_flops
        report.model_flops_per_chip = per_example * cfg.data.batch_size / report.chips
    report.step_time = hlo.step_time(
        cost or {},
        colls,
        num_devices=report.chips,
        flops=prof.flops,
        memory_bandwidth=prof.memory_bandwidth,
        interconnect_bandwidth=prof.interconnect_bandwidth,
        model_flops=report.model_flops_per_chip,
        memory_bytes=memory_bytes,
    )
    report.peak_flops = prof.flops
    return report


MESH_CANDIDATES = (
    {"fsdp": True},
    {"model_parallel": 2},
    {"model_parallel": 4},
    {"model_parallel": 8},
    {"fsdp": True, "model_parallel": 4},
    {"fsdp": True, "model_parallel": 8},
)
"""The meshes :func:`alternative_meshes` tries, each over the run's own."""


def alternative_meshes(
    cfg: Any, build_model: Any, hw: tpu_gpu_configs.LaunchPreset, *, global_batch: int = 0
) -> list[dict[str, Any]]:
    """The predicted state per chip of ``cfg`` under each of :data:`MESH_CANDIDATES` (planned,
    not compiled): ``{"flags", "state_bytes_per_chip", "fits"}`` in that order. The state is
    a lower bound of what a chip needs (activations and temporaries come on top: ``--compile``
    says)."""
    out = []
    console = Console(stderr=True)
    for change in track(MESH_CANDIDATES, description="planning other meshes", console=console):
        mesh = dataclasses.replace(cfg.mesh, **change)
        if mesh == cfg.mesh or hw.num_devices % mesh.model_parallel:
            continue
        flags = (["--mesh.fsdp"] if mesh.fsdp else []) + (
            [f"--mesh.model-parallel {mesh.model_parallel}"] if mesh.model_parallel > 1 else []
        )
        row: dict[str, Any] = {"flags": " ".join(flags)}
        try:
            r = plan_step(
                dataclasses.replace(cfg, mesh=mesh),
                build_model,
                hw,
                preset="",
                global_batch=global_batch,
            )
        except ValueError as e:  # the planner cannot place a table on this mesh
            out.append({**row, "fits": False, "error": str(e)})
            continue
        need = r.predicted["state_bytes_per_chip"] + r.predicted["batch_bytes_per_chip"]
        out.append({**row, "state_bytes_per_chip": need, "fits": r.state_fits()})
    return out


def _new_fallbacks(before: collections.Counter) -> list[str]:
    """The kernel fallbacks (``common.FALLBACKS``) counted since ``before``."""
    return [
        f"{op}: {impl} -> xla ({why})"
        for (op, impl, why), n in common.FALLBACKS.items()
        if n > before[(op, impl, why)]
    ]


def _opt_slots(cfg: Any) -> int:
    return {"adam": 2, "adamw": 2, "lamb": 2, "sgd": 0, "adagrad": 1, "lars": 1}.get(
        cfg.dense_optim.name, 0
    )


def _split_params(params: Any) -> tuple[Any, Any]:
    from flax import nnx  # noqa: PLC0415

    tables, dense = nnx.split_state(params, EmbeddingTable, ...)
    return dense, tables


def nnx_merge(graphdef: Any, state: Any) -> Any:
    from flax import nnx  # noqa: PLC0415

    return nnx.merge(graphdef, state.params, state.batch_stats)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: python -m recscale.plan PRESET --hardware NAME [--compile [--hlo FILE]] "
        "[--json FILE] "
        "[--global-batch N] [--tiers [--hbm-gib G] [--dram-gib G] [--policy lru|lfu] "
        "[--sample-batches N]] [--field.sub value ...]"
    )
    if not argv or argv[0].startswith("-"):
        raise SystemExit(usage)
    preset, rest = argv[0], argv[1:]
    own, overrides = _own_flags(rest)
    if "hardware" not in own:
        raise SystemExit(usage)
    try:
        hw = tpu_gpu_configs.get(own["hardware"])
    except KeyError as e:
        raise SystemExit(str(e.args[0])) from None
    try:
        family = families.of_preset(preset)
    except families.UnknownFamilyError as e:
        raise SystemExit(f"error: preset {preset!r}: {e}") from None
    _, cfg = config_lib.parse_preset_cli(
        f"{family.name}/", [preset, "--workdir", "-", *overrides], prog="python -m recscale.plan"
    )
    try:
        batch = int(own.get("global-batch", 0))
    except ValueError:
        raise SystemExit(
            f"--global-batch: expected an integer, got {own['global-batch']!r}"
        ) from None
    if "tiers" in own:
        try:
            print(
                plan_tiers(
                    cfg,
                    hw,
                    hbm_gib=float(own.get("hbm-gib", 0)),
                    dram_gib=float(own.get("dram-gib", 64)),
                    policy=own.get("policy", "lru"),
                    sample_batches=int(own.get("sample-batches", 64)),
                )
            )
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        return
    try:
        report = plan_step(
            cfg,
            family.build_model,
            hw,
            preset=preset,
            compile="compile" in own,
            global_batch=batch,
            hlo_path=own.get("hlo"),
        )
        if report.state_fits() is False:
            report.alternatives = alternative_meshes(
                cfg, family.build_model, hw, global_batch=batch
            )
    except ValueError as e:  # the mesh or the planner refuses the layout
        raise SystemExit(f"error: {e}") from None
    except OSError as e:  # --hlo FILE could not be written
        raise SystemExit(f"error: --hlo {e.filename}: {e.strerror}") from None
    print(render(report))
    if "json" in own:
        with open(own["json"], "a") as f:
            f.write(json.dumps(dataclasses.asdict(report), sort_keys=True) + "\n")


def _own_flags(args: list[str]) -> tuple[dict[str, str], list[str]]:
    own, rest = {}, []
    it: Iterator[str] = iter(args)
    for a in it:
        if a in ("--compile", "--tiers"):
            own[a[2:]] = "1"
        elif a in (
            "--hardware",
            "--json",
            "--hlo",
            "--global-batch",
            "--hbm-gib",
            "--dram-gib",
            "--policy",
            "--sample-batches",
        ):
            own[a[2:]] = next(it, "")
        else:
            rest.append(a)
    return own, rest


if __name__ == "__main__":
    main()
