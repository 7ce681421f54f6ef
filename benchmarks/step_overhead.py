"""What a small model's training step costs on CPU, and what two cheaper dispatches would save.

``python benchmarks/step_overhead.py [--rungs d2 w1] [--batch 256] [--k 16] [--reps 40]``
builds each named rung of ``sweeps.specs.study`` (its data and optimizers, the embedding engine
as the study runs it) and times, on device batches prepared in advance (no data waits, compile
excluded):

* ``single``: the trainer's own step program, one dispatch per step (what ``train()`` runs);
* ``scan``: ``--k`` steps per dispatch, ``lax.scan`` of the same step over stacked batches
  (checked bitwise equal to ``--k`` single steps first);
* ``flat``: one dispatch per step with the dense optimizer wrapped in ``optax.flatten`` (one
  update over the concatenated dense parameters instead of one per leaf);

and prints milliseconds per step, microseconds per example, the ratios to ``single`` and the
compiled step's XLA instruction count. Neither ``scan`` nor ``flat`` is in the trainer: this
measures what they would buy (issue 15's note).

``--sharding off|auto`` times the rungs with the per-table path or the embedding engine instead
of the study's own setting (``study``, the default: the engine).

``--profile``: where a step's time goes, from ``jax.profiler``'s trace of ``--reps`` passes (the
step's XLA thunks: fusions, matmuls, the kernels' custom calls), the largest first.

``--against REV``: before / after. ``git archive REV`` of this repository is unpacked in a
temporary folder, and each rung's ``single`` step is timed at every ``--batch`` in a fresh
process of this script run on that tree (before) and on this one (after), alternating,
``--rounds`` times; prints the median and best microseconds per example of each side and their
ratio. E.g. ``python benchmarks/step_overhead.py --against HEAD~3 --batch 256 1024``.

``--dot-interaction xla cpu_ffi``: each rung's ``single`` step with ``kernels.dot_interaction``
set to each implementation in turn, in this process, alternating ``--rounds`` times (each round
times every implementation once, best of three timings of ``--reps`` passes); prints the median
microseconds per example of each and their ratio to the first. E.g. ``python
benchmarks/step_overhead.py --rungs d2 w1 --batch 256 1024 --dot-interaction xla cpu_ffi``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
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
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from data.batch import Batch  # noqa: E402
from recscale import config as config_lib  # noqa: E402
from recscale import (  # noqa: E402
    families,  # noqa: E402
    optim,
    sharding,
)
from recscale.train import experiment  # noqa: E402
from recscale.train.steps import make_train_step  # noqa: E402
from sweeps.specs import study  # noqa: E402


@contextlib.contextmanager
def _flat_dense():
    """While active, the trainer's dense optimizer is wrapped in ``optax.flatten``."""
    dense = optim.dense_optimizer
    optim.dense_optimizer = lambda *a, **k: optax.flatten(dense(*a, **k))
    try:
        yield
    finally:
        optim.dense_optimizer = dense


def _programs(cfg, exp):
    """The trainer's step (as ``_TrainRun`` builds it) and a ``lax.scan`` of it."""
    params, graphdef = exp.abstract_state.params, exp.graphdef

    def train_step(state, batch, args):
        tx = experiment.make_optimizer(cfg, params, args)
        return make_train_step(graphdef, tx, nonfinite=cfg.train.nonfinite)(state, batch)

    def multi(state, batches, args):
        return jax.lax.scan(lambda s, b: train_step(s, b, args), state, batches)

    shard = (exp.state_sharding, None, sharding.replicated())
    out = (exp.state_sharding, None)
    jit = lambda f: jax.jit(f, in_shardings=shard, out_shardings=out, donate_argnums=(0,))  # noqa: E731
    return jit(train_step), jit(multi)


def _time(fn, state, batches, sargs, reps: int) -> float:
    """Seconds per call of ``fn(state, batch, sargs)`` over ``reps`` passes of ``batches``."""
    state, _ = fn(state, batches[0], sargs)
    jax.block_until_ready(state)
    t = time.perf_counter()
    for _ in range(reps):
        for b in batches:
            state, _ = fn(state, b, sargs)
    jax.block_until_ready(state)
    return (time.perf_counter() - t) / (reps * len(batches))


def _count(compiled_text: str) -> int:
    """Instructions of the compiled entry computation, less parameters, constants and tuples."""
    entry = compiled_text[compiled_text.index("ENTRY") :].splitlines()[1:]
    ops = [re.search(r"=.*?\s([a-z][\w-]*)\(", line) for line in entry]
    skip = ("parameter", "constant", "get-tuple-element", "tuple")
    return sum(1 for m in ops if m and m.group(1) not in skip)


def _build(rung: str, batch: int, sharding_mode: str, kernels: dict | None = None):
    """The trial of ``rung`` at ``batch`` (its config, ``embeddings.sharding`` set unless
    ``study``, ``kernels`` entries overridden) and its model family."""
    t = study.trial_per_rung(batch)[rung]
    family = families.by_package(t.package)
    raw = json.loads(json.dumps(t.config))
    if sharding_mode != "study":
        raw["embeddings"]["sharding"] = sharding_mode
    raw.setdefault("kernels", {}).update(kernels or {})
    return t, family, config_lib.from_dict(family.config_cls, raw)


def _single_us(
    rung: str, batch: int, k: int, reps: int, sharding_mode: str, kernels: dict | None = None
) -> float:
    """Microseconds per example of the trainer's step (best of three timings of ``reps``
    passes over ``k`` prepared batches)."""
    with _prepared(rung, batch, k, sharding_mode, kernels) as (exp, single, dev, sargs):
        best = min(_time(single, exp.init_state(), dev, sargs, reps) for _ in range(3))
    return best / batch * 1e6


@contextlib.contextmanager
def _prepared(rung: str, batch: int, k: int, sharding_mode: str, kernels: dict | None = None):
    """``(experiment, jitted single step, k device batches, schedule args)`` of ``rung``, under
    its mesh."""
    _, family, cfg = _build(rung, batch, sharding_mode, kernels)
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.activate(mesh, cfg.mesh):
        exp = experiment.Experiment.build(cfg, family.build_model)
        sargs = jax.device_put(experiment.schedule_args(cfg), sharding.replicated())
        dev = [exp.device_batch(exp.source.train_batch(s)) for s in range(k)]
        single, _ = _programs(cfg, exp)
        yield exp, single, dev, sargs


def _profile(rung: str, batch: int, k: int, reps: int, sharding_mode: str, top: int = 25) -> None:
    """Prints the step's largest XLA thunks, microseconds per step, from a profiler trace."""
    with _prepared(rung, batch, k, sharding_mode) as (exp, single, dev, sargs):
        state = exp.init_state()
        for b in dev:
            state, _ = single(state, b, sargs)
        jax.block_until_ready(state)
        hlo = single.lower(state, dev[0], sargs).compile().as_text()
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp, create_perfetto_trace=True):
                for _ in range(reps):
                    for b in dev:
                        state, _ = single(state, b, sargs)
                jax.block_until_ready(state)
            trace = json.load(gzip.open(next(Path(tmp).rglob("*.trace.json.gz"))))
    ops = {
        m.group(1): m.group(2)
        for m in re.finditer(r"%([\w.-]+) = .*?metadata=\{op_name=\"([^\"]*)\"", hlo)
    }
    names = set(re.findall(r"^\s+(?:ROOT )?%([\w.-]+) = ", hlo[hlo.index("ENTRY") :], re.M))
    total: collections.Counter = collections.Counter()
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    for e in events:
        if e.get("ph") == "X" and e["name"] in names:
            total[e["name"]] += e.get("dur", 0.0)
    steps = reps * len(dev)
    step_us = sum(total.values()) / steps
    print(f"  {rung} at batch {batch}: {step_us:.0f} us of XLA thunks per step; the largest:")
    for name, us in total.most_common(top):
        what = ops.get(name, "").split("/")[-1][:60]
        print(f"    {us / steps:8.1f} us {us / steps / batch:6.3f} us/example  {name:<32} {what}")


def _against(args) -> None:
    """Before (``git archive`` of ``args.against``) against after (this tree), alternating."""
    here = Path(__file__).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.against], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        roots = {"before": tmp, "after": str(ROOT)}
        us: dict = collections.defaultdict(list)
        for r in range(args.rounds):
            for side, root in roots.items():
                for rung in args.rungs:
                    cmd = [sys.executable, str(here), "--child", "--root", root, "--rungs", rung]
                    cmd += ["--batch", *map(str, args.batch), "--k", str(args.k)]
                    cmd += ["--reps", str(args.reps), "--sharding", args.sharding]
                    out = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
                    if out.returncode != 0:
                        sys.exit(f"{side} ({root}) failed:\n{out.stderr[-3000:]}")
                    for line in out.stdout.splitlines():
                        if line.startswith("{"):
                            row = json.loads(line)
                            us[(rung, row["batch"], side)].append(row["us"])
                            print(
                                f"  round {r}: {side:<6} {rung} batch {row['batch']}: "
                                f"{row['us']:.2f} us/example",
                                flush=True,
                            )
    print(
        f"\n{args.against} (before) against this tree (after), us per example, median (best) "
        f"of {args.rounds} alternating runs:"
    )
    print("| rung | batch | before | after | before / after |\n|---|---:|---:|---:|---:|")
    for rung in args.rungs:
        for b in args.batch:
            bef, aft = us[(rung, b, "before")], us[(rung, b, "after")]
            mb, ma = statistics.median(bef), statistics.median(aft)
            print(
                f"| {rung} | {b} | {mb:.2f} ({min(bef):.2f}) | {ma:.2f} ({min(aft):.2f}) "
                f"| {mb / ma:.2f}x |"
            )


def _dot_impls(args) -> None:
    """The ``single`` step with each ``--dot-interaction`` implementation, alternating."""
    us: dict = collections.defaultdict(list)
    for r in range(args.rounds):
        for batch in args.batch:
            for rung in args.rungs:
                for impl in args.dot_interaction:
                    kernels = {"dot_interaction": impl}
                    u = _single_us(rung, batch, args.k, args.reps, args.sharding, kernels)
                    us[(rung, batch, impl)].append(u)
                    print(f"  round {r}: {rung} batch {batch} {impl}: {u:.3f} us/example")
    base = args.dot_interaction[0]
    print(f"\nus per example, median (best) of {args.rounds} alternating rounds:")
    print("| rung | batch | dot_interaction | us/example | " + base + " / it |")
    print("|---|---:|---|---:|---:|")
    for rung in args.rungs:
        for batch in args.batch:
            m0 = statistics.median(us[(rung, batch, base)])
            for impl in args.dot_interaction:
                u = us[(rung, batch, impl)]
                print(
                    f"| {rung} | {batch} | {impl} | {statistics.median(u):.3f} ({min(u):.3f}) "
                    f"| {m0 / statistics.median(u):.2f}x |"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rungs", nargs="+", default=["d2", "w1"])
    ap.add_argument("--batch", type=int, nargs="+", default=[256])
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--sharding", choices=("study", "off", "auto"), default="study")
    ap.add_argument("--profile", action="store_true", help="where a step's time goes")
    ap.add_argument("--against", metavar="REV", help="before (REV) / after (this tree)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations (--against, --dot-...)")
    ap.add_argument("--dot-interaction", nargs="+", metavar="IMPL", help="time each, alternating")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.against:
        return _against(args)
    if args.dot_interaction:
        return _dot_impls(args)
    for batch in args.batch:
        for rung in args.rungs:
            if args.child:
                us = _single_us(rung, batch, args.k, args.reps, args.sharding)
                print(json.dumps({"rung": rung, "batch": batch, "us": us}), flush=True)
            elif args.profile:
                _profile(rung, batch, args.k, args.reps, args.sharding)
            else:
                _three_ways(rung, batch, args.k, args.reps, args.sharding)


def _three_ways(rung: str, batch: int, k: int, reps: int, sharding_mode: str) -> None:
    """``single``, ``scan`` and ``flat`` (the module docstring) for one rung and batch."""
    t, family, cfg = _build(rung, batch, sharding_mode)
    build_model = family.build_model
    print(f"batch {batch}; ms per step (compile excluded), us per example, ratio to single")
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.activate(mesh, cfg.mesh):
        exp = experiment.Experiment.build(cfg, build_model)
        sargs = jax.device_put(experiment.schedule_args(cfg), sharding.replicated())
        dev = [exp.device_batch(exp.source.train_batch(s)) for s in range(k)]
        stacked = Batch(*(jnp.stack(xs) for xs in zip(*dev, strict=True)))
        single, multi = _programs(cfg, exp)
        a, b = exp.init_state(), exp.init_state()
        for x in dev:
            a, _ = single(a, x, sargs)
        b, _ = multi(b, stacked, sargs)
        same = all(
            np.array_equal(x, y)
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        )
        if not same:
            sys.exit(f"{rung}: {k} scanned steps differ from {k} single steps")
        ms = {}
        ms["single"] = _time(single, exp.init_state(), dev, sargs, reps)
        per_call = _time(multi, exp.init_state(), [stacked], sargs, reps)
        ms["scan"] = per_call / k
        n_ops = {"single": _count(single.lower(a, dev[0], sargs).compile().as_text())}
        experiment._PROGRAMS.clear()  # the init program kept for this model is the unflattened one
        with _flat_dense():  # its own state layout (flattened moments), init and step
            exp_flat = experiment.Experiment.build(cfg, build_model)
            flat_single, _ = _programs(cfg, exp_flat)
            ms["flat"] = _time(flat_single, exp_flat.init_state(), dev, sargs, reps)
            n_ops["flat"] = _count(
                flat_single.lower(exp_flat.init_state(), dev[0], sargs).compile().as_text()
            )
    print(
        f"  {t.family} {rung} ({t.flops_per_example:.2e} FLOPs/example), "
        f"{n_ops['single']} XLA instructions per step ({n_ops['flat']} flat):"
    )
    for name, sec in ms.items():
        print(
            f"    {name:<7}{sec * 1e3:8.3f} ms/step {sec / batch * 1e6:7.2f} us/example"
            f" {ms['single'] / sec:6.2f}x"
        )


if __name__ == "__main__":
    main()
