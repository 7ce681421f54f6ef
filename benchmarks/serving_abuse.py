"""The server's well-behaved clients with and without hostile ones beside them (issue 35).

``python benchmarks/serving_abuse.py --model MODEL [--rows FILE] [--rate 100] [--duration 20]
[--max-batch 64] [--cache-mb 16] [--body-timeout-s 2] [--repeats 2] [--out
runs/bench_serving_abuse]``

Two phases, ``--repeats`` times in turn (medians reported, the machine's noise in view), each against a fresh ``python -m recscale.serve MODEL`` process with the same flags:
well-behaved clients alone, then with hostile clients beside them. The well-behaved load is
open-loop Poisson at ``--rate`` requests a second, each one raw row of ``--rows`` (by default
the run's evaluation file named in the artifact's manifest). The hostile clients, in a process
of their own, run for the whole phase:

* slow bodies: ``--slow`` connections, each declaring a body of ``max_body`` bytes, sending 90%
  of it at once and then nothing, reconnecting when the server closes it (408);
* oversized bodies: 10 a second, half declaring twice ``max_body`` (413 before a byte is read),
  half chunked without a length and sent past the bound (413 once it passes);
* unique huge values: 4 a second, ``max_batch`` rows each, every column a new value of about
  ``8 KiB / columns`` characters (a new 18-digit number padded with spaces, valid text for a
  string, integer or hex column: 200, the value unseen, never remembered);
* malformed JSON: 20 a second, in turn nested 3,000 deep, a 5,000-digit integer, an unknown
  charset, invalid UTF-8, not JSON (400 each).

Reported per phase: the well-behaved requests' p50 / p99 latency and their errors, the hostile
requests' answers by status, and the server's peak RSS (its ``VmHWM``, and ``VmRSS`` sampled
every 20 ms); then the ratios with hostile clients to alone. ``OUT/results.json`` keeps them.
Beside each phase's peak above the idle server (its ``VmRSS`` once ready; the sampled peak from
then, so the start-up's compilations are not counted), the README's bound for the run's flags
(``recscale.serving.server.memory_bound``, plus ``CONNECTION_BYTES`` for each connection of the
most the server had open at once, counted from its socket descriptors), and ``BREACH`` where the
peak passed it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from recscale.serving.server import (  # noqa: E402
    CONNECTION_BYTES,
    EXAMPLE_BYTES,
    body_bounds,
    memory_bound,
)


def _sockets(pid: int) -> int:
    """The process's open sockets (listening ones included)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return n


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) << 10
    return out


class _Server:
    """``python -m recscale.serve`` in a process of its own, its RSS sampled in a thread."""

    def __init__(self, model: str, port: int, flags: list[str]):
        root = Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "recscale.serve", model, "--port", str(port), *flags],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        line = self.proc.stderr.readline()
        if not line.startswith("compiled batch sizes"):
            self.proc.kill()
            raise SystemExit(f"error: the server did not start: {line.strip()}")
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # drain its log
        self.peak_rss, self._stop = 0, threading.Event()
        self.idle_rss = self.idle_sockets = None  # set by ``ready``
        self.serving_peak = self.peak_sockets = 0
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def ready(self) -> None:
        """The server answers: its RSS and sockets now are the idle ones the bound is above."""
        self.idle_sockets = _sockets(self.proc.pid)
        self.serving_peak = self.idle_rss = _status(self.proc.pid)["VmRSS"]

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            try:
                rss = _status(self.proc.pid)["VmRSS"]
                self.peak_rss = max(self.peak_rss, rss)
                if self.idle_rss is not None:
                    self.serving_peak = max(self.serving_peak, rss)
                    self.peak_sockets = max(self.peak_sockets, _sockets(self.proc.pid))
            except (OSError, KeyError):
                return

    def close(self) -> dict[str, int]:
        self._stop.set()
        self._sampler.join()
        st = _status(self.proc.pid)
        self.proc.terminate()
        self.proc.wait(timeout=30)
        return {
            "peak_rss": max(self.peak_rss, st["VmHWM"]),
            "end_rss": st["VmRSS"],
            "idle_rss": self.idle_rss,
            "peak_above_idle": max(self.serving_peak - self.idle_rss, 0),
            "peak_connections": max(self.peak_sockets - self.idle_sockets, 0),
        }


async def _wait_ready(url: str) -> None:
    from aiohttp import ClientError, ClientSession

    async with ClientSession() as s:
        for _ in range(300):
            try:
                async with s.get(url + "/healthz") as r:
                    if r.status == 200:
                        return
            except (ClientError, OSError):
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("error: the server did not answer /healthz")


async def _well_behaved(url: str, bodies: list[bytes], rate: float, duration: float) -> dict:
    """Open-loop Poisson arrivals, one raw row a request: latencies of the 200s, other statuses."""
    from aiohttp import ClientSession, TCPConnector

    rng = np.random.default_rng(0)
    times = np.cumsum(rng.exponential(1 / rate, int(rate * duration * 1.3) + 10))
    times = times[times < duration]
    lat, codes = [], collections.Counter()
    loop = asyncio.get_running_loop()
    async with ClientSession(connector=TCPConnector(limit=0)) as session:

        async def one(i: int, at: float) -> None:
            try:
                async with session.post(
                    url + "/predict",
                    data=bodies[i % len(bodies)],
                    headers={"Content-Type": "application/json"},
                ) as r:
                    await r.read()
                    codes[r.status] += 1
                    if r.status == 200:
                        lat.append(loop.time() - at)
            except Exception as e:  # noqa: BLE001
                codes[type(e).__name__] += 1

        t0 = loop.time() + 0.05
        tasks = []
        for i, t in enumerate(times):
            delay = t0 + t - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, t0 + t)))
        await asyncio.gather(*tasks)
    ms = np.asarray(lat) * 1e3
    p50, p99 = np.percentile(ms, [50, 99]) if ms.size else (float("inf"),) * 2
    return {"sent": len(times), "p50_ms": float(p50), "p99_ms": float(p99), "codes": dict(codes)}


# ------------------------------------------------------------------------------------------------
# Hostile clients (in a process of their own).


async def _hostile(host: str, port: int, columns: list[str], args: dict) -> dict:
    from aiohttp import ClientSession, TCPConnector

    duration, max_body, max_batch = args["duration"], args["max_body"], args["max_batch"]
    codes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    end = time.monotonic() + duration

    async def answer(reader) -> str:
        try:
            line = await asyncio.wait_for(reader.readline(), 30)
            return line.split()[1].decode() if line else "closed"
        except (TimeoutError, OSError, IndexError):
            return "no answer"

    async def raw(kind: str, head: bytes, body: bytes, stall: bool = False) -> None:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            codes[kind]["refused"] += 1
            return
        try:
            writer.write(head + body)
            await writer.drain()
            codes[kind][await answer(reader)] += 1
        except OSError as e:
            codes[kind][type(e).__name__] += 1
        finally:
            writer.close()

    def head(length: int | None) -> bytes:
        size = f"Content-Length: {length}" if length else "Transfer-Encoding: chunked"
        return f"POST /predict HTTP/1.1\r\nHost: x\r\n{size}\r\n\r\n".encode()

    async def slow() -> None:
        while time.monotonic() < end:
            await raw("slow", head(max_body), b" " * (max_body * 9 // 10))

    async def every(period: float, fn) -> None:
        for i in itertools.count():
            if time.monotonic() >= end:
                return
            asyncio.ensure_future(fn(i))
            await asyncio.sleep(period)

    async def oversized(i: int) -> None:
        if i % 2:
            await raw("oversized", head(2 * max_body), b"{" * 1024)
        else:
            chunk = b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16))
            await raw("oversized", head(None), chunk * (max_body // (1 << 16) + 2))

    width = max(16, EXAMPLE_BYTES // max(len(columns), 1) - 16)
    malformed = [
        (b'{"examples": [' + b"[" * 3000 + b"]" * 3000 + b"]}", "application/json"),
        (b'{"examples": [{"x": ' + b"9" * 5000 + b"}]}", "application/json"),
        (b'{"examples": []}', "application/json; charset=foo"),
        (b'{"examples": [{"x": "\xff\xfe"}]}', "application/json"),
        (b'{"examples": [{"x": ', "application/json"),
    ]
    async with ClientSession(connector=TCPConnector(limit=0, force_close=True)) as s:

        async def post(kind: str, data: bytes, ctype: str = "application/json") -> None:
            try:
                async with s.post(
                    f"http://{host}:{port}/predict", data=data, headers={"Content-Type": ctype}
                ) as r:
                    await r.read()
                    codes[kind][str(r.status)] += 1
            except Exception as e:  # noqa: BLE001
                codes[kind][type(e).__name__] += 1

        async def unique(i: int) -> None:
            rows = [  # a new 18-digit number padded with spaces: valid text for any column
                {
                    c: str(10**17 + (i * max_batch + r) * 1000 + j).rjust(width)
                    for j, c in enumerate(columns)
                }
                for r in range(max_batch)
            ]
            await post("unique", json.dumps({"examples": rows}).encode())

        async def bad(i: int) -> None:
            await post("malformed", *malformed[i % len(malformed)])

        await asyncio.gather(
            *(slow() for _ in range(args["slow"])),
            every(0.1, oversized),
            every(0.25, unique),
            every(0.05, bad),
        )
        await asyncio.sleep(2)  # the last answers
    return {k: dict(v) for k, v in codes.items()}


def _hostile_process(host, port, columns, args, q) -> None:
    q.put(asyncio.run(_hostile(host, port, columns, args)))


def bound(args, example_values: int, connections: int) -> int:
    """The README's bound on the server's memory above its idle self, for the flags ``phase``
    starts it with (the others at ``recscale.serve``'s defaults) and ``connections`` open."""
    max_body, max_inflight = body_bounds(args.max_batch)
    return (
        memory_bound(
            max_batch=args.max_batch,
            max_body=max_body,
            max_inflight=max_inflight,
            cache_bytes=int(args.cache_mb * 2**20),
            max_queue=4096,
            workers=1,
            example_values=example_values,
        )
        + connections * CONNECTION_BYTES
    )


def phase(args, hostile: bool, bodies: list[bytes], columns: list[str], port: int) -> dict:
    flags = [
        "--max-batch",
        str(args.max_batch),
        "--cache-mb",
        str(args.cache_mb),
        "--body-timeout-s",
        str(args.body_timeout_s),
    ]
    server = _Server(args.model, port, flags)
    url = f"http://127.0.0.1:{port}"
    asyncio.run(_wait_ready(url))
    server.ready()
    proc = q = None
    if hostile:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        hargs = {
            "duration": args.duration,
            "max_body": body_bounds(args.max_batch)[0],
            "max_batch": args.max_batch,
            "slow": args.slow,
        }
        proc = ctx.Process(target=_hostile_process, args=("127.0.0.1", port, columns, hargs, q))
        proc.start()
        time.sleep(1.0)  # the hostile clients under way before the measured load starts
    res = asyncio.run(_well_behaved(url, bodies, args.rate, args.duration))
    if proc is not None:
        res["hostile"] = q.get(timeout=args.duration + 120)
        proc.join()
    res.update(server.close())
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an artifact that takes raw rows")
    ap.add_argument("--rows", default="", help="a data file of the run (default: its eval file)")
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--cache-mb", type=float, default=16.0)
    ap.add_argument("--body-timeout-s", type=float, default=2.0)
    ap.add_argument("--slow", type=int, default=8, help="slow-body connections")
    ap.add_argument("--repeats", type=int, default=2, help="alone/hostile pairs (medians)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", default="runs/bench_serving_abuse")
    args = ap.parse_args(argv)
    from recscale.serving.runtime import Model, read_rows

    man = json.loads((Path(args.model) / "manifest.json").read_text())
    if not man.get("vocab"):
        raise SystemExit(f"error: --model {args.model}: takes no raw rows (export a tabular run)")
    model = Model.load(args.model)
    rows_file = args.rows or man["source"]["eval_path"]
    fmt, columns = man["vocab"]["format"], model.rows.columns
    example_values = len(model.dense_names) + len(model.features) * model.max_hotness
    rows = list(itertools.islice(read_rows(rows_file, fmt, columns), 512))
    del model
    bodies = [json.dumps({"examples": [r]}).encode() for r in rows]
    port = args.port
    if not port:
        import portpicker

        port = portpicker.pick_unused_port()
    out = {"args": vars(args)}
    out["phases"] = []
    for rep, (name, hostile) in itertools.product(
        range(args.repeats), (("alone", False), ("hostile", True))
    ):
        r = phase(args, hostile, bodies, columns, port)
        r["bound"] = bound(args, example_values, r["peak_connections"])
        out["phases"].append({"phase": name, "repeat": rep, **r})
        print(
            f"{name:8s}: p50 {r['p50_ms']:6.2f} ms, p99 {r['p99_ms']:6.2f} ms "
            f"({r['sent']} sent: {r['codes']}), server peak RSS {r['peak_rss'] / 2**20:.0f} MiB"
            f" (at the end {r['end_rss'] / 2**20:.0f} MiB)",
            flush=True,
        )
        print(
            f"  peak above the idle server {r['peak_above_idle'] / 2**20:.1f} MiB, the README's "
            f"bound {r['bound'] / 2**20:.1f} MiB (with {r['peak_connections']} connections at "
            f"most): {'within' if r['peak_above_idle'] <= r['bound'] else 'BREACH'}",
            flush=True,
        )
        if hostile:
            for kind, c in r["hostile"].items():
                print(f"  hostile {kind:10s}: {c}")
    breaches = [r for r in out["phases"] if r["peak_above_idle"] > r["bound"]]
    out["bound_breaches"] = len(breaches)
    flat = bound(args, example_values, 0)
    print(
        f"the README's bound for these flags: {flat / 2**20:.1f} MiB above the idle server, "
        f"+ {CONNECTION_BYTES / 2**20:.1f} MiB a connection; "
        + (f"BREACHED in {len(breaches)} phases" if breaches else "held in every phase")
    )
    for key in ("p50_ms", "p99_ms", "peak_rss"):  # medians over the repeats
        for name in ("alone", "hostile"):
            out[f"{name}_{key}"] = float(
                np.median([r[key] for r in out["phases"] if r["phase"] == name])
            )
        out[f"{key}_ratio"] = out[f"hostile_{key}"] / out[f"alone_{key}"]
    print(
        f"with hostile clients / alone (medians of {args.repeats}): p50 "
        f"{out['alone_p50_ms']:.2f} -> {out['hostile_p50_ms']:.2f} ms "
        f"({out['p50_ms_ratio']:.2f}x), p99 {out['alone_p99_ms']:.2f} -> "
        f"{out['hostile_p99_ms']:.2f} ms ({out['p99_ms_ratio']:.2f}x), peak RSS "
        f"{out['alone_peak_rss'] / 2**20:.0f} -> {out['hostile_peak_rss'] / 2**20:.0f} MiB "
        f"({out['peak_rss_ratio']:.2f}x)"
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
