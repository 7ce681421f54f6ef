"""Hessian-free (truncated-Newton) optimisation of the dense parameters, with a trust region
that uses negative curvature (Steihaug-CG; Nocedal & Wright, "Numerical Optimization", Alg. 7.2
and 4.1).

Each step minimises the local quadratic model of the loss,

    m(d) = g·d + ½ d·(H + λI)d,      ||d|| <= Δ,

with conjugate gradients on Hessian-vector products (never the Hessian; Martens 2010,
"Deep learning via Hessian-free optimization"), truncated after ``cg_iters`` iterations or
once the residual is small. Where CG meets a direction of non-positive curvature
(``p·(H + λI)p <= 0``), plain CG would stop (or divide by a negative number); Steihaug-CG
follows that direction to the trust region's boundary instead, which is exactly the descent
a saddle offers. The radius ``Δ`` adapts by the ratio of the actual to the predicted decrease
(shrunk by 4 below 1/4, doubled above 3/4 when the step reached the boundary), and a step
that does not decrease the loss is refused. The curvature products are of the step's
mini-batch loss, as in Martens' method; ``λ`` (``damping``) keeps the model's curvature
positive where the mini-batch Hessian is nearly singular.

It is an ``optax.GradientTransformationExtraArgs``: ``update(grads, state, params,
value_fn=loss)``, ``loss(params)`` the step's mini-batch loss, from which the
Hessian-vector products (reverse over reverse) and the trust region's ratio come. The train
step passes it for a dense optimizer named ``hessian_free`` (the embedding tables stay on
their sparse optimizer: the engine, whose lookups the loss holds fixed).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree


class HessianFreeState(NamedTuple):
    count: jax.Array  # steps taken (accepted or not)
    radius: jax.Array  # the trust region's radius Δ
    accepted: jax.Array  # whether the last step was taken (1.0) or refused (0.0)
    ratio: jax.Array  # the last step's actual / predicted decrease
    cg_iters: jax.Array  # CG iterations the last step ran
    negative_curvature: jax.Array  # whether the last step's CG met non-positive curvature


def steihaug_cg(
    hvp, g: jax.Array, radius: jax.Array, *, max_iters: int, tol: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Approximate minimiser of ``g·d + ½ d·B d`` over ``||d|| <= radius`` (``hvp(v) = B v``,
    flat vectors): ``(d, iterations, met non-positive curvature)``. On a positive definite
    ``B`` of dimension n with a large radius it is plain CG, exact after n iterations."""
    g_norm = jnp.linalg.norm(g)

    def to_boundary(z, p):
        # the tau >= 0 with ||z + tau p|| = radius
        a, b, c = p @ p, 2 * (z @ p), z @ z - radius**2
        tau = (-b + jnp.sqrt(jnp.maximum(b * b - 4 * a * c, 0.0))) / (2 * jnp.maximum(a, 1e-30))
        return z + tau * p

    def cond(c):
        j, _, _, _, done, _ = c
        return (j < max_iters) & ~done

    def body(c):
        j, z, r, p, _, neg = c
        bp = hvp(p)
        pbp = p @ bp
        rr = r @ r
        alpha = rr / jnp.where(pbp > 0, pbp, 1.0)
        z_next = z + alpha * p
        out_neg = pbp <= 0
        out_far = ~out_neg & (jnp.linalg.norm(z_next) >= radius)
        z_stop = to_boundary(z, p)
        r_next = r + alpha * bp
        small = jnp.linalg.norm(r_next) <= tol * g_norm
        z_new = jnp.where(out_neg | out_far, z_stop, z_next)
        beta = (r_next @ r_next) / jnp.maximum(rr, 1e-30)
        p_new = -r_next + beta * p
        done = out_neg | out_far | small
        return j + 1, z_new, r_next, p_new, done, neg | out_neg

    z0 = jnp.zeros_like(g)
    init = (jnp.zeros((), jnp.int32), z0, g, -g, g_norm == 0, jnp.zeros((), bool))
    j, z, _, _, _, neg = jax.lax.while_loop(cond, body, init)
    return z, j, neg


def hessian_free(
    learning_rate: float = 1.0,
    *,
    cg_iters: int = 20,
    damping: float = 1e-4,
    initial_radius: float = 1.0,
    max_radius: float = 100.0,
    cg_tol: float = 1e-4,
) -> optax.GradientTransformationExtraArgs:
    """Truncated Newton with Steihaug-CG in a trust region (module docstring). The update is
    ``learning_rate · d`` for an accepted step ``d``, zero for a refused one."""

    def init(params: Any) -> HessianFreeState:
        del params
        z = jnp.zeros((), jnp.float32)
        return HessianFreeState(
            count=jnp.zeros((), jnp.int32),
            radius=jnp.asarray(initial_radius, jnp.float32),
            accepted=z,
            ratio=z,
            cg_iters=jnp.zeros((), jnp.int32),
            negative_curvature=jnp.zeros((), bool),
        )

    def update(grads, state: HessianFreeState, params=None, *, value_fn=None, **extra):
        del extra
        if params is None or value_fn is None:
            raise ValueError("hessian_free: update needs params and value_fn=loss(params)")
        g, unravel = ravel_pytree(grads)
        x, _ = ravel_pytree(params)
        g = g.astype(jnp.float32)

        def flat_loss(v):
            return value_fn(unravel(v.astype(x.dtype)))

        def hvp(v):
            hv = jax.grad(lambda y: jnp.vdot(jax.grad(flat_loss)(y), v))(x)
            return hv.astype(jnp.float32) + damping * v

        d, iters, neg = steihaug_cg(hvp, g, state.radius, max_iters=cg_iters, tol=cg_tol)
        predicted = -(g @ d + 0.5 * d @ hvp(d))
        f0, f1 = flat_loss(x), flat_loss(x + learning_rate * d)
        actual = f0 - f1
        ratio = actual / jnp.where(predicted > 0, predicted, 1.0)
        ratio = jnp.where(predicted > 0, ratio, 0.0)
        at_edge = jnp.linalg.norm(d) >= 0.99 * state.radius
        radius = jnp.where(
            ratio < 0.25,
            0.25 * state.radius,
            jnp.where(
                (ratio > 0.75) & at_edge, jnp.minimum(2 * state.radius, max_radius), state.radius
            ),
        )
        ok = (actual > 0) & jnp.isfinite(f1)
        step = jnp.where(ok, learning_rate * d, 0.0)
        new = HessianFreeState(
            count=state.count + 1,
            radius=radius.astype(jnp.float32),
            accepted=ok.astype(jnp.float32),
            ratio=ratio.astype(jnp.float32),
            cg_iters=iters,
            negative_curvature=neg,
        )
        return unravel(step.astype(x.dtype)), new

    return optax.GradientTransformationExtraArgs(init, update)
