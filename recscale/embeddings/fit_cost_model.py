"""Trains the learned sharding cost model on a measured cost table, saves it and prints both
models' held-out error (``recscale.embeddings.learned_cost``):

``python -m recscale.embeddings.fit_cost_model benchmarks/cost_tables/cpu-2core_v1.jsonl.gz
--out recscale/embeddings/cost_models/cpu-2core.npz``

A fifth of the table's tasks is held out (whole); the analytic model's lookup factor is fitted
to the same training samples. The model's metadata records the table, its machine, the factor
and the held-out report (MAPE and rank correlation of both models).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from recscale.embeddings import learned_cost
from tpu_gpu_configs.profiles import get_profile


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m recscale.embeddings.fit_cost_model")
    ap.add_argument("table", help="a cost table (benchmarks/cost_table.py)")
    ap.add_argument("--out", required=True, help="the model file (.npz)")
    ap.add_argument("--profile", default="cpu-2core", help="the analytic model's profile")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        header, samples = learned_cost.load_table(args.table)
        profile = get_profile(args.profile)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        if not os.access(Path(args.out).parent, os.W_OK):
            raise ValueError(f"{args.out}: its folder is not writable")
    except (ValueError, KeyError, OSError) as e:
        sys.exit(f"error: {e}")
    tr, te = learned_cost.split_by_task(samples, seed=args.seed)
    if not tr or not te:
        sys.exit(
            f"error: {args.table}: {len({s.task for s in samples})} task(s); a held-out "
            "fifth needs at least two"
        )
    model = learned_cost.train(tr, steps=args.steps, seed=args.seed)
    factor = learned_cost.fit_analytic(tr, profile)
    report = learned_cost.evaluate(model, factor, te, profile)
    model.meta.update(
        table=str(args.table),
        machine=header.get("machine"),
        profile=args.profile,
        analytic_lookup_factor=factor,
        train_samples=len(tr),
        held_out=report,
    )
    model.save(args.out)
    print(json.dumps({"out": args.out, "train": len(tr), **report}, indent=1))


if __name__ == "__main__":
    main()
