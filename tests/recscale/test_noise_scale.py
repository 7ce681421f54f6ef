"""The gradient noise scale estimator recovers the planted value on a quadratic with known
gradient noise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recscale.analysis import noise_scale


def test_recovers_the_planted_noise_scale_of_a_quadratic():
    # Per-example loss 0.5·|θ - x_i|², x_i = μ + σ·ε_i: gradient θ - x_i, so G = θ - μ and
    # Σ = σ² I; B_simple = d σ² / |θ - μ|² = 50 · 4 / 2 = 100.
    d, sigma = 50, 2.0
    key = jax.random.key(0)
    mu = jax.random.normal(key, (d,))
    theta = mu + jnp.sqrt(2.0 / d)  # |θ - μ|² = 2
    planted = d * sigma**2 / 2.0

    @jax.jit
    def measure(x):
        def sq_norms(batch):
            return {"p": jnp.sum(jnp.square(theta - batch.mean(axis=0)))}

        return noise_scale.micro_batch_sq_norms(sq_norms, x, 8)

    ns = noise_scale.NoiseScale(decay=0.99)
    n = 1024
    now = []
    for i in range(400):
        x = mu + sigma * jax.random.normal(jax.random.fold_in(key, i + 1), (n, d))
        small, big = measure(x)
        out = ns.update(small, big, n / 8, n)
        now.append((out["p/g2_now"], out["p/trace_now"]))
    assert out["p"] == pytest.approx(planted, rel=0.05)
    assert out["p/g2"] == pytest.approx(2.0, rel=0.05)
    assert out["p/trace"] == pytest.approx(d * sigma**2, rel=0.03)
    # Each measurement's own estimates are unbiased: their plain mean recovers both terms too.
    g2_now, trace_now = np.mean(now, axis=0)
    assert g2_now == pytest.approx(2.0, rel=0.05)
    assert trace_now == pytest.approx(d * sigma**2, rel=0.03)


def test_estimates_are_exact_on_expected_norms_and_errors_are_clear():
    # E|G_B|² = |G|² + tr(Σ)/B exactly: the estimates invert it.
    g2, trace = 3.0, 600.0
    got = noise_scale.estimates(g2 + trace / 64, g2 + trace / 512, 64, 512)
    np.testing.assert_allclose(got, (g2, trace), rtol=1e-12)
    with pytest.raises(ValueError, match="must be >= 2 and divide the batch 10"):
        noise_scale.micro_batch_sq_norms(lambda b: {}, jnp.zeros((10, 2)), 3)
