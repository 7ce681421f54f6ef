"""Latency-bounded throughput of an exported model under open-loop Poisson load (issue 20).

``python benchmarks/serving.py --workdir RUN [--precisions float32 int8 int4]
[--policies 1:0 64:1 256:2] [--colocation t1 t2 p2] [--rates 250 500 1000 2000 4000 8000]
[--duration 4] [--bound-ms 10] [--out runs/bench_serving] [--http] [--raw DATA_FILE]``

DeepRecSys's setting: requests of one example arrive as a Poisson process at a fixed rate
(open loop: a request is sent at its time whether or not earlier ones were answered) and wait
in the dynamic batcher (``recscale.serving.batcher``) for a batch policy ``MAX_BATCH:MAX_WAIT_MS``.
Latency is answer time minus arrival time. Per configuration and rate it prints the p50 / p95 /
p99 latency, the throughput achieved and the requests shed, and per configuration the highest
rate whose p99 meets ``--bound-ms`` with nothing shed, with its ratio to the baseline measured in
the same run (float32, no batching: ``1:0``, one instance). Co-location: ``tN`` runs N model
instances as threads sharing one batcher queue and the weights; ``pN`` runs N processes, each
with its own model and batcher, the load split evenly between them (a load balancer).

``--http`` sends every request through the HTTP server (``recscale.serving.server``) with an
aiohttp client on localhost, so the numbers include HTTP and JSON. ``--raw FILE`` (a model
whose artifact has its data's encoding: a feature-spec, Frappe or Criteo run) makes each request
one raw row of the file, encoded by the model as it arrives, so the encoding's cost is in the
latency (else requests are encoded ids drawn at random). Results go to
``OUT/results.json`` and ``OUT/latency_vs_load.png``. The same script runs on a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import multiprocessing as mp
import queue as queue_lib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402


def _inputs(model, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random examples within the artifact's vocabularies (latency does not depend on
    the values)."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((n, len(model.dense_names))).astype(np.float32)
    ids = np.full((n, len(model.features), model.max_hotness), -1, np.int32)
    for j, f in enumerate(model.features):
        hot = rng.integers(1, f["max_hotness"] + 1, n)
        for k in range(f["max_hotness"]):
            vals = rng.integers(0, f["vocab_size"], n)
            ids[:, j, k] = np.where(k < hot, vals, -1)
    return dense, ids


async def _drive(score, dense, ids, rate: float, duration: float, seed: int) -> dict:
    """Open-loop Poisson arrivals at ``rate`` per second for ``duration`` seconds; each calls
    ``score(i)``. Returns latencies (s) of answered requests and the count shed."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, int(rate * duration * 1.2) + 10)
    times = np.cumsum(gaps)
    times = times[times < duration]
    lat, shed, errors = [], [0], [0]
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.05

    async def one(i, at):
        try:
            await score(i % len(dense))
            lat.append(loop.time() - at)
        except Exception as e:  # noqa: BLE001
            if "overloaded" in str(e) or "503" in str(e):
                shed[0] += 1
            else:
                errors[0] += 1

    tasks = []
    for i, t in enumerate(times):
        at = t0 + t
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, at)))
    await asyncio.gather(*tasks)
    wall = loop.time() - t0
    return {
        "latencies": lat,
        "shed": shed[0],
        "errors": errors[0],
        "sent": len(times),
        "wall": wall,
    }


async def _run_inprocess(
    artifact: str,
    policy: tuple[int, float],
    workers: int,
    rate: float,
    duration: float,
    seed: int,
    http: bool,
    raw: str = "",
    barrier=None,
) -> dict:
    from recscale.serving.batcher import DynamicBatcher
    from recscale.serving.runtime import Model, read_rows

    model = Model.load(artifact)
    dense, ids = _inputs(model, 4096, seed)
    dense, ids, _ = model.check(dense, ids)
    rows = []
    if raw:  # requests are rows of a data file, encoded by the model as they arrive
        if model.rows is None:
            raise SystemExit(f"error: --raw: {artifact} has no encoding of raw rows")
        rows = list(
            itertools.islice(
                read_rows(raw, model.manifest["vocab"]["format"], model.rows.columns), 4096
            )
        )
    max_batch, max_wait = policy
    for b in sorted({1 << k for k in range(max_batch.bit_length())} | {max_batch}):  # compile
        model.predict_checked(dense[:b], ids[:b])
    gc.collect()  # as recscale.serve does: what is alive now is out of the collector's view
    gc.freeze()
    if barrier is not None:  # co-located processes start their load together, warmed up
        barrier.wait()
    if http:
        from aiohttp import ClientSession, TCPConnector
        from aiohttp.test_utils import TestServer

        from recscale.serving.server import make_app

        app = make_app(
            model,
            max_batch=max_batch,
            max_wait=max_wait,
            workers=workers,
            max_queue=max(4096, max_batch),
        )
        server = TestServer(app)
        await server.start_server()
        bodies = [
            json.dumps({"examples": [rows[i % len(rows)]]})
            if raw
            else json.dumps({"dense": dense[i : i + 1].tolist(), "ids": ids[i : i + 1].tolist()})
            for i in range(256)
        ]
        async with ClientSession(connector=TCPConnector(limit=0)) as session:
            url = str(server.make_url("/predict"))

            async def score(i):
                async with session.post(
                    url, data=bodies[i % 256], headers={"Content-Type": "application/json"}
                ) as r:
                    if r.status != 200:
                        raise RuntimeError(f"{r.status}")
                    await r.read()

            await _drive(score, dense, ids, min(rate, 200.0), 0.3, seed + 1)  # warm-up
            out = await _drive(score, dense, ids, rate, duration, seed)
        await server.close()
        return out
    batcher = DynamicBatcher(
        model.predict_checked,
        max_batch=max_batch,
        max_wait=max_wait,
        workers=workers,
        max_queue=max(4096, max_batch),
    )
    batcher.start()

    async def score(i):
        if raw:  # encode and check on the event loop, then queue (the server does it in a thread)
            d, x, _ = model.encode([rows[i % len(rows)]])
            d, x, _ = model.check(d, x)
            await batcher.score(d, x)
        else:
            await batcher.score(dense[i : i + 1], ids[i : i + 1])

    await _drive(score, dense, ids, min(rate, 200.0), 0.3, seed + 1)  # warm-up, not counted
    before = batcher.stats.as_dict()
    out = await _drive(score, dense, ids, rate, duration, seed)
    after = batcher.stats.as_dict()
    out["mean_batch"] = (after["examples"] - before["examples"]) / max(
        after["batches"] - before["batches"], 1
    )
    await batcher.close()
    return out


def _worker(args_tuple, barrier, q):
    q.put(asyncio.run(_run_inprocess(*args_tuple, barrier=barrier)))


def measure(
    artifact: str, policy, coloc: str, rate: float, duration: float, http: bool, raw: str = ""
) -> dict:
    """One configuration at one rate: latencies pooled over the co-located instances."""
    kind, n = coloc[0], int(coloc[1:])
    if kind == "t":
        res = [asyncio.run(_run_inprocess(artifact, policy, n, rate, duration, 0, http, raw))]
    else:  # n processes, each with rate / n
        ctx = mp.get_context("spawn")
        q, barrier = ctx.Queue(), ctx.Barrier(n)
        procs = [
            ctx.Process(
                target=_worker,
                args=((artifact, policy, 1, rate / n, duration, s, http, raw), barrier, q),
            )
            for s in range(n)
        ]
        for p in procs:
            p.start()
        res = []
        for _ in procs:
            try:
                res.append(q.get(timeout=duration * 20 + 300))
            except queue_lib.Empty:
                codes = [p.exitcode for p in procs]
                for p in procs:
                    p.kill()
                raise SystemExit(
                    f"error: a co-located process gave no result (exit codes {codes})"
                ) from None
        for p in procs:
            p.join()
    lat = np.concatenate([np.asarray(r["latencies"]) for r in res]) * 1e3
    sent = sum(r["sent"] for r in res)
    shed = sum(r["shed"] for r in res)
    wall = max(r["wall"] for r in res)
    pct = np.percentile(lat, [50, 95, 99]) if lat.size else [np.inf] * 3
    return {
        "rate": rate,
        "p50_ms": float(pct[0]),
        "p95_ms": float(pct[1]),
        "p99_ms": float(pct[2]),
        "throughput": lat.size / wall,
        "sent": sent,
        "shed": shed,
        "errors": sum(r["errors"] for r in res),
        "mean_batch": float(np.mean([r.get("mean_batch", 0) for r in res])),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, help="a trained run to export")
    ap.add_argument("--precisions", nargs="*", default=["float32", "int8", "int4"])
    ap.add_argument(
        "--policies", nargs="*", default=["1:0", "64:1", "256:2"], help="MAX_BATCH:MAX_WAIT_MS"
    )
    ap.add_argument(
        "--colocation",
        nargs="*",
        default=["t1", "t2", "p2"],
        help="tN: N instances as threads in one process; pN: N processes",
    )
    ap.add_argument(
        "--rates", nargs="*", type=float, default=[250, 500, 1000, 2000, 4000, 8000, 16000]
    )
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--bound-ms", type=float, default=10.0)
    ap.add_argument("--http", action="store_true")
    ap.add_argument(
        "--raw",
        default="",
        help="a data file of the run: requests are its raw "
        "rows, encoded by the model (its encoding's cost included)",
    )
    ap.add_argument("--out", default="runs/bench_serving")
    args = ap.parse_args(argv)
    from recscale.export import export_main, family_of

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=150)
    family = family_of(args.workdir)
    sizes = {}
    for p in dict.fromkeys(["float32", *args.precisions]):  # float32: the baseline's
        art = out / f"model_{p}"
        man = art / "manifest.json"
        src = json.loads(man.read_text())["source"]["workdir"] if man.is_file() else None
        if src != str(Path(args.workdir).resolve()):  # none yet, or another run's
            export_main(
                family,
                ["--workdir", args.workdir, "--out", str(art), "--replace", "--precision", p],
            )
        sizes[p] = json.loads(man.read_text())["table_bytes"]
    configs = [("float32", "1:0", "t1")]  # the baseline first
    configs += [
        (p, pol, c)
        for p in args.precisions
        for pol in args.policies
        for c in args.colocation
        if (p, pol, c) != configs[0]
    ]
    results = []
    for p, pol, coloc in configs:
        mb, mw = pol.split(":")
        policy = (int(mb), float(mw) / 1e3)
        rows = []
        for rate in args.rates:
            r = measure(
                str(out / f"model_{p}"), policy, coloc, rate, args.duration, args.http, args.raw
            )
            rows.append(r)
            console.print(
                f"{p:8s} {pol:>7s} {coloc:3s} rate {rate:7.0f}/s: p50 {r['p50_ms']:7.2f} "
                f"p99 {r['p99_ms']:8.2f} ms, {r['throughput']:7.0f}/s, shed {r['shed']}, "
                f"batch {r['mean_batch']:.1f}"
            )
            if r["p99_ms"] > 20 * args.bound_ms or r["shed"]:
                break  # far past saturation: higher rates only queue longer
        ok = [
            r["rate"]
            for r in rows
            if r["p99_ms"] <= args.bound_ms and not r["shed"] and not r["errors"]
        ]
        results.append(
            {
                "precision": p,
                "policy": pol,
                "colocation": coloc,
                "rows": rows,
                "max_rate_within_bound": max(ok) if ok else 0.0,
            }
        )
    base = results[0]["max_rate_within_bound"] or float("nan")
    table = Table(
        title=f"highest Poisson rate with p99 <= {args.bound_ms:g} ms, nothing shed "
        f"({'HTTP' if args.http else 'in process'}"
        f"{', raw rows' if args.raw else ''})"
    )
    for col in (
        "precision",
        "table MiB",
        "policy",
        "co-location",
        "max req/s",
        "vs baseline",
        "p50 / p99 ms there",
    ):
        table.add_column(col, justify="right")
    for r in results:
        at = next((x for x in r["rows"] if x["rate"] == r["max_rate_within_bound"]), None)
        r["ratio"] = r["max_rate_within_bound"] / base
        table.add_row(
            r["precision"],
            f"{sizes[r['precision']] / 2**20:.3f}",
            r["policy"],
            r["colocation"],
            f"{r['max_rate_within_bound']:.0f}",
            f"{r['ratio']:.2f}x",
            f"{at['p50_ms']:.2f} / {at['p99_ms']:.2f}" if at else "-",
        )
    console.print(table)
    _plot(results, args, out / "latency_vs_load.png")
    res = {
        "workdir": args.workdir,
        "bound_ms": args.bound_ms,
        "http": args.http,
        "raw": args.raw,
        "duration": args.duration,
        "table_bytes": sizes,
        "results": results,
    }
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def _plot(results: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    precisions = sorted({r["precision"] for r in results})
    fig, axes = plt.subplots(1, len(precisions), figsize=(5 * len(precisions), 4), squeeze=False)
    policies = sorted({r["policy"] for r in results}, key=lambda p: int(p.split(":")[0]))
    colors = dict(zip(policies, plt.cm.viridis(np.linspace(0, 0.9, len(policies))), strict=True))
    styles = {"t1": "-", "t2": "--"}
    for ax, p in zip(axes[0], precisions, strict=True):
        for r in results:
            if r["precision"] != p:
                continue
            x = [row["rate"] for row in r["rows"]]
            y = [row["p99_ms"] for row in r["rows"]]
            ax.plot(
                x,
                y,
                marker="o",
                color=colors[r["policy"]],
                ls=styles.get(r["colocation"], ":"),
                label="max {}, wait {} ms, ".format(*r["policy"].split(":")) + r["colocation"],
            )
        ax.axhline(args.bound_ms, color="gray", ls="--", lw=1)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="offered load (requests/s)",
            ylabel="p99 latency (ms)",
            title=p,
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
