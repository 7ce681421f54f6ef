"""Production-shape train steps compiled for TPU slices on this CPU host, against the planner.

``python benchmarks/pod_compile.py [--out runs/pod_compile.jsonl] [--only SUBSTRING]
[--timeout-s 1800]`` then ``python benchmarks/pod_compile.py --table runs/pod_compile.jsonl``

Needs the TPU compiler: ``pip install -e '.[tpu-aot]'`` (``jax[tpu]``: the libtpu release that
matches the installed jax; a mismatched one compiles but its HLO does not parse back). Each case
is ``python -m recscale.plan PRESET --hardware SLICE --compile`` in its own process (libtpu holds
memory between compiles): the whole train step (the sharded embedding engine, the Pallas TPU
kernels, the dense layers as ``mesh.*`` lays them out) is lowered for the slice's topology
(``jax.experimental.topologies``) and compiled by XLA:TPU. Recorded per case: the compiler's
memory per chip (``memory_analysis``: arguments, temporaries, the peak) and the bytes of every
collective in the partitioned HLO, next to the predictions (state bytes per chip from the
shardings and the embedding planner; the planner's all-to-all bytes), and the predicted step
per chip (a roofline of the compiled HLO: compute, HBM, each collective, serial and overlapped,
the MFU of each). A case that does not fit the chip's HBM is recorded with the compiler's
message.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PALLAS = (
    "--kernels.embedding-bag",
    "pallas_tpu",
    "--kernels.embedding-update",
    "pallas_tpu",
    "--kernels.dot-interaction",
    "pallas_tpu",
    "--kernels.fm-interaction",
    "pallas_tpu",
)
FSDP = ("--mesh.fsdp",)
SCAN = ("--model.scan-layers",)
TP4 = ("--mesh.model-parallel", "4")

# (preset, slice, extra flags), most telling first. Kernels as ``auto`` picks them (the XLA
# references until a Pallas kernel is verified on TPU hardware), plus one case with every Pallas
# TPU kernel named.
CASES = [
    ("dlrm/criteo-mlperf", "tpu-v5p-16", ()),
    ("dlrm/criteo-mlperf", "tpu-v5p-128", ()),
    ("dlrm/criteo-mlperf", "tpu-v5p-512", ()),
    ("dlrm/criteo-mlperf", "tpu-v6e-8", ()),
    ("dlrm/criteo-mlperf", "tpu-v6e-256", ()),
    ("wukong/table5-1", "tpu-v5p-16", ()),
    ("wukong/table5-7", "tpu-v5p-16", ()),
    ("wukong/table5-7", "tpu-v5p-16", FSDP),
    # Wukong at the preset's own batch (131,072, the paper's) rather than 16,384 per chip
    ("wukong/table5-7", "tpu-v5p-128", (*FSDP, "--global-batch", "131072")),
    ("wukong/table5-7", "tpu-v5p-128", (*FSDP, *TP4, "--global-batch", "131072")),
    ("wukong/table5-7", "tpu-v5p-512", (*FSDP, "--global-batch", "131072")),
    # layer-wise FSDP: layers 2..8 in a scan, each gathered inside the loop
    ("wukong/table5-7", "tpu-v5p-128", (*FSDP, *SCAN, "--global-batch", "131072")),
    ("wukong/table5-7", "tpu-v5p-512", (*FSDP, *SCAN, "--global-batch", "131072")),
    ("wukong/table5-7", "tpu-v5p-128", (*FSDP, *TP4, *SCAN, "--global-batch", "131072")),
    ("wukong/table5-5", "tpu-v5p-128", (*FSDP, "--global-batch", "131072")),
    ("wukong/table5-5", "tpu-v5p-128", (*FSDP, *SCAN, "--global-batch", "131072")),
    ("wukong/table5-5", "tpu-v5p-16", (*FSDP, *SCAN, "--global-batch", "131072")),
    ("wukong/table5-6", "tpu-v5p-128", (*FSDP, "--global-batch", "131072")),
    ("wukong/table5-6", "tpu-v5p-128", (*FSDP, *SCAN, "--global-batch", "131072")),
    ("wukong/table5-6", "tpu-v5p-128", (*FSDP, *TP4, *SCAN, "--global-batch", "131072")),
    ("wukong/table5-6", "tpu-v5p-128", (*FSDP, *TP4, "--global-batch", "131072")),
    ("dlrm/criteo-mlperf", "tpu-v5p-16", PALLAS[:4]),  # the embedding kernels: packed buffers
    ("dlrm/criteo-mlperf", "tpu-v5p-16", PALLAS),
    ("wukong/table5-1", "tpu-v6e-8", ()),
]


def run(out: Path, only: str, timeout_s: int) -> None:
    from rich.progress import track  # noqa: PLC0415

    cases = [c for c in CASES if only in " ".join((c[0], c[1], *c[2]))]
    if not cases:
        raise SystemExit(f"no case matches --only {only!r}")
    for preset, hw, extra in track(cases, description="compiling"):
        cmd = [
            sys.executable,
            "-m",
            "recscale.plan",
            preset,
            "--hardware",
            hw,
            "--compile",
            "--json",
            str(out),
            *extra,
        ]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
            )
            ok, tail = proc.returncode == 0, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            ok, tail = False, f"timed out after {timeout_s} s"
        flags = "pallas_tpu kernels" if extra == PALLAS else " ".join(extra)
        print(f"{preset} {hw} {flags}: {time.perf_counter() - t0:.0f} s", flush=True)
        if ok:
            print(proc.stdout.strip())
        else:
            lines = [ln for ln in tail.splitlines() if ln.strip()]
            print("\n".join(lines[-3:]))


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def _refusal(error: str) -> str:
    m = re.search(r"temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", error)
    if m:
        return f"**does not fit**: temporaries {m.group(1)} GB > HBM {m.group(2)} GB"
    return error[:120]


def table(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = [
        "| preset | slice (chips) | mesh | layout | examples per data shard | dense params | state + batch "
        "GiB/chip: predicted / compiled (err) | peak GiB/chip (temporaries) / HBM | engine's "
        "all-to-all MiB/chip: planner / HLO (err) | all-gather, all-reduce MiB/chip | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, c, k = r["predicted"], r["compiled"], r["collectives"]
        mesh = " x ".join(f"{n} {v}" for n, v in r["mesh"].items())
        want = p["state_bytes_per_chip"] + p["batch_bytes_per_chip"]
        hbm = _gib(r.get("memory_bytes", 0))
        if c:
            err = want / c["argument_bytes"] - 1
            state = f"{_gib(want)} / {_gib(c['argument_bytes'])} ({err:+.1%})"
            peak = f"{_gib(c['peak_bytes'])} ({_gib(c['temp_bytes'])}) / {hbm}"
        else:
            state = f"{_gib(want)} / -"
            peak = _refusal(r.get("error", "not compiled"))
        a2a = f"{p['all_to_all_bytes_per_chip'] / 2**20:.0f}"
        engine = k.get("all-to-all (engine)", k.get("all-to-all", 0))
        if k:
            a2a += f" / {engine / 2**20:.0f}"
            if engine:
                a2a += f" ({p['all_to_all_bytes_per_chip'] / engine - 1:+.0%})"
        other = (
            ", ".join(f"{k[x] / 2**20:,.0f}" for x in ("all-gather", "all-reduce")) if k else "-"
        )
        dp = r["mesh"].get("data", r["chips"])
        out.append(
            f"| {r['preset']} | {r['hardware']} ({r['chips']}) | {mesh} | {r['layout']} | "
            f"{r['global_batch'] // dp:,} | {_count(r['dense_params'])} | {state} | {peak} | "
            f"{a2a} | {other} | {r['compile_s']:.0f} |"
        )
    return "\n".join(out)


def _ms(x: float) -> str:
    return f"{1e3 * x:,.3g}"


def step_table(path: Path) -> str:
    """The predicted step per chip (``recscale.plan``'s roofline of the compiled HLO)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = [
        "| preset | slice (chips) | layout | compute ms (XLA's FLOPs / the model's) | HBM ms "
        "(XLA's count) | collectives ms | serial ms (MFU) | overlapped ms (MFU) | the "
        "planner's embedding step ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r.get("step_time") or {}
        if not t:
            continue
        comm = ", ".join(
            f"{k} {_ms(v)}"
            for k, v in t.items()
            if k not in ("compute", "memory", "memory (XLA)", "serial", "overlapped")
        )
        peak, flops = r["peak_flops"], r["model_flops_per_chip"]
        times = [max(d["time_s"] for d in p["devices"]) for p in r["plans"].values()]
        out.append(
            f"| {r['preset']} | {r['hardware']} ({r['chips']}) | {r['layout']} | "
            f"{_ms(t['compute'])} ({r.get('xla_flops_per_chip', 0.0) / flops:.2f}) | "
            f"{_ms(t['memory'])} ({_ms(t.get('memory (XLA)', 0.0))}) | "
            f"{comm or '-'} | "
            f"{_ms(t['serial'])} ({flops / (t['serial'] * peak):.1%}) | "
            f"{_ms(t['overlapped'])} ({flops / (t['overlapped'] * peak):.1%}) | "
            f"{_ms(max(times, default=0.0))} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "pod_compile.jsonl")
    ap.add_argument("--only", default="", help="run the cases whose preset/slice/flags match")
    ap.add_argument("--timeout-s", type=int, default=1800)
    ap.add_argument("--table", type=Path, help="render a results file as a markdown table")
    args = ap.parse_args()
    if args.table:
        print(table(args.table), step_table(args.table), sep="\n\n")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run(args.out, args.only, args.timeout_s)
    print(table(args.out), step_table(args.out), sep="\n\n")


if __name__ == "__main__":
    main()
