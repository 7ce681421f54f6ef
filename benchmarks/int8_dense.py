"""Does an int8 dense layer pay on this backend? (issue 20)

``python benchmarks/int8_dense.py [--batches 1 64 1024 4096] [--shapes 512x256 ...]``

Times one dense layer ``x [B, K] @ w [K, N]`` per batch size and shape, jitted, on the default
backend: float32, bfloat16, and int8 (``x`` quantised per row and ``w`` per column, symmetric,
an int8 x int8 -> int32 ``dot`` with ``preferred_element_type``, rescaled to float32; the
quantisation of ``x`` is inside the timed function, as serving would do it). Prints the median
time of each and the ratios to float32 measured in the same run. The default shapes are the
top MLP of ``dlrm/synthetic`` and of DLRM at production width.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402


def f32(x, w):
    return x @ w


def bf16(x, w):
    return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)


def int8(x, wq, wscale):
    xs = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127.0
    xq = jnp.round(x / jnp.where(xs > 0, xs, 1.0)).astype(jnp.int8)
    acc = jax.lax.dot(xq, wq, preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * xs * wscale


def _time(fn, *args, reps: int = 30) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 64, 1024, 4096])
    ap.add_argument("--shapes", nargs="*", default=["479x128", "128x64", "1024x1024", "512x256"])
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    table = Table(
        title=f"one dense layer on {jax.devices()[0].platform} "
        f"({jax.devices()[0].device_kind}), median ms"
    )
    for col in (
        "B x K x N",
        "float32",
        "bfloat16",
        "int8",
        "bf16 / f32",
        "int8 / f32",
        "int8 max rel. error",
    ):
        table.add_column(col, justify="right")
    for shape in args.shapes:
        k, n = map(int, shape.split("x"))
        w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k))
        wscale = jnp.max(jnp.abs(w), axis=0, keepdims=True) / 127.0
        wq = jnp.round(w / wscale).astype(jnp.int8)
        wb = w.astype(jnp.bfloat16)
        for b in args.batches:
            x = jnp.asarray(rng.standard_normal((b, k)).astype(np.float32))
            t32 = _time(jax.jit(f32), x, w)
            tb = _time(jax.jit(bf16), x, wb)
            t8 = _time(jax.jit(int8), x, wq, wscale)
            ref = np.asarray(f32(x, w))
            err = np.abs(np.asarray(int8(x, wq, wscale)) - ref).max() / np.abs(ref).max()
            table.add_row(
                f"{b} x {k} x {n}",
                f"{t32 * 1e3:.4f}",
                f"{tb * 1e3:.4f}",
                f"{t8 * 1e3:.4f}",
                f"{tb / t32:.2f}",
                f"{t8 / t32:.2f}",
                f"{err:.4f}",
            )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
