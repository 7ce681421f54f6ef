"""The curvature of the loss around trained parameters: the top eigenvalues of the Hessian
(Lanczos on Hessian-vector products) and Keskar et al.'s ε-sharpness (ICLR 2017, "On
Large-Batch Training for Deep Learning: Generalization Gap and Sharp Minima").

Any family's ``evaluate`` measures it on a checkpoint: ``python -m dlrm.evaluate --workdir DIR
--curvature [--curvature-batches 4] [--curvature-top-k 5] [--curvature-iters 40]
[--curvature-epsilon 1e-3 5e-4]`` (``recscale.train.evaluation``) fixes the run's embedding
tables and measures the dense parameters' curvature on the first training batches, the model
in evaluation mode (BatchNorm's running statistics, no dropout: the loss is a fixed function of
the dense parameters); the JSON gains ``curvature``, also written to ``DIR/curvature.json``.

- **Hessian spectrum.** Lanczos with full reorthogonalisation (hand-written: no maintained
  JAX library offers it for pytrees; the matrix-free product is the gradient of
  ``<grad f, v>``, reverse over reverse, :func:`hvp`). ``iters`` steps give Ritz values whose
  extremes converge first: the largest eigenvalues (what sharpness means) and the most
  negative one.
- **ε-sharpness** (Keskar's Metric 2.1 with ``A = I``): ``100 · (max_{y ∈ C_ε} f(x + y) - f(x))
  / (1 + f(x))`` over the box ``|y_i| <= ε (|x_i| + 1)``. Keskar maximise with L-BFGS-B; here
  projected sign-gradient ascent (the box's own geometry: each step moves every coordinate by
  a fixed fraction of its half-width), keeping the best value seen. An inner approximation of
  the maximum, as theirs is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree


def hvp(loss: Callable[[Any], jax.Array], params: Any, v: Any) -> Any:
    """The Hessian of ``loss`` at ``params`` times ``v`` (pytrees like ``params``), as the
    gradient of ``<grad loss, v>``: reverse over reverse, since the models' custom-VJP ops
    (the kernels' APIs) admit no forward mode."""
    return jax.grad(lambda p: optax.tree.vdot(jax.grad(loss)(p), v))(params)


def lanczos(
    matvec: Callable[[jax.Array], jax.Array], v0: jax.Array, iters: int
) -> tuple[np.ndarray, np.ndarray]:
    """``iters`` steps of Lanczos on the symmetric operator ``matvec`` from ``v0``, with full
    reorthogonalisation. The products run on the device; the Krylov basis, the
    reorthogonalisation and the small tridiagonal stay on the host in float64 (one shape
    throughout: nothing recompiles as the basis grows). Returns the Ritz values (ascending)
    and the tridiagonal's ``(alpha, beta)`` stacked."""
    n = v0.shape[0]
    iters = min(iters, n)
    basis = np.zeros((iters, n))
    q = np.asarray(v0, np.float64)
    q /= np.linalg.norm(q)
    alphas, betas = [], []
    for j in range(iters):
        basis[j] = q
        w = np.asarray(matvec(jnp.asarray(q, v0.dtype)), np.float64)
        alphas.append(float(q @ w))
        # Full reorthogonalisation against every earlier vector (twice: "twice is enough").
        for _ in range(2):
            w -= basis[: j + 1].T @ (basis[: j + 1] @ w)
        beta = float(np.linalg.norm(w))
        if j == iters - 1 or beta < 1e-10 * max(1.0, abs(alphas[-1])):
            break
        betas.append(beta)
        q = w / beta
    k = len(alphas)
    t = np.diag(alphas) + np.diag(betas[: k - 1], 1) + np.diag(betas[: k - 1], -1)
    return np.linalg.eigvalsh(t), np.array([alphas, betas[:k] + [0.0] * (k - len(betas[:k]))])


def hessian_extremes(
    loss: Callable[..., jax.Array],
    params: Any,
    *args: Any,
    top_k: int = 5,
    iters: int = 40,
    seed: int = 0,
) -> dict:
    """``{"top": the top_k Ritz values, descending, "min": the smallest, "iters", "dim"}`` of
    the Hessian of ``loss(params, *args)`` with respect to ``params``."""
    flat, unravel = ravel_pytree(params)

    @jax.jit
    def matvec(x, params, args):
        v = unravel(x.astype(flat.dtype))
        hv = hvp(lambda p: loss(p, *args), params, v)
        return ravel_pytree(hv)[0].astype(jnp.float32)

    v0 = jax.random.normal(jax.random.key(seed), flat.shape, jnp.float32)
    ritz, _ = lanczos(lambda x: matvec(x, params, args), v0, iters)
    return {
        "top": [float(x) for x in ritz[::-1][:top_k]],
        "min": float(ritz[0]),
        "iters": int(min(iters, flat.shape[0])),
        "dim": int(flat.shape[0]),
    }


def epsilon_sharpness(
    loss: Callable[..., jax.Array],
    params: Any,
    *args: Any,
    epsilon: float,
    steps: int = 20,
    step_frac: float = 0.25,
) -> dict:
    """Keskar's ε-sharpness of ``loss(params, *args)`` at ``params`` over the box
    ``|y| <= ε (|x| + 1)``: ``{"epsilon", "loss", "max_loss", "sharpness"}``."""

    @jax.jit
    def value_and_grad(y, params, args):
        return jax.value_and_grad(lambda y_: loss(jax.tree.map(jnp.add, params, y_), *args))(y)

    @jax.jit
    def ascend(y, g, params):
        def step(y_, g_, x):
            b = epsilon * (jnp.abs(x) + 1.0)
            return jnp.clip(y_ + step_frac * b * jnp.sign(g_), -b, b)

        return jax.tree.map(step, y, g, params)

    y = jax.tree.map(jnp.zeros_like, params)
    f0 = float(value_and_grad(y, params, args)[0])
    best = f0
    for _ in range(steps):
        f, g = value_and_grad(y, params, args)
        best = max(best, float(f))
        y = ascend(y, g, params)
    best = max(best, float(value_and_grad(y, params, args)[0]))
    return {
        "epsilon": epsilon,
        "loss": f0,
        "max_loss": best,
        "sharpness": 100.0 * (best - f0) / (1.0 + f0),
    }
