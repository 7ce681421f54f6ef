"""A batch-size sweep's analysis: steps and examples to a target quality per recipe, the
critical batch they imply, and the gradient noise scale measured during the runs.

``python -m sweeps.batch_analysis SWEEP_DIR --target 0.47 [--metric logloss] [--plots]``

For every finished trial of a batch-size sweep (``SweepSpec.batch_sizes``), the first
evaluation at which the metric reaches ``target`` (logloss at most, AUC at least) gives its
steps and examples to target; a trial that never reaches it has none. For each (family, rung,
recipe) and batch, the best of the learning-rate multipliers counts (the sweep's small LR
search), seeds averaged.

McCandlish et al. (2018) predict the trade-off ``S / S_min - 1 = (E / E_min - 1)^-1``, i.e.
``S(B) = S_min (1 + B_crit / B)`` and ``E(B) = E_min (1 + B / B_crit)``: a least-squares fit of
``S = S_min + S_min B_crit / B`` (linear in ``1 / B``) gives the critical batch ``B_crit``, the
knee where doubling the batch stops halving the steps. The runs' own noise-scale
measurements (``train.noise_scale_every``; ``split="noise_scale"`` rows), averaged over each
run's second half, give ``B_simple`` for the dense parameters and the tables apart, the
paper's predictor of ``B_crit``, to compare.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from sweeps.store import SweepStore, read_results


def first_reaching(evals: list[dict], metric: str, target: float) -> int | None:
    """The first eval step whose ``metric`` reaches ``target`` (logloss <=, AUC >=)."""
    better = (lambda v: v >= target) if metric == "auc" else (lambda v: v <= target)
    for r in sorted(evals, key=lambda r: r["step"]):
        v = r.get(metric)
        if v is not None and math.isfinite(v) and better(v):
            return int(r["step"])
    return None


def fit_critical_batch(batches: np.ndarray, steps: np.ndarray) -> dict[str, float]:
    """``S(B) = S_min (1 + B_crit / B)`` by least squares in ``1 / B``: ``{"s_min", "b_crit",
    "e_min" = S_min B_crit}``; ``b_crit`` is NaN with fewer than two points or steps that do
    not fall with the batch, and infinite when they fall as ``1 / B`` throughout (the knee
    beyond ten times the largest batch measured)."""
    b, s = np.asarray(batches, float), np.asarray(steps, float)
    if len(b) < 2:
        return {"s_min": math.nan, "b_crit": math.nan, "e_min": math.nan}
    a = np.stack([np.ones_like(b), 1.0 / b], axis=1)
    (s_min, c), *_ = np.linalg.lstsq(a, s, rcond=None)
    if c <= 0:  # steps do not fall with the batch: no trade-off to fit
        return {"s_min": float(s_min), "b_crit": math.nan, "e_min": math.nan}
    if s_min <= 0 or c / s_min > 10 * b.max():
        # steps fall as 1/B over every measured batch: the knee lies beyond them
        return {"s_min": float(max(s_min, 0.0)), "b_crit": math.inf, "e_min": float(c)}
    return {"s_min": float(s_min), "b_crit": float(c / s_min), "e_min": float(c)}


def _rows(path: Path, split: str) -> list[dict]:
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("split") == split]


def analyze(sweep_dir: str | Path, *, target: float, metric: str = "logloss") -> dict[str, Any]:
    """Steps/examples to ``target`` per (family, rung, recipe, batch), the fitted critical batch
    per (family, rung, recipe), and the measured noise scale per (family, rung, batch)."""
    store = SweepStore(sweep_dir)
    results = read_results(Path(sweep_dir) / "results.jsonl").rows
    cells: dict[tuple, dict[int, list[tuple[float, int | None, int]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    noise: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for row in results:
        if row.get("status") != "SUCCESS":
            continue
        tid = row["trial_id"]
        trial = json.loads((store.trial_dir(tid) / "trial.json").read_text())
        metrics = store.workdir(tid) / "metrics.jsonl"
        steps = first_reaching(_rows(metrics, "eval"), metric, target)
        # every recipe this run serves (coinciding recipes share one trial, ``Trial.also``)
        recipes = [(trial.get("lr_rule") or "batch_rule", trial.get("lr_multiplier", 1.0)),
                   *(tuple(a) for a in trial.get("also", ()))]  # fmt: skip
        for rule, mult in recipes:
            key = (trial["family"], trial["rung"], rule)
            cells[key][trial["batch_size"]].append((mult, steps, trial["seed"]))
        late = [r for r in _rows(metrics, "noise_scale") if r["step"] >= trial["steps"] / 2]
        means = {}
        for part in ("dense", "embedding"):
            vals = [r.get(f"noise_scale/{part}") for r in late]
            vals = [v for v in vals if v is not None and math.isfinite(v)]
            if vals:
                means[part] = float(np.mean(vals))
        if means:
            noise[(trial["family"], trial["rung"])][trial["batch_size"]].append(means)
    out: dict[str, Any] = {"metric": metric, "target": target, "recipes": [], "noise_scale": []}
    for (fam, rung, recipe), per_batch in sorted(cells.items()):
        points = []
        for b, runs in sorted(per_batch.items()):
            by_mult: dict[float, list[int | None]] = defaultdict(list)
            for mult, steps, _ in runs:
                by_mult[mult].append(steps)
            # a multiplier counts if every seed reached the target; the best such one
            reached = {m: float(np.mean(v)) for m, v in by_mult.items() if None not in v}
            if reached:
                m, s = min(reached.items(), key=lambda kv: kv[1])
                points.append({"batch": b, "steps": s, "examples": s * b, "lr_multiplier": m})
            else:
                points.append({"batch": b, "steps": None, "examples": None, "lr_multiplier": None})
        ok = [p for p in points if p["steps"] is not None]
        fit = fit_critical_batch(np.array([p["batch"] for p in ok]),
                                 np.array([p["steps"] for p in ok]))  # fmt: skip
        out["recipes"].append({"family": fam, "rung": rung, "recipe": recipe, "points": points,
                               **fit})  # fmt: skip
    for (fam, rung), per_batch in sorted(noise.items()):
        for b, vals in sorted(per_batch.items()):
            row = {"family": fam, "rung": rung, "batch": b}
            for part in ("dense", "embedding"):
                got = [v[part] for v in vals if part in v]
                row[f"b_simple_{part}"] = float(np.mean(got)) if got else math.nan
            out["noise_scale"].append(row)
    return out


def plot(analysis: dict, path: str | Path) -> Path:
    """Steps and examples to target against batch, one line per (family, rung, recipe)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_s, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    for r in analysis["recipes"]:
        ok = [p for p in r["points"] if p["steps"] is not None]
        if not ok:
            continue
        label = f"{r['family']} {r['rung']} {r['recipe']}"
        b = [p["batch"] for p in ok]
        ax_s.plot(b, [p["steps"] for p in ok], "o-", label=label)
        ax_e.plot(b, [p["examples"] for p in ok], "o-", label=label)
        if math.isfinite(r["b_crit"]):
            ax_s.axvline(r["b_crit"], ls=":", color=ax_s.lines[-1].get_color())
    for ax, what in ((ax_s, "steps"), (ax_e, "examples")):
        ax.set(xscale="log", yscale="log", xlabel="global batch",
               ylabel=f"{what} to {analysis['metric']} {analysis['target']}")  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
    ax_s.legend(fontsize=7)
    ax_s.set_title("dotted: fitted critical batch")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir")
    ap.add_argument("--target", type=float, required=True)
    ap.add_argument("--metric", choices=["logloss", "auc"], default="logloss")
    ap.add_argument("--plots", action="store_true", help="write batch_curves.png")
    args = ap.parse_args(argv)
    if not (Path(args.sweep_dir) / "results.jsonl").is_file():
        raise SystemExit(f"error: {args.sweep_dir}/results.jsonl not found: not a sweep directory")
    out = analyze(args.sweep_dir, target=args.target, metric=args.metric)
    (Path(args.sweep_dir) / "batch_analysis.json").write_text(json.dumps(out, indent=1) + "\n")
    if args.plots:
        plot(out, Path(args.sweep_dir) / "batch_curves.png")
    for r in out["recipes"]:
        pts = ", ".join(f"{p['batch']}: {p['steps'] if p['steps'] is not None else '-'}"
                        for p in r["points"])  # fmt: skip
        print(
            f"{r['family']} {r['rung']} {r['recipe']}: steps to target {{{pts}}}; "
            f"B_crit {r['b_crit']:.4g}, S_min {r['s_min']:.4g}"
        )
    for n in out["noise_scale"]:
        print(
            f"{n['family']} {n['rung']} batch {n['batch']}: B_simple dense "
            f"{n['b_simple_dense']:.4g}, embedding {n['b_simple_embedding']:.4g}"
        )
    return out


if __name__ == "__main__":
    main()
