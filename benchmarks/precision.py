"""AUC and size of a trained model's serving artifact in every table precision (issue 20).

``python benchmarks/precision.py --workdirs RUN [RUN ...] [--precisions float32 bfloat16
float16 int8 int4 auto] [--auc-budget 0.0002] [--out runs/bench_precision]``

Each run is exported (``recscale.export``) once per precision, ``auto`` choosing each table's
smallest precision within ``--auc-budget`` of float32's validation AUC. Each artifact is then
loaded by its own jax-only loader and scores the run's whole validation set; printed per run and
precision: the tables' bytes and their ratio to float32, the whole artifact's weights, the AUC
and logloss from the artifact and their differences to the float32 artifact's, and for ``auto``
the precision chosen per table. Results go to ``OUT/results.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402


def _eval_set(family, workdir: str):
    """The run's validation examples (dense, ids, labels, weights) as its evaluation reads them."""
    from recscale.train.evaluation import restored

    with restored(family.config_cls, family.build_model, workdir, num_devices=1) as r:
        batches = list(r.exp.source.eval_batches())
    cat = lambda k: np.concatenate([getattr(b, k) for b in batches])  # noqa: E731
    return cat("dense_bn"), cat("ids_bfh"), cat("labels_b"), cat("weights_b")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdirs", nargs="+", required=True)
    ap.add_argument(
        "--precisions",
        nargs="*",
        default=["float32", "bfloat16", "float16", "int8", "int4", "auto"],
    )
    ap.add_argument("--auc-budget", type=float, default=0.0002)
    ap.add_argument("--out", default="runs/bench_precision")
    args = ap.parse_args(argv)
    from recscale import metrics
    from recscale.export import export_main, family_of
    from recscale.serving.runtime import Model

    console = Console(width=160)
    out = Path(args.out)
    results = {}
    for wd in args.workdirs:
        family = family_of(wd)
        dense, ids, labels, weights = _eval_set(family, wd)
        logit = lambda p: np.log(np.clip(p, 1e-7, 1 - 1e-7) / np.clip(1 - p, 1e-7, 1))  # noqa: E731
        rows = {}
        for p in args.precisions:
            art = out / str(Path(wd)).strip("/").replace("/", "__") / p  # unique per run
            if not (art / "manifest.json").is_file():
                extra = ["--auc-budget", str(args.auc_budget)] if p == "auto" else []
                export_main(family, ["--workdir", wd, "--out", str(art), "--precision", p, *extra])
            man = json.loads((art / "manifest.json").read_text())
            probs = Model.load(art).predict(dense, ids)
            weight_bytes = sum(
                int(np.prod(w["shape"]))
                * np.dtype({"bfloat16": "float16"}.get(w["dtype"], w["dtype"])).itemsize
                for w in man["weights"].values()
            )
            rows[p] = {
                "table_bytes": man["table_bytes"],
                "weight_bytes": weight_bytes,
                "auc": metrics.auc(probs, labels, weights),
                "logloss": metrics.logloss(logit(probs), labels, weights),
                "tables": {k: v["precision"] for k, v in man["tables"].items()},
            }
            console.print(f"{wd} {p}: AUC {rows[p]['auc']:.5f}")
        results[wd] = rows
        base = rows.get("float32")
        table = Table(
            title=f"{wd} ({family.package}), {int((weights > 0).sum())} validation examples"
        )
        for col in (
            "precision",
            "table MiB",
            "vs float32",
            "all weights MiB",
            "AUC",
            "ΔAUC",
            "logloss",
            "Δlogloss",
            "per table",
        ):
            table.add_column(col, justify="right")
        for p, r in rows.items():
            d_auc = r["auc"] - base["auc"] if base else float("nan")
            d_ll = r["logloss"] - base["logloss"] if base else float("nan")
            ratio = base["table_bytes"] / r["table_bytes"] if base else float("nan")
            kinds = sorted(set(r["tables"].values()))
            per = (
                ("all " + kinds[0])
                if len(kinds) == 1
                else " ".join(f"{k}={v}" for k, v in r["tables"].items())
            )
            table.add_row(
                p,
                f"{r['table_bytes'] / 2**20:.3f}",
                f"{ratio:.2f}x",
                f"{r['weight_bytes'] / 2**20:.3f}",
                f"{r['auc']:.5f}",
                f"{d_auc:+.5f}",
                f"{r['logloss']:.5f}",
                f"{d_ll:+.5f}",
                per,
            )
        console.print(table)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
