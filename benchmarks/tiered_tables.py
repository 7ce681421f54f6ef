"""Tables beyond memory (issue 19): a Zipf workload trains through a device cache over an SSD
tier whose table is several times the RAM the process may use, against the same model with a
table that fits all in the engine; the planner's predicted hit rate against the measured one.

``python benchmarks/tiered_tables.py [--rows 40000000] [--mem-limit-gib 1.5] [--steps 300]
[--out runs/bench_tiers]``

Each configuration trains in its own child process; the tiered one runs inside a cgroup-v1
memory cgroup (``/sys/fs/cgroup/memory/recscale_bench_*``, ``memory.limit_in_bytes``) when this
machine lets us create one (root), so the table file is several times what the process may hold
in RAM: the kernel keeps only the pages the cache's misses touch, and evicts them under the
limit. Without a cgroup the run goes on and says the limit was not enforced.

The model is a small DLRM (1 device, table-wise engine, row-wise Adagrad) with one big table of
``--rows`` rows x ``--dim`` (ids Zipf(s) over a hashed permutation of the rows, one per example)
and three 1,000-row tables. Configurations:

* ``in_memory``: the big table shrunk to ``--fit-rows`` rows, all in the engine (the baseline);
* ``dram``: that same table tiered to DRAM with the cache below (the cache's own cost);
* ``ssd``: the big table tiered to SSD, under the memory limit.

Printed per configuration: examples/s over the measured steps (after ``--warmup`` steps that
fill the cache), its ratio to ``in_memory``, the measured hit rate, the hit rate the planner
(``recscale.embeddings.tier_plan.predict_hit_rate``) predicts from the Zipf probabilities, MiB
read from and written to the tier per step, the table file's size and the cgroup's peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

CGROUP = Path("/sys/fs/cgroup/memory")


def zipf_ranks(rng: np.random.Generator, n: int, rows: int, s: float) -> np.ndarray:
    """``n`` ranks in ``[0, rows)`` of the continuous power law ``~ x^-s`` on ``[1, rows+1)``,
    floored (no table-sized CDF: the child's memory is the point)."""
    u = rng.random(n)
    if abs(s - 1) < 1e-9:
        x = np.exp(u * np.log(rows + 1.0))
    else:
        x = ((rows + 1.0) ** (1 - s) * u + (1 - u)) ** (1 / (1 - s))
    return np.minimum(np.floor(x).astype(np.int64) - 1, rows - 1)


def rank_probabilities(rows: int, s: float) -> np.ndarray:
    """P(rank r) of :func:`zipf_ranks`: the power law's mass on ``[r+1, r+2)``."""
    edges = np.arange(1, rows + 2, dtype=np.float64)
    cdf = np.log(edges) if abs(s - 1) < 1e-9 else edges ** (1 - s)
    p = np.diff(cdf)
    return p / p.sum()


def hashed(ranks: np.ndarray, rows: int) -> np.ndarray:
    """A fixed permutation of the rows (``a r + b mod rows``, ``a`` prime to ``rows``), so hot
    rows are spread over the file as real ids are."""
    a = 2654435761 % rows
    while np.gcd(a, rows) != 1:
        a += 1
    return ((ranks * a + 12345) % rows).astype(np.int32)


# ------------------------------------------------------------------------------------------------
# The child: one configuration's training.


def child(args) -> None:
    if args.cgroup:
        (Path(args.cgroup) / "cgroup.procs").write_text(str(os.getpid()))
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from data.batch import Batch, FeatureInfo, Schema  # noqa: PLC0415
    from data.config import DataConfig  # noqa: PLC0415
    from dlrm.config import DLRMConfig, DLRMModelConfig  # noqa: PLC0415
    from dlrm.model import build_model  # noqa: PLC0415
    from recscale import sharding  # noqa: PLC0415
    from recscale.config import (  # noqa: PLC0415
        DenseOptimConfig,
        EmbeddingOptimConfig,
        EmbeddingShardingConfig,
        MeshConfig,
    )
    from recscale.embeddings import tiers as tiers_lib  # noqa: PLC0415
    from recscale.train.loop import make_optimizer  # noqa: PLC0415
    from recscale.train.steps import TrainState, initial_rng, make_train_step  # noqa: PLC0415

    rows = args.rows
    schema = Schema(
        dense_names=tuple(f"d{i}" for i in range(4)),
        features=(
            FeatureInfo(name="big", vocab_size=rows),
            *(FeatureInfo(name=f"s{i}", vocab_size=1000) for i in range(3)),
        ),
    )
    cfg = DLRMConfig(
        model=DLRMModelConfig(embed_dim=args.dim, bottom_mlp=(64, args.dim), top_mlp=(64, 1)),
        data=DataConfig(batch_size=args.batch, eval_batch_size=args.batch),
        dense_optim=DenseOptimConfig(name="adam", learning_rate=1e-3),
        embedding_optim=EmbeddingOptimConfig(name="rowwise_adagrad", learning_rate=0.05),
        mesh=MeshConfig(data_parallel=1),
        embeddings=EmbeddingShardingConfig(sharding="table_wise"),
    )
    specs = (
        tiers_lib.parse_tiers((f"big={args.tier}:{args.cache_rows}",))
        if args.tier != "none"
        else {}
    )
    mesh = sharding.make_mesh(cfg.mesh)
    rng = np.random.default_rng(0)
    out: dict = {"config": args.name, "rows": rows, "device": jax.devices()[0].device_kind}
    with sharding.activate(mesh, cfg.mesh):
        model = build_model(cfg, tiers_lib.model_schema(schema, specs), nnx.Rngs(params=0))
        graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
        tx = make_optimizer(cfg, params)
        state = TrainState(
            step=jax.numpy.zeros((), "int32"),
            params=params,
            opt_state=tx.init(params),
            batch_stats=stats,
            rng=initial_rng(0),
        )
        step = jax.jit(make_train_step(graphdef, tx), donate_argnums=0)
        tiers = None
        if specs:
            t0 = time.perf_counter()
            tiers = tiers_lib.TieredTables(
                model,
                schema,
                specs,
                Path(args.dir),
                optimizer="rowwise_adagrad",
                initial_accumulator=0.0,
                seed=0,
                mesh=mesh,
            )
            tiers.create()
            out["create_s"] = time.perf_counter() - t0
            out["file_bytes"] = tiers.stores["big"].path.stat().st_size

        def batches():
            for i in range(args.warmup + args.steps):
                ids = np.empty((args.batch, 4, 1), np.int32)
                ids[:, 0, 0] = hashed(zipf_ranks(rng, args.batch, rows, args.zipf), rows)
                ids[:, 1:, 0] = rng.integers(0, 1000, (args.batch, 3))
                yield (
                    i,
                    Batch(
                        dense_bn=rng.standard_normal((args.batch, 4)).astype(np.float32),
                        ids_bfh=ids,
                        labels_b=(rng.random(args.batch) < 0.25).astype(np.float32),
                        weights_b=np.ones(args.batch, np.float32),
                    ),
                )

        stream = tiers.lookahead(batches()) if tiers is not None else batches()
        t_tiers = 0.0
        for i, b in stream:
            if i == args.warmup:
                jax.block_until_ready(state)
                t0 = time.perf_counter()
                if tiers is not None:
                    c, s = tiers.caches["big"], tiers.stores["big"]
                    base = (c.requests, c.hits, s.bytes_read, s.bytes_written)
            if tiers is not None:
                t1 = time.perf_counter()
                state, b = tiers.prepare(state, b, train=True)
                t_tiers += time.perf_counter() - t1 if i >= args.warmup else 0.0
            state, m = step(state, b)
            if i % 100 == 0:
                print(f"step {i} {time.strftime('%X')}", file=sys.stderr, flush=True)
        jax.block_until_ready(state)
        secs = time.perf_counter() - t0
        out["examples_per_s"] = args.steps * args.batch / secs
        out["step_ms"] = 1e3 * secs / args.steps
        out["loss"] = float(m["loss"])
        if tiers is not None:
            c, s = tiers.caches["big"], tiers.stores["big"]
            req, hits = c.requests - base[0], c.hits - base[1]
            out["hit_rate"] = hits / req
            out["distinct_per_step"] = req / args.steps
            out["read_mib_per_step"] = (s.bytes_read - base[2]) / 2**20 / args.steps
            out["written_mib_per_step"] = (s.bytes_written - base[3]) / 2**20 / args.steps
            out["tiers_ms_per_step"] = 1e3 * t_tiers / args.steps
            t0 = time.perf_counter()
            state = tiers.checkpoint(state, args.warmup + args.steps)
            out["checkpoint_s"] = time.perf_counter() - t0
            tiers.close()
    if args.cgroup:
        out["cgroup_peak_bytes"] = int(
            (Path(args.cgroup) / "memory.max_usage_in_bytes").read_text()
        )
        out["cgroup_limit_bytes"] = int((Path(args.cgroup) / "memory.limit_in_bytes").read_text())
    print("RESULT " + json.dumps(out), flush=True)


# ------------------------------------------------------------------------------------------------
# The parent: configurations, the cgroup, the prediction, the table.


def _cgroup(limit: int) -> Path | None:
    path = CGROUP / f"recscale_bench_{os.getpid()}"
    try:
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(limit))
        try:  # no swap either, where the kernel accounts it
            (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
        except OSError:
            pass
        return path
    except OSError as e:
        print(f"no memory cgroup ({e}): the memory limit is NOT enforced", file=sys.stderr)
        return None


def _run(args, name: str, tier: str, rows: int, cgroup: Path | None) -> dict:
    out = Path(args.out)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--name",
        name,
        "--tier",
        tier,
        "--rows",
        str(rows),
        "--dir",
        str(out / "stores" / name),
    ]
    for k in ("dim", "batch", "cache_rows", "steps", "warmup", "zipf"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if cgroup is not None:
        cmd += ["--cgroup", str(cgroup)]
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1"}
    if args.platform:
        env["JAX_PLATFORMS"] = args.platform
    print(f"== {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise SystemExit(f"{name}: exit {p.returncode} (its errors are above)")
    return json.loads(line[len("RESULT ") :])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=40_000_000)
    ap.add_argument("--fit-rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--cache-rows", type=int, default=1 << 18)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--mem-limit-gib", type=float, default=1.5)
    ap.add_argument("--out", default="runs/bench_tiers")
    ap.add_argument("--configs", nargs="+", default=["in_memory", "dram", "ssd"])
    ap.add_argument(
        "--platform",
        default="cpu",
        help="JAX_PLATFORMS of the runs ('' : JAX's default, e.g. the GPU)",
    )
    # the child's
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tier", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)

    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    from recscale.embeddings.tier_plan import predict_hit_rate  # noqa: PLC0415

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.configs:
        rows = args.rows if name == "ssd" else args.fit_rows
        tier = {"in_memory": "none", "dram": "dram", "ssd": "ssd"}[name]
        cg = _cgroup(int(args.mem_limit_gib * 2**30)) if name == "ssd" else None
        try:
            r = _run(args, name, tier, rows, cg)
        finally:
            if cg is not None:
                cg.rmdir()
        if tier != "none":
            t0 = time.perf_counter()
            p = rank_probabilities(rows, args.zipf)
            r["predicted_hit_rate"] = predict_hit_rate(p, args.cache_rows, args.batch, "lru")
            r["predict_s"] = time.perf_counter() - t0
            del p
        results.append(r)
        for d in (out / "stores" / name).glob("*/rows.f32"):
            d.unlink()  # gigabytes: not kept
    base = next((r for r in results if r["config"] == "in_memory"), None)
    t = Table(
        title=f"tiered tables: Zipf {args.zipf}, batch {args.batch}, dim {args.dim}, "
        f"cache {args.cache_rows:,} rows, {args.steps} steps after {args.warmup}"
    )
    for c in (
        "config",
        "table rows",
        "file GiB",
        "limit GiB",
        "peak GiB",
        "ex/s",
        "vs in-memory",
        "hit rate",
        "predicted",
        "MiB read/step",
        "MiB written/step",
        "tiers ms/step",
    ):
        t.add_column(c, justify="right")
    for r in results:
        gib = lambda k, r=r: f"{r[k] / 2**30:.2f}" if k in r else "-"  # noqa: E731
        t.add_row(
            r["config"],
            f"{r['rows']:,}",
            gib("file_bytes"),
            gib("cgroup_limit_bytes"),
            gib("cgroup_peak_bytes"),
            f"{r['examples_per_s']:,.0f}",
            f"{r['examples_per_s'] / base['examples_per_s']:.2f}" if base else "-",
            f"{r['hit_rate']:.4f}" if "hit_rate" in r else "-",
            f"{r['predicted_hit_rate']:.4f}" if "predicted_hit_rate" in r else "-",
            f"{r['read_mib_per_step']:.2f}" if "hit_rate" in r else "-",
            f"{r['written_mib_per_step']:.2f}" if "hit_rate" in r else "-",
            f"{r['tiers_ms_per_step']:.1f}" if "hit_rate" in r else "-",
        )
    Console(width=200).print(t)
    (out / "results.json").write_text(
        json.dumps({"args": vars(args), "results": results}, indent=1)
    )


if __name__ == "__main__":
    main()
