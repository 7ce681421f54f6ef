"""Warmup-stable-decay with cooldown branches against a cosine run per budget: final eval loss.

``python benchmarks/wsd_vs_cosine.py [--preset dlrm/tiny] [--budgets 100 200 400]
[--seeds 0 1 2] [--cooldown-fraction 0.2] [--cooldown-shape 1-sqrt] [--out runs/bench_wsd]``, or
on a size of the scaling study (its data, batch 256 and rates; budgets in training FLOPs):
``--study-rung d2 --budgets 1e10 3.16e10 1e11``

Issue 36's check before a study relies on branches. For every seed, two arms train the preset at
each budget (a step count), the same model, data, peak rates and warmup:

* ``cosine``: today's schedule, one run per budget, each decaying from the end of its warmup to
  ``end_lr_fraction`` of the peak at its last step (both optimizers);
* ``wsd``: one stable run to the largest budget that keeps a checkpoint at each smaller budget's
  decay start, and a cooldown branch per smaller budget (``recscale.train.branches``); the
  largest budget's point is the stable run itself, which ends in its own cooldown.

It prints each budget's final eval logloss (the whole evaluation set) of both arms, averaged
over the seeds, the difference ``wsd - cosine`` (paired by seed) with its 95% t-interval over
the seeds, and what each arm cost in training steps (and seconds, compile included: the runs of
one arm share their compiled programs with the other's, so the first run pays them). Written
to ``OUT/results.json``; the runs' own folders stay under ``OUT``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _arm_config(cfg, decay: str, fraction: float, shape: str, seed: int):
    def optim(o):
        return dataclasses.replace(o, decay=decay, cooldown_fraction=fraction, cooldown_shape=shape)

    return dataclasses.replace(
        cfg,
        dense_optim=optim(cfg.dense_optim),
        embedding_optim=optim(cfg.embedding_optim),
        train=dataclasses.replace(
            cfg.train,
            seed=seed,
            progress=False,
            eval_every=0,
            checkpoint_every=0,
            log_every=max(1, cfg.train.log_every),
        ),
    )


def _study_rung(rung: str, flops: list[float]):
    """The study's trial config of model size ``rung`` (batch 256, its rates, data and engine),
    its preset, and the step counts of the budgets ``flops`` (training FLOPs); both arms warm
    up over 5% of the smallest budget's steps, as a branched sweep's size does."""
    from recscale import config as config_lib  # noqa: PLC0415
    from sweeps.specs import study  # noqa: PLC0415

    trial = study.trial_per_rung(256)[rung]
    preset = {f.family: f.preset for f in study.SPEC.families}[trial.family]
    cfg = config_lib.from_dict(type(config_lib.get_preset(preset)), trial.config)
    steps = sorted({round(c / trial.flops_per_example / trial.batch_size) for c in flops})
    warmup = round(0.05 * steps[0])
    cfg = dataclasses.replace(
        cfg,
        dense_optim=dataclasses.replace(cfg.dense_optim, warmup_steps=warmup),
        embedding_optim=dataclasses.replace(cfg.embedding_optim, warmup_steps=warmup),
    )
    return cfg, preset, steps


def _interval(diffs: list[float]) -> tuple[float, float, float]:
    """Mean of paired differences and its 95% t-interval (nan bounds with one seed)."""
    from scipy import stats  # noqa: PLC0415

    n = len(diffs)
    mean = sum(diffs) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="dlrm/tiny", help="family preset (its family and data)")
    p.add_argument(
        "--budgets", type=float, nargs="+", default=[100, 200, 400], help="steps (or FLOPs)"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--cooldown-fraction", type=float, default=0.2)
    p.add_argument("--cooldown-shape", choices=["1-sqrt", "linear"], default="1-sqrt")
    p.add_argument("--out", type=Path, default=Path("runs/bench_wsd"))
    p.add_argument(
        "--study-rung",
        default="",
        help="train this model size of sweeps.specs.study (e.g. d2, w1) on the study's data, "
        "batch and rates instead of --preset; --budgets are then training FLOPs",
    )
    args = p.parse_args(argv)

    from recscale import families  # noqa: PLC0415
    from recscale.config import get_preset  # noqa: PLC0415
    from recscale.train import branches  # noqa: PLC0415
    from recscale.train.loop import train  # noqa: PLC0415

    if args.study_rung:
        base, args.preset, budgets = _study_rung(args.study_rung, args.budgets)
    else:
        base, budgets = get_preset(args.preset), sorted({int(b) for b in args.budgets})
    family = families.of_preset(args.preset)
    if args.out.exists() and any(args.out.iterdir()):  # never delete what this run did not make
        raise SystemExit(f"error: --out {args.out} exists and is not empty: name a new folder")
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "train.log", "w")  # the runs' plans and notes, out of the table's way

    def run(cfg, workdir: Path) -> dict:
        with contextlib.redirect_stderr(log), contextlib.redirect_stdout(log):
            return train(cfg, family.build_model, workdir, argv=["wsd_vs_cosine"])

    loss = {arm: {b: [] for b in budgets} for arm in ("cosine", "wsd")}
    steps = {"cosine": 0, "wsd": 0}
    seconds = {"cosine": 0.0, "wsd": 0.0}
    for seed in args.seeds:
        cos = _arm_config(base, "cosine", args.cooldown_fraction, args.cooldown_shape, seed)
        t0 = time.perf_counter()
        for b in budgets:
            c = dataclasses.replace(cos, train=dataclasses.replace(cos.train, num_steps=b))
            loss["cosine"][b].append(run(c, args.out / f"cosine/seed{seed}/b{b}")["logloss"])
            steps["cosine"] += b
        seconds["cosine"] += time.perf_counter() - t0

        wsd = _arm_config(base, "wsd", args.cooldown_fraction, args.cooldown_shape, seed)
        t0 = time.perf_counter()
        stable_dir = args.out / f"wsd/seed{seed}/b{budgets[-1]}"
        loss["wsd"][budgets[-1]].append(
            run(branches.stable_config(wsd, budgets), stable_dir)["logloss"]
        )
        steps["wsd"] += budgets[-1]
        for b in budgets[:-1]:
            c = branches.branch_config(wsd, b, stable_dir)
            loss["wsd"][b].append(run(c, args.out / f"wsd/seed{seed}/b{b}")["logloss"])
            steps["wsd"] += b - c.train.init_step
        seconds["wsd"] += time.perf_counter() - t0
    log.close()

    rows = []
    print(
        f"{args.preset}, seeds {args.seeds}, {args.cooldown_shape} cooldown of "
        f"{args.cooldown_fraction:g} of each budget; final eval logloss (mean over seeds)"
    )
    print(f"{'budget':>8} {'cosine':>9} {'wsd':>9} {'wsd - cosine':>13}  95% interval")
    for b in budgets:
        c, w = loss["cosine"][b], loss["wsd"][b]
        mean, lo, hi = _interval([x - y for x, y in zip(w, c, strict=True)])
        rows.append(
            {"budget": b, "cosine": c, "wsd": w, "diff": mean, "diff_lo": lo, "diff_hi": hi}
        )
        print(
            f"{b:>8} {sum(c) / len(c):>9.5f} {sum(w) / len(w):>9.5f} {mean:>+13.5f}  "
            f"[{lo:+.5f}, {hi:+.5f}]"
        )
    for arm in ("cosine", "wsd"):
        print(
            f"{arm:>6}: {steps[arm]:,} training steps over {len(args.seeds)} seeds "
            f"({steps[arm] / steps['cosine']:.2f}x cosine's), {seconds[arm]:.1f} s"
        )
    out = {
        "preset": args.preset,
        "budgets": budgets,
        "seeds": args.seeds,
        "cooldown_fraction": args.cooldown_fraction,
        "cooldown_shape": args.cooldown_shape,
        "rows": rows,
        "steps": steps,
        "seconds": seconds,
    }
    (args.out / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
