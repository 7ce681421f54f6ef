"""The compressed exchange's codec (issue 19): encode and decode time per step on this backend,
and the exchange time each scheme would save on the hardware profiles' links.

``python benchmarks/compress_codec.py [--batch 65536 --devices 8 --tables 26 --dim 128]
[--reps 20] [--quick] [--out runs/bench_codec/results.json]``

What one device does per step in the engine's all-to-all (``recscale.embeddings.compress``):
it sends each of its ``S = tables / devices`` slots' pooled outputs, one block of
``m = batch / devices x dim`` float32 values per destination device (``S x devices`` blocks),
and receives as many; backward, the gradients go the other way. So per step a device encodes
``2 S n`` blocks and decodes ``2 S n`` (forward and backward). The codec times below are
measured on **this** backend (jitted, warmed up, median of ``--reps``); the link times come from
the hardware profiles' bandwidths (``tpu_gpu_configs.profiles``: ``interconnect_bandwidth``
within a host, ``cross_host_bandwidth`` across hosts), as the planner's cost model takes them:
the bytes a device sends / the bandwidth. The saving is float32's link time minus the scheme's
link time plus its codec time; it is only meaningful where the codec was timed on the profile's
kind of chip (run it on the GPU for the GPU profiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from recscale.embeddings import compress  # noqa: E402
from tpu_gpu_configs.profiles import get_profile  # noqa: E402

SCHEMES = {
    "float32": compress.Compression(),
    "eb8": compress.Compression(kind="error_bounded", eps=0.002, eps_grad=0.002),
    "eb6": compress.Compression(kind="error_bounded", eps=0.0081, eps_grad=0.0081),
    "eb4": compress.Compression(kind="error_bounded", eps=0.036, eps_grad=0.036),
    "fp8_e4m3": compress.Compression(kind="fp8_e4m3"),
    "fp8_e5m2": compress.Compression(kind="fp8_e5m2"),
}
PROFILES = ("gpu-h100", "gpu-h200", "tpu-v5p", "tpu-v6e")


def _median_ms(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--zeros", type=float, default=0.0, help="fraction of exact zeros (a "
                    "row-wise shard's partial outputs are mostly zeros)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="CPU-sized: batch 8192, dim 32")
    ap.add_argument("--out", default="runs/bench_codec/results.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.dim, args.reps = 8192, 32, 5
    n = args.devices
    slots = -(-args.tables // n)
    m = args.batch // n * args.dim
    blocks = slots * n
    rng = np.random.default_rng(0)
    x = rng.standard_normal((blocks, m)).astype(np.float32)
    x *= rng.lognormal(0, 1, (blocks, 1)).astype(np.float32)  # blocks of different scales
    x[rng.random(x.shape) < args.zeros] = 0.0
    x = jax.device_put(x)
    zero = jax.device_put(np.float32(0))
    f32_mib = blocks * m * 4 / 2**20
    res: dict = {}
    for name, comp in SCHEMES.items():
        if name == "float32":  # a copy: the memory-bound floor of touching the payload
            enc = jax.jit(lambda v, z: v + z)
            dec = enc
            payload = enc(x, zero)
            enc_ms = _median_ms(enc, x, zero, reps=args.reps)
            dec_ms = enc_ms
        else:
            codec = compress._codec(comp.eps, comp.kind)
            enc = jax.jit(codec[0])
            dec = jax.jit(lambda p, c=codec: c[1](p, m))
            payload = enc(x)
            enc_ms = _median_ms(enc, x, reps=args.reps)
            dec_ms = _median_ms(dec, payload, reps=args.reps)
            err = float(jnp.max(jnp.abs(dec(payload) - x)))
            res.setdefault(name, {})["max_abs_error"] = err
        sent = blocks * comp.payload_bytes(m)
        r = res.setdefault(name, {})
        r.update(encode_ms=enc_ms, decode_ms=dec_ms, bytes_per_direction=sent,
                 ratio=blocks * 4.0 * m / sent,
                 gbps=blocks * m * 4 / 1e9 / ((enc_ms + dec_ms) / 2e3))  # fmt: skip
        # forward and backward: two exchanges, each encoded and decoded once
        codec_ms = 0.0 if name == "float32" else 2 * (enc_ms + dec_ms)
        r["codec_ms_per_step"] = codec_ms
        for prof in PROFILES:
            p = get_profile(prof)
            for link, bw in (("intra", p.interconnect_bandwidth), ("cross", p.cross_host_bandwidth)):
                r[f"{prof}/{link}_link_ms"] = 2 * sent / bw * 1e3
    base = res["float32"]
    for r in res.values():
        for prof in PROFILES:
            for link in ("intra", "cross"):
                k = f"{prof}/{link}_link_ms"
                r[f"{prof}/{link}_saving_ms"] = base[k] - (r[k] + r["codec_ms_per_step"])
                r[f"{prof}/{link}_speedup"] = base[k] / (r[k] + r["codec_ms_per_step"])
    dev = jax.devices()[0]
    console = Console(width=200)
    console.print(
        f"{dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}: batch {args.batch}, "
        f"{n} devices, {args.tables} tables x dim {args.dim}; per device and step {blocks} "
        f"blocks of {m:,} values each way ({f32_mib:.1f} MiB float32 per direction)"
    )
    t = Table(title="codec on this backend")
    for c in ("scheme", "ratio", "encode ms", "decode ms", "GB/s (float32 in)", "codec ms/step",
              "max |error|"):  # fmt: skip
        t.add_column(c, justify="right")
    for name, r in res.items():
        t.add_row(name, f"{r['ratio']:.2f}", f"{r['encode_ms']:.3f}", f"{r['decode_ms']:.3f}",
                  f"{r['gbps']:.1f}", f"{r['codec_ms_per_step']:.3f}",
                  f"{r.get('max_abs_error', 0):.3g}")  # fmt: skip
    console.print(t)
    t = Table(title="exchange per step and device, forward + backward: link ms (+ codec) and "
                    "speed-up against float32")  # fmt: skip
    t.add_column("scheme")
    for prof in PROFILES:
        for link in ("intra", "cross"):
            t.add_column(f"{prof} {link}-host", justify="right")
    for name, r in res.items():
        t.add_row(name, *(
            f"{r[f'{p}/{k}_link_ms'] + r['codec_ms_per_step']:.3f} ({r[f'{p}/{k}_speedup']:.2f}x)"
            for p in PROFILES for k in ("intra", "cross")
        ))  # fmt: skip
    console.print(t)
    out = {"device": dev.device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
           "args": vars(args), "blocks": blocks, "m": m, "results": res}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
