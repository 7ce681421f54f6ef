"""Where a sweep trial's wall time goes, and how much compute a whole sweep turns into results.

``python benchmarks/sweep_overhead.py trials [--spec sweeps.specs.showcase] [--family dlrm]``
runs a small and a large trial of the spec (the middle rung of the first and of the last
budget) two ways, each on a cold JAX compilation cache:

* ``process``: a fresh ``python -m FAMILY.train`` per trial, as sweeps ran before the trial
  server (and still do with ``--isolate-trials`` or a multi-host prefix);
* ``server``: the same train command sent to a warm ``sweeps.trial_server`` (the default
  worker), after one warm-up trial of another size;
* ``server, rung cached``: then the same model size again with another seed (as a sweep runs a
  size at several budgets and seeds), whose programs the persistent cache now holds.

and prints each trial's wall time broken into process start-up and imports (launch to entering
``train()``), the trainer's phases from its ``timings.jsonl`` (setup, init, data waits,
training steps, evaluations, checkpoints, close; each compile separately) and teardown (leaving
``train()`` to the process's exit, or to the server's reply), with the share in the step loop
(training steps and the data waits between them: the step loop is what a trial's logged
examples/s measures; the split between the two is approximate, as the device runs a step while
the host waits for the next batch) and the ratio of the ways' wall times.

``python benchmarks/sweep_overhead.py sweep DIR [DIR ...]`` summarises finished sweep
directories (or a ``results.csv`` / ``results.jsonl``): training FLOPs over the summed trial
wall time (the effective FLOP/s the issue measures), over the sweep's makespan, and the
median trial's share of wall time in training steps (from each trial's ``timings.jsonl``, where
the trials wrote one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sweeps.runner import TrialServer, WorkerOptions  # noqa: E402
from sweeps.spec import load_spec, resolve  # noqa: E402

ROWS = (
    ("startup + imports", "startup"),
    ("setup (mesh, data source)", "setup"),
    ("init (compile)", "init:compile"),
    ("init (run, restore)", "init:run"),
    ("data waits", "data"),
    ("train step compile", "train:compile"),
    ("training steps", "train:run"),
    ("evaluations (compile)", "eval:compile"),
    ("evaluations (run)", "eval:run"),
    ("final evaluation", "final_eval"),
    ("checkpoints", "checkpoint"),
    ("close (commit saves)", "close"),
    ("teardown", "teardown"),
)


def breakdown(timings: dict, launched: float, ended: float) -> dict[str, float]:
    """Seconds per row of ``ROWS`` from a ``timings.jsonl`` row and the outer clock."""
    phases = timings["phases"]
    out = {"startup": timings["entered_at"] - launched, "teardown": ended - timings["exited_at"]}
    for name, p in phases.items():
        if name in ("init", "train", "eval"):
            out[f"{name}:compile"] = p["compile_s"]
            out[f"{name}:run"] = p["seconds"] - p["compile_s"]
        else:
            out[name] = p["seconds"]
    out["total"] = ended - launched
    return out


def pick_trials(spec_ref: str, family: str):
    res = resolve(load_spec(spec_ref))
    trials = [t for t in res.trials if t.family == family]
    if not trials:
        raise SystemExit(f"spec {spec_ref} has no trials of family {family!r}")
    budgets = sorted({t.budget for t in trials})

    def middle(budget):
        at = sorted((t for t in trials if t.budget == budget), key=lambda t: t.rung_index)
        return at[len(at) // 2]

    warm = sorted((t for t in trials if t.budget == budgets[0]), key=lambda t: t.rung_index)[0]
    return {"small": middle(budgets[0]), "large": middle(budgets[-1])}, warm


def write_config(trial, root: Path) -> Path:
    path = root / f"{trial.trial_id}.json"
    path.write_text(json.dumps(trial.config, indent=2, sort_keys=True) + "\n")
    return path


def run_process(trial, root: Path, env: dict) -> dict:
    cfg = write_config(trial, root)
    workdir = root / f"process-{trial.trial_id}"
    cmd = [sys.executable, *trial.train_command(cfg, workdir)]
    t0 = time.time()
    with open(root / "process.log", "ab") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
    t1 = time.time()
    return breakdown(json.loads((workdir / "timings.jsonl").read_text().splitlines()[-1]), t0, t1)


def run_server(server: TrialServer, trial, root: Path, tag: str, seed: int | None = None) -> dict:
    if seed is not None:
        config = {**trial.config, "train": {**trial.config["train"], "seed": seed}}
        trial = dataclasses.replace(trial, config=config, trial_id=f"{trial.trial_id}-s{seed}")
    cfg = write_config(trial, root)
    workdir = root / f"{tag}-{trial.trial_id}"
    t0 = time.time()
    server.submit(trial.train_command(cfg, workdir), root / "server.log")
    rc = server.wait()
    t1 = time.time()
    if rc:
        raise SystemExit(f"trial {trial.trial_id} exited {rc}; see {root / 'server.log'}")
    return breakdown(json.loads((workdir / "timings.jsonl").read_text().splitlines()[-1]), t0, t1)


def trials_main(args) -> None:
    chosen, warmup = pick_trials(args.spec, args.family)
    root = Path(tempfile.mkdtemp(prefix="sweep_overhead-"))
    results: dict[tuple[str, str], dict] = {}
    for size, trial in chosen.items():
        print(
            f"{size}: {trial.family} {trial.rung} at {trial.budget:.3g} FLOPs, "
            f"{trial.steps} steps of {trial.batch_size}",
            file=sys.stderr,
        )
    for way in ("process", "server"):
        cache = root / f"jax_cache_{way}"
        env = {
            **os.environ,
            "JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.1",
            "PYTHONUNBUFFERED": "1",
        }
        if way == "process":
            for size, trial in chosen.items():
                results[(size, way)] = run_process(trial, root, env)
            continue
        server = TrialServer(WorkerOptions(env=env), root / "server.err")
        try:
            run_server(server, warmup, root, "warmup")
            for size, trial in chosen.items():
                results[(size, way)] = run_server(server, trial, root, way)
                results[(size, "cached")] = run_server(
                    server, trial, root, way, seed=trial.seed + 1
                )
        finally:
            server.retire()
    ways = {"process": "process", "server": "server", "cached": "server, rung cached"}
    cols = [(s, w) for s in chosen for w in ways]
    head = " | ".join(f"{s} ({ways[w]})" for s, w in cols)
    print(f"| part of the trial's wall time, s | {head} |")
    print("|---|" + "---:|" * len(cols))
    for label, key in ROWS:
        cells = " | ".join(f"{results[c].get(key, 0.0):.2f}" for c in cols)
        print(f"| {label} | {cells} |")
    totals = " | ".join(f"**{results[c]['total']:.2f}**" for c in cols)
    print(f"| **total** | {totals} |")
    share = " | ".join(
        f"{(results[c].get('train:run', 0) + results[c].get('data', 0)) / results[c]['total']:.0%}"
        for c in cols
    )
    print(f"| share in the step loop | {share} |")
    for size, trial in chosen.items():
        p, s, c = (results[(size, w)]["total"] for w in ways)
        flops = trial.compute
        print(
            f"{size}: process {p:.2f} s, server {s:.2f} s ({p / s:.2f}x), rung cached "
            f"{c:.2f} s ({p / c:.2f}x); {flops / p / 1e9:.2f} -> {flops / s / 1e9:.2f} -> "
            f"{flops / c / 1e9:.2f} GFLOP/s of training per second of trial wall time"
        )


def _load_rows(path: Path) -> list[dict]:
    if path.is_dir():
        path = path / "results.jsonl" if (path / "results.jsonl").exists() else path / "results.csv"
    if path.suffix == ".csv":
        import pandas as pd  # noqa: PLC0415

        return pd.read_csv(path).to_dict("records")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sweep_main(args) -> None:
    for ref in args.dirs:
        path = Path(ref)
        rows = [r for r in _load_rows(path) if r["status"] == "SUCCESS"]
        flops = sum(float(r["compute"]) for r in rows)
        wall = sum(float(r["wall_time_s"]) for r in rows)
        line = (
            f"{ref}: {len(rows)} trials, {flops:.3g} training FLOPs, summed trial wall "
            f"{wall / 60:.1f} min: {flops / wall / 1e9:.2f} GFLOP/s"
        )
        sweep_dir = path if path.is_dir() else path.parent
        starts, ends, shares = [], [], []
        estimated = False
        for r in rows:
            tdir = sweep_dir / "trials" / str(r["trial_id"])
            att = tdir / "attempts.jsonl"
            if att.exists():
                for a in map(json.loads, att.read_text().splitlines()):
                    starts.append(a["start"])
                    ends.append(a["start"] + a["duration_s"])
            tim = tdir / "run" / "timings.jsonl"
            met = tdir / "run" / "metrics.jsonl"
            if tim.exists():  # the step loop: training steps and the data waits between them
                loop = sum(
                    ph.get("train", {}).get("seconds", 0.0)
                    - ph.get("train", {}).get("compile_s", 0.0)
                    + ph.get("data", {}).get("seconds", 0.0)
                    for ph in (json.loads(t)["phases"] for t in tim.read_text().splitlines())
                )
                shares.append(loop / float(r["wall_time_s"]))
            elif met.exists():  # trials from before timings.jsonl: as the issue measured it
                eps = [
                    m["examples_per_sec"]
                    for m in map(json.loads, met.read_text().splitlines())
                    if m.get("split") == "train"
                ]
                if eps:
                    estimated = True
                    shares.append(
                        float(r["examples"]) / statistics.median(eps) / float(r["wall_time_s"])
                    )
        if starts:
            span = max(ends) - min(starts)
            line += f"; makespan {span / 60:.1f} min: {flops / span / 1e9:.2f} GFLOP/s"
        if shares:
            line += (
                f"; the step loop is {statistics.median(shares):.0%} of the median "
                f"trial's wall time ({min(shares):.0%}-{max(shares):.0%}"
                f"{', estimated from logged examples/s' if estimated else ''})"
            )
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trials", help="break a small and a large trial into their parts")
    t.add_argument("--spec", default="sweeps.specs.showcase")
    t.add_argument("--family", default="dlrm")
    s = sub.add_parser("sweep", help="effective FLOP/s of finished sweeps")
    s.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    trials_main(args) if args.cmd == "trials" else sweep_main(args)


if __name__ == "__main__":
    main()
