"""The Hessian-free optimizer: exact on a convex quadratic within n CG iterations, uses
negative curvature to leave a saddle, and decreases a non-convex objective."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recscale.optim.hessian_free import hessian_free, steihaug_cg


def _run(tx, f, x, steps):
    state = tx.init(x)
    update = jax.jit(lambda x, s: tx.update(jax.grad(f)(x), s, x, value_fn=f))
    history = [float(f(x))]
    for _ in range(steps):
        u, state = update(x, state)
        x = jax.tree.map(jnp.add, x, u)
        history.append(float(f(x)))
    return x, state, history


def test_one_step_solves_a_convex_quadratic_in_n_cg_iterations():
    n = 12
    rng = np.random.default_rng(0)
    m = rng.standard_normal((n, n))
    a = jnp.asarray(m @ m.T + n * np.eye(n), jnp.float32)
    b = jnp.asarray(rng.standard_normal(n), jnp.float32)

    def f(p):
        return 0.5 * p["x"] @ a @ p["x"] - b @ p["x"]

    tx = hessian_free(cg_iters=n, damping=0.0, initial_radius=1e6, cg_tol=0.0)
    x, state, _ = _run(tx, f, {"x": jnp.zeros(n)}, 1)
    np.testing.assert_allclose(x["x"], np.linalg.solve(np.asarray(a), np.asarray(b)), rtol=2e-4)
    assert int(state.cg_iters) <= n and float(state.accepted) == 1.0
    # Truncated at fewer iterations, CG is not yet exact.
    x3, *_ = _run(
        hessian_free(cg_iters=3, damping=0.0, initial_radius=1e6, cg_tol=0.0),
        f,
        {"x": jnp.zeros(n)},
        1,
    )
    assert float(f(x3)) > float(f(x)) + 1e-6


def test_steihaug_follows_negative_curvature_to_the_boundary():
    b = jnp.diag(jnp.array([2.0, -1.0]))
    g = jnp.array([0.1, 1.0])  # -g points mostly along the negative direction
    d, iters, neg = steihaug_cg(lambda v: b @ v, g, jnp.asarray(0.5), max_iters=5, tol=1e-8)
    assert bool(neg) and np.linalg.norm(d) == pytest.approx(0.5, rel=1e-5)
    assert float(g @ d + 0.5 * d @ b @ d) < 0  # a decrease of the model


def test_leaves_a_saddle_and_decreases_a_nonconvex_objective():
    # f = x² - y² + y⁴/4: a saddle at the origin, minima at (0, ±√2) with f = -1.
    def f(p):
        x, y = p[0], p[1]
        return x**2 - y**2 + 0.25 * y**4

    x, state, hist = _run(hessian_free(cg_iters=2, damping=0.0), f, jnp.array([1.0, 1e-3]), 15)
    assert all(b <= a for a, b in zip(hist, hist[1:], strict=False))  # never increases
    assert hist[-1] == pytest.approx(-1.0, abs=1e-4)
    np.testing.assert_allclose(np.abs(x), [0.0, np.sqrt(2.0)], atol=1e-3)

    def rosenbrock(p):
        return jnp.sum(100 * (p[1:] - p[:-1] ** 2) ** 2 + (1 - p[:-1]) ** 2)

    x, _, hist = _run(hessian_free(cg_iters=10), rosenbrock, jnp.full(6, -1.0), 60)
    assert all(b <= a for a, b in zip(hist, hist[1:], strict=False))
    assert hist[-1] < 1e-3 * hist[0]


def test_trains_dlrm_with_the_engine_and_refuses_the_per_table_path(tmp_path):
    import dataclasses
    import json

    import dlrm.presets  # noqa: F401  (registers the dlrm/* presets)
    from dlrm.model import build_model
    from recscale.config import EmbeddingShardingConfig, get_preset
    from recscale.train.experiment import make_optimizer
    from recscale.train.loop import train

    base = get_preset("dlrm/tiny")
    cfg = dataclasses.replace(
        base,
        dense_optim=dataclasses.replace(
            base.dense_optim,
            name="hessian_free",
            learning_rate=1.0,
            warmup_steps=0,
            decay="constant",
            weight_decay=0.0,
            grad_clip_norm=0.0,
            hf_cg_iters=5,
        ),
        train=dataclasses.replace(base.train, num_steps=4, log_every=1, progress=False),
        mesh=dataclasses.replace(base.mesh, data_parallel=8),
        embeddings=EmbeddingShardingConfig(sharding="row_wise"),
    )
    train(cfg, build_model, tmp_path)
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert len(train_rows) == 4
    for r in train_rows:
        assert np.isfinite(r["loss"]) and 1 <= r["hf_cg_iters"] <= 5 and r["hf_radius"] > 0
    assert sum(r["hf_accepted"] for r in train_rows) >= 1
    off = dataclasses.replace(cfg, embeddings=EmbeddingShardingConfig(sharding="off"))
    with pytest.raises(ValueError, match="hessian_free needs the embedding engine"):
        make_optimizer(off, {})
    with pytest.raises(ValueError, match="set grad_clip_norm 0, warmup_steps 0 and decay"):
        dataclasses.replace(cfg.dense_optim, decay="cosine")
