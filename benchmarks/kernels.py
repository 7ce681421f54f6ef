"""Each hot-op kernel against the XLA reference at production shapes, forward and forward +
backward, on this machine's default device.

``python benchmarks/kernels.py [--ops embedding_bag ...] [--batches 8192 65536] [--reps 5]
[--kernel IMPL]``

For every case it prints the reference's time (``fwd+bwd``: ``value_and_grad`` of a sum, so
the forward is not dead code), the kernel's time, their ratio (reference / kernel: above 1 the
kernel is faster), and what each reaches of the device's roofline: bytes moved per second over
memory bandwidth for the memory-bound ops (embedding bag, its update, the int8 lookup, DLRM's
dot interaction), FLOP/s over peak for Wukong's FMB core. On GPU and TPU the kernel is the
Pallas one (``--kernel`` names another); on CPU it is the C++ FFI kernel where the op has one
(the embedding bag and its update) and the Pallas kernels are skipped (they run there only in
interpret mode, which times the interpreter). Rooflines: the ``tpu_gpu_configs`` profile of the
accelerator, or on CPU this machine's float32 matmul and memory stream measured in the same run.

The XLA reference's matmuls run at ``--ref-precision`` (default ``highest``): the kernels compute
float32 inputs to float32 accuracy (IEEE or 3xTF32 dots), while XLA's default float32 matmul on
a GPU is TF32 (10 mantissa bits); ``--ref-precision default`` times that cheaper reference.

Shapes: Criteo-Terabyte-like embedding work (26 tables, dim 128, 1 or 20 ids per bag; the
bag kernels see one buffer of 26 x 100,000 rows and 26·B bags, as the engine calls them),
DLRM interaction over 27 vectors of dim 128, Wukong Table 5-like FMB layers (E = 32 or 56
embeddings of dim 128 (or 192), rank K = 24 or 32), and HSTU's jagged attention at sequence
4,096 and 8,192 (``hstu_cases``; FLOP/s over peak, causal pairs only).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from recscale.kernels import common
from recscale.kernels.dot_interaction import api as dot_api
from recscale.kernels.embedding_bag import api as bag_api
from recscale.kernels.embedding_bag import cpu_ffi as bag_ffi
from recscale.kernels.embedding_update import api as update_api
from recscale.kernels.embedding_update import cpu_ffi as update_ffi
from recscale.kernels.fm_interaction import api as fm_api
from recscale.kernels.hstu_attention import api as hstu_api
from recscale.kernels.quantized_embedding_bag import api as q_api
from tpu_gpu_configs.profiles import get_profile

OPS = (
    "embedding_bag",
    "embedding_update",
    "quantized_embedding_bag",
    "dot_interaction",
    "fm_interaction",
    "hstu_attention",
)
TABLES, ROWS, DIM = 26, 100_000, 128


def device_roofline() -> dict:
    """``{"name", "memory_bytes_per_s", "flops"}`` of the default device."""
    dev = jax.devices()[0]
    kind = dev.device_kind.lower()
    if dev.platform == "gpu":
        name = "gpu-h200" if "h200" in kind else "gpu-a100" if "a100" in kind else "gpu-h100"
    elif dev.platform == "tpu":
        name = next(
            (f"tpu-{v}" for v in ("v6e", "v5p", "v5e", "v4") if v in kind.replace(" ", "")),
            "tpu-v5p",
        )
    else:
        return {"name": "this CPU (measured)", **measured_cpu_roofline()}
    p = get_profile(name)
    return {"name": name, "memory_bytes_per_s": p.memory_bandwidth, "flops": p.flops}


def measured_cpu_roofline() -> dict:
    """float32 matmul FLOP/s and memory stream (read + write, donated) of this CPU, best of 5."""
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    t = best_time(lambda: mm(a), 5)
    add = jax.jit(lambda v: v + 1.0, donate_argnums=0)
    x = [jnp.ones((64 << 20,), jnp.float32)]

    def step():
        x[0] = add(x[0])
        return x[0]

    tb = best_time(step, 5)
    return {"flops": 2 * n**3 / t, "memory_bytes_per_s": 2 * x[0].nbytes / tb}


def best_time(fn, reps: int) -> float:
    """Best wall time of ``fn()`` (outputs blocked on) over ``reps`` runs after one warm-up."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def kernel_impl(op: str, named: str | None = None) -> str | None:
    """The implementation benchmarked against ``xla`` here (None: none runs natively): the
    named one, else the backend's Pallas kernel (verified on hardware or not: that is what
    this measures), else on CPU the C++ kernel where the op has one."""
    if named:
        return named
    backend = jax.default_backend()
    if backend in ("gpu", "tpu"):
        return f"pallas_{backend}"
    cpu_ffi = {"embedding_bag": bag_ffi, "embedding_update": update_ffi}.get(op)
    return "cpu_ffi" if cpu_ffi is not None and cpu_ffi.available() else None


HSTU_SHAPES = ((4096, 8, 2, 128, jnp.bfloat16), (8192, 4, 1, 256, jnp.float32))
"""``(N, sequences, heads, head width, dtype)`` of :func:`hstu_cases`."""


def hstu_cases(key: jax.Array, shapes=HSTU_SHAPES):
    """HSTU's jagged causal SiLU attention at the issue's production shapes (``--batches`` does
    not apply): 8 sequences of 2,048-4,096 tokens (N = 4,096, 2 heads of 128, bfloat16) and
    4 of 4,096-8,192 (N = 8,192, one head of 256, float32), seeded lengths, a learned relative
    bias. FLOPs count the causal pairs only (``Σ n(n+1)/2 · H · 2(d_qk + d_v)`` forward; the
    backward's four products make fwd+bwd three times that)."""
    for n_max, seqs, heads, d, dtype in shapes:
        lengths = jax.random.randint(key, (seqs,), n_max // 2, n_max + 1)
        offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths)]).astype(
            jnp.int32
        )
        t = int(offsets[-1])
        kq, kk, kv, kb = jax.random.split(key, 4)
        q = (jax.random.normal(kq, (t, heads, d)) * d**-0.5).astype(dtype)
        k = (jax.random.normal(kk, (t, heads, d)) * d**-0.5).astype(dtype)
        v = jax.random.normal(kv, (t, heads, d)).astype(dtype)
        rab = jax.random.normal(kb, (1, 32), jnp.float32) * 0.1
        pairs = int(jnp.sum(lengths * (lengths + 1) // 2))
        flops = pairs * heads * 2 * (d + d)
        moved = 4 * t * heads * d * jnp.dtype(dtype).itemsize  # q, k, v in, out

        def make(impl, q=q, k=k, v=v, offsets=offsets, rab=rab, n_max=n_max):
            def attn(q_, k_, v_, r_):
                return hstu_api.hstu_attention(
                    q_, k_, v_, offsets, None, r_, max_seq_len=n_max, impl=impl
                )

            fwd = jax.jit(attn)

            def loss(q_, k_, v_, r_):
                return attn(q_, k_, v_, r_).astype(jnp.float32).sum()

            bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
            return (lambda: fwd(q, k, v, rab)), (lambda: bwd(q, k, v, rab))

        label = f"B={seqs} T={t} N={n_max} H={heads} D={d} {jnp.dtype(dtype).name}"
        yield label, make, moved, flops


def cases(op: str, batches: list[int]):
    """``(label, make_fns(impl) -> (fwd, fwd_bwd or None), bytes, flops)`` per case."""
    key = jax.random.key(0)
    if op == "hstu_attention":
        yield from hstu_cases(key)
        return
    for b in batches:
        if op in ("embedding_bag", "embedding_update", "quantized_embedding_bag"):
            for h in (1, 20):
                n = TABLES * b
                v = TABLES * ROWS
                table = jax.random.normal(key, (v, DIM), jnp.float32) * 0.01
                ids = jax.random.randint(key, (n, h), 0, v, jnp.int32)
                label = f"B={b} bags={n} H={h} V={v} D={DIM}"
                if op == "embedding_bag":
                    moved = n * h * (DIM * 4 + 4) + n * DIM * 4

                    def make(impl, table=table, ids=ids):
                        f = jax.jit(lambda t, i: bag_api.pool(t, i, impl=impl))
                        return (lambda: f(table, ids)), None

                    yield label, make, moved, 0
                elif op == "quantized_embedding_bag":
                    q, sb = q_api.quantize_rowwise(table)
                    moved = n * h * (DIM + 8 + 4) + n * DIM * 4

                    def make(impl, q=q, sb=sb, ids=ids):
                        f = jax.jit(lambda q_, s_, i: q_api.pool(q_, s_, i, impl=impl))
                        return (lambda: f(q, sb, ids)), None

                    yield label, make, moved, 0
                else:
                    grad = jax.random.normal(key, (n, DIM), jnp.float32)
                    acc = jnp.zeros((v,), jnp.float32)
                    # Read the bag gradients; read + write each touched row and accumulator.
                    moved = n * DIM * 4 + n * h * 4 + 2 * n * h * (DIM * 4 + 4)

                    def make(impl, table=table, acc=acc, ids=ids, grad=grad):
                        f = jax.jit(
                            lambda t, a, i, g: update_api.update(
                                t, a, i, g, 0.01, optimizer="rowwise_adagrad", impl=impl
                            ),
                            donate_argnums=(0, 1),
                        )
                        state = [table.copy(), acc.copy()]

                        def run():
                            state[0], state[1], sq = f(state[0], state[1], ids, grad)
                            return sq

                        return run, None

                    yield label + " rowwise_adagrad", make, moved, 0
        elif op == "dot_interaction":
            for dtype in (jnp.float32, jnp.bfloat16):
                nvec = 27
                x = jax.random.normal(key, (b, nvec, DIM), dtype)
                s = jnp.dtype(dtype).itemsize
                p = nvec * (nvec - 1) // 2
                moved = b * (nvec * DIM + p) * s
                flops = 2 * b * nvec * nvec * DIM

                def make(impl, x=x):
                    fwd = jax.jit(lambda x_: dot_api.dot_interaction(x_, impl=impl))

                    def loss(x_):
                        return dot_api.dot_interaction(x_, impl=impl).astype(jnp.float32).sum()

                    bwd = jax.jit(jax.value_and_grad(loss))
                    return (lambda: fwd(x)), (lambda: bwd(x))

                yield f"B={b} N={nvec} D={DIM} {jnp.dtype(dtype).name}", make, moved, flops
        elif op == "fm_interaction":
            for e, d, k in ((32, 128, 24), (56, 192, 32)):
                for dtype in (jnp.float32, jnp.bfloat16):
                    x = jax.random.normal(key, (b, e, d), dtype)
                    y = jax.random.normal(key, (e, k), dtype) * 0.1
                    s = jnp.dtype(dtype).itemsize
                    moved = b * (e * d + e * k) * s
                    flops = 2 * 2 * b * e * d * k

                    def make(impl, x=x, y=y):
                        fwd = jax.jit(lambda x_, y_: fm_api.fm_interaction(x_, y_, impl=impl))

                        def loss(x_, y_):
                            return (
                                fm_api.fm_interaction(x_, y_, impl=impl).astype(jnp.float32).sum()
                            )

                        bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
                        return (lambda: fwd(x, y)), (lambda: bwd(x, y))

                    label = f"B={b} E={e} D={d} K={k} {jnp.dtype(dtype).name}"
                    yield label, make, moved, flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    ap.add_argument("--batches", nargs="+", type=int, default=[8192, 65536])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--kernel",
        default=None,
        help="implementation to time against xla "
        "(default: pallas_gpu / pallas_tpu on those backends, cpu_ffi on CPU)",
    )
    ap.add_argument(
        "--ref-precision",
        default="highest",
        choices=["highest", "default"],
        help="matmul precision of the XLA reference: highest (float32 accuracy, as "
        "the kernels compute float32 inputs) or default (TF32 on a GPU)",
    )
    args = ap.parse_args()
    roof = device_roofline()
    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); roofline "
        f"{roof['name']}: {roof['memory_bytes_per_s'] / 1e9:.0f} GB/s, "
        f"{roof['flops'] / 1e12:.2f} TFLOP/s; XLA matmul precision {args.ref_precision}"
    )
    print(
        "| op | case | pass | XLA ms | kernel | kernel ms | XLA / kernel | XLA roofline | "
        "kernel roofline |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for op in args.ops:
        impl = kernel_impl(op, args.kernel)
        for label, make, moved, flops in cases(op, args.batches):
            ref_fns = make("xla")
            ker_fns = make(impl) if impl else (None, None)
            first = "bwd+update" if op == "embedding_update" else "fwd"
            for name, rf, kf, scale in (
                (first, ref_fns[0], ker_fns[0], 1),
                ("fwd+bwd", ref_fns[1], ker_fns[1], 3),
            ):
                if rf is None:
                    continue
                with jax.default_matmul_precision(args.ref_precision):
                    t_ref = best_time(rf, args.reps)
                t_ker = best_time(kf, args.reps) if kf is not None else float("nan")

                def frac(t, scale=scale, op=op, flops=flops, moved=moved):
                    if op in ("fm_interaction", "hstu_attention"):
                        return f"{100 * scale * flops / t / roof['flops']:.1f}% FLOP/s"
                    return f"{100 * scale * moved / t / roof['memory_bytes_per_s']:.1f}% BW"

                print(
                    f"| {op} | {label} | {name} | {1e3 * t_ref:.2f} | {impl or 'none here'} | "
                    f"{1e3 * t_ker:.2f} | {t_ref / t_ker:.2f} | {frac(t_ref)} | "
                    f"{frac(t_ker)} |"
                )
    print(f"fallbacks: {dict(common.FALLBACKS) or 'none'}")
    if jax.default_backend() == "cpu":
        print(
            "GPU/TPU numbers need an accelerator: the Pallas kernels run on CPU only in "
            "interpret mode, which times the interpreter, not the kernel."
        )


if __name__ == "__main__":
    main()
