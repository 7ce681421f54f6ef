"""A scaling-study model's training step: dense table updates against the sparse engine.

``python benchmarks/study_step.py [--rungs w1 w4 d4] [--steps 300] [--batch 256]`` trains each
named rung of ``sweeps.specs.study`` (its data: 26 tables, 201k rows) for ``--steps`` steps
twice in this process, with ``embeddings.sharding=off`` (one array per table, the dense optax
update of every row each step: the reference path) and ``auto`` (the embedding engine: sparse
row-wise Adagrad on the rows the batch touches), and prints milliseconds per step (compile
excluded, from the trainer's ``timings.jsonl``), the data waits per step and the ratio. Both do
the same updates: row-wise Adagrad leaves a row the batch does not touch unchanged either way.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from recscale import families
from recscale.train.cli import train_main
from sweeps.specs import study


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rungs", nargs="+", default=["w1", "w4", "d4"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    trials = study.trial_per_rung(args.batch)
    print(
        f"batch {args.batch}, {args.steps} steps; ms per step (compile excluded) and data "
        "waits per step"
    )
    for rung in args.rungs:
        t = trials[rung]
        ms = {}
        for mode in ("off", "auto"):
            cfg = json.loads(json.dumps(t.config))
            cfg["train"].update(num_steps=args.steps, eval_every=0, checkpoint_every=args.steps)
            cfg["dense_optim"]["warmup_steps"] = cfg["embedding_optim"]["warmup_steps"] = 1
            cfg["embeddings"]["sharding"] = mode
            with tempfile.TemporaryDirectory() as wd:
                (Path(wd) / "config.json").write_text(json.dumps(cfg))
                train_main(
                    families.by_package(t.package),
                    [f"{wd}/config.json", "--workdir", wd, "--train.no-progress"],
                )
                row = json.loads((Path(wd) / "timings.jsonl").read_text().splitlines()[-1])
            tr, data = row["phases"]["train"], row["phases"]["data"]
            ms[mode] = (tr["seconds"] - tr["compile_s"]) / args.steps * 1e3
            print(
                f"  {t.family} {rung} ({t.flops_per_example:.3g} FLOPs/example), sharding="
                f"{mode}: {ms[mode]:.1f} ms/step, data waits "
                f"{data['seconds'] / args.steps * 1e3:.1f} ms/step"
            )
        print(f"  {rung}: the engine's step is {ms['off'] / ms['auto']:.2f}x faster")


if __name__ == "__main__":
    main()
