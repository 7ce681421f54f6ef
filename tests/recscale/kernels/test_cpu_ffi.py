"""The C++ CPU kernels of the embedding engine match its plain-JAX path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recscale.embeddings import engine
from recscale.kernels.embedding_bag import cpu_ffi as cpu

R, W, S, B, H = 1000, 16, 3, 64, 5


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not cpu.available():
        pytest.skip("the CPU kernels did not build here (no C++ compiler?): the plain path runs")


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    buf = jnp.asarray(rng.standard_normal((R, W)), jnp.float32)
    # slot s reads rows [300 s, 300 s + 50): many repeats within and across bags; some padding
    keys = rng.integers(0, 50, (S, B, H)) + 300 * np.arange(S)[:, None, None]
    keys[rng.random((S, B, H)) < 0.2] = R
    grad = jnp.asarray(rng.standard_normal((S, B, W)), jnp.float32)
    acc = jnp.asarray(rng.random(R), jnp.float32)
    return buf, jnp.asarray(keys, jnp.int32), grad, acc


def test_pool_equals_the_plain_path_bitwise():
    buf, keys, *_ = _inputs()
    got = jax.jit(cpu.pool)(buf, keys)
    want = jax.jit(engine._pool, static_argnums=2)(buf, keys, R)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_update_equals_the_plain_path(optimizer):
    buf, keys, grad, acc = _inputs()
    tdim = jnp.full((S,), W, jnp.int32)
    rule = engine.UpdateRule(optimizer)
    adagrad = optimizer == "rowwise_adagrad"

    @jax.jit
    def plain(buf, acc):
        uids, g = engine.row_gradients(keys, grad, R)
        st = {"acc": acc} if adagrad else {}
        new, st, sq = engine._update_rows(buf, st, uids, g, tdim, tdim, 0.1, 0, rule, 0)
        return new, st.get("acc", acc), sq, jnp.sum(g * g)

    @jax.jit
    def kernel(buf, acc):
        a = acc if adagrad else jnp.zeros((1,), jnp.float32)
        new, a, stats = cpu.update(buf, a, keys, grad, 0.1, tdim, eps=1e-8, adagrad=adagrad)
        return new, (a if adagrad else acc), stats

    p_buf, p_acc, p_sq, p_gsq = plain(buf, acc)
    k_buf, k_acc, stats = kernel(buf, acc)
    touched = np.zeros(R, bool)
    touched[np.asarray(keys)[np.asarray(keys) < R]] = True
    assert not np.allclose(k_buf[touched], buf[touched])  # the touched rows moved
    np.testing.assert_array_equal(k_buf[~touched], buf[~touched])  # the others did not, bitwise
    np.testing.assert_array_equal(k_acc[~touched], acc[~touched])
    # repeats of a row are summed in (slot, bag, slot-in-bag) order by the kernel and in XLA's
    # scatter order by the plain path: float32 rounding apart
    np.testing.assert_allclose(k_buf, p_buf, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(k_acc, p_acc, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats, [p_sq, p_gsq], rtol=1e-4)
