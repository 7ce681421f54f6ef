"""The compressed exchange's codec (issue 19): encode and decode time per step on this backend,
and the exchange time each scheme would save on the hardware profiles' links.

``python benchmarks/compress_codec.py [--batch 65536 --devices 8 --tables 26 --dim 128]
[--reps 20] [--zeros 0.0] [--out runs/bench_codec/results.json]``; on a CPU add ``--quick``
(batch 16384, dim 64, 10 repetitions: 17 MB per direction, seconds on a 2-core VM).

What one device does per step in the engine's all-to-all (``recscale.embeddings.compress``,
``exchange``): it holds ``S = ceil(tables / devices)`` slots (every device has as many as the
fullest one: the all-to-all's fixed shape) and sends each slot's pooled outputs to each of the
``n = devices`` destinations, one block of ``m = batch / n x dim`` float32 values per (slot,
destination): ``S x n`` blocks per direction, ``S x n x m`` values (the planner's
``_exchange_bytes`` counts the same, the block a device keeps for itself included). Forward it
encodes its ``S x n`` blocks and decodes the ``S x n`` it receives; backward the gradients go
the other way, so per step a device runs 2 encodes and 2 decodes of a ``[n, S, m]`` payload.
That payload (values normal with a log-normal scale per block, ``--zeros`` of them exact zeros,
as a row-wise shard's partial outputs are) is what is timed here: each scheme's encode and
decode jitted separately, compiled and warmed up, then the median of ``--reps`` calls, each
waited on with ``jax.block_until_ready``. ``float32`` is a plain copy of the payload (``x + z``
with ``z`` a traced zero, which XLA cannot fold away): the memory-bound floor of any pass that
reads the payload and writes a result, to read the codecs' GB/s against. The uncompressed
exchange itself runs no such pass (the engine sends the buffer as it is), so its codec time is
0.

The codec times are measured on **this** backend; the link times come from the hardware
profiles (``tpu_gpu_configs.profiles``: ``interconnect_bandwidth`` within a host,
``cross_host_bandwidth`` across hosts), as the planner's cost model takes them: the bytes one
device sends (``Compression.payload_bytes`` per block) / the bandwidth, forward plus backward.
A scheme's exchange costs its link time plus its codec time (the codec and the link are in
series: a block is encoded before it is sent and decoded after it arrives); the saving is
float32's link time minus that. The combination means something only where the codec was timed
on the profile's kind of chip: on a CPU it is indicative at most; run it on the GPU for the GPU
profiles. The "pays off below" column is profile-free: the link bandwidth under which the
scheme's bytes saved outweigh its codec time on this backend. On the TPU profiles the float32
baseline is an upper bound: XLA:TPU sends the forward exchange in bfloat16 where every consumer
multiplies at default precision (``planner.CostModel.for_profile``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

from recscale.embeddings import compress  # noqa: E402
from tpu_gpu_configs.profiles import get_profile  # noqa: E402

# Dimensions: S slots per device, n devices (= destinations), m float32 values per block.

SCHEMES = {
    "float32": compress.Compression(),
    "eb8": compress.Compression(kind="error_bounded", eps=0.002, eps_grad=0.002),
    "eb6": compress.Compression(kind="error_bounded", eps=0.0081, eps_grad=0.0081),
    "eb4": compress.Compression(kind="error_bounded", eps=0.036, eps_grad=0.036),
    "fp8_e4m3": compress.Compression(kind="fp8_e4m3"),
    "fp8_e5m2": compress.Compression(kind="fp8_e5m2"),
}
PROFILES = ("gpu-h100", "gpu-h200", "tpu-v5p", "tpu-v6e")
LINKS = {"intra": "interconnect_bandwidth", "cross": "cross_host_bandwidth"}
FULL = {"batch": 65536, "dim": 128, "reps": 20}
QUICK = {"batch": 16384, "dim": 64, "reps": 10}
NOTE = (
    "codec times measured on this backend ({backend}: {kind}); link times from the "
    "profiles' bandwidths: the sum is meaningful only where this backend is the profile's "
    "kind of chip"
)


def _times_ms(fn, *args, reps: int) -> list[float]:
    """Milliseconds of ``reps`` calls of ``fn(*args)`` after compiling and two warm-up calls."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(1e3 * (time.perf_counter() - t))
    return times


def _codec(name: str, comp: compress.Compression, m: int):
    """Jitted ``(encode(x), decode(payload))`` of one scheme, each taking ``zero`` as well."""
    if name == "float32":  # a real copy each way: z is traced, so XLA cannot drop the add
        copy = jax.jit(lambda v, z: v + z)
        return copy, copy
    enc, dec = compress._codec(comp.eps, comp.kind)
    return jax.jit(lambda v, z: enc(v)), jax.jit(lambda p, z: dec(p, m))


def _payload(n: int, s: int, m: int, zeros: float) -> np.ndarray:
    """``[n, S, m]`` float32: normal values with a log-normal scale per block (tables' pooled
    outputs differ in magnitude), a fraction ``zeros`` of them exactly zero."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, s, m), dtype=np.float32)
    x *= rng.lognormal(0.0, 1.0, (n, s, 1)).astype(np.float32)
    if zeros > 0:
        x[rng.random(x.shape, dtype=np.float32) < zeros] = 0.0
    return x


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--batch",
        type=int,
        help=f"global batch B (default {FULL['batch']}; --quick {QUICK['batch']})",
    )
    ap.add_argument("--devices", type=int, default=8, help="devices n (= destinations)")
    ap.add_argument("--tables", type=int, default=26, help="tables T (S = ceil(T / n) slots)")
    ap.add_argument(
        "--dim", type=int, help=f"buffer width w (default {FULL['dim']}; --quick {QUICK['dim']})"
    )
    ap.add_argument(
        "--reps",
        type=int,
        help=f"timed calls per codec, after warm-up (default "
        f"{FULL['reps']}; --quick {QUICK['reps']})",
    )
    ap.add_argument(
        "--zeros",
        type=float,
        default=0.0,
        help="fraction of exact zeros (a row-wise shard's partial outputs are mostly zeros)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="CPU-sized defaults: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()),
    )
    ap.add_argument("--out", default="runs/bench_codec/results.json")
    args = ap.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():  # explicit flags win over --quick
        if getattr(args, k) is None:
            setattr(args, k, v)
    if min(args.batch, args.devices, args.tables, args.dim, args.reps) < 1:
        ap.error("--batch, --devices, --tables, --dim and --reps must be positive")
    if args.batch % args.devices:
        ap.error(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
    if not 0 <= args.zeros < 1:
        ap.error(f"--zeros {args.zeros} must be in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _args(argv)
    n = args.devices
    s = math.ceil(args.tables / n)
    m = args.batch // n * args.dim
    blocks = s * n
    f32_bytes = 4.0 * blocks * m  # one direction, one device
    dev = jax.devices()[0]
    backend = jax.default_backend()
    x = jax.device_put(_payload(n, s, m, args.zeros))
    zero = jax.device_put(np.float32(0))
    # per block: its range (the error bound's unit) and its largest magnitude
    rng_b = jnp.max(x, axis=-1) - jnp.min(x, axis=-1)
    amax_b = jnp.max(jnp.abs(x), axis=-1)

    res: dict[str, dict] = {}
    for name, comp in SCHEMES.items():
        enc, dec = _codec(name, comp, m)
        payload = enc(x, zero)
        enc_t = _times_ms(enc, x, zero, reps=args.reps)
        dec_t = _times_ms(dec, payload, zero, reps=args.reps)
        err = jnp.max(jnp.abs(dec(payload, zero) - x), axis=-1)
        fwd = blocks * comp.payload_bytes(m)
        bwd = blocks * comp.payload_bytes(m, grad=True)
        enc_ms, dec_ms = statistics.median(enc_t), statistics.median(dec_t)
        # forward and backward: two exchanges, each encoded once and decoded once
        codec_ms = 0.0 if name == "float32" else 2 * (enc_ms + dec_ms)
        saved = 2 * f32_bytes - (fwd + bwd)
        res[name] = {
            "eps": comp.eps or None,
            "code_bits": compress.code_bits(comp.eps) if comp.eps else None,
            "payload_shape": list(payload.shape),
            "payload_dtype": str(payload.dtype),
            "bytes_forward": fwd,
            "bytes_backward": bwd,
            "bits_per_value": 8 * fwd / (blocks * m),
            "ratio": f32_bytes / fwd,
            "encode_ms": enc_ms,
            "decode_ms": dec_ms,
            "encode_ms_min": min(enc_t),
            "decode_ms_min": min(dec_t),
            "encode_gbps": f32_bytes / 1e9 / (enc_ms / 1e3),
            "decode_gbps": f32_bytes / 1e9 / (dec_ms / 1e3),
            "codec_ms_per_step": codec_ms,
            "max_abs_error": float(jnp.max(err)),
            "max_error_over_range": float(jnp.max(jnp.where(rng_b > 0, err / rng_b, 0.0))),
            "max_error_over_amax": float(jnp.max(jnp.where(amax_b > 0, err / amax_b, 0.0))),
            # below this bandwidth the bytes saved take longer than the codec
            "pays_off_below_gbps": saved / 1e9 / (codec_ms / 1e3) if codec_ms else None,
            "links": {},
        }
        del payload
    for prof in PROFILES:
        p = get_profile(prof)
        for link, field in LINKS.items():
            bw = getattr(p, field)
            base_ms = 2 * f32_bytes / bw * 1e3
            for r in res.values():
                link_ms = (r["bytes_forward"] + r["bytes_backward"]) / bw * 1e3
                total = link_ms + r["codec_ms_per_step"]
                r["links"][f"{prof}/{link}"] = {
                    "bandwidth": bw,
                    "float32_ms": base_ms,
                    "link_ms": link_ms,
                    "total_ms": total,
                    "saving_ms": base_ms - total,
                    "speedup": base_ms / total,
                }

    note = NOTE.format(backend=backend, kind=dev.device_kind)
    console = Console(width=160)
    console.print(
        escape(
            f"{dev.device_kind} ({backend}, {jax.device_count()} device(s)), jax "
            f"{jax.__version__}; model: batch B={args.batch}, n={n} devices, T={args.tables} tables, "
            f"width w={args.dim}, zeros {args.zeros:g}\n"
            f"per device and step: S=ceil({args.tables}/{n})={s} slots x {n} destinations = "
            f"{blocks} blocks of m=({args.batch}/{n})x{args.dim}={m:,} values, payload "
            f"[n, S, m]=[{n}, {s}, {m}] = {blocks * m:,} values = {f32_bytes / 1e6:.1f} MB float32 "
            f"per direction; 2 encodes + 2 decodes per step (forward and backward)"
        )
    )
    t = Table(title=f"codec on this backend ({dev.device_kind}), median of {args.reps}")
    cols = (
        "scheme",
        "bits/value",
        "ratio",
        "encode ms",
        "decode ms",
        "enc GB/s",
        "dec GB/s",
        "codec ms/step",
        "max err/range",
        "max err/|max|",
        "pays off below GB/s",
    )
    for c in cols:
        t.add_column(c, justify="right")
    for name, r in res.items():
        bound = f" (ε {r['eps']:g})" if r["eps"] else ""
        t.add_row(
            name + bound,
            f"{r['bits_per_value']:.2f}",
            f"{r['ratio']:.2f}",
            f"{r['encode_ms']:.3f}",
            f"{r['decode_ms']:.3f}",
            f"{r['encode_gbps']:.1f}",
            f"{r['decode_gbps']:.1f}",
            f"{r['codec_ms_per_step']:.3f}",
            f"{r['max_error_over_range']:.5g}",
            f"{r['max_error_over_amax']:.3g}",
            "-" if r["pays_off_below_gbps"] is None else f"{r['pays_off_below_gbps']:.1f}",
        )
    console.print(t)
    t = Table(
        title="exchange per step and device, forward + backward: link ms (profile) + "
        "codec ms (this backend)"
    )
    for c in (
        "profile",
        "link",
        "GB/s",
        "float32 ms",
        "scheme",
        "link ms",
        "codec ms",
        "total ms",
        "saving ms",
        "speed-up",
    ):
        t.add_column(c, justify="right")
    compressed = [(k, r) for k, r in res.items() if k != "float32"]
    for prof in PROFILES:
        for i, link in enumerate(LINKS):  # the group's link and float32 time on its first row
            key = f"{prof}/{link}"
            for j, (name, r) in enumerate(compressed):
                e = r["links"][key]
                t.add_row(
                    prof if i == j == 0 else "",
                    f"{link}-host" if j == 0 else "",
                    f"{e['bandwidth'] / 1e9:.0f}" if j == 0 else "",
                    f"{e['float32_ms']:.3f}" if j == 0 else "",
                    name,
                    f"{e['link_ms']:.3f}",
                    f"{r['codec_ms_per_step']:.3f}",
                    f"{e['total_ms']:.3f}",
                    f"{e['saving_ms']:+.3f}",
                    f"{e['speedup']:.2f}x",
                    end_section=j == len(compressed) - 1,
                )
    console.print(t)
    console.print(f"note: {note}")

    out = {
        "device_kind": dev.device_kind,
        "backend": backend,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "python": platform.python_version(),
        "args": vars(args),
        "shapes": {
            "slots_per_device": s,
            "destinations": n,
            "blocks_per_direction": blocks,
            "values_per_block": m,
            "payload_shape": [n, s, m],
            "float32_bytes_per_direction": f32_bytes,
            "encodes_per_step": 2,
            "decodes_per_step": 2,
        },
        "note": note,
        "results": res,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    console.print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
