"""``python -m sweeps.analyze SWEEP_DIR``: results table, fitted scaling laws, PNG plots.

For each family: the compute-efficient frontier (at each budget, the best final eval metric over
its rungs, seeds averaged first) is fitted with ``L(C) = a·C^(−b) + c`` (``sweeps.fit``:
Huber in log space, bootstrap intervals over the frontier trials); the largest budget is held
out and predicted from the rest; and the IsoFLOP curves (metric vs FLOPs/example at one budget)
give the compute-optimal model size per budget. Only SUCCESS trials enter fits: DIVERGED and
FAILED ones are listed and excluded, with the reason logged.

Writes into ``SWEEP_DIR`` (or ``--out``): ``results.csv`` (one row per trial; ``--parquet`` adds
``results.parquet``), ``analysis.json`` (the fits), ``scaling.png`` and ``isoflop.png``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import tyro

from sweeps import fit as fit_lib
from sweeps import surface as surface_lib
from sweeps.store import read_results

log = logging.getLogger("sweeps.analyze")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnalyzeArgs:
    sweep_dir: tyro.conf.Positional[str]
    metric: Literal["", "logloss", "auc"] = ""
    """Metric to fit (default: the sweep's); AUC is fitted as 1 - AUC."""
    out: str = ""
    """Where to write the tables and plots (default: SWEEP_DIR)."""
    parquet: bool = False
    """Also write results.parquet (needs pyarrow)."""
    plots: bool = True
    n_boot: int = 1000
    """Bootstrap replicates of each fit."""
    surface_from: str = ""
    """A sweep directory whose loss surfaces (``sweeps.surface``, fitted per family on its
    results) predict this sweep's cells: an out-of-sample check, written to analysis.json."""


# ------------------------------------------------------------------------------------------------
# Loading.


def load_results(sweep_dir: str | Path, *, all_rows: bool = False) -> pd.DataFrame:
    """The sweep's results as a DataFrame, one row per trial, metrics flattened
    (``final_logloss``, ``best_auc``, ...). Rows of trials not in the sweep's current
    ``sweep.json`` (an older code version or spec) are dropped unless ``all_rows``."""
    root = Path(sweep_dir)
    res = read_results(root / "results.jsonl")
    if res.truncated:
        log.warning("%s: skipped a truncated last line (its trial will be re-run)", root)
    rows = []
    for r in res.rows:
        flat = {k: v for k, v in r.items() if k not in ("final", "best", "config", "versions")}
        for which in ("final", "best"):
            for k, v in (r.get(which) or {}).items():
                if k not in ("split",):
                    flat[f"{which}_{k}"] = v
        flat["versions"] = json.dumps(r.get("versions"), sort_keys=True)
        flat["config"] = json.dumps(r.get("config"), sort_keys=True)
        rows.append(flat)
    df = pd.DataFrame(rows)
    sweep_json = root / "sweep.json"
    if not all_rows and sweep_json.exists() and len(df):
        current = set(json.loads(sweep_json.read_text())["trial_ids"])
        stale = ~df["trial_id"].isin(current)
        if stale.any():
            log.warning(
                "%d result rows belong to other versions of the sweep; not analysed",
                int(stale.sum()),
            )
            df = df[~stale]
    return df.reset_index(drop=True)


def _quality(df: pd.DataFrame, metric: str, which: str = "final") -> pd.Series:
    col = f"{which}_{metric}"
    if col not in df:
        return pd.Series(np.nan, index=df.index)
    return 1.0 - df[col] if metric == "auc" else df[col]


# ------------------------------------------------------------------------------------------------
# Analysis.


def analyze(
    df: pd.DataFrame, metric: str, *, n_boot: int = 1000, floor: float | None = None
) -> dict[str, Any]:
    """Fits per family; returns a JSON-able dict (also what ``analysis.json`` holds).

    ``floor``: the Bayes-optimal value of the fitted quantity, when known (a planted teacher):
    every law is also fitted with its c fixed there (``law_bayes_floor``, ``holdout_bayes_floor``).
    """
    out: dict[str, Any] = {"metric": metric, "fitted_quantity": _ylabel(metric), "families": {}}
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
                law = fit_lib.fit_frontier_seeds(*cells, n_boot=n_boot, floor=fl)
            else:
                law = fit_lib.fit_power_law(c, y, n_boot=n_boot, floor=fl)
            fam[f"law{suffix}"] = law.to_dict()
            fam[f"law{suffix}_str"] = law.law_str()
            fam[f"_fit{suffix}"] = law
        except ValueError as e:
            fam[f"law{suffix}"] = None
            fam[f"reason{suffix}"] = str(e)
        try:
            if seeded:
                fam[f"holdout{suffix}"] = fit_lib.holdout_frontier_seeds(
                    *cells, n_boot=n_boot, floor=fl
                )
            else:
                fam[f"holdout{suffix}"] = fit_lib.holdout_extrapolation(
                    c, y, n_boot=n_boot, floor=fl
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
            per["budget"].to_numpy(), per["fpe"].to_numpy(), list(per["seeds"]), n_boot=n_boot
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


def _plot_sparse_dense(grid: dict[str, Any], out_dir: Path, metric: str) -> Path:
    """A heat map per (family, budget): columns embedding configs by sparse parameters, rows
    dense sizes by FLOPs per example, the best cell outlined."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    panels = [(fam, b) for fam, budgets in grid.items() for b in budgets]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.2), squeeze=False)
    for ax, (fam, b) in zip(axes[0], panels, strict=True):
        cells = pd.DataFrame(b["cells"])
        cols = list(dict.fromkeys(cells.sort_values("params_sparse")["embedding"]))
        rows = list(cells.groupby("dense")["fpe"].min().sort_values().index)
        z = np.full((len(rows), len(cols)), np.nan)
        for _, c in cells.iterrows():
            z[rows.index(c["dense"]), cols.index(c["embedding"])] = c["y"]
        im = ax.imshow(z, cmap="viridis_r", aspect="auto", origin="lower")
        for i in range(len(rows)):
            for j in range(len(cols)):
                if np.isfinite(z[i, j]):
                    ax.text(
                        j,
                        i,
                        f"{z[i, j]:.4f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="w" if z[i, j] > np.nanmean(z) else "k",
                    )
        bi, bj = rows.index(b["best"]["dense"]), cols.index(b["best"]["embedding"])
        ax.add_patch(plt.Rectangle((bj - 0.5, bi - 0.5), 1, 1, fill=False, ec="r", lw=2.5))
        psp = cells.drop_duplicates("embedding").set_index("embedding")["params_sparse"]
        ax.set_xticks(
            range(len(cols)), [f"{c}\n{psp[c] / 1e6:.2g}M" for c in cols], fontsize=7, rotation=0
        )
        ax.set_yticks(range(len(rows)), rows)
        ax.set_xlabel("embedding: dim / rows per table (sparse parameters)")
        ax.set_ylabel("dense size (FLOPs per example grow upward)")
        ax.set_title(f"{fam}, C = {b['budget']:.2g} FLOPs: {_ylabel(metric)} (red: best)")
        fig.colorbar(im, ax=ax, shrink=0.85)
    return _save(plt, fig, out_dir / "sparse_dense.png")


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


def _plot_quality_vs_size(q: dict[str, list[dict[str, Any]]], out_dir: Path) -> Path:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (fam, rows) in enumerate(q.items()):
        r = pd.DataFrame(rows)
        for ax, m in zip(axes, ("logloss", "auc"), strict=True):
            ax.errorbar(
                r["flops_per_example"],
                r[f"best_{m}"],
                yerr=r[f"best_{m}_sd"],
                color=f"C{i}",
                marker="o",
                ms=4,
                capsize=2,
                label=f"{fam} (best eval)",
            )
            ax.plot(
                r["flops_per_example"],
                r[f"final_{m}"],
                color=f"C{i}",
                ls="--",
                lw=1,
                label=f"{fam} (last eval)",
            )
    for ax, m in zip(axes, ("eval logloss", "eval AUC"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("model size: training FLOPs per example")
        ax.set_ylabel(m)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_title("fixed data: quality vs size (mean ± s.d. over seeds)")
    axes[1].legend(fontsize=7)
    return _save(plt, fig, out_dir / "quality_vs_size.png")


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


def _ylabel(metric: str) -> str:
    return "1 - AUC" if metric == "auc" else "eval logloss"


# ------------------------------------------------------------------------------------------------
# Printing and plots.


def print_report(df: pd.DataFrame, analysis: dict, metric: str, file=None) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(file=file or sys.stdout, width=150)
    t = Table(title=f"trials ({len(df)})")
    for col in (
        "family",
        "rung",
        "budget",
        "compute",
        "FLOPs/ex",
        "steps",
        f"final {metric}",
        f"best {metric}",
        "status",
        "wall s",
    ):
        t.add_column(col, justify="left" if col in ("family", "rung", "status") else "right")
    for _, r in df.sort_values(["family", "budget", "rung_index"]).iterrows():
        fin, best = r.get(f"final_{metric}"), r.get(f"best_{metric}")
        t.add_row(
            r["family"],
            r["rung"],
            f"{r['budget']:.3g}",
            f"{r['compute']:.3g}",
            f"{r['flops_per_example']:.3g}",
            str(r["steps"]),
            _fmt(fin),
            _fmt(best),
            r["status"],
            f"{r['wall_time_s']:.0f}",
        )
    console.print(t)
    if df["budget"].nunique() == 1:  # fixed data (e.g. study_frappe): nothing scales with C
        console.print("one compute budget: no scaling laws, IsoFLOP optima or loss surface to fit")
        return
    laws = Table(title=f"scaling laws: {_ylabel(metric)} = c + a'·(C/C0)^-b on the frontier")
    for col in (
        "family",
        "floor",
        "law",
        "b [95% CI]",
        "c [95% CI]",
        "dL per decade",
        "largest budget held out: error, predicted for observed [band]",
    ):
        laws.add_column(col)
    for fam, d in analysis["families"].items():
        for suffix, label in (("", "free"), ("_bayes_floor", "Bayes")):
            if f"law{suffix}" not in d:
                continue
            law = d[f"law{suffix}"]
            if not law:
                laws.add_row(fam, label, d.get(f"reason{suffix}", "no fit"), "", "", "", "")
                continue
            iv = law["intervals"]
            h = d[f"holdout{suffix}"]
            hold = (
                f"{h['rel_error']:.2%}: {h['predicted']:.4f} for {h['observed']:.4f} "
                f"[{h['interval'][0]:.4f}, {h['interval'][1]:.4f}]"
                if h.get("rel_error") is not None
                else h.get("reason", "")
            )
            c_iv = "fixed" if law.get("floor_fixed") else f"[{iv['c'][0]:.4f}, {iv['c'][1]:.4f}]"
            laws.add_row(
                fam,
                label,
                d[f"law{suffix}_str"],
                f"{law['b']:.3f} [{iv['b'][0]:.3f}, {iv['b'][1]:.3f}]",
                f"{law['c']:.4f} {c_iv}",
                f"{law['slope_per_decade']:+.4f}",
                hold,
            )
    console.print(laws)
    for fam, d in analysis["families"].items():
        parts = []
        for r in d["isoflop"]:
            tag = "" if r.get("interior") else " (edge)"
            parts.append(f"C={r['budget']:.2g}: {r['size_opt']:.3g}{tag}")
        console.print(f"IsoFLOP optimum FLOPs/example, {fam}: " + "; ".join(parts))
        osl = d["optimal_size_law"]
        if osl.get("alpha") is not None:
            iv = osl.get("alpha_interval")
            ivs = f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv else ""
            console.print(f"  optimal size ~ C^{osl['alpha']:.2f}{ivs}")
        ls = d.get("loss_surface") or {}
        if "a" in ls:
            top = ls["optima"][-1]
            where = (
                "inside"
                if top["inside_sampled"]
                else "below"
                if top["size_opt"] < top["sampled_sizes"][0]
                else "above"
                if top["size_opt"] > top["sampled_sizes"][1]
                else "undefined for"
            )
            iv = ls["intervals"]["a"]
            console.print(
                f"  loss surface {ls['law']} (rms log residual {ls['rms_log_residual']:.4f}): "
                f"optimal size ~ C^{ls['a']:.2f} [{iv[0]:.2f}, {iv[1]:.2f}]; at C={top['budget']:.2g} "
                f"{top['size_opt']:.3g} FLOPs/example, {where} the sizes sampled there"
            )
        elif ls:
            console.print(f"  loss surface: {ls['reason']}")
    for r in analysis.get("lr_check", []):
        losses = ", ".join(f"x{m}: {v:.4f}" for m, v in r["loss_by_multiplier"].items())
        console.print(
            f"LR check {r['family']} {r['rung']} C={r['budget']:.2g}: {losses} "
            f"(best x{r['best_multiplier']:.3g})"
        )


def _fmt(v) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"


def plot(
    analysis: dict, out_dir: Path, metric: str, *, reference: float | None = None
) -> list[Path]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fams = analysis["families"]
    colors = {f: f"C{i}" for i, f in enumerate(fams)}
    paths = []
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for fam, d in fams.items():
        pts, col = d["_points"], colors[fam]
        ax.scatter(pts["compute"], pts["y"], s=14, color=col, alpha=0.35)
        fr = pd.DataFrame(d["frontier"])
        ax.scatter(fr["compute"], fr["y"], s=40, color=col, label=f"{fam} (frontier)", zorder=3)
        law = d.get("_fit")
        cs = np.geomspace(fr["compute"].min(), fr["compute"].max() * 3, 200)
        if law is not None:
            lo, hi = law.band(cs, 0.95)
            ax.plot(
                cs, law.predict(cs), color=col, lw=1.5, label=f"{fam}: b={law.b:.2f}, c={law.c:.3f}"
            )
            ax.fill_between(cs, lo, hi, color=col, alpha=0.15, lw=0)
        law_b = d.get("_fit_bayes_floor")
        if law_b is not None:
            ax.plot(
                cs,
                law_b.predict(cs),
                color=col,
                lw=1,
                ls="--",
                label=f"{fam}, c = Bayes: b={law_b.b:.3f}",
            )
        h = d.get("holdout") or {}
        if h.get("predicted") is not None:
            ax.scatter(
                [h["holdout_compute"]], [h["predicted"]], marker="x", s=60, color=col, zorder=4
            )
    if reference is not None:
        ax.axhline(reference, color="k", ls=":", lw=1, label="Bayes-optimal (planted teacher)")
    # Bands of a 5-point fit can be wide where it extrapolates: frame the data, not the band.
    ys = np.concatenate([d["_points"]["y"].to_numpy() for d in fams.values()])
    lo_y = min(ys.min(), reference if reference is not None else ys.min())
    pad = 0.08 * (ys.max() - lo_y)
    ax.set_ylim(lo_y - pad, ys.max() + pad)
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel(_ylabel(metric))
    ax.set_title("quality vs compute (x: holdout prediction of the largest budget)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "scaling.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(fams), figsize=(4.5 * len(fams), 4), squeeze=False)
    for ax, (fam, d) in zip(axes[0], fams.items(), strict=True):
        pts = d["_points"]
        budgets = sorted(pts["budget"].unique())
        cmap = plt.get_cmap("viridis")
        for i, (b, iso) in enumerate(zip(budgets, d["isoflop"], strict=True)):
            g = pts[pts["budget"] == b].sort_values("fpe")
            col = cmap(i / max(len(budgets) - 1, 1))
            ax.plot(g["fpe"], g["y"], "o", color=col, label=f"C={b:.2g}")
            coef = iso.get("coef")
            if coef is not None:
                xs = np.geomspace(g["fpe"].min(), g["fpe"].max(), 50)
                ax.plot(xs, np.polyval(coef, np.log10(xs)), "-", color=col, lw=1)
            if iso.get("size_opt") is not None:
                ax.plot(
                    [iso["size_opt"]],
                    [iso["loss_opt"]],
                    "*",
                    ms=12,
                    color=col,
                    mec="k" if iso.get("interior") else col,
                )
        ax.set_xscale("log")
        ax.set_title(f"{fam}: IsoFLOP curves")
        ax.set_xlabel("model size: training FLOPs per example")
        ax.set_ylabel(_ylabel(metric))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "isoflop.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    paths.append(_plot_optimal_size(plt, fams, colors, out_dir))
    paths.append(_plot_residuals(plt, fams, colors, out_dir, metric))
    return paths


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_optimal_size(plt, fams: dict, colors: dict, out_dir: Path) -> Path:
    """Compute-optimal size against budget: IsoFLOP vertices with their C^alpha, and the loss
    surface's N_opt(C) with its band, beside the sizes each budget sampled."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for fam, d in fams.items():
        col = colors[fam]
        iso = d["isoflop"]
        b = np.array([r["budget"] for r in iso])
        s = np.array([r["size_opt"] for r in iso])
        inner = np.array([bool(r.get("interior")) for r in iso])
        ax.scatter(b[inner], s[inner], color=col, s=36, zorder=3)
        ax.scatter(b[~inner], s[~inner], facecolors="none", edgecolors=col, s=36, zorder=3)
        osl = d["optimal_size_law"]
        if osl.get("alpha") is not None:
            iv = osl.get("alpha_interval")
            ivs = f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv else ""
            xs = np.geomspace(b.min(), b.max(), 50)
            ax.plot(
                xs,
                osl["coefficient"] * xs ** osl["alpha"],
                color=col,
                lw=1.2,
                label=f"{fam}: size ~ C^{osl['alpha']:.2f}{ivs}",
            )
        else:
            ax.plot([], [], color=col, label=f"{fam}: no IsoFLOP law")
        sf = d.get("_surface")
        if sf is not None:
            xs = np.geomspace(b.min(), b.max(), 50)
            with np.errstate(invalid="ignore"):
                tail = (1 - sf.ci) / 2
                lo, hi = np.nanquantile(sf.optimal_size(xs, samples=True), [tail, 1 - tail], axis=0)
            iv = sf.intervals["a"]
            ax.plot(
                xs,
                sf.optimal_size(xs),
                color=col,
                lw=1.2,
                ls="--",
                label=f"{fam}: L(N, D) surface, size ~ C^{sf.a:.2f} [{iv[0]:.2f}, {iv[1]:.2f}]",
            )
            ax.fill_between(xs, lo, hi, color=col, alpha=0.12, lw=0)
        # The sizes each budget sampled: an optimum outside them is an extrapolation.
        pts = d["_points"]
        for j, (bud, g) in enumerate(pts.groupby("budget")):
            x = bud * 10 ** (0.04 * (list(fams).index(fam) - (len(fams) - 1) / 2))
            ax.plot(
                [x, x],
                [g["fpe"].min(), g["fpe"].max()],
                color=col,
                lw=3,
                alpha=0.3,
                solid_capstyle="butt",
                label="sizes sampled" if j == 0 and fam == next(iter(fams)) else None,
            )
    # Frame the sizes run (a surface optimum far below them is off the chart, and says so in
    # analysis.json), not the surface's extrapolation.
    sizes = np.concatenate([d["_points"]["fpe"].to_numpy() for d in fams.values()])
    ax.set_ylim(sizes.min() / 30, sizes.max() * 3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("optimal size: training FLOPs per example")
    ax.set_title(
        "compute-optimal size (dots: IsoFLOP minimum, filled if interior;\n"
        "dashed: from the L(N, D) surface, 95% band; bars: sizes sampled)"
    )
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    return _save(plt, fig, out_dir / "optimal_size.png")


def _plot_residuals(plt, fams: dict, colors: dict, out_dir: Path, metric: str) -> Path:
    """Frontier points' relative residuals against each law (free floor; floor at Bayes)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (suffix, title) in zip(
        axes, (("", "floor fitted"), ("_bayes_floor", "floor fixed at the Bayes loss")), strict=True
    ):
        for fam, d in fams.items():
            law = d.get(f"_fit{suffix}")
            if law is None:
                continue
            fr = pd.DataFrame(d["frontier"])
            rel = fr["y"].to_numpy() / law.predict(fr["compute"].to_numpy()) - 1
            ax.plot(fr["compute"], 100 * rel, "o-", color=colors[fam], lw=1, label=fam)
            h = d.get(f"holdout{suffix}") or {}
            if h.get("predicted") is not None:
                ax.scatter(
                    [h["holdout_compute"]],
                    [100 * (h["observed"] / h["predicted"] - 1)],
                    marker="x",
                    s=60,
                    color=colors[fam],
                    zorder=4,
                )
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("training compute C (FLOPs)")
        ax.set_title(f"residuals, {title}\n(x: held-out top budget vs its prediction)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"{_ylabel(metric)}: observed / law - 1 (%)")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    return _save(plt, fig, out_dir / "residuals.png")


def bayes_reference(sweep_dir: str | Path, metric: str) -> float | None:
    """The planted teacher's own eval metric, when every trial of the sweep reads one synthetic
    dataset (read from the results' configs: the committed results suffice, no trial folders)."""
    return bayes_reference_of(load_results(sweep_dir), metric)


def bayes_reference_of(df: pd.DataFrame, metric: str) -> float | None:
    """``bayes_reference`` of a results table (``load_results``)."""
    if df.empty or "config" not in df:
        return None
    # What the generator is (kind, generator settings, seed); not how it is batched or capped.
    datas = {
        json.dumps(
            {
                k: (json.loads(c).get("data") or {}).get(k)
                for k in ("kind", "synthetic", "shuffle_seed")
            },
            sort_keys=True,
        )
        for c in df["config"]
    }
    if len(datas) != 1:
        return None
    data = json.loads(datas.pop())
    if data.get("kind") != "synthetic":
        return None
    from data.config import SyntheticConfig  # noqa: PLC0415
    from data.synthetic import EVAL_INDEX_OFFSET, SyntheticGenerator  # noqa: PLC0415
    from recscale import config as config_lib  # noqa: PLC0415

    cfg = config_lib.from_dict(SyntheticConfig, data["synthetic"])
    gen = SyntheticGenerator(cfg, data.get("shuffle_seed", 0))
    idx = EVAL_INDEX_OFFSET + np.arange(cfg.num_eval_examples, dtype=np.int64)
    z = gen.teacher_logits(idx)
    yb = gen.examples(idx).labels_b
    if metric == "auc":
        from recscale.metrics import EvalAccumulator  # noqa: PLC0415

        acc = EvalAccumulator()
        acc.update(z, yb, np.ones_like(yb))
        return 1.0 - acc.result()["auc"]
    return float(np.mean(np.logaddexp(0.0, z) - yb * z))


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = tyro.cli(AnalyzeArgs, args=argv, prog="python -m sweeps.analyze")
    root = Path(args.sweep_dir)
    for d in (root, *([Path(args.surface_from)] if args.surface_from else [])):
        if not (d / "results.jsonl").exists():
            raise SystemExit(f"{d}: no results.jsonl (launch the sweep first)")
    sweep = json.loads((root / "sweep.json").read_text()) if (root / "sweep.json").exists() else {}
    metric = args.metric or sweep.get("metric", "logloss")
    out_dir = Path(args.out) if args.out else root
    out_dir.mkdir(parents=True, exist_ok=True)
    df = load_results(root)
    df.to_csv(out_dir / "results.csv", index=False)
    if args.parquet:
        df.to_parquet(out_dir / "results.parquet", index=False)
    ref = bayes_reference_of(df, metric)
    analysis = analyze(df, metric, n_boot=args.n_boot, floor=ref)
    analysis["bayes_reference"] = ref
    print_report(df, analysis, metric)
    if ref is not None:
        print(f"Bayes-optimal {_ylabel(metric)} of the planted teacher on the eval set: {ref:.4f}")
    if args.plots and analysis["families"] and df["budget"].nunique() > 1:
        for p in plot(analysis, out_dir, metric, reference=ref):
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
            print(f"wrote {_plot_quality_vs_size(q, out_dir)}")
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
            print(f"wrote {_plot_sparse_dense(grid, out_dir, metric)}")
    if args.surface_from:
        analysis["surface_check"] = chk = surface_check(
            df, load_results(args.surface_from), metric, n_boot=args.n_boot
        )
        analysis["surface_check_reference"] = args.surface_from
        for fam, d in chk.items():
            for c in d.get("cells", []):
                best = c["reference_best_at_budget"]
                pi = c["prediction_interval"]
                print(
                    f"surface check {fam} {c['rung']} C={c['budget']:.2g}: observed "
                    f"{c['observed']:.4f}, predicted {c['predicted']:.4f} [{pi[0]:.4f}, "
                    f"{pi[1]:.4f}] ({c['rel_error']:.2%})"
                    + (
                        f"; {args.surface_from}'s best there: {best['rung']} {best['y']:.4f}"
                        if best
                        else ""
                    )
                )
    public = _public(analysis)
    (out_dir / "analysis.json").write_text(json.dumps(public, indent=2, default=str) + "\n")
    return public


if __name__ == "__main__":
    main()
