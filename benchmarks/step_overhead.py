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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rungs", nargs="+", default=["d2", "w1"])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    trials = study.trial_per_rung(args.batch)
    print(f"batch {args.batch}; ms per step (compile excluded), us per example, ratio to single")
    for rung in args.rungs:
        t = trials[rung]
        family = families.by_package(t.package)
        build_model = family.build_model
        cfg = config_lib.from_dict(family.config_cls, json.loads(json.dumps(t.config)))
        mesh = sharding.make_mesh(cfg.mesh)
        with sharding.activate(mesh, cfg.mesh):
            exp = experiment.Experiment.build(cfg, build_model)
            sargs = jax.device_put(experiment.schedule_args(cfg), sharding.replicated())
            dev = [exp.device_batch(exp.source.train_batch(s)) for s in range(args.k)]
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
                sys.exit(f"{rung}: {args.k} scanned steps differ from {args.k} single steps")
            ms = {}
            ms["single"] = _time(single, exp.init_state(), dev, sargs, args.reps)
            per_call = _time(multi, exp.init_state(), [stacked], sargs, args.reps)
            ms["scan"] = per_call / args.k
            n_ops = {"single": _count(single.lower(a, dev[0], sargs).compile().as_text())}
            experiment._PROGRAMS.clear()  # the init program kept for this model is the unflattened one
            with _flat_dense():  # its own state layout (flattened moments), init and step
                exp_flat = experiment.Experiment.build(cfg, build_model)
                flat_single, _ = _programs(cfg, exp_flat)
                ms["flat"] = _time(flat_single, exp_flat.init_state(), dev, sargs, args.reps)
                n_ops["flat"] = _count(
                    flat_single.lower(exp_flat.init_state(), dev[0], sargs).compile().as_text()
                )
        print(
            f"  {t.family} {rung} ({t.flops_per_example:.2e} FLOPs/example), "
            f"{n_ops['single']} XLA instructions per step ({n_ops['flat']} flat):"
        )
        for name, sec in ms.items():
            print(
                f"    {name:<7}{sec * 1e3:8.3f} ms/step {sec / args.batch * 1e6:7.2f} us/example"
                f" {ms['single'] / sec:6.2f}x"
            )


if __name__ == "__main__":
    main()
