"""Printing and plots of a sweep analysis (``sweeps.analyze``): the rich tables of trials and
fitted laws, and the PNGs (optimal size, residuals, quality vs size, the sparse/dense grid)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd


def plot_sparse_dense(grid: dict[str, Any], out_dir: Path, metric: str) -> Path:
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
        ax.set_title(f"{fam}, C = {b['budget']:.2g} FLOPs: {ylabel(metric)} (red: best)")
        fig.colorbar(im, ax=ax, shrink=0.85)
    return _save(plt, fig, out_dir / "sparse_dense.png")


def plot_quality_vs_size(q: dict[str, list[dict[str, Any]]], out_dir: Path) -> Path:
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


def ylabel(metric: str) -> str:
    return {"auc": "1 - AUC", "loss": "eval next-item loss (nats)"}.get(metric, "eval logloss")


def print_floors(analysis: dict, baselines: dict[str, float], file=None) -> None:
    """Planted histories (``sweeps.reference.planted_baselines``): the generator's reference
    losses, and each family's fitted floor ``c`` (free fit) beside the Bayes-optimal one."""
    out = file or sys.stdout
    print(
        "planted baselines on the eval set (nats): "
        + ", ".join(f"{k} {v:.4f}" for k, v in baselines.items()),
        file=out,
    )
    for fam, d in analysis["families"].items():
        law = d.get("law")
        if not law:
            print(f"{fam}: no free fit ({d.get('reason', '')})", file=out)
            continue
        lo, hi = law["intervals"]["c"]
        print(
            f"{fam}: fitted floor c = {law['c']:.4f} [{lo:.4f}, {hi:.4f}] against the Bayes "
            f"floor {baselines['bayes']:.4f} (gap {law['c'] - baselines['bayes']:+.4f}); "
            f"best observed {min(r['y'] for r in d['frontier']):.4f}",
            file=out,
        )


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
    if cost := analysis.get("cost"):
        console.print(
            f"cost: {cost['runs']} runs and {cost['branches']} cooldown branches ran "
            f"{cost['run_compute']:.3g} training FLOPs for points of {cost['points_compute']:.3g} "
            f"({cost['points_per_run_compute']:.2f}x), {cost['wall_time_s']:.0f} s summed wall"
        )
    if df["budget"].nunique() == 1:  # fixed data (e.g. study_frappe): nothing scales with C
        console.print("one compute budget: no scaling laws, IsoFLOP optima or loss surface to fit")
        return
    laws = Table(title=f"scaling laws: {ylabel(metric)} = c + a'·(C/C0)^-b on the frontier")
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
    analysis: dict,
    out_dir: Path,
    metric: str,
    *,
    reference: float | None = None,
    baselines: dict[str, float] | None = None,
) -> list[Path]:
    """``scaling.png`` (with the Bayes-optimal ``reference`` and the planted ``baselines``
    that see less than the history, when given), ``isoflop.png``, the optimal-size and the
    residual plots."""
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
    for i, name in enumerate(("last_item", "bag")):
        if baselines and name in baselines:
            ax.axhline(
                baselines[name], color="0.5", ls=(0, (1, 2 + 2 * i)), lw=1, label=f"{name} baseline"
            )
    # Bands of a 5-point fit can be wide where it extrapolates: frame the data, not the band.
    ys = np.concatenate([d["_points"]["y"].to_numpy() for d in fams.values()])
    lo_y = min(ys.min(), reference if reference is not None else ys.min())
    pad = 0.08 * (ys.max() - lo_y)
    ax.set_ylim(lo_y - pad, ys.max() + pad)
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel(ylabel(metric))
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
        ax.set_ylabel(ylabel(metric))
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
    axes[0].set_ylabel(f"{ylabel(metric)}: observed / law - 1 (%)")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    return _save(plt, fig, out_dir / "residuals.png")
