"""Sparse vs dense-gradient embedding update: step time and XLA temporary memory, same run.

``python benchmarks/sparse_update.py [--rows 1000000] [--dim 64] [--batch 4096] [--hotness 20]``

One table, a sum-pooled bag per example and a small head; row-wise Adagrad. The dense step is
what the trainer does today (``jax.grad`` w.r.t. the whole table, then the optax optimizer over
every row); the sparse step differentiates w.r.t. the batch's distinct rows only
(``recscale.embeddings.sparse``). Both jitted with the table and accumulator donated.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from recscale.embeddings.sparse import gather_rows, sparse_rowwise_adagrad, unique_rows
from recscale.optim.embedding import rowwise_adagrad


def loss(table_vd, ids_bh, w_d):
    safe = jnp.where(ids_bh >= 0, ids_bh, 0)
    pooled_bd = jnp.zeros((ids_bh.shape[0], table_vd.shape[1]), table_vd.dtype)
    for h in range(ids_bh.shape[1]):  # a loop over bag slots (XLA does not fuse gather + sum)
        pooled_bd += jnp.take(table_vd, safe[:, h], axis=0) * (ids_bh[:, h] >= 0)[:, None]
    return jnp.mean(jnp.tanh(pooled_bd @ w_d) ** 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--hotness", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    lr = 0.01
    tx = rowwise_adagrad(lr)

    def dense_step(table, opt_state, ids, w):
        g = jax.grad(loss)(table, ids, w)
        u, opt_state = tx.update(g, opt_state, table)
        return optax.apply_updates(table, u), opt_state

    def sparse_step(table, acc, ids, w):
        uids, local = unique_rows(ids, a.rows)
        g_u = jax.grad(loss)(gather_rows(table, uids), local, w)
        return sparse_rowwise_adagrad(table, acc, uids, g_u, lr)

    rng = np.random.default_rng(0)
    batches = [
        jnp.asarray(rng.zipf(1.1, (a.batch, a.hotness)) % a.rows, jnp.int32) for _ in range(4)
    ]
    w = jnp.ones((a.dim,), jnp.float32) / a.dim
    table_bytes = a.rows * a.dim * 4
    print(f"table {a.rows:,} x {a.dim} ({table_bytes / 2**20:.0f} MiB), batch {a.batch} x "
          f"{a.hotness} ids")  # fmt: skip
    results = {}
    for name, fn, state_fn in (
        ("dense", dense_step, lambda t: tx.init(t)),
        ("sparse", sparse_step, lambda t: jnp.zeros((a.rows,), jnp.float32)),
    ):
        table = jax.random.normal(jax.random.key(0), (a.rows, a.dim)) * 0.01
        state = state_fn(table)
        step = jax.jit(fn, donate_argnums=(0, 1))
        compiled = step.lower(table, state, batches[0], w).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        table, state = step(table, state, batches[0], w)
        jax.block_until_ready(table)
        t0 = time.perf_counter()
        for i in range(a.steps):
            table, state = step(table, state, batches[i % 4], w)
        jax.block_until_ready(table)
        dt = (time.perf_counter() - t0) / a.steps
        results[name] = (dt, temp)
        print(f"{name:6s}: {dt * 1e3:8.1f} ms/step  {a.batch / dt:10,.0f} examples/s  "
              f"XLA temporaries {temp / 2**20:8.1f} MiB ({temp / table_bytes:.2f} x table)")  # fmt: skip
    print(f"sparse speedup: {results['dense'][0] / results['sparse'][0]:.1f}x")


if __name__ == "__main__":
    main()
