"""Peak memory of DLRM training steps against the tables + optimizer state they update.

``python benchmarks/embedding_memory.py [--tables 26 --rows 1000000 --dim 64 --hotness 20
--batch 4096] [--sharding data_parallel|row_wise|...|off] [--steps 5]``

Builds the model (tables initialised one at a time into the engine's buffers), runs one step
(compilation), then resets the process's peak-RSS counter (``/proc/self/clear_refs``) and runs
``--steps`` more. It prints the peak resident memory of those steps, minus the process's
footprint before the model existed (Python, jax, the compiled step), against:

* ``tables + optimizer state``: the bytes of the parameters the steps must hold;
* the batch term: XLA's own count of the step's temporaries (``memory_analysis``) plus the batch.

The issue's goal: peak <= 1.2 x (tables + optimizer state) + the batch term. One CPU device; the
default is configuration C of ``torchrec_vs_recscale.py`` (26 tables x 1,000,000 x 64, 6.7 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from data.batch import Batch, FeatureInfo, Schema  # noqa: E402
from data.config import DataConfig  # noqa: E402
from dlrm.config import DLRMConfig, DLRMModelConfig  # noqa: E402
from dlrm.model import build_model  # noqa: E402
from recscale import sharding  # noqa: E402
from recscale.config import (  # noqa: E402
    DenseOptimConfig,
    EmbeddingOptimConfig,
    EmbeddingShardingConfig,
    MeshConfig,
)
from recscale.embeddings import engine  # noqa: E402
from recscale.train.experiment import make_optimizer  # noqa: E402
from recscale.train.steps import (  # noqa: E402
    TrainState,
    initial_rng,
    make_train_step,
)


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--hotness", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--sharding", default="data_parallel")
    ap.add_argument("--optimizer", default="rowwise_adagrad")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    schema = Schema(
        dense_names=tuple(f"d{i}" for i in range(13)),
        features=tuple(
            FeatureInfo(name=f"f{i}", vocab_size=a.rows, max_hotness=a.hotness)
            for i in range(a.tables)
        ),
    )
    cfg = DLRMConfig(
        model=DLRMModelConfig(embed_dim=a.dim, bottom_mlp=(256, a.dim), top_mlp=(256, 1)),
        data=DataConfig(batch_size=a.batch, eval_batch_size=a.batch),
        dense_optim=DenseOptimConfig(name="sgd", learning_rate=0.01, b1=0.0),
        embedding_optim=EmbeddingOptimConfig(name=a.optimizer, learning_rate=0.01),
        mesh=MeshConfig(data_parallel=1),
        embeddings=EmbeddingShardingConfig(sharding=a.sharding),
    )
    rng = np.random.default_rng(0)
    batch = Batch(
        dense_bn=rng.standard_normal((a.batch, 13), np.float32),
        ids_bfh=rng.integers(0, a.rows, (a.batch, a.tables, a.hotness), dtype=np.int32),
        labels_b=rng.integers(0, 2, a.batch).astype(np.float32),
        weights_b=np.ones(a.batch, np.float32),
    )
    spec = engine.EngineSpec.from_config(cfg)
    mesh = sharding.make_mesh(cfg.mesh, devices=jax.devices()[:1])
    with sharding.activate(mesh, cfg.mesh):
        # The process's own footprint, and the compiled step, before any table exists.
        abstract = nnx.eval_shape(lambda: build_model(cfg, schema, nnx.Rngs(params=0)))
        graphdef, a_params, a_stats = nnx.split(abstract, nnx.Param, nnx.BatchStat)
        tx = make_optimizer(cfg, a_params)
        a_state = TrainState(
            step=jax.ShapeDtypeStruct((), jnp.int32),
            params=a_params,
            opt_state=jax.eval_shape(tx.init, a_params),
            batch_stats=a_stats,
            rng=jax.eval_shape(initial_rng, 0),
        )
        dbatch = jax.device_put(batch)
        step = (
            jax.jit(make_train_step(graphdef, tx), donate_argnums=0)
            .lower(a_state, dbatch)
            .compile()
        )
        analysis = step.memory_analysis()
        base = _status("VmRSS")

        model = build_model(cfg, schema, nnx.Rngs(params=0))
        _, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
        del model
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=jax.jit(tx.init)(params),
            batch_stats=stats,
            rng=initial_rng(0),
        )
        del params
        state, m = step(state, dbatch)
        jax.block_until_ready(state)
        _reset_peak()
        for _ in range(a.steps):
            state, m = step(state, dbatch)
        jax.block_until_ready(state)
        peak = _status("VmHWM") - base
    tables = sum(x.nbytes for x in jax.tree.leaves(state.params["embeddings"]))
    opt = state.opt_state["embedding"] if spec is not None else state.opt_state
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(opt))
    batch_term = analysis.temp_size_in_bytes + sum(x.nbytes for x in batch)
    budget = 1.2 * (tables + opt_bytes) + batch_term
    row = {
        "sharding": a.sharding,
        "kernels": os.environ.get("RECSCALE_CPU_KERNELS", "1"),
        "tables_gb": tables / 1e9,
        "optimizer_state_gb": opt_bytes / 1e9,
        "xla_temporaries_gb": analysis.temp_size_in_bytes / 1e9,
        "batch_term_gb": batch_term / 1e9,
        "peak_gb": peak / 1e9,
        "peak_over_tables_and_state": peak / (tables + opt_bytes),
        "budget_gb": budget / 1e9,
        "within_budget": bool(peak <= budget),
        "loss": float(m["loss"]),
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
