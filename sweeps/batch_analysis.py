"""A batch-size sweep's analysis: steps and examples to a target quality per recipe, the
critical batch they imply, and the gradient noise scale measured during the runs.

``python -m sweeps.batch_analysis SWEEP_DIR (--target 0.47 | --target-gap 0.01)
[--metric logloss] [--plots]``

For every finished trial of a batch-size sweep (``SweepSpec.batch_sizes``), the step at which
the metric first reaches the target (logloss at most, AUC at least; interpolated between
evaluations) gives its steps and examples to target; a trial that never reaches it has none.
The target is one number, or per model size the best value its runs reached worsened by a gap.
For each (family, rung, recipe) and batch, the best of the learning-rate multipliers counts
(the sweep's small LR search), seeds averaged.

McCandlish et al. (2018) predict the trade-off ``S / S_min - 1 = (E / E_min - 1)^-1``, i.e.
``S(B) = S_min (1 + B_crit / B)`` and ``E(B) = E_min (1 + B / B_crit)``: a fit of
``S = S_min + S_min B_crit / B`` (linear in ``1 / B``, least squares in relative error, as
steps span decades) gives the critical batch ``B_crit``, the knee where doubling the batch
stops halving the steps. Their predictor of it is the gradient noise scale at the target,
``B_simple = tr(Σ) / |G|²``: here from the runs' own measurements (``train.noise_scale_every``;
``split="noise_scale"`` rows) taken near the step each reached the target, ``|G|²`` and
``tr(Σ)`` averaged before the ratio, for the dense parameters, the tables and all together.
Each batch's late-run ``B_simple`` (second half of its runs) is reported too.
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


def first_reaching(evals: list[dict], metric: str, target: float) -> float | None:
    """The step at which ``metric`` first reaches ``target`` (logloss <=, AUC >=): the first
    evaluation that does, moved back to where the line from the evaluation before it crosses
    the target (evaluations are a run's 16th or 32nd parts: without it steps to target would
    be quantised to them); None if none does."""
    better = (lambda v: v >= target) if metric == "auc" else (lambda v: v <= target)
    prev = None
    for r in sorted(evals, key=lambda r: r["step"]):
        v = r.get(metric)
        if v is None or not math.isfinite(v):
            continue
        if better(v):
            if prev is None or prev[1] == v:
                return float(r["step"])
            (s0, v0), s1 = prev, r["step"]
            return float(s0 + (s1 - s0) * (v0 - target) / (v0 - v))
        prev = (r["step"], v)
    return None


def best_value(evals: list[dict], metric: str) -> float:
    """The best ``metric`` among ``evals`` (lowest logloss, highest AUC); NaN if none."""
    vals = [r[metric] for r in evals if r.get(metric) is not None and math.isfinite(r[metric])]
    if not vals:
        return math.nan
    return max(vals) if metric == "auc" else min(vals)


def fit_critical_batch(batches: np.ndarray, steps: np.ndarray) -> dict[str, float]:
    """``S(B) = S_min (1 + B_crit / B)`` by least squares in ``1 / B`` (relative residuals):
    ``{"s_min", "b_crit",
    "e_min" = S_min B_crit}``; ``b_crit`` is NaN with fewer than two points or steps that do
    not fall with the batch, and infinite when they fall as ``1 / B`` throughout (the knee
    beyond ten times the largest batch measured)."""
    b, s = np.asarray(batches, float), np.asarray(steps, float)
    if len(b) < 2:
        return {"s_min": math.nan, "b_crit": math.nan, "e_min": math.nan}
    # relative residuals: rows divided by the measured steps
    a = np.stack([np.ones_like(b), 1.0 / b], axis=1) / s[:, None]
    (s_min, c), *_ = np.linalg.lstsq(a, np.ones_like(s), rcond=None)
    if c <= 0 or (s_min > 0 and c / s_min < b.min() / 100):
        # steps do not fall with the batch (or only by rounding): no trade-off to fit
        return {"s_min": float(s_min), "b_crit": math.nan, "e_min": math.nan}
    if s_min <= 0 or c / s_min > 10 * b.max():
        # steps fall as 1/B over every measured batch: the knee lies beyond them
        return {"s_min": float(max(s_min, 0.0)), "b_crit": math.inf, "e_min": float(c)}
    return {"s_min": float(s_min), "b_crit": float(c / s_min), "e_min": float(c)}


def _rows(path: Path, split: str) -> list[dict]:
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("split") == split]


def _noise_parts(row: dict, suffix: str = "") -> dict[str, float]:
    return {
        k.removeprefix("noise_scale/").removesuffix(suffix): v
        for k, v in row.items()
        if k.startswith("noise_scale/") and k.endswith(suffix)
    }


def _pooled_b_simple(rows: list[dict], *, resamples: int = 1000) -> dict[str, float]:
    """``B_simple`` per part and for all parameters together from measurements' own unbiased
    ``|G|²`` and ``tr(Σ)`` (``noise_scale/<part>/g2_now``, ``.../trace_now``), each averaged
    over ``rows`` before the ratio (as McCandlish et al. average over steps), with the 16th and
    84th percentiles of a bootstrap over the measurements (``..._lo``, ``..._hi``): a part
    whose ``|G|²`` the batches could not resolve shows as a NaN or a wide interval. The total's
    ``|G|²`` is the parts' sum, itself unbiased, so a part estimated below zero is kept."""
    parts = sorted({p for r in rows for p in _noise_parts(r, "/g2_now")})
    data = {}  # part -> (n, 2) array of (g2, trace), rows where both are finite
    for part in parts:
        vals = [
            (r[f"noise_scale/{part}/g2_now"], r.get(f"noise_scale/{part}/trace_now"))
            for r in rows
            if f"noise_scale/{part}/g2_now" in r
        ]
        data[part] = np.array([v for v in vals if v[1] is not None and all(map(math.isfinite, v))])
    whole = [r for r in rows if all(f"noise_scale/{p}/g2_now" in r for p in parts)]
    data["total"] = np.array(
        [
            (
                sum(r[f"noise_scale/{p}/g2_now"] for p in parts),
                sum(r[f"noise_scale/{p}/trace_now"] for p in parts),
            )
            for r in whole
        ]
    ).reshape(-1, 2)
    out = {}
    rng = np.random.default_rng(0)
    for part, arr in data.items():
        if not len(arr):
            continue
        g, t = arr.mean(axis=0)
        out[f"b_simple_{part}"] = float(t / g) if g > 0 else math.nan
        idx = rng.integers(0, len(arr), size=(resamples, len(arr)))
        gb, tb = arr[idx].mean(axis=1).T
        boot = np.where(gb > 0, tb / np.where(gb > 0, gb, 1.0), np.inf)  # |G|² <= 0: unbounded
        lo, hi = np.percentile(boot, [16, 84], method="nearest")
        out[f"b_simple_{part}_lo"], out[f"b_simple_{part}_hi"] = float(lo), float(hi)
    return out


def analyze(
    sweep_dir: str | Path,
    *,
    target: float | None = None,
    target_gap: float | None = None,
    metric: str = "logloss",
) -> dict[str, Any]:
    """Steps/examples to a target per (family, rung, recipe, batch), the fitted critical batch
    per (family, rung, recipe), the noise scale measured where the runs reached the target per
    (family, rung), and the late-run noise scale per (family, rung, batch).

    The target is ``target`` for every size, or, with ``target_gap``, each size's own: the best
    ``metric`` any of its runs reached, worsened by the gap (a size's loss floor is its own, so
    one number cannot be a fair target for three sizes)."""
    if (target is None) == (target_gap is None):
        raise ValueError("give exactly one of target and target_gap")
    store = SweepStore(sweep_dir)
    results = read_results(Path(sweep_dir) / "results.jsonl").rows
    runs = []
    for row in results:
        if row.get("status") != "SUCCESS":
            continue
        tid = row["trial_id"]
        trial = json.loads((store.trial_dir(tid) / "trial.json").read_text())
        metrics = store.workdir(tid) / "metrics.jsonl"
        runs.append((trial, _rows(metrics, "eval"), _rows(metrics, "noise_scale")))
    targets: dict[tuple[str, str], float] = {}
    for trial, evals, _ in runs:
        key = (trial["family"], trial["rung"])
        if target is not None:
            targets[key] = target
            continue
        best = best_value(evals, metric)
        if math.isfinite(best):
            now = targets.get(key, best)
            targets[key] = max(now, best) if metric == "auc" else min(now, best)
    if target_gap is not None:
        sign = -1.0 if metric == "auc" else 1.0
        targets = {k: v + sign * target_gap for k, v in targets.items()}
    cells: dict[tuple, dict[int, list[tuple[float, float | None, int]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    noise: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    at_target: dict[tuple, list[dict]] = defaultdict(list)
    reached_runs: dict[tuple, int] = defaultdict(int)
    for trial, evals, noise_rows in runs:
        key = (trial["family"], trial["rung"])
        if key not in targets:
            continue
        steps = first_reaching(evals, metric, targets[key])
        # every recipe this run serves (coinciding recipes share one trial, ``Trial.also``)
        recipes = [
            (trial.get("lr_rule") or "batch_rule", trial.get("lr_multiplier", 1.0)),
            *(tuple(a) for a in trial.get("also", ())),
        ]
        for rule, mult in recipes:
            cells[(*key, rule)][trial["batch_size"]].append((mult, steps, trial["seed"]))
        if steps is not None:
            # the measurements taken while this run was near the target (within a factor 2 of
            # the step it reached it at): the noise scale there is the paper's predictor of
            # the critical batch for that target
            near = [r for r in noise_rows if steps / 2 <= r["step"] <= 2 * steps]
            if near:
                at_target[key] += near
                reached_runs[key] += 1
        late = [r for r in noise_rows if r["step"] >= trial["steps"] / 2]
        means = {}
        for part in ("dense", "embedding"):
            vals = [r.get(f"noise_scale/{part}") for r in late]
            vals = [v for v in vals if v is not None and math.isfinite(v)]
            if vals:
                means[part] = float(np.mean(vals))
        if means:
            noise[key][trial["batch_size"]].append(means)
    out: dict[str, Any] = {
        "metric": metric,
        "target": target,
        "target_gap": target_gap,
        "recipes": [],
        "noise_at_target": [],
        "noise_scale": [],
    }
    for (fam, rung, recipe), per_batch in sorted(cells.items()):
        points = []
        for b, cell in sorted(per_batch.items()):
            by_mult: dict[float, list[float | None]] = defaultdict(list)
            for mult, steps, _ in cell:
                by_mult[mult].append(steps)
            # a multiplier counts if every seed reached the target; the best such one
            reached = {m: float(np.mean(v)) for m, v in by_mult.items() if None not in v}
            if reached:
                m, st = min(reached.items(), key=lambda kv: kv[1])
                points.append({"batch": b, "steps": st, "examples": st * b, "lr_multiplier": m})
            else:
                points.append({"batch": b, "steps": None, "examples": None, "lr_multiplier": None})
        ok = [p for p in points if p["steps"] is not None]
        fit = fit_critical_batch(
            np.array([p["batch"] for p in ok]), np.array([p["steps"] for p in ok])
        )
        out["recipes"].append(
            {
                "family": fam,
                "rung": rung,
                "recipe": recipe,
                "target": targets[(fam, rung)],
                "points": points,
                **fit,
            }
        )
    for (fam, rung), rows in sorted(at_target.items()):
        out["noise_at_target"].append(
            {
                "family": fam,
                "rung": rung,
                "target": targets[(fam, rung)],
                "measurements": len(rows),
                "runs": reached_runs[(fam, rung)],
                **_pooled_b_simple(rows),
            }
        )
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
        color = ax_s.lines[-1].get_color()
        if math.isfinite(r["b_crit"]):
            ax_s.axvline(r["b_crit"], ls=":", color=color)
        for n in analysis.get("noise_at_target", ()):
            if (n["family"], n["rung"]) == (r["family"], r["rung"]):
                if math.isfinite(n.get("b_simple_total", math.nan)):
                    ax_s.axvline(n["b_simple_total"], ls="--", color=color, alpha=0.6)
    for ax, what in ((ax_s, "steps"), (ax_e, "examples")):
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="global batch",
            ylabel=f"{what} to target {analysis['metric']}",
        )
        ax.grid(True, which="both", alpha=0.3)
    ax_s.legend(fontsize=7)
    ax_s.set_title("dotted: fitted critical batch; dashed: B_simple at the target", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _with_interval(row: dict, part: str) -> str:
    """``B_simple [16th, 84th percentile]`` of one part of a ``noise_at_target`` row."""
    v, lo, hi = (row.get(f"b_simple_{part}{k}", math.nan) for k in ("", "_lo", "_hi"))
    return f"{v:.4g} [{lo:.3g}, {hi:.3g}]"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--target", type=float, help="one target for every model size")
    which.add_argument(
        "--target-gap",
        type=float,
        help="per size: the best value its runs reached, worsened by this much",
    )
    ap.add_argument("--metric", choices=["logloss", "auc"], default="logloss")
    ap.add_argument("--plots", action="store_true", help="write batch_curves.png")
    args = ap.parse_args(argv)
    if not (Path(args.sweep_dir) / "results.jsonl").is_file():
        raise SystemExit(f"error: {args.sweep_dir}/results.jsonl not found: not a sweep directory")
    if args.target_gap is not None and args.target_gap <= 0:
        raise SystemExit(
            f"error: --target-gap {args.target_gap}: must be > 0 (a target no "
            "better than the best run reached)"
        )
    out = analyze(
        args.sweep_dir, target=args.target, target_gap=args.target_gap, metric=args.metric
    )
    (Path(args.sweep_dir) / "batch_analysis.json").write_text(json.dumps(out, indent=1) + "\n")
    if args.plots:
        plot(out, Path(args.sweep_dir) / "batch_curves.png")
    simple = {(n["family"], n["rung"]): n for n in out["noise_at_target"]}
    for r in out["recipes"]:
        pts = ", ".join(
            f"{p['batch']}: {p['steps']:.0f}" if p["steps"] is not None else f"{p['batch']}: -"
            for p in r["points"]
        )
        n = simple.get((r["family"], r["rung"]), {})
        total = n.get("b_simple_total", math.nan)
        print(
            f"{r['family']} {r['rung']} {r['recipe']}: {args.metric} {r['target']:.4g}; steps to "
            f"target {{{pts}}}; B_crit {r['b_crit']:.4g}, S_min {r['s_min']:.4g}; B_simple at "
            f"target {_with_interval(n, 'total')} (dense {_with_interval(n, 'dense')}, embedding "
            f"{_with_interval(n, 'embedding')}; {n.get('measurements', 0)} measurements); "
            f"B_crit / B_simple {r['b_crit'] / total:.3g}"
        )
    for n in out["noise_scale"]:
        print(
            f"{n['family']} {n['rung']} batch {n['batch']}: B_simple dense "
            f"{n['b_simple_dense']:.4g}, embedding {n['b_simple_embedding']:.4g}"
        )
    return out


if __name__ == "__main__":
    main()
