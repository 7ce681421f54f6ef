"""Sparse embedding updates equal the dense-gradient optax reference, row for row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from recscale.embeddings.sparse import (
    gather_rows,
    sparse_rowwise_adagrad,
    sparse_sgd,
    unique_rows,
)
from recscale.optim.embedding import rowwise_adagrad

V, D, B, H = 50, 8, 16, 3


def pooled_loss(table_vd, ids_bh, w_d):
    """A model-like loss: sum-pool each bag (PAD_ID slots contribute nothing), then a head."""
    safe = jnp.where(ids_bh >= 0, ids_bh, 0)
    rows_bhd = jnp.take(table_vd, safe, axis=0) * (ids_bh >= 0)[..., None]
    pooled_bd = rows_bhd.sum(1)
    return jnp.mean(jnp.tanh(pooled_bd @ w_d) ** 2)


def batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, 12, (B, H))  # few distinct rows: many repeats within a batch
        ids[rng.random((B, H)) < 0.3] = -1  # padding
        yield jnp.asarray(ids, jnp.int32)


def test_unique_rows_maps_ids_and_pads():
    ids = jnp.array([[3, 7, -1], [7, 3, 3]], jnp.int32)
    uids, local = unique_rows(ids, num_rows=10, size=6)
    np.testing.assert_array_equal(uids, [3, 7, 10, 10, 10, 10])
    np.testing.assert_array_equal(local, [[0, 1, -1], [1, 0, 0]])
    table = jnp.arange(40.0).reshape(10, 4)
    sub = gather_rows(table, uids)
    np.testing.assert_array_equal(sub[:2], table[jnp.array([3, 7])])
    np.testing.assert_array_equal(sub[2:], 0.0)
    with pytest.raises(ValueError, match="size=5 < 6 ids"):
        unique_rows(ids, num_rows=10, size=5)


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad"])
def test_sparse_equals_dense_reference(name):
    key = jax.random.key(0)
    table0 = jax.random.normal(key, (V, D)) * 0.1
    w_d = jax.random.normal(jax.random.key(1), (D,))
    lr = 0.05
    tx = optax.sgd(lr) if name == "sgd" else rowwise_adagrad(lr, eps=1e-8)

    @jax.jit
    def dense_step(table, opt_state, ids):
        g = jax.grad(pooled_loss)(table, ids, w_d)  # [V, D]: the dense gradient
        u, opt_state = tx.update(g, opt_state, table)
        return optax.apply_updates(table, u), opt_state

    @jax.jit
    def sparse_step(table, acc, ids):
        uids, local = unique_rows(ids, V)
        sub = gather_rows(table, uids)
        g_u = jax.grad(pooled_loss)(sub, local, w_d)  # [U, D]: only the touched rows
        if name == "sgd":
            return sparse_sgd(table, uids, g_u, lr), acc
        return sparse_rowwise_adagrad(table, acc, uids, g_u, lr, eps=1e-8)

    t_dense, opt_state = table0, tx.init(table0)
    t_sparse, acc = table0, jnp.zeros((V,), jnp.float32)
    touched = np.zeros(V, bool)
    for ids in batches(6):
        t_dense, opt_state = dense_step(t_dense, opt_state, ids)
        t_sparse, acc = sparse_step(t_sparse, acc, ids)
        touched[np.asarray(ids)[np.asarray(ids) >= 0]] = True
    # Untouched rows: bitwise unchanged on both paths.
    np.testing.assert_array_equal(t_sparse[~touched], table0[~touched])
    np.testing.assert_array_equal(t_dense[~touched], table0[~touched])
    # Touched rows: equal to float32 rounding (repeats of a row may be summed in another order).
    np.testing.assert_allclose(t_sparse, t_dense, rtol=2e-6, atol=1e-7)
    if name == "rowwise_adagrad":
        dense_acc = opt_state[0].sum_of_squares
        np.testing.assert_allclose(acc, dense_acc, rtol=2e-6, atol=1e-9)
        np.testing.assert_array_equal(acc[~touched], 0.0)


def test_sparse_step_builds_no_table_sized_gradient():
    """XLA's memory analysis of the compiled steps: the sparse step's temporaries are batch-sized,
    the dense reference's hold at least one table-sized gradient (so the check can fail)."""
    big_v = 1_000_000
    table_bytes = big_v * D * 4
    tx = rowwise_adagrad(0.01)

    def sparse_step(table, acc, ids, w_d):
        uids, local = unique_rows(ids, big_v)
        g_u = jax.grad(pooled_loss)(gather_rows(table, uids), local, w_d)
        return sparse_rowwise_adagrad(table, acc, uids, g_u, 0.01)

    def dense_step(table, opt_state, ids, w_d):
        g = jax.grad(pooled_loss)(table, ids, w_d)
        u, opt_state = tx.update(g, opt_state, table)
        return optax.apply_updates(table, u), opt_state

    table = jax.ShapeDtypeStruct((big_v, D), jnp.float32)
    ids = jax.ShapeDtypeStruct((B, H), jnp.int32)
    w = jax.ShapeDtypeStruct((D,), jnp.float32)
    acc = jax.ShapeDtypeStruct((big_v,), jnp.float32)
    sparse = jax.jit(sparse_step, donate_argnums=(0, 1)).lower(table, acc, ids, w).compile()
    dense = (
        jax.jit(dense_step, donate_argnums=(0, 1))
        .lower(table, jax.eval_shape(tx.init, table), ids, w)
        .compile()
    )
    sparse_temp = sparse.memory_analysis().temp_size_in_bytes
    dense_temp = dense.memory_analysis().temp_size_in_bytes
    assert sparse_temp < 0.01 * table_bytes, sparse_temp
    assert dense_temp >= table_bytes, dense_temp
