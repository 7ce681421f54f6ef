"""The curvature analysis: Lanczos recovers known Hessian spectra (negative eigenvalues
included), ε-sharpness equals its closed form on a quadratic."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from recscale.analysis import curvature


def _symmetric(eigs, seed=0):
    """A random orthogonal basis around the spectrum ``eigs``."""
    n = len(eigs)
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))
    return jnp.asarray(q @ np.diag(eigs) @ q.T, jnp.float32)


def test_lanczos_recovers_a_known_spectrum():
    # 60 parameters, a spread spectrum with two negative directions; extremes well separated.
    eigs = np.concatenate([[50.0, 20.0, 10.0], np.linspace(-0.5, 2.0, 55), [-3.0, -8.0]])
    a = _symmetric(eigs)
    x0 = jnp.ones(60) * 0.1

    def loss(p, a):
        return 0.5 * p @ a @ p

    got = curvature.hessian_extremes(loss, x0, a, top_k=3, iters=40)
    np.testing.assert_allclose(got["top"], [50.0, 20.0, 10.0], rtol=1e-4)
    np.testing.assert_allclose(got["min"], -8.0, rtol=1e-4)
    assert got["dim"] == 60


def test_hessian_vector_products_of_a_pytree():
    a = _symmetric(np.arange(1.0, 5.0))
    params = {"w": jnp.ones(4), "b": jnp.ones(())}

    def loss(p):
        return 0.5 * p["w"] @ a @ p["w"] + 1.5 * p["b"] ** 2

    v = {"w": jnp.arange(4.0), "b": jnp.ones(())}
    got = curvature.hvp(loss, params, v)
    np.testing.assert_allclose(got["w"], a @ v["w"], rtol=1e-5)
    np.testing.assert_allclose(got["b"], 3.0, rtol=1e-6)
    full = curvature.hessian_extremes(lambda p: loss(p), params, top_k=5, iters=10)
    np.testing.assert_allclose(full["top"], [4.0, 3.0, 3.0, 2.0, 1.0], rtol=1e-4)


def test_epsilon_sharpness_equals_the_closed_form_on_a_quadratic():
    # f(x) = 0.5·Σ c_i x_i²: the box's farthest corner from 0 is the maximiser,
    # y_i = sign(x_i)·ε(|x_i|+1).
    c = jnp.array([1.0, 4.0, 0.5])
    x = jnp.array([0.3, -0.2, 1.0])

    def loss(p):
        return 0.5 * jnp.sum(c * p * p)

    eps = 1e-2
    got = curvature.epsilon_sharpness(loss, x, epsilon=eps, steps=10)
    y = jnp.sign(x) * eps * (jnp.abs(x) + 1)
    f0, f1 = float(loss(x)), float(loss(x + y))
    assert got["max_loss"] == pytest.approx(f1, rel=1e-6)
    assert got["sharpness"] == pytest.approx(100 * (f1 - f0) / (1 + f0), rel=1e-5)
