"""Compressed embedding exchanges (issue 19): bytes per step, compression ratio and validation
quality of each scheme against the float32 exchange, on simulated devices.

``python benchmarks/compressed_comm.py [--preset dlrm/synthetic] [--devices 8]
[--sharding row_wise] [--steps 3000] [--out runs/bench_comm] [-- EXTRA TRAIN ARGS]``

Each scheme trains the same preset (same seed, data and steps) with its tables sharded by the
engine over ``--devices`` simulated CPU devices, and only the exchange of pooled embeddings and
their gradients differs:

* ``float32``: the uncompressed all-to-all (the baseline);
* ``eb8``, ``eb6``, ``eb5``, ``eb4``: ``error_bounded`` with ε = 0.002, 0.0081, 0.0167, 0.036
  both ways (8-, 6-, 5- and 4-bit codes);
* ``fp8_e4m3``, ``fp8_e5m2``;
* ``tables`` (with ``--tables-from comm_sensitivity.json``; another name with
  ``--tables-name``): per-table bounds proposed from each table's measured sensitivity
  (``python -m FAMILY.evaluate --workdir DIR --comm-sensitivity``), around that file's base
  bound.

Printed per scheme: the all-to-all bytes of one step (forward + backward, all devices, as the
engine's layout sends them), the ratio to float32, the final validation AUC and logloss on the
whole evaluation set and their differences to float32, and the time the exchange would take
per step at an H100 node's interconnect bandwidth (``tpu_gpu_configs`` profile ``gpu-h100``)
by the planner's cost model: bytes / bandwidth. Results go to ``OUT/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tpu_gpu_configs.profiles import get_profile  # noqa: E402

EB = (
    "--embeddings.comm-compression error_bounded --embeddings.comm-error-bound {e} "
    "--embeddings.comm-error-bound-grad {e}"
)
SCHEMES = {
    "float32": "",
    "eb8": EB.format(e=0.002),
    "eb6": EB.format(e=0.0081),
    "eb5": EB.format(e=0.0167),
    "eb4": EB.format(e=0.036),
    "fp8_e4m3": "--embeddings.comm-compression fp8_e4m3",
    "fp8_e5m2": "--embeddings.comm-compression fp8_e5m2",
}
_BYTES = re.compile(r"all-to-all per step, all devices: ([\d.e+-]+) MiB forward \+ ([\d.e+-]+) MiB")


def _table_scheme(path: str) -> str:
    """The ``tables`` scheme: per-table bounds proposed by ``--comm-sensitivity``
    (``comm_sensitivity.json``: its base bound, and each table's scale of it)."""
    prop = json.loads(Path(path).read_text())
    return (
        EB.format(e=prop["base_bound"])
        + " --embeddings.comm-error-bound-tables "
        + " ".join(prop["comm_error_bound_tables"])
    )


def _run(args, name: str, extra: list[str]) -> dict:
    wd = Path(args.out) / name
    log = wd.with_suffix(".log")
    family = args.preset.split("/")[0]
    if not (wd / "timings.jsonl").is_file():  # a finished run is reused
        cmd = [
            sys.executable,
            "-m",
            f"{family}.train",
            args.preset,
            "--workdir",
            str(wd),
            "--embeddings.sharding",
            args.sharding,
            "--train.num-steps",
            str(args.steps),
            "--train.eval-max-batches",
            "0",
            "--train.no-progress",
            *args.scheme_args[name].split(),
            *extra,
        ]
        env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(args.devices)}
        wd.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, env=env)
    found = _BYTES.search(log.read_text())
    if found is None:
        raise SystemExit(f"error: {log}: no all-to-all line (is --sharding a sharded engine type?)")
    fwd, bwd = map(float, found.groups())
    rows = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if r["split"] == "eval"][-1]
    return {"bytes": (fwd + bwd) * 2**20, "auc": final["auc"], "logloss": final["logloss"]}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="dlrm/synthetic")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--sharding", default="row_wise")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--schemes", nargs="*", default=list(SCHEMES))
    ap.add_argument("--out", default="runs/bench_comm")
    ap.add_argument(
        "--tables-from",
        default="",
        help="a comm_sensitivity.json (python -m FAMILY.evaluate --workdir DIR "
        "--comm-sensitivity): adds the scheme 'tables', its per-table bounds",
    )
    ap.add_argument("--tables-name", default="tables", help="the --tables-from scheme's name")
    args = ap.parse_args(argv)
    args.scheme_args = dict(SCHEMES)
    if args.tables_from:
        args.scheme_args[args.tables_name] = _table_scheme(args.tables_from)
        if args.tables_name not in args.schemes:
            args.schemes = [*args.schemes, args.tables_name]
    unknown = set(args.schemes) - set(args.scheme_args)
    if unknown:
        raise SystemExit(
            f"error: unknown schemes {sorted(unknown)}; known: {sorted(args.scheme_args)}"
        )
    if "float32" not in args.schemes:
        raise SystemExit("error: --schemes must include float32 (the baseline)")
    console = Console(width=140)
    res = {}
    for name in args.schemes:
        console.print(f"[bold]{name}[/]: {args.preset}, {args.steps} steps, {args.devices} devices")
        res[name] = _run(args, name, extra)
    bw = get_profile("gpu-h100").interconnect_bandwidth
    base = res["float32"]
    table = Table(
        title=f"{args.preset}, {args.sharding} on {args.devices} devices, {args.steps} steps"
    )
    for col in (
        "scheme",
        "MiB/step",
        "ratio",
        "AUC",
        "ΔAUC",
        "logloss",
        "Δlogloss",
        "H100 exchange ms/step",
    ):
        table.add_column(col, justify="right")
    for name, r in res.items():
        r["ratio"] = base["bytes"] / r["bytes"]
        r["delta_auc"] = r["auc"] - base["auc"]
        r["delta_logloss"] = r["logloss"] - base["logloss"]
        # every device sends its share at once: per device bytes / the link's bandwidth
        r["h100_exchange_ms"] = r["bytes"] / args.devices / bw * 1e3
        table.add_row(
            name,
            f"{r['bytes'] / 2**20:.3f}",
            f"{r['ratio']:.2f}",
            f"{r['auc']:.5f}",
            f"{r['delta_auc']:+.5f}",
            f"{r['logloss']:.5f}",
            f"{r['delta_logloss']:+.5f}",
            f"{r['h100_exchange_ms']:.4f}",
        )
    console.print(table)
    out = {
        "preset": args.preset,
        "sharding": args.sharding,
        "devices": args.devices,
        "steps": args.steps,
        "extra": extra,
        "results": res,
    }
    Path(args.out, "results.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
