"""Hessian-free against Adam and LAMB at large batch: steps and wall time to a target logloss.

``python benchmarks/dense_optimizers.py [--rung d4] [--batch 16384] [--examples 2097152]
[--out runs/bench_dense_optim]``

Issue 18's comparison. One model and batch of ``sweeps.specs.critical_batch`` (the planted
synthetic data, fresh examples every step; DLRM ``d4`` at batch 16,384 by default, the largest
batch of that sweep, where Adam still reaches the sweep's targets) trains with the dense part
on each optimizer, the tables on the sweep's row-wise Adagrad throughout:

* ``adam``: the sweep's rate carried by the square-root rule, times 0.5, 1 and 2;
* ``lamb``: Adam's direction scaled per layer by ``||w|| / ||u||`` (optax), rates 3e-3, 1e-2
  and 3e-2;
* ``hessian_free``: ``recscale.optim.hessian_free`` (Steihaug-CG in a trust region on
  reverse-over-reverse Hessian-vector products, no warmup, no decay), 5 and 10 CG iterations
  per step, damping 1e-3.

Each run is the real trainer (``python -m dlrm.train``) with an evaluation every few steps on
the sweep's held-out examples. The target is the best logloss any Adam rate reached, plus
``--gap`` (0.002): how many steps and seconds does each optimizer need to match tuned Adam?
Steps to target are interpolated between evaluations (``sweeps.batch_analysis``); seconds are
the trainer's measured train-step time per step (compile excluded) times those steps. Printed
per run with the ratio to the best Adam run, and written to ``OUT/results.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sweeps.batch_analysis import best_value, first_reaching  # noqa: E402
from sweeps.spec import resolve  # noqa: E402


def _base_config(rung: str, batch: int, examples: int) -> dict:
    from sweeps.specs import critical_batch  # noqa: PLC0415

    spec = dataclasses.replace(
        critical_batch.SPEC,
        examples_per_trial=examples,
        batch_sizes=(batch,),
        lr_multipliers=(1.0,),
    )
    (trial,) = [t for t in resolve(spec).trials if t.rung == rung]
    return trial.config


def _recipes(cfg: dict) -> list[tuple[str, list[str]]]:
    lr = cfg["dense_optim"]["learning_rate"]
    out = [(f"adam x{m:g}", ["--dense-optim.learning-rate", f"{lr * m:.6g}"]) for m in (0.5, 1, 2)]
    out += [
        (f"lamb {r:g}", ["--dense-optim.name", "lamb", "--dense-optim.learning-rate", f"{r:g}"])
        for r in (3e-3, 1e-2, 3e-2)
    ]
    out += [
        (
            f"hessian_free cg{k}",
            [
                "--dense-optim.name",
                "hessian_free",
                "--dense-optim.learning-rate",
                "1.0",
                "--dense-optim.warmup-steps",
                "0",
                "--dense-optim.decay",
                "constant",
                "--dense-optim.hf-cg-iters",
                str(k),
                "--dense-optim.hf-damping",
                "1e-3",
            ],
        )
        for k in (5, 10)
    ]
    return out


def _run(cfg_path: Path, workdir: Path, extra: list[str], evals: int, steps: int) -> dict:
    if not (workdir / "timings.jsonl").is_file():  # a finished run is reused
        cmd = [
            sys.executable,
            "-m",
            "dlrm.train",
            str(cfg_path),
            "--workdir",
            str(workdir),
            "--train.eval-every",
            str(max(steps // evals, 1)),
            "--train.checkpoint-every",
            str(steps),
            "--train.no-progress",
            *extra,
        ]
        workdir.mkdir(parents=True, exist_ok=True)
        with open(workdir.with_suffix(".log"), "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evals_ = [r for r in rows if r["split"] == "eval"]
    timing = json.loads((workdir / "timings.jsonl").read_text().splitlines()[-1])["phases"]["train"]
    per_step = (timing["seconds"] - timing["compile_s"]) / timing["count"]
    return {"evals": evals_, "step_s": per_step, "best": best_value(evals_, "logloss")}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rung", default="d4")
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--examples", type=int, default=1 << 21)
    ap.add_argument("--evals", type=int, default=32, help="evaluations per run")
    ap.add_argument("--gap", type=float, default=0.002)
    ap.add_argument("--only", nargs="*", help="run only recipes whose name starts with these")
    ap.add_argument("--out", default="runs/bench_dense_optim")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _base_config(args.rung, args.batch, args.examples)
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    steps = cfg["train"]["num_steps"]
    recipes = [
        r for r in _recipes(cfg) if not args.only or any(r[0].startswith(o) for o in args.only)
    ]
    console = Console()
    runs = {}
    for name, extra in recipes:
        console.print(f"[bold]{name}[/]: {steps} steps of {args.batch}")
        runs[name] = _run(cfg_path, out / name.replace(" ", "_"), extra, args.evals, steps)
    adam = [r["best"] for n, r in runs.items() if n.startswith("adam")]
    if not adam:
        raise SystemExit("error: the target comes from the Adam runs: include them (--only adam)")
    target = min(adam) + args.gap
    results = []
    for name, r in runs.items():
        s = first_reaching(r["evals"], "logloss", target)
        results.append(
            {
                "recipe": name,
                "best_logloss": r["best"],
                "steps_to_target": s,
                "step_s": r["step_s"],
                "seconds_to_target": None if s is None else s * r["step_s"],
            }
        )
    ref = min(
        (x for x in results if x["recipe"].startswith("adam") and x["steps_to_target"]),
        key=lambda x: x["steps_to_target"],
    )
    table = Table(
        title=f"dlrm {args.rung}, batch {args.batch}: to logloss {target:.4f} "
        f"(best Adam + {args.gap})"
    )
    for col in ("recipe", "best logloss", "steps", "x Adam", "s/step", "seconds", "x Adam"):
        table.add_column(col, justify="right")
    for x in results:
        s, t = x["steps_to_target"], x["seconds_to_target"]
        table.add_row(
            x["recipe"],
            f"{x['best_logloss']:.4f}",
            "-" if s is None else f"{s:.1f}",
            "-" if s is None else f"{s / ref['steps_to_target']:.2f}",
            f"{x['step_s']:.3f}",
            "-" if t is None else f"{t:.1f}",
            "-" if t is None else f"{t / ref['seconds_to_target']:.2f}",
        )
    console.print(table)
    summary = {
        "rung": args.rung,
        "batch": args.batch,
        "steps": steps,
        "target": target,
        "reference": ref["recipe"],
        "results": results,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, allow_nan=True) + "\n")
    return summary


if __name__ == "__main__":
    main()
