"""The Frappe reproduction table: every model's preset over several seeds, with time and cost.

    python benchmarks/frappe_table.py --root runs/frappe_table [--models dlrm wukong ...]
        [--seeds 0 1 2] [--data-dir ../shared/data/frappe]
        [--early-stopping auc --eval-every 100 --patience 2]

For each (model, seed) it runs the model's normal command, one after another (the runs share
the machine's cores, so they are never run concurrently)::

    python -m PACKAGE.train FAMILY/frappe --workdir ROOT/FAMILY_sSEED --train.seed SEED
        --data.shuffle-seed SEED --train.no-progress

timing the whole command (reading the CSVs, compiling, training, evaluations, checkpoints), and
then prints a Markdown table of validation AUC and logloss (mean ± sample std over seeds, of the
final checkpoint, which the trainer evaluates on all of ``valid.csv``; with ``--early-stopping``
the best checkpoint by that validation metric, the BARS protocol, and the steps column shows the
best step / the step the run stopped at), wall time, parameters
and FLOPs per example (``recscale.flops`` conventions) beside the published test numbers. A run
whose workdir already holds its final evaluation is not run again, so the script resumes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# family (recscale.families) -> published test AUC / logloss: Wukong paper Table 2; BARS
# Frappe_x1.
MODELS = {
    "wukong": ("0.9868 / 0.1757", "—"),
    "dlrm": ("0.9846 / 0.1465", "0.9840"),
    "dcnv2": ("0.9774 / 0.2325", "0.9845"),
    "finalmlp": ("0.9868 / 0.1280", "0.9861"),
    "masknet": ("0.9816 / 0.1701", "0.9837"),
}


def run(family: str, seed: int, root: Path, data_dir: str | None, extra: list[str]) -> dict:
    """Trains one (family, seed) unless done; returns its final eval row and wall time."""
    from recscale import families

    workdir = root / f"{family}_s{seed}"
    done = workdir / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    cmd = [
        sys.executable,
        "-m",
        families.load(family).module("train"),
        f"{family}/frappe",
        "--workdir",
        str(workdir),
        "--train.seed",
        str(seed),
        "--data.shuffle-seed",
        str(seed),
        "--train.no-progress",
    ]
    cmd += extra
    if data_dir:
        d = Path(data_dir).absolute()
        cmd += ["--data.train-path", str(d / "train.csv"), "--data.eval-path", str(d / "valid.csv")]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    done.write_text(json.dumps(result, sort_keys=True) + "\n")
    return result


def cost(family: str, workdir: Path):
    """The model's cost on the run's real schema (vocabularies read from its training file)."""
    from data.builders import make_source
    from recscale import families
    from recscale.config import load_json

    cls = families.load(family).config_cls
    cfg = load_json(cls, workdir / "config.json")
    schema = make_source(cfg.data, process_index=0, process_count=1, eval_only=True).schema
    return cfg.model.cost(schema), cfg


def cfg_steps(root: Path, family: str, seed: int) -> int:
    return json.loads((root / f"{family}_s{seed}" / "config.json").read_text())["train"][
        "num_steps"
    ]


def fmt(xs: list[float], digits: int) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", default="runs/frappe_table", help="directory for the runs' workdirs")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--data-dir", default=None, help="Frappe directory (default: the presets')")
    p.add_argument(
        "--early-stopping",
        default="",
        choices=["", "auc", "logloss"],
        help="stop on this validation metric and report the best checkpoint",
    )
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--patience", type=int, default=2)
    args = p.parse_args()
    extra = []
    if args.early_stopping:
        extra = [
            "--train.early-stopping-metric",
            args.early_stopping,
            "--train.eval-every",
            str(args.eval_every),
            "--train.early-stopping-patience",
            str(args.patience),
        ]
    root = Path(args.root).absolute()
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in args.models:
        results = [run(family, s, root, args.data_dir, extra) for s in args.seeds]
        steps = f"{cfg_steps(root, family, args.seeds[0]):,}"
        if args.early_stopping:
            steps = " ".join(f"{r['best_step']}/{r['step']}" for r in results)
        c, cfg = cost(family, root / f"{family}_s{args.seeds[0]}")
        paper, bars = MODELS[family]
        rows.append(
            f"| {family}/frappe | {fmt([r['auc'] for r in results], 4)} | "
            f"{fmt([r['logloss'] for r in results], 4)} | {steps} | "
            f"{fmt([r['wall_s'] / 60 for r in results], 1)} | {c.dense_params:,} | "
            f"{c.sparse_params:,} | {c.forward_flops / 1e6:.3f} | {c.train_flops / 1e6:.3f} | "
            f"{paper} | {bars} |"
        )
        per_seed = ", ".join(
            f"s{s}: {r['auc']:.5f} / {r['logloss']:.4f}"
            for s, r in zip(args.seeds, results, strict=True)
        )
        print(f"{family}: {per_seed}", file=sys.stderr)
    print(
        "| preset | val AUC | val logloss | steps | wall min (2 cores) | dense params | "
        "sparse params | fwd MFLOP/ex | train MFLOP/ex | Wukong paper test AUC / logloss | BARS test AUC |"
    )
    print("| --- " * 11 + "|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
