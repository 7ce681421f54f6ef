"""The HSTU attention kernel's tiling on a GPU: block size, warps and pipeline stages per
kernel (forward, backward dk/dv, backward dq), each configuration timed against the XLA path
and checked against the float32 reference at production shapes; the measured best go into
``recscale.kernels.hstu_attention.pallas_gpu.TUNED``.

    python benchmarks/hstu_tiling.py [--shapes bf16_d128 f32_d256] [--deadline-s 240]

Compiles run in a thread pool (XLA and Triton compile off the GIL); timings one at a time.
Configurations that do not compile (shared memory) are reported, not fatal. GPU only: on CPU
the kernel runs in interpret mode, which times the interpreter.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels import best_time, device_roofline
from recscale.kernels.hstu_attention import api, pallas_gpu

SHAPES = {  # name: (N, sequences, heads, head width, dtype)
    "bf16_d128": (4096, 8, 2, 128, jnp.bfloat16),
    "f32_d128": (4096, 8, 2, 128, jnp.float32),
    "f32_d256": (8192, 4, 1, 256, jnp.float32),
    "bf16_d256": (8192, 4, 1, 256, jnp.bfloat16),
}
BLOCKS = {
    "bf16_d128": (32, 64, 128),
    "f32_d128": (16, 32, 64),
    "f32_d256": (16, 32),
    "bf16_d256": (16, 32, 64),
}
STAGES = {"bf16_d128": (1, 2, 3)}


def inputs(n_max, seqs, heads, d, dtype):
    key = jax.random.key(0)
    lengths = jax.random.randint(key, (seqs,), n_max // 2, n_max + 1)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths)]).astype(jnp.int32)
    t = int(offsets[-1])
    kq, kk, kv, kb, kg = jax.random.split(key, 5)
    q = (jax.random.normal(kq, (t, heads, d)) * d**-0.5).astype(dtype)
    k = (jax.random.normal(kk, (t, heads, d)) * d**-0.5).astype(dtype)
    v = jax.random.normal(kv, (t, heads, d)).astype(dtype)
    g = jax.random.normal(kg, (t, heads, d)).astype(dtype)
    rab = jax.random.normal(kb, (1, 32), jnp.float32) * 0.1
    pairs = int(jnp.sum(lengths * (lengths + 1) // 2))
    return (q, k, v, rab, g), offsets, pairs * heads * 2 * (d + d)


def functions(impl, offsets, n_max, with_bias=True):
    def attn(q, k, v, r):
        return api.hstu_attention(
            q, k, v, offsets, None, r if with_bias else None, max_seq_len=n_max, impl=impl
        )

    def fwd_bwd(q, k, v, r, g):
        out, vjp = jax.vjp(attn, q, k, v, r)
        return out, *vjp(g)

    return jax.jit(attn), jax.jit(fwd_bwd)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def configs(name):
    yield from itertools.product(BLOCKS[name], (4, 8), STAGES.get(name, (1, 2)))


def run_shape(name: str, args, roof: dict, pool, t_end: float) -> None:
    """Every tiling of one shape, timed and checked, one table row each."""
    n_max, seqs, heads, d, dtype = SHAPES[name]
    n_max = args.n_max or n_max
    xs, offsets, flops = inputs(n_max, seqs, heads, d, dtype)
    key = (jnp.dtype(dtype).name, pallas_gpu.pad_dim(d))
    up = [x.astype(jnp.float32) for x in xs]
    ref_fwd, ref_bwd = functions("xla", offsets, n_max)
    with jax.default_matmul_precision("highest"):
        want = ref_bwd(*up)
        t_xla = best_time(lambda f=ref_fwd: f(*xs[:4]), args.reps)
        t_xla_b = best_time(lambda f=ref_bwd: f(*xs), args.reps)
    print(
        f"| {name} | XLA | | | {1e3 * t_xla:.2f} | {1e3 * t_xla_b:.2f} | | | "
        f"{100 * 3 * flops / t_xla_b / roof['flops']:.1f}% | |"
    )
    # Trace each configuration with its tiling in place, then compile them all at once.
    jobs = []
    for block, warps, stages in configs(name):
        pallas_gpu.TUNED[key] = (block, dict.fromkeys(pallas_gpu.KERNELS, (warps, stages)))
        fwd, bwd = functions("pallas_gpu", offsets, n_max)
        try:
            lowered = (fwd.lower(*xs[:4]), bwd.lower(*xs))
        except Exception as e:  # noqa: BLE001 - reported in the table
            jobs.append(((block, warps, stages), e))
            continue
        jobs.append(((block, warps, stages), pool.map(lambda lo: lo.compile(), lowered)))
    pallas_gpu.TUNED.pop(key)
    fwd_nb, _ = functions("pallas_gpu", offsets, n_max, with_bias=False)
    ref_nb, _ = functions("xla", offsets, n_max, with_bias=False)
    for (block, warps, stages), compiled in jobs:
        if time.monotonic() > t_end:
            print(f"| {name} | {block} | {warps} | {stages} | past the deadline |")
            continue
        try:
            if isinstance(compiled, Exception):
                raise compiled
            fwd, bwd = list(compiled)
            got = bwd(*xs)
            t_f = best_time(lambda f=fwd: f(*xs[:4]), args.reps)
            t_b = best_time(lambda f=bwd: f(*xs), args.reps)
        except Exception as e:  # noqa: BLE001 - a tiling that does not fit is a result
            print(
                f"| {name} | {block} | {warps} | {stages} | fails: {str(e).splitlines()[0][:120]} |"
            )
            continue
        errs = [rel_err(a, b) for a, b in zip(got, want, strict=True)]
        print(
            f"| {name} | {block} | {warps} | {stages} | {1e3 * t_f:.2f} | {1e3 * t_b:.2f} | "
            f"{t_xla / t_f:.2f} | {t_xla_b / t_b:.2f} | "
            f"{100 * 3 * flops / t_b / roof['flops']:.1f}% | "
            f"{errs[0]:.1e} / {max(errs[1:]):.1e} |",
            flush=True,
        )
    t_nb = best_time(lambda: fwd_nb(*xs[:4]), args.reps)
    t_xnb = best_time(lambda: ref_nb(*xs[:4]), args.reps)
    print(f"| {name} | untuned, no bias | | | {1e3 * t_nb:.2f} | | {t_xnb / t_nb:.2f} | | | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=240.0)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--n-max", type=int, default=0, help="override N (a CPU smoke run)")
    args = ap.parse_args()
    t_end = time.monotonic() + args.deadline_s
    roof = device_roofline()
    print(f"device: {jax.devices()[0].device_kind}; roofline {roof['flops'] / 1e12:.0f} TFLOP/s")
    print(
        "| shape | block | warps | stages | fwd ms | fwd+bwd ms | XLA / kernel fwd | "
        "XLA / kernel fwd+bwd | fwd+bwd FLOP/s | max rel err out / grads |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    pool = concurrent.futures.ThreadPoolExecutor(args.workers)
    for name in args.shapes:
        if time.monotonic() > t_end:
            print(f"{name}: past the deadline, not run")
            continue
        run_shape(name, args, roof, pool, t_end)


if __name__ == "__main__":
    main()
