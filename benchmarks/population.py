"""Seeds as a vmapped population against one run per seed: models x examples per second.

``python benchmarks/population.py [--rungs d1 d5 w1 w5] [--k 1 3 8] [--batch 256]
[--steps 300] [--out runs/bench_population.json]``

For each model size of the scaling study (``sweeps.specs.study``: its data, engine, rates; by
default the smallest and the median size of DLRM and Wukong) it times, in one process on this
machine's devices:

* ``single``: one run's training loop (``recscale.train.loop``'s jitted step, the data produced
  ahead on threads, copied to the device, stepped): examples per second, which is also the
  models x examples per second of K runs one after another;
* ``population K``: K members (seeds 0..K-1) in one vmapped program
  (``recscale.train.population``), every batch shared: models x examples per second, K times
  the population's examples per second.

Each is timed over ``--steps`` steps after 5 warm-up steps (compiles excluded), best of
``--repeats``; the ratio is against ``single`` measured in the same process. A population
shares each batch among its members, so part of its gain on a CPU is the data it does not
produce K times; on a GPU or TPU a small model fills a fraction of the chip and K members
should run in about the time of one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WARMUP = 5


def _time_loop(step, state, args, exp, steps: int) -> float:
    """Seconds for ``steps`` steps of the training loop after the warm-up."""
    import jax  # noqa: PLC0415

    from recscale.train.loop import prefetch  # noqa: PLC0415

    batches = prefetch(exp.source, 0, WARMUP + steps)
    t0 = None
    for i, (_, host) in enumerate(batches):
        if i == WARMUP:
            jax.block_until_ready(state)
            t0 = time.perf_counter()
        state, _ = step(state, exp.device_batch(host), args)
    jax.block_until_ready(state)
    return time.perf_counter() - t0


def measure(trial, ks: list[int], steps: int, repeats: int) -> dict:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from recscale import config as config_lib  # noqa: PLC0415
    from recscale import families, sharding  # noqa: PLC0415
    from recscale.train.experiment import (  # noqa: PLC0415
        Experiment,
        schedule_args,
        train_programs,
    )
    from recscale.train.population import population_programs  # noqa: PLC0415
    from sweeps.specs import study  # noqa: PLC0415

    preset = {f.family: f.preset for f in study.SPEC.families}[trial.family]
    family = families.of_preset(preset)
    cfg = config_lib.from_dict(type(config_lib.get_preset(preset)), trial.config)
    batch = cfg.data.batch_size
    out = {"rung": trial.rung, "flops_per_example": trial.flops_per_example, "batch": batch}
    with sharding.activate(sharding.make_mesh(cfg.mesh), cfg.mesh):
        exp = Experiment.build(cfg, family.build_model)
        step, _ = train_programs(cfg, family.build_model, exp)
        args = jax.device_put(schedule_args(cfg), sharding.replicated())
        times = [_time_loop(step, exp.init_state(), args, exp, steps) for _ in range(repeats)]
        single = steps * batch / min(times)
        out["single"] = single
        for k in ks:
            init, pstep = population_programs(cfg, family.build_model, exp, k)
            a = schedule_args(cfg)
            pargs = jax.device_put({n: np.stack([v] * k) for n, v in a.items()})
            seeds = jnp.arange(k, dtype=jnp.int32)
            times = [_time_loop(pstep, init(seeds), pargs, exp, steps) for _ in range(repeats)]
            rate = k * steps * batch / min(times)
            out[f"population {k}"] = rate
            out[f"ratio {k}"] = rate / single
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rungs", nargs="+", default=["d1", "d5", "w1", "w5"])
    p.add_argument("--k", type=int, nargs="+", default=[1, 3, 8])
    p.add_argument("--batch", type=int, default=256, help="global batch (the study's: 256)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("runs/bench_population.json"))
    args = p.parse_args(argv)

    import jax  # noqa: PLC0415

    from sweeps.specs import study  # noqa: PLC0415

    trials = study.trial_per_rung(args.batch)
    rows = []
    device = f"{jax.devices()[0].device_kind} x{jax.device_count()}"
    print(f"{device}, batch {args.batch}, {args.steps} steps; models x examples per second")
    head = f"{'rung':>5} {'FLOPs/ex':>9} {'single':>10}"
    for k in args.k:
        head += f" {'K=' + str(k):>10} {'ratio':>6}"
    print(head)
    for rung in args.rungs:
        r = measure(trials[rung], args.k, args.steps, args.repeats)
        rows.append(r)
        line = f"{rung:>5} {r['flops_per_example']:>9.3g} {r['single']:>10,.0f}"
        for k in args.k:
            line += f" {r[f'population {k}']:>10,.0f} {r[f'ratio {k}']:>5.2f}x"
        print(line, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": device, "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
