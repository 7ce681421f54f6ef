"""The sequential families' training step on SASRec's Video.txt: steps/s before and after.

``python benchmarks/sequential_step.py --data.sasrec-path /tmp/sasrec/Video.txt --against REV
[--presets sasrec/games hstu/games] [--cpus 0] [--steps 8] [--reps 10] [--rounds 3]``

For each preset, the trainer's own jitted step (``recscale.train.experiment.train_programs``,
buffer donation and all) is built on the real data (``--data.sasrec-path``, SASRec's
``data/Video.txt``, read in place) and timed over ``--steps`` training packs prepared on the
device in advance (steps ``0..steps-1`` of the run's own data stream; compile excluded), best
of three timings of ``--reps`` passes. Each side runs in a fresh process of this script: on a
``git archive`` of ``REV`` unpacked in a temporary folder (before) and on this tree (after),
alternating, ``--rounds`` times. Each side uses its own preset (its own ``data.token_budget``
and so its own ``T_pad``; ``--token-budget`` sets one for both). Prints the median steps/s of
each side, steps per CPU-second of the process (``time.process_time``: on a shared machine,
with ``--cpus`` pinning it to one core, the better estimate of a dedicated core's rate), real
tokens/s (the packs' tokens, not their padding slots) and the ratio, and each side's ``T_pad``
and the step's XLA cost-analysis FLOPs.

``--cpus 0``: each process is pinned to these CPUs (``os.sched_setaffinity``) before jax
starts, e.g. one core. Without ``--against``: this tree only. ``--profile``: where this tree's
step spends its time, from a ``jax.profiler`` trace (random bits, the item table's passes, the
rest; the largest XLA thunks, by op). ``--chunks 64 32``: this tree's step at each chunk size
of the attention's local windows (``recscale.jagged.chunk_size`` patched in each process),
alternating ``--rounds`` times, steps per CPU-second.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The tree whose code is timed: this repository, or (``--root``, a child of ``--against``) another.
ROOT = (
    Path(sys.argv[sys.argv.index("--root") + 1]).resolve()
    if "--root" in sys.argv
    else Path(__file__).resolve().parent.parent
)
HERE = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def _prepared(preset: str, video: str, token_budget: int):
    """``(jitted step, experiment, schedule args)`` of ``preset`` on the real data, under its
    mesh."""
    sys.path.insert(0, str(ROOT))
    import jax  # noqa: PLC0415

    from recscale import config as config_lib  # noqa: PLC0415
    from recscale import families, sharding  # noqa: PLC0415
    from recscale.train import experiment  # noqa: PLC0415

    family = families.of_preset(preset)
    cfg = config_lib.get_preset(preset)
    data = dataclasses.replace(cfg.data, sasrec_path=video)
    if token_budget:
        data = dataclasses.replace(data, token_budget=token_budget)
    cfg = dataclasses.replace(cfg, data=data)
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.activate(mesh, cfg.mesh):
        exp = experiment.Experiment.build(cfg, family.build_model)
        step, _ = experiment.train_programs(cfg, family.build_model, exp)
        sargs = jax.device_put(experiment.schedule_args(cfg), sharding.replicated())
        yield step, exp, sargs


def _child(args) -> None:
    """Times each preset's step; one JSON line each."""
    for preset in args.presets:
        with _prepared(preset, args.video, args.token_budget) as (step, exp, sargs):
            print(json.dumps(_time(step, exp, sargs, preset, args)), flush=True)


def _time(step, exp, sargs, preset: str, args) -> dict:
    """Steps/s (best of three timings of ``args.reps`` passes over ``args.steps`` packs)."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    host = [exp.source.train_batch(s) for s in range(args.steps)]
    dev = [exp.device_batch(b) for b in host]
    tokens = float(np.mean([b.offsets[:, -1].sum() for b in host]))
    state = exp.init_state()
    t0 = time.perf_counter()
    state, _ = step(state, dev[0], sargs)
    jax.block_until_ready(state)
    first = time.perf_counter() - t0
    cost = step.lower(state, dev[0], sargs).compile().cost_analysis()
    best, best_cpu = float("inf"), float("inf")
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.reps):
            for b in dev:
                state, _ = step(state, b, sargs)
        jax.block_until_ready(state)
        n = args.reps * len(dev)
        best = min(best, (time.perf_counter() - t0) / n)
        best_cpu = min(best_cpu, (time.process_time() - c0) / n)
    return {
        "preset": preset,
        "steps_per_s": 1.0 / best,
        "steps_per_cpu_s": 1.0 / best_cpu,
        "tokens_per_s": tokens / best,
        "t_pad": int(host[0].values.shape[-1]),
        "tokens": tokens,
        "flops": float(cost.get("flops", 0.0)),
        "first_step_s": first,
    }


def _profile(args, top: int = 30) -> None:
    """Prints this tree's largest XLA thunks per step, from a profiler trace."""
    import jax  # noqa: PLC0415

    for preset in args.presets:
        with _prepared(preset, args.video, args.token_budget) as (step, exp, sargs):
            dev = [exp.device_batch(exp.source.train_batch(s)) for s in range(args.steps)]
            state = exp.init_state()
            for b in dev:
                state, _ = step(state, b, sargs)
            jax.block_until_ready(state)
            hlo = step.lower(state, dev[0], sargs).compile().as_text()
            with tempfile.TemporaryDirectory() as tmp:
                with jax.profiler.trace(tmp):
                    for _ in range(args.reps):
                        for b in dev:
                            state, _ = step(state, b, sargs)
                    jax.block_until_ready(state)
                trace = json.load(gzip.open(next(Path(tmp).rglob("*.trace.json.gz"))))
        entry = hlo[hlo.index("ENTRY") :]
        shapes = {
            m.group(1): m.group(2)
            for m in re.finditer(r"^\s+(?:ROOT )?%([\w.-]+) = (\S+) ", entry, re.M)
        }
        ops = {
            m.group(1): m.group(2)
            for m in re.finditer(r"%([\w.-]+) = .*?metadata=\{op_name=\"([^\"]*)\"", hlo)
        }
        total: collections.Counter = collections.Counter()
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        for e in events:
            if e.get("ph") == "X" and e["name"] in shapes:
                total[e["name"]] += e.get("dur", 0.0)
        steps = args.reps * len(dev)
        print(f"{preset}: {sum(total.values()) / steps:.0f} us of XLA thunks per step")
        rows = exp.abstract_state.params["embeddings"]["tables"]["item"].shape[0]
        groups: collections.Counter = collections.Counter()
        for name, us in total.items():
            groups[_group(ops.get(name, ""), shapes[name], rows)] += us / steps
        for group, us in groups.most_common():
            print(f"  {us:8.1f} us  {group}")
        print("  largest:")
        for name, us in total.most_common(top):
            what = ops.get(name, "").removeprefix("jit(train_step)/")[-70:]
            print(f"  {us / steps:8.1f} us  {shapes[name][:28]:<28} {name[:28]:<28} {what}")


def _group(op: str, shape: str, table_rows: int) -> str:
    """A thunk's share of the step: random bits, the item table's passes, or the rest."""
    if re.search(r"bernoulli|uniform|threefry|random_bits|randint", op):
        return "random bits (dropout masks, negatives)"
    if re.match(rf"\w+\[{table_rows},", shape):
        return "item table [V + 1, D] (gradient, optimizer, norms)"
    if "transpose(" in op:
        return "backward (the rest)"
    return "forward, loss (the rest)"


def _chunks(args) -> None:
    """This tree's step at each ``--chunks`` size of ``recscale.jagged`` (patched in this
    process; ``_child`` per chunk in a fresh process), alternating ``--rounds`` times."""
    rows: dict = collections.defaultdict(list)
    for r in range(args.rounds):
        for chunk in args.chunks:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--chunk", str(chunk)]
            cmd += ["--presets", *args.presets, "--data.sasrec-path", args.video]
            cmd += ["--steps", str(args.steps), "--reps", str(args.reps)]
            cmd += ["--cpus", *map(str, args.cpus)] if args.cpus else []
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, check=True)
            for line in out.stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    rows[(row["preset"], chunk)].append(row["steps_per_cpu_s"])
                    print(
                        f"  round {r}: C = {chunk} {row['preset']}: {rows[(row['preset'], chunk)][-1]:.2f} steps per CPU-s",
                        flush=True,
                    )
    print(f"\nsteps per CPU-s, median of {args.rounds} alternating runs, by chunk size C:")
    print("| preset | " + " | ".join(f"C = {c}" for c in args.chunks) + " |")
    print("|---|" + "---:|" * len(args.chunks))
    for preset in args.presets:
        cells = [f"{statistics.median(rows[(preset, c)]):.2f}" for c in args.chunks]
        print(f"| {preset} | " + " | ".join(cells) + " |")


def _against(args) -> None:
    """Before (``git archive`` of ``args.against``) against after (this tree), alternating."""
    here = Path(__file__).resolve()
    rows: dict = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(HERE), "archive", args.against], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        for r in range(args.rounds):
            for side, root in (("before", tmp), ("after", str(HERE))):
                cmd = [sys.executable, str(here), "--child", "--root", root]
                cmd += ["--presets", *args.presets, "--data.sasrec-path", args.video]
                cmd += ["--steps", str(args.steps), "--reps", str(args.reps)]
                cmd += ["--token-budget", str(args.token_budget)]
                if args.cpus:
                    cmd += ["--cpus", *map(str, args.cpus)]
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
                if out.returncode != 0:
                    sys.exit(f"{side} ({root}) failed:\n{out.stderr[-3000:]}")
                for line in out.stdout.splitlines():
                    if line.startswith("{"):
                        row = json.loads(line)
                        rows[(row["preset"], side)].append(row)
                        print(
                            f"  round {r}: {side:<6} {row['preset']}: "
                            f"{row['steps_per_s']:.2f} steps/s, "
                            f"{row['steps_per_cpu_s']:.2f} per CPU-s (T_pad {row['t_pad']})",
                            flush=True,
                        )
    cpus = f"pinned to CPUs {args.cpus}" if args.cpus else "unpinned"
    print(
        f"\n{args.against} (before) against this tree (after), {cpus}: the trainer's step, "
        f"median of {args.rounds} alternating runs (each the best of 3 x {args.reps} passes "
        f"over {args.steps} packs)"
    )
    print(
        "| preset | T_pad before / after | steps/s before | steps/s after | after / before "
        "| steps per CPU-s before / after | tokens/s before / after "
        "| XLA GFLOP/step before / after |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for preset in args.presets:
        b, a = rows[(preset, "before")], rows[(preset, "after")]

        def med(x, key):
            return statistics.median(r[key] for r in x)

        sb, sa = med(b, "steps_per_s"), med(a, "steps_per_s")
        print(
            f"| {preset} | {b[0]['t_pad']} / {a[0]['t_pad']} | {sb:.2f} | {sa:.2f} "
            f"| {sa / sb:.2f}x | {med(b, 'steps_per_cpu_s'):.2f} / "
            f"{med(a, 'steps_per_cpu_s'):.2f} | {med(b, 'tokens_per_s'):,.0f} / "
            f"{med(a, 'tokens_per_s'):,.0f} | {b[0]['flops'] / 1e9:.2f} / "
            f"{a[0]['flops'] / 1e9:.2f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data.sasrec-path", dest="video", required=True)
    ap.add_argument("--against", metavar="REV")
    ap.add_argument("--presets", nargs="+", default=["sasrec/games", "hstu/games"])
    ap.add_argument("--token-budget", type=int, default=0, help="0: each preset's own")
    ap.add_argument("--cpus", type=int, nargs="*", default=[])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--chunks", type=int, nargs="*", default=[])
    ap.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)  # before jax starts its threads
    if args.chunk:  # a child of --chunks: the local windows' chunk size, patched
        sys.path.insert(0, str(ROOT))
        from recscale import jagged  # noqa: PLC0415

        jagged.chunk_size = lambda n: args.chunk
    if args.profile:
        return _profile(args)
    if args.chunks and not args.child:
        return _chunks(args)
    if args.against and not args.child:
        return _against(args)
    return _child(args)


if __name__ == "__main__":
    main()
