"""Tabular preparation against a plain pyarrow read, and prepared shards against the model.

``python benchmarks/tabular_prepare.py prepare [--gigabytes 10 2] [--dir DIR]``
    Writes a raw Criteo-format TSV of each size (40 columns, tab-separated, the Criteo sample's
    missing rates; a block of 200,000 generated rows repeated), then, each in a fresh child
    process: a plain streaming ``pyarrow.csv`` read of the file (all columns, default types and
    threads), and ``data.tabular.prepare`` of it with the Criteo preset spec (hashing, log of
    the integers, array_record shards). Prints rows/s of both, their ratio, and each child's
    peak resident memory: the preparation's must stay flat as the file grows (target < 2 GB,
    rate >= 0.5x the read's). The files are deleted afterwards unless ``--keep``.

``python benchmarks/tabular_prepare.py input [--frappe ../shared/data/frappe]``
    Frappe as a spec (``data.tabular.presets.frappe_spec``): examples/s of the prepared source's
    ``train_batch`` (one thread, batch 4,096 random records from array_record) against the
    examples/s ``dlrm/frappe`` trains at on this machine, measured in the same run from a short
    training run's logged rate (target: the input >= 3x the model).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "data"))


def _write_criteo(path: Path, gigabytes: float) -> int:
    from conftest import criteo_lines  # the tests' generator of Criteo-shaped rows

    block = ("".join(line + "\n" for line in criteo_lines(200_000, seed=1))).encode()
    target = int(gigabytes * 1e9)
    rows_per_block = 200_000
    rows = 0
    with open(path, "wb") as fh:
        written = 0
        while written < target:
            fh.write(block)
            written += len(block)
            rows += rows_per_block
    return rows


# Each child samples the resident memory of itself plus its own children (the preparation's
# workers) every 20 ms: ru_maxrss would carry over the forking parent's peak across exec.
_SAMPLER = """
import os, threading, time, psutil
PEAK = [0]
def _sample():
    me = psutil.Process()
    while True:
        total = 0
        for p in [me, *me.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        PEAK[0] = max(PEAK[0], total)
        time.sleep(0.02)
threading.Thread(target=_sample, daemon=True).start()
"""

_READ = (
    _SAMPLER
    + """
import sys, time, pyarrow.csv as c
t = time.perf_counter(); n = 0
r = c.open_csv(sys.argv[1], read_options=c.ReadOptions(autogenerate_column_names=True, block_size=1 << 22),
               parse_options=c.ParseOptions(delimiter="\\t"))
for b in r:
    n += b.num_rows
print(n, time.perf_counter() - t, PEAK[0])
"""
)

_PREP = (
    _SAMPLER
    + """
import sys, time
sys.path.insert(0, sys.argv[3])
from data.tabular.prepare import prepare
from data.tabular.presets import criteo_spec
import dataclasses
spec = dataclasses.replace(criteo_spec((sys.argv[1],), valid_fraction=0.05), rows_per_shard=1 << 21)
t = time.perf_counter()
p = prepare(spec, sys.argv[2], progress=False, workers=int(sys.argv[4]))
print(sum(p.stats["rows"].values()), time.perf_counter() - t, PEAK[0])
"""
)


def _child(code: str, *args: str) -> tuple[int, float, float]:
    """(rows, seconds, peak RSS GB of the child or any of its own children) of a fresh
    ``python -c code args`` (memory: the sum over the child and its workers, sampled)."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    rows, secs, rss = out.stdout.split()[-3:]
    return int(rows), float(secs), int(rss) / 1e9


def bench_prepare(sizes: list[float], directory: str, keep: bool, workers: int) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    results = []
    for gb in sorted(sizes):
        work = Path(tempfile.mkdtemp(prefix="tabular_bench_", dir=directory))
        try:
            path = work / "criteo.tsv"
            t = time.perf_counter()
            rows = _write_criteo(path, gb)
            size = path.stat().st_size
            print(
                f"wrote {size / 1e9:.1f} GB, {rows:,} rows in {time.perf_counter() - t:.0f} s",
                flush=True,
            )
            r_rows, r_s, r_rss = _child(_READ, str(path))
            p_rows, p_s, p_rss = _child(
                _PREP, str(path), str(work / "prep"), str(REPO), str(workers)
            )
            assert r_rows == rows and p_rows == rows, (r_rows, p_rows, rows)
            results.append(
                {
                    "gb": size / 1e9,
                    "rows": rows,
                    "read_rows_s": rows / r_s,
                    "read_rss_gb": r_rss,
                    "prepare_rows_s": rows / p_s,
                    "prepare_rss_gb": p_rss,
                    "ratio": r_s / p_s,
                }
            )
        finally:
            if not keep:
                shutil.rmtree(work, ignore_errors=True)
    t = Table(title="tabular preparation vs a plain pyarrow.csv read (Criteo-format TSV)")
    for h in (
        "file GB",
        "rows",
        "read rows/s",
        "prepare rows/s",
        "ratio",
        "read peak RSS",
        "prepare peak RSS",
    ):
        t.add_column(h)
    for r in results:
        t.add_row(
            f"{r['gb']:.1f}",
            f"{r['rows']:,}",
            f"{r['read_rows_s']:,.0f}",
            f"{r['prepare_rows_s']:,.0f}",
            f"{r['ratio']:.2f}x",
            f"{r['read_rss_gb']:.2f} GB",
            f"{r['prepare_rss_gb']:.2f} GB",
        )
    Console().print(t)
    print(json.dumps(results))
    return results


def bench_input(frappe: str) -> dict:
    import dataclasses

    import numpy as np

    from data.builders import make_source
    from data.tabular.presets import frappe_spec, write_spec

    with tempfile.TemporaryDirectory() as tmp:
        spec = os.path.join(tmp, "frappe.yaml")
        write_spec(frappe_spec(os.path.abspath(frappe)), spec)
        import dlrm.presets  # noqa: F401
        from dlrm.model import build_model
        from recscale.config import get_preset
        from recscale.train.loop import train

        cfg = get_preset("dlrm/frappe")
        data = dataclasses.replace(
            cfg.data,
            kind="tabular",
            tabular=dataclasses.replace(
                cfg.data.tabular, spec=spec, prepared_dir=os.path.join(tmp, "prep")
            ),
        )
        source = make_source(data)
        source.train_batch(0)
        steps = 50
        t = time.perf_counter()
        for s in range(1, steps + 1):
            source.train_batch(s)
        input_eps = steps * data.batch_size / (time.perf_counter() - t)
        run = dataclasses.replace(
            cfg,
            data=data,
            train=dataclasses.replace(
                cfg.train, num_steps=150, log_every=50, eval_every=0, progress=False
            ),
        )
        wd = os.path.join(tmp, "run")
        train(run, build_model, wd)
        rows = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
        rates = [r["examples_per_sec"] for r in rows if r["split"] == "train"][1:]  # no compile
        model_eps = float(np.median(rates))
    out = {
        "input_examples_s": input_eps,
        "model_examples_s": model_eps,
        "ratio": input_eps / model_eps,
    }
    print(
        f"prepared Frappe shards: {input_eps:,.0f} examples/s (one thread, batch "
        f"{data.batch_size}); dlrm/frappe trains at {model_eps:,.0f} examples/s: "
        f"input / model = {input_eps / model_eps:.1f}x"
    )
    print(json.dumps(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--gigabytes", type=float, nargs="+", default=[10.0, 2.0])
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--keep", action="store_true")
    p.add_argument("--workers", type=int, default=0, help="preparation processes (0: CPUs)")
    i = sub.add_parser("input")
    i.add_argument("--frappe", default=str(REPO.parent / "shared" / "data" / "frappe"))
    args = ap.parse_args()
    if args.cmd == "prepare":
        bench_prepare(args.gigabytes, args.dir, args.keep, args.workers)
    else:
        bench_input(args.frappe)


if __name__ == "__main__":
    main()
