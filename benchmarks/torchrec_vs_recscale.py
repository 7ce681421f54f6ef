"""DLRM training and inference throughput, recscale vs TorchRec, side by side on this machine.

``python benchmarks/torchrec_vs_recscale.py [--configs A128 A2048 B C] [--steps N]
[--baseline torchrec|torch] [--kernels auto|xla|pallas_gpu|...]``

Both train the same DLRM (issue 5's configurations) on the same kind of random data
(pre-generated batches, so data loading is not measured): SGD on the dense part, row-wise Adagrad
on the tables. TorchRec runs in its own venv (``.venv-torchrec``; see BENCHMARKS.md for the
install) with its fused embedding optimizer (fbgemm TBE CPU kernels, the update applied in the
backward). The script also measures this machine's float32 matmul FLOP/s and memory bandwidth
and prints the fraction of that roofline each side reaches (training FLOPs per example from
``recscale.flops``).

``--baseline torch`` compares with plain PyTorch instead (``benchmarks/_torch_dlrm.py``: the
facebookresearch/dlrm way, ``nn.EmbeddingBag(sparse=True)`` and exact row-wise Adagrad on the
sparse gradients), run by this Python on this machine's accelerator if torch sees one: the GPU
machines here have torch but no fbgemm-gpu CUDA build (TorchRec's kernels), which cannot be
installed there. ``--kernels`` sets recscale's embedding-bag, embedding-update and interaction
implementations (``KernelConfig``).

Configurations:
  A: 26 tables x 100,000 rows, dim 16, 1 id per bag, 13 dense, bottom 13-512-256-64-16,
     top 367-512-256-1 (batch 128: ``A128``; 2,048: ``A2048``).
  B: 8 tables x 1,000,000 rows, dim 64, 100 ids per bag, 512 dense, bottom 512-512-64,
     top 100-1024-1024-1024-1; batch 2,048.
  C: 26 tables x 1,000,000 rows, dim 64, 20 ids per bag, 13 dense, bottom 13-256-64,
     top 415-256-1; batch 4,096.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data.batch import Batch, FeatureInfo, Schema
from data.config import DataConfig
from dlrm.config import DLRMConfig, DLRMModelConfig
from dlrm.model import build_model
from recscale import sharding
from recscale.config import (
    DenseOptimConfig,
    EmbeddingOptimConfig,
    EmbeddingShardingConfig,
    KernelConfig,
    MeshConfig,
)
from recscale.flops import dlrm_cost
from recscale.train.experiment import make_optimizer
from recscale.train.steps import (
    TrainState,
    initial_rng,
    make_eval_step,
    make_train_step,
)

ROOT = Path(__file__).resolve().parents[1]
TORCHREC_PY = ROOT / ".venv-torchrec" / "bin" / "python"

_KEYS = ("tables", "rows", "dim", "hotness", "dense", "bottom", "top", "batch")
CONFIGS = {
    name: dict(zip(_KEYS, row, strict=True))
    for name, row in {
        # tables, rows per table, dim, hotness, dense features, bottom MLP, top MLP, batch
        "A128": (26, 100_000, 16, 1, 13, (512, 256, 64, 16), (512, 256, 1), 128),
        "A2048": (26, 100_000, 16, 1, 13, (512, 256, 64, 16), (512, 256, 1), 2048),
        "B": (8, 1_000_000, 64, 100, 512, (512, 64), (1024, 1024, 1024, 1), 2048),
        "C": (26, 1_000_000, 64, 20, 13, (256, 64), (256, 1), 4096),
    }.items()
}
LR = 0.01


def machine_roofline() -> dict:
    """float32 matmul FLOP/s (best of 5) and memory bandwidth (read + write of 256 MiB)."""
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    t = min(_timed(lambda: mm(a).block_until_ready()) for _ in range(5))
    # Donated, so the output reuses the input's pages (a fresh 256 MiB output page-faults and
    # reads as a third of the bandwidth).
    add = jax.jit(lambda v: v + 1.0, donate_argnums=0)
    x = add(jnp.ones((64 << 20,), jnp.float32)).block_until_ready()
    tb = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x = add(x).block_until_ready()
        tb = min(tb, time.perf_counter() - t0)
    return {"matmul_flops": 2 * n**3 / t, "memory_bytes_per_s": 2 * x.nbytes / tb}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def kernel_config(spec: str) -> KernelConfig:
    """``--kernels``: one implementation for every op (``auto``, ``xla``, ``pallas_gpu``, ...),
    or per op, ``op=impl`` pairs joined by commas (ops not named run ``auto``), e.g.
    ``embedding_bag=xla,embedding_update=auto,dot_interaction=xla``."""
    ops = ("embedding_bag", "embedding_update", "dot_interaction")
    if "=" not in spec:
        return KernelConfig(**dict.fromkeys(ops, spec))
    chosen = dict.fromkeys(ops, "auto")
    for pair in spec.split(","):
        op, _, impl = pair.partition("=")
        if op not in ops or not impl:
            raise SystemExit(f"error: --kernels {spec!r}: {pair!r} is not op=impl, op in {ops}")
        chosen[op] = impl
    return KernelConfig(**chosen)


def recscale_run(
    c: dict, steps: int, warmup: int, sharding_kind: str, windows: int = 3, kernels: str = "auto"
) -> dict:
    schema = Schema(
        dense_names=tuple(f"d{i}" for i in range(c["dense"])),
        features=tuple(
            FeatureInfo(name=f"f{i}", vocab_size=c["rows"], max_hotness=c["hotness"])
            for i in range(c["tables"])
        ),
    )
    cfg = DLRMConfig(
        model=DLRMModelConfig(embed_dim=c["dim"], bottom_mlp=c["bottom"], top_mlp=c["top"]),
        data=DataConfig(batch_size=c["batch"], eval_batch_size=c["batch"]),
        dense_optim=DenseOptimConfig(name="sgd", learning_rate=LR, b1=0.0),
        embedding_optim=EmbeddingOptimConfig(name="rowwise_adagrad", learning_rate=LR),
        mesh=MeshConfig(data_parallel=1),
        embeddings=EmbeddingShardingConfig(sharding=sharding_kind),
        kernels=kernel_config(kernels),
    )
    mesh = sharding.make_mesh(cfg.mesh, devices=jax.devices()[:1])
    rng = np.random.default_rng(1)
    B = c["batch"]
    host = [
        Batch(
            dense_bn=rng.standard_normal((B, c["dense"]), np.float32),
            ids_bfh=rng.integers(0, c["rows"], (B, c["tables"], c["hotness"]), dtype=np.int32),
            labels_b=rng.integers(0, 2, B).astype(np.float32),
            weights_b=np.ones(B, np.float32),
        )
        for _ in range(8)
    ]
    with sharding.activate(mesh, cfg.mesh):
        model = build_model(cfg, schema, nnx.Rngs(params=0))
        graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
        tx = make_optimizer(cfg, params)
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            batch_stats=stats,
            rng=initial_rng(0),
        )
        batches = [jax.device_put(b) for b in host]
        train = jax.jit(make_train_step(graphdef, tx), donate_argnums=(0,))
        infer = jax.jit(make_eval_step(graphdef))
        for i in range(warmup):
            state, m = train(state, batches[i % 8])
        jax.block_until_ready(state)
        train_s = float("inf")  # the best of `windows` timed windows (a noisy shared machine)
        for _ in range(windows):
            t0 = time.perf_counter()
            for i in range(steps):
                state, m = train(state, batches[i % 8])
            jax.block_until_ready(state)
            train_s = min(train_s, time.perf_counter() - t0)
        for i in range(warmup):
            infer(state.params, state.batch_stats, batches[i % 8]).block_until_ready()
        infer_s = float("inf")
        for _ in range(windows):
            t0 = time.perf_counter()
            for i in range(steps):
                out = infer(state.params, state.batch_stats, batches[i % 8])
            out.block_until_ready()
            infer_s = min(infer_s, time.perf_counter() - t0)
    cost = dlrm_cost(cfg.model, schema)
    return {
        "train_examples_per_s": steps * B / train_s,
        "infer_examples_per_s": steps * B / infer_s,
        "final_loss": float(m["loss"]),
        "train_flops_per_example": cost.train_flops,
        "embedding_bytes_per_example": cost.embedding_bytes_read,
    }


def torchrec_run(
    c: dict, steps: int, warmup: int, threads: int, windows: int = 3, baseline: str = "torchrec"
) -> dict:
    """The baseline's numbers: TorchRec in its own venv, or plain PyTorch (``baseline="torch"``)
    with this Python on the accelerator torch sees (else the CPU)."""
    if baseline == "torchrec":
        py, script, device = TORCHREC_PY, "_torchrec_dlrm.py", "cpu"
        if not py.exists():
            raise SystemExit(f"{py} not found: install TorchRec's venv (BENCHMARKS.md)")
    else:
        import torch

        py, script = Path(sys.executable), "_torch_dlrm.py"
        device = "cuda" if torch.cuda.is_available() else "cpu"
    args = {
        **c,
        "bottom": list(c["bottom"]),
        "top": list(c["top"]),
        "emb_lr": LR,
        "dense_lr": LR,
        "num_batches": 8,
        "warmup": warmup,
        "steps": steps,
        "threads": threads,
        "windows": windows,
        "device": device,
    }
    out = subprocess.run(
        [str(py), str(ROOT / "benchmarks" / script), json.dumps(args)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"{script} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument(
        "--sharding",
        default="data_parallel",
        help="recscale's embeddings.sharding (off = per-table arrays, dense updates)",
    )
    ap.add_argument("--windows", type=int, default=3, help="timed windows; the best counts")
    ap.add_argument("--skip-torchrec", action="store_true")
    ap.add_argument(
        "--baseline",
        choices=["torchrec", "torch"],
        default="torchrec",
        help="TorchRec (its venv, CPU) or plain PyTorch on this machine's device",
    )
    ap.add_argument(
        "--kernels",
        default="auto",
        help="recscale's kernel implementation (auto, xla, pallas_gpu, ...), or per op: "
        "embedding_bag=IMPL,embedding_update=IMPL,dot_interaction=IMPL",
    )
    args = ap.parse_args()
    roof = machine_roofline()
    print(
        f"device: {jax.devices()[0].device_kind}; baseline: {args.baseline}; "
        f"recscale kernels: {args.kernels}"
    )
    print(
        f"machine: {roof['matmul_flops'] / 1e9:.0f} GFLOP/s float32 matmul, "
        f"{roof['memory_bytes_per_s'] / 1e9:.1f} GB/s memory"
    )
    rows = []
    for name in args.configs:
        c = CONFIGS[name]
        r = recscale_run(c, args.steps, args.warmup, args.sharding, args.windows, args.kernels)
        if args.skip_torchrec:
            print(json.dumps({"config": name, **r}), flush=True)
            continue
        t = torchrec_run(c, args.steps, args.warmup, args.threads, args.windows, args.baseline)
        flops = r["train_flops_per_example"]
        emb_bytes = r["embedding_bytes_per_example"]
        row = {
            "config": name,
            "batch": c["batch"],
            "recscale_train": r["train_examples_per_s"],
            "torchrec_train": t["train_examples_per_s"],
            "train_ratio": r["train_examples_per_s"] / t["train_examples_per_s"],
            "recscale_infer": r["infer_examples_per_s"],
            "torchrec_infer": t["infer_examples_per_s"],
            "infer_ratio": r["infer_examples_per_s"] / t["infer_examples_per_s"],
            "recscale_matmul_roofline": r["train_examples_per_s"] * flops / roof["matmul_flops"],
            "torchrec_matmul_roofline": t["train_examples_per_s"] * flops / roof["matmul_flops"],
            # rows read by the lookup, then read and written by the update: 3x the lookup bytes
            "recscale_memory_roofline": r["train_examples_per_s"]
            * 3
            * emb_bytes
            / roof["memory_bytes_per_s"],
            "torchrec_memory_roofline": t["train_examples_per_s"]
            * 3
            * emb_bytes
            / roof["memory_bytes_per_s"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    b = "TorchRec" if args.baseline == "torchrec" else "PyTorch"
    print(
        f"\n| config | batch | recscale train ex/s | {b} train ex/s | ratio | recscale infer "
        f"ex/s | {b} infer ex/s | ratio | matmul roofline recscale / {b} | memory "
        f"roofline recscale / {b} |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['batch']} | {r['recscale_train']:,.0f} | "
            f"{r['torchrec_train']:,.0f} | {r['train_ratio']:.2f} | {r['recscale_infer']:,.0f} | "
            f"{r['torchrec_infer']:,.0f} | {r['infer_ratio']:.2f} | "
            f"{100 * r['recscale_matmul_roofline']:.1f}% / "
            f"{100 * r['torchrec_matmul_roofline']:.1f}% | "
            f"{100 * r['recscale_memory_roofline']:.1f}% / "
            f"{100 * r['torchrec_memory_roofline']:.1f}% |"
        )


if __name__ == "__main__":
    main()
