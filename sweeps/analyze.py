"""``python -m sweeps.analyze SWEEP_DIR``: results table, fitted scaling laws, PNG plots.

For each family: the compute-efficient frontier (at each budget, the best final eval metric over
its rungs, seeds averaged first) is fitted with ``L(C) = a·C^(−b) + c`` (``sweeps.fit``:
Huber in log space, bootstrap intervals over the frontier trials); the largest budget is held
out and predicted from the rest; and the IsoFLOP curves (metric vs FLOPs/example at one budget)
give the compute-optimal model size per budget. Only SUCCESS trials enter fits: DIVERGED and
FAILED ones are listed and excluded, with the reason logged. Where the data is planted, the
Bayes-optimal value is drawn and every law is also fitted with its floor there; planted
histories (metric ``loss``) add the generator's baselines and each family's fitted floor beside
the Bayes one (``sweeps.reference``).

Writes into ``SWEEP_DIR`` (or ``--out``): ``results.csv`` (one row per trial; ``--parquet`` adds
``results.parquet``), ``analysis.json`` (the fits), ``scaling.png`` and ``isoflop.png``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import tyro

from sweeps import fit as fit_lib
from sweeps import provenance
from sweeps import surface as surface_lib
from sweeps.provenance import BOOTSTRAP_SEED
from sweeps.reference import bayes_reference_of, planted_baselines
from sweeps.report import (
    plot,
    plot_quality_vs_size,
    plot_sparse_dense,
    print_floors,
    print_report,
    ylabel,
)
from sweeps.table import branch_cost, learning_rate_search, load_results

log = logging.getLogger("sweeps.analyze")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnalyzeArgs:
    sweep_dir: tyro.conf.Positional[str]
    metric: Literal["", "logloss", "auc", "loss"] = ""
    """Metric to fit (default: the sweep's); AUC is fitted as 1 - AUC; ``loss`` is a sequential
    family's next-item loss."""
    out: str = ""
    """Where to write the tables and plots (default: SWEEP_DIR)."""
    parquet: bool = False
    """Also write results.parquet (needs pyarrow)."""
    plots: bool = True
    n_boot: int | None = None
    """Bootstrap replicates of each fit (default: as many as the output folder's existing
    analysis.json was made with, so that a regeneration repeats it; else 1,000)."""
    surface_from: str = ""
    """A sweep directory whose loss surfaces (``sweeps.surface``, fitted per family on its
    results) predict this sweep's cells: an out-of-sample check, written to analysis.json
    (default: the one the output folder's existing analysis.json checked against, if any)."""


# ------------------------------------------------------------------------------------------------
# Loading.


def _quality(df: pd.DataFrame, metric: str, which: str = "final") -> pd.Series:
    col = f"{which}_{metric}"
    if col not in df:
        return pd.Series(np.nan, index=df.index)
    return 1.0 - df[col] if metric == "auc" else df[col]


# ------------------------------------------------------------------------------------------------
# Analysis.


def analyze(
    df: pd.DataFrame,
    metric: str,
    *,
    n_boot: int = provenance.DEFAULT_N_BOOT,
    floor: float | None = None,
) -> dict[str, Any]:
    """Fits per family; returns a JSON-able dict (also what ``analysis.json`` holds).

    ``floor``: the Bayes-optimal value of the fitted quantity, when known (a planted teacher):
    every law is also fitted with its c fixed there (``law_bayes_floor``, ``holdout_bayes_floor``).
    """
    out: dict[str, Any] = {"metric": metric, "fitted_quantity": ylabel(metric), "families": {}}
    if df.empty:
        return out
    bad = df[df["status"] != "SUCCESS"]
    for _, r in bad.iterrows():
        reason = r["status"]
        if r["status"] == "DIVERGED" and r.get("diverged_at_step") == r.get("diverged_at_step"):
            reason += f" (non-finite loss at step {int(r['diverged_at_step'])})"
        log.warning(
            "excluded from fits: trial %s (%s %s, budget %.3g): %s",
            r["trial_id"],
            r["family"],
            r["rung"],
            r["budget"],
            reason,
        )
    out["excluded"] = [
        {
            "trial_id": r["trial_id"],
            "family": r["family"],
            "rung": r["rung"],
            "budget": r["budget"],
            "status": r["status"],
        }
        for _, r in bad.iterrows()
    ]
    if "own_compute" in df and df["branch_of"].notna().any():
        out["cost"] = branch_cost(df)
    ok = df[df["status"] == "SUCCESS"].copy()
    ok["y"] = _quality(ok, metric)
    missing = ok[~np.isfinite(ok["y"].astype(float))]
    for _, r in missing.iterrows():
        log.warning(
            "excluded from fits: trial %s (%s %s, budget %.3g): no finite final %s",
            r["trial_id"],
            r["family"],
            r["rung"],
            r["budget"],
            metric,
        )
        out["excluded"].append(
            {
                "trial_id": r["trial_id"],
                "family": r["family"],
                "rung": r["rung"],
                "budget": r["budget"],
                "status": f"SUCCESS without a finite final {metric}",
            }
        )
    ok = ok[np.isfinite(ok["y"].astype(float))]
    for family, g in ok.groupby("family", sort=True):
        if "@lr" in family:  # a learning-rate check's variant: tabulated by _lr_check, not fitted
            continue
        out["families"][family] = _fit_family(_cells(g), n_boot=n_boot, floor=floor)
    if lr := _lr_check(ok):
        out["lr_check"] = lr
    return out


def _successes(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The SUCCESS trials with a finite metric, as column ``y``."""
    ok = df[df["status"] == "SUCCESS"].copy()
    ok["y"] = _quality(ok, metric)
    return ok[np.isfinite(ok["y"].astype(float))]


def _cells(g: pd.DataFrame) -> pd.DataFrame:
    """One family's trials ``g`` as IsoFLOP cells, one row per (budget, rung): seed-mean ``y``
    (compute differs between seeds by rounding only), the per-seed ``seeds``, and ``examples``
    D = C / N (N = ``fpe``, training FLOPs per example)."""
    cells = g.groupby(["budget", "rung"], as_index=False).agg(
        y=("y", "mean"),
        compute=("compute", "mean"),
        fpe=("flops_per_example", "first"),
        params_dense=("params_dense", "first"),
        n=("y", "size"),
        seeds=("y", list),
    )
    cells["examples"] = cells["compute"] / cells["fpe"]  # so that C = N·D holds exactly
    return cells


def surface_check(df: pd.DataFrame, ref: pd.DataFrame, metric: str, *, n_boot: int) -> dict:
    """This sweep's cells against the loss surfaces fitted on the reference sweep ``ref`` (per
    family): an out-of-sample test of ``sweeps.surface`` at sizes or budgets ``ref`` lacks."""
    ok, ref_ok = _successes(df, metric), _successes(ref, metric)
    out: dict[str, Any] = {}
    for family, g in ok.groupby("family", sort=True):
        rg = ref_ok[ref_ok["family"] == family]
        if rg.empty:
            out[family] = {"reason": f"no {family} trials in the reference sweep"}
            continue
        rc = _cells(rg)
        got = _loss_surface(rc, n_boot=n_boot, floor=None)
        if "_surface" not in got:
            out[family] = got["loss_surface"]  # its reason
            continue
        fit = got["_surface"]
        cells = _cells(g)
        preds = fit.prediction(cells["fpe"].to_numpy(), cells["examples"].to_numpy())
        rows = []
        for (_, c), p in zip(cells.iterrows(), preds, strict=True):
            same = rc[rc["budget"] == c["budget"]]
            sd = float(np.std(c["seeds"], ddof=1)) if len(c["seeds"]) > 1 else None
            pred, (lo, hi) = p["predicted"], p["interval"]
            # As fit.holdout_frontier_seeds: the observation's own seed noise widens the band.
            pi = list(fit_lib.prediction_interval(pred, (lo, hi), c["seeds"], fit.ci)[1])
            rows.append(
                {
                    "budget": float(c["budget"]),
                    "rung": c["rung"],
                    "fpe": float(c["fpe"]),
                    "examples": float(c["examples"]),
                    "observed": float(c["y"]),
                    "observed_sd": sd,
                    "seeds": len(c["seeds"]),
                    **p,
                    "prediction_interval": pi,
                    "rel_error": abs(pred - c["y"]) / c["y"],
                    "inside_interval": bool(lo <= c["y"] <= hi),
                    "inside_prediction_interval": bool(pi[0] <= c["y"] <= pi[1]),
                    "reference_best_at_budget": None
                    if same.empty
                    else {
                        "rung": same.loc[same["y"].idxmin(), "rung"],
                        "y": float(same["y"].min()),
                    },
                }
            )
        out[family] = {"surface": fit.law_str(), "cells": rows}
    return out


def _fit_family(per: pd.DataFrame, *, n_boot: int, floor: float | None) -> dict[str, Any]:
    """Laws, holdouts and compute-optimal sizes of one family's IsoFLOP grid ``per`` (one row
    per (budget, rung): seed-mean ``y``, ``compute``, ``fpe`` and the per-seed ``seeds``).

    With several seeds per point, intervals come from bootstraps over seeds (the frontier is
    re-chosen in every replicate); with one seed, from pairs bootstraps over the frontier's
    points. ``floor`` (the Bayes-optimal loss, when known) adds the fits with c fixed there.
    """
    frontier = per.loc[per.groupby("budget")["y"].idxmin()].sort_values("budget")
    fam: dict[str, Any] = {
        "frontier": frontier[["budget", "rung", "compute", "y", "n"]].to_dict("records"),
        "seeds_per_point": int(per["n"].min()),
    }
    seeded = int(per["n"].max()) > 1
    fam["intervals_from"] = "bootstrap over seeds" if seeded else "pairs bootstrap over budgets"
    cells = (per["budget"].to_numpy(), per["compute"].to_numpy(), list(per["seeds"]))
    c, y = frontier["compute"].to_numpy(), frontier["y"].to_numpy()
    floors = {"": None} if floor is None else {"": None, "_bayes_floor": floor}
    for suffix, fl in floors.items():
        try:
            if seeded:
                law = fit_lib.fit_frontier_seeds(
                    *cells, n_boot=n_boot, seed=BOOTSTRAP_SEED, floor=fl
                )
            else:
                law = fit_lib.fit_power_law(c, y, n_boot=n_boot, seed=BOOTSTRAP_SEED, floor=fl)
            fam[f"law{suffix}"] = law.to_dict()
            fam[f"law{suffix}_str"] = law.law_str()
            fam[f"_fit{suffix}"] = law
        except ValueError as e:
            fam[f"law{suffix}"] = None
            fam[f"reason{suffix}"] = str(e)
        try:
            if seeded:
                fam[f"holdout{suffix}"] = fit_lib.holdout_frontier_seeds(
                    *cells, n_boot=n_boot, seed=BOOTSTRAP_SEED, floor=fl
                )
            else:
                fam[f"holdout{suffix}"] = fit_lib.holdout_extrapolation(
                    c, y, n_boot=n_boot, seed=BOOTSTRAP_SEED, floor=fl
                )
        except ValueError as e:  # e.g. a zero loss (1 - AUC = 0) has no log
            fam[f"holdout{suffix}"] = {"reason": str(e)}
    iso = []
    for budget, b in per.groupby("budget"):
        opt = fit_lib.isoflop_optimum(b["fpe"].to_numpy(), b["y"].to_numpy())
        iso.append({"budget": float(budget), **_jsonable(opt)})
    fam["isoflop"] = iso
    if seeded:
        osl = fit_lib.optimal_size_seeds(
            per["budget"].to_numpy(),
            per["fpe"].to_numpy(),
            list(per["seeds"]),
            n_boot=n_boot,
            seed=BOOTSTRAP_SEED,
        )
        osl.pop("per_budget")  # the same optima as "isoflop"
        fam["optimal_size_law"] = _jsonable(osl)
    else:
        interior = [r for r in iso if r.get("interior")]
        fam["optimal_size_law"] = (
            _jsonable(
                fit_lib.fit_optimal_size_law(
                    np.array([r["budget"] for r in interior]),
                    np.array([r["size_opt"] for r in interior]),
                )
            )
            if len(interior) >= 2
            else {"reason": f"{len(interior)} budgets with an interior optimum (need 2)"}
        )
    for suffix, fl in floors.items():
        got = _loss_surface(per, n_boot=n_boot, floor=fl)
        fam |= {k.replace("surface", f"surface{suffix}"): v for k, v in got.items()}
    fam["_points"] = per.drop(columns="seeds")
    return fam


def _loss_surface(per: pd.DataFrame, *, n_boot: int, floor: float | None) -> dict[str, Any]:
    """L(N, D) over every cell (``sweeps.surface``): the compute-optimal size from all of the
    grid, not only from the budgets whose IsoFLOP minimum is interior."""
    if per["budget"].nunique() < 2:
        return {"loss_surface": {"reason": "one budget: size and data are not separable"}}
    try:
        fit = surface_lib.fit_loss_surface(
            per["budget"].to_numpy(),
            per["fpe"].to_numpy(),
            per["examples"].to_numpy(),
            list(per["seeds"]),
            n_boot=n_boot,
            seed=BOOTSTRAP_SEED,
            floor=floor,
        )
    except ValueError as e:
        return {"loss_surface": {"reason": str(e)}}
    optima = surface_lib.surface_optima(fit, per["budget"].to_numpy(), per["fpe"].to_numpy())
    return {"loss_surface": fit.to_dict() | {"optima": optima}, "_surface": fit}


def sparse_dense(df: pd.DataFrame, metric: str) -> dict[str, Any]:
    """Per family and budget, the grid of embedding capacity x dense size (rungs named
    ``<embedding>/<rows>/<dense>`` as in ``sweeps.specs.study_grid``): each cell's seed-mean
    metric, sparse parameters and FLOPs per example, and the best cell."""
    ok = _successes(df, metric)
    out: dict[str, Any] = {}
    for (family, budget), g in ok.groupby(["family", "budget"], sort=True):
        parts = g["rung"].str.rsplit("/", n=1, expand=True)
        if parts.shape[1] != 2 or parts[1].isna().any():
            continue
        g = g.assign(embedding=parts[0], dense=parts[1])
        cells = (
            g.groupby(["embedding", "dense"], as_index=False)
            .agg(
                y=("y", "mean"),
                n=("y", "size"),
                params_sparse=("params_sparse", "first"),
                params_dense=("params_dense", "first"),
                fpe=("flops_per_example", "first"),
            )
            .sort_values(["params_sparse", "embedding", "fpe"])
        )
        best = cells.loc[cells["y"].idxmin()]
        out.setdefault(family, []).append(
            {
                "budget": float(budget),
                "cells": _jsonable(cells.to_dict("records")),
                "best": {
                    "embedding": best["embedding"],
                    "dense": best["dense"],
                    "y": float(best["y"]),
                    "params_sparse": int(best["params_sparse"]),
                    "fpe": float(best["fpe"]),
                },
            }
        )
    return out


def quality_vs_size(df: pd.DataFrame) -> dict[str, list[dict[str, Any]]]:
    """Per family and rung (smallest first): final and best eval logloss and AUC, mean and s.d.
    over seeds, with the size (FLOPs per example, dense and sparse parameters)."""
    ok = df[df["status"] == "SUCCESS"]
    out: dict[str, list[dict[str, Any]]] = {}
    for family, g in ok.groupby("family", sort=True):
        rows = []
        for rung, r in g.groupby("rung"):
            row: dict[str, Any] = {
                "rung": rung,
                "flops_per_example": float(r["flops_per_example"].iloc[0]),
                "params_dense": int(r["params_dense"].iloc[0]),
                "params_sparse": int(r["params_sparse"].iloc[0]),
                "seeds": int(len(r)),
            }
            for col in ("final_logloss", "best_logloss", "final_auc", "best_auc"):
                v = r[col].astype(float).to_numpy() if col in r else np.array([np.nan])
                row[col] = float(np.mean(v))
                row[f"{col}_sd"] = float(np.std(v, ddof=1)) if v.size > 1 else 0.0
            rows.append(row)
        out[family] = sorted(rows, key=lambda x: x["flops_per_example"])
    return out


def _lr_check(ok: pd.DataFrame) -> list[dict[str, Any]]:
    """For families named ``<family>@lr<multiplier>`` (a learning-rate check such as
    ``sweeps.specs.study_lr``): per (family, budget, rung), the loss at each multiplier and the
    best multiplier."""
    tagged = ok[ok["family"].str.contains("@lr", regex=False)]
    if tagged.empty:
        return []
    parts = tagged["family"].str.split("@lr", n=1, expand=True)
    t = tagged.assign(base=parts[0], mult=parts[1].astype(float))
    rows = []
    for (base, budget, rung), g in t.groupby(["base", "budget", "rung"], sort=True):
        losses = g.groupby("mult")["y"].mean().sort_index()
        rows.append(
            {
                "family": base,
                "budget": float(budget),
                "rung": rung,
                "flops_per_example": float(g["flops_per_example"].iloc[0]),
                "loss_by_multiplier": {f"{m:.3g}": float(v) for m, v in losses.items()},
                "best_multiplier": float(losses.idxmin()),
            }
        )
    return rows


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _public(analysis: dict) -> dict:
    """``analysis`` without the private (``_``) entries, JSON-able."""
    fams = {
        f: {k: v for k, v in d.items() if not k.startswith("_")}
        for f, d in analysis["families"].items()
    }
    return _jsonable({**analysis, "families": fams})


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = tyro.cli(AnalyzeArgs, args=argv, prog="python -m sweeps.analyze")
    root = Path(args.sweep_dir)
    out_dir = Path(args.out) if args.out else root
    # A regeneration repeats the settings the analysis it replaces was made with.
    old_path = out_dir / "analysis.json"
    try:
        old = json.loads(old_path.read_text()) if old_path.exists() else {}
        if not isinstance(old, dict):
            raise ValueError("not a JSON object")
        recorded = provenance.recorded_n_boot(old)
    except ValueError as e:
        raise SystemExit(f"{old_path}: {e} (pass --n-boot, or remove it)") from None
    n_boot, surface_from = args.n_boot, args.surface_from
    if n_boot is None and (n_boot := recorded) is not None:
        log.info("%d bootstrap replicates, as %s/analysis.json records", n_boot, out_dir)
    n_boot = provenance.DEFAULT_N_BOOT if n_boot is None else n_boot
    if not surface_from and (surface_from := old.get("surface_check_reference") or ""):
        log.info("surface check against %s, as %s/analysis.json records", surface_from, out_dir)
    for d in (root, *([Path(surface_from)] if surface_from else [])):
        if not (d / "results.jsonl").exists():
            raise SystemExit(f"{d}: no results.jsonl (launch the sweep first)")
    sweep = json.loads((root / "sweep.json").read_text()) if (root / "sweep.json").exists() else {}
    metric = args.metric or sweep.get("metric", "logloss")
    out_dir.mkdir(parents=True, exist_ok=True)
    df = load_results(root)
    if search := learning_rate_search(df):
        raise SystemExit(f"{root}: {search}")
    df.to_csv(out_dir / "results.csv", index=False)
    if args.parquet:
        df.to_parquet(out_dir / "results.parquet", index=False)
    baselines = planted_baselines(df) if metric == "loss" else None
    ref = baselines["bayes"] if baselines else bayes_reference_of(df, metric)
    analysis = analyze(df, metric, n_boot=n_boot, floor=ref)
    analysis["bayes_reference"] = ref
    if baselines:
        analysis["planted_baselines"] = baselines
    print_report(df, analysis, metric)
    if ref is not None:
        print(f"Bayes-optimal {ylabel(metric)} of the planted teacher on the eval set: {ref:.4f}")
    if baselines:
        print_floors(analysis, baselines)
    if args.plots and analysis["families"] and df["budget"].nunique() > 1:
        for p in plot(analysis, out_dir, metric, reference=ref, baselines=baselines):
            print(f"wrote {p}")
    analyses = (sweep.get("spec") or {}).get("analyses", ())
    if "quality_vs_size" in analyses:
        analysis["quality_vs_size"] = q = quality_vs_size(df)
        for fam, rows in q.items():
            print(
                f"{fam}: best eval logloss by size "
                + ", ".join(
                    f"{r['rung']} {r['best_logloss']:.4f}±{r['best_logloss_sd']:.4f}" for r in rows
                )
            )
        if args.plots and q:
            print(f"wrote {plot_quality_vs_size(q, out_dir)}")
    if "sparse_dense" in analyses:
        analysis["sparse_dense"] = grid = sparse_dense(df, metric)
        for fam, budgets in grid.items():
            for b in budgets:
                best = b["best"]
                print(
                    f"sparse/dense grid {fam} C={b['budget']:.2g}: best {best['embedding']} "
                    f"x {best['dense']} ({best['y']:.4f}, {best['params_sparse']:,} sparse "
                    f"parameters, {best['fpe']:.3g} FLOPs/example)"
                )
        if args.plots and grid:
            print(f"wrote {plot_sparse_dense(grid, out_dir, metric)}")
    if surface_from:
        analysis["surface_check"] = chk = surface_check(
            df, load_results(surface_from), metric, n_boot=n_boot
        )
        analysis["surface_check_reference"] = surface_from
        for fam, d in chk.items():
            for c in d.get("cells", []):
                best = c["reference_best_at_budget"]
                pi = c["prediction_interval"]
                print(
                    f"surface check {fam} {c['rung']} C={c['budget']:.2g}: observed "
                    f"{c['observed']:.4f}, predicted {c['predicted']:.4f} [{pi[0]:.4f}, "
                    f"{pi[1]:.4f}] ({c['rel_error']:.2%})"
                    + (
                        f"; {surface_from}'s best there: {best['rung']} {best['y']:.4f}"
                        if best
                        else ""
                    )
                )
    analysis["produced_by"] = provenance.produced_by(n_boot, surface_from)
    public = _public(analysis)
    (out_dir / "analysis.json").write_text(json.dumps(public, indent=2, default=str) + "\n")
    return public


if __name__ == "__main__":
    main()
