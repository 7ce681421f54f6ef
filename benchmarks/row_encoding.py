"""Raw-row encoding cost of a serving artifact against the model's own cost (issue 20).

``python benchmarks/row_encoding.py [--rows 200000] [--sizes 1 16 256 4096] [--repeats 5]``

A feature-spec model served on raw rows encodes them first (``RowEncoder`` in
``recscale/serving/rows.py``: numpy and Python, so the artifact needs only jax). This prepares
the example shop dataset and its spec (``data/tabular/example.py``: side tables, a vocabulary, a
bag, a hash, buckets, standardised and log numerics), trains dlrm/tiny on it for a few steps, exports it, and
times per request size: encoding the rows (its caches warm, as a server's are, and cold), scoring
the encoded inputs, and (baseline, same run)
``prepare``'s pyarrow encoder on the same rows as a file. It prints microseconds per row and the
ratio of encoding to scoring; the share of a raw-row request spent encoding is what a server
would win by a compiled encoder.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402


def _best(fn, repeats: int) -> float:
    fn()  # warm-up (compilation, caches)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000, help="training rows of the example")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 256, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import dlrm.presets  # noqa: F401
    from data.config import TabularConfig
    from data.tabular import example, prepare
    from dlrm.config import DLRMConfig
    from dlrm.model import build_model
    from recscale.config import get_preset
    from recscale.serving.export import ExportArgs, export_workdir
    from recscale.serving.runtime import Model, read_rows
    from recscale.train.loop import train

    console = Console(width=130)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "shop"
        example.make(str(d), rows=args.rows)
        (d / "spec.yaml").write_text(example.SPEC)
        cfg = get_preset("dlrm/tiny")
        tab = TabularConfig(spec=str(d / "spec.yaml"), prepared_dir=str(d / "prep"))
        cfg = dataclasses.replace(
            cfg,
            data=dataclasses.replace(cfg.data, kind="tabular", tabular=tab),
            train=dataclasses.replace(cfg.train, num_steps=20, progress=False),
        )
        train(cfg, build_model, Path(tmp) / "run")
        export_workdir(
            DLRMConfig,
            build_model,
            ExportArgs(workdir=str(Path(tmp) / "run"), out=str(Path(tmp) / "m")),
            log=lambda _: None,
        )
        model = Model.load(Path(tmp) / "m")
        p = prepare(tab.spec, tab.prepared_dir, progress=False)
        fmt = model.manifest["vocab"]["format"]
        rows = list(read_rows(d / "new.csv", fmt, model.rows.columns))
        header = (d / "new.csv").read_text().splitlines()[0]
        lines = (d / "new.csv").read_text().splitlines()[1:]
        table = Table(title="raw-row encoding, microseconds per row (best of repeats)")
        for col in (
            "rows per request",
            "RowEncoder",
            "cold cache",
            "score (predict)",
            "encode / score",
            "prepare's encoder (file)",
            "RowEncoder / prepare",
        ):
            table.add_column(col, justify="right")
        for n in args.sizes:
            batch = (rows * (n // len(rows) + 1))[:n]
            dense, ids, _ = model.encode(batch)
            f = Path(tmp) / f"req{n}.csv"
            f.write_text("\n".join([header, *(lines * (n // len(lines) + 1))[:n]]) + "\n")
            enc = _best(lambda b=batch: model.encode(b), args.repeats) / n * 1e6
            cold = (
                _best(lambda b=batch: (model.rows.clear(), model.encode(b)), args.repeats) / n * 1e6
            )
            score = _best(lambda d=dense, i=ids: model.predict(d, i), args.repeats) / n * 1e6
            ref = _best(lambda f=f: p.encode_file(str(f)), args.repeats) / n * 1e6
            table.add_row(
                str(n),
                f"{enc:.1f}",
                f"{cold:.1f}",
                f"{score:.1f}",
                f"{enc / score:.2f}",
                f"{ref:.1f}",
                f"{enc / ref:.2f}",
            )
        console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
