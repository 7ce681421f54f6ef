"""Wukong's optimized factorization machine in plain jnp: the spec, the oracle and the XLA path.

For each example b (Zhang et al., ICML 2024, section 3.3, "optimized FM"):

    T_b = X_bᵀ Y_b          [D, K]     X_b: [E, D], Y_b: [E, K]
    O_b = X_b T_b           [E, K]     = (X_b X_bᵀ) Y_b without forming the [E, E] X_b X_bᵀ

``Y`` is a learned projection shared by all examples (``[E, K]``) or, in the attentive variant,
one per example (``[B, E, K]``). With a cotangent ``G_b`` of ``O_b`` ([E, K]):

    dT_b = X_bᵀ G_b                          [D, K]
    dX_b = G_b T_bᵀ + Y_b dT_bᵀ              [E, D]   (O depends on X twice: directly, and via T)
    dY_b = X_b dT_b = X_b X_bᵀ G_b           [E, K]   (dY = Σ_b dY_b when Y is shared)

Dimension glossary: ``B`` batch, ``E`` embeddings entering the layer (Wukong's n), ``D``
embedding dim, ``K`` FM rank.

Computation runs in ``x``'s dtype (``y`` is cast to it) with float32 accumulation; the
intermediate ``T`` is rounded to ``x``'s dtype before the second product, as the two einsums of
XLA's own lowering would, so the Pallas kernels and this path round alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fm_interaction(x_bed: jax.Array, y: jax.Array) -> jax.Array:
    """``X (Xᵀ Y)`` per example: ``[B, E, K]`` from ``x_bed`` ``[B, E, D]`` and ``y`` ``[E, K]``
    or ``[B, E, K]``. Two batched matmuls; never forms ``X Xᵀ``. Differentiable by JAX."""
    y = y.astype(x_bed.dtype)
    spec = "bed,ek->bdk" if y.ndim == 2 else "bed,bek->bdk"
    t_bdk = jnp.einsum(spec, x_bed, y, preferred_element_type=jnp.float32).astype(x_bed.dtype)
    o_bek = jnp.einsum("bed,bdk->bek", x_bed, t_bdk, preferred_element_type=jnp.float32)
    return o_bek.astype(x_bed.dtype)


def fm_interaction_vjp(
    x_bed: jax.Array, y: jax.Array, g_bek: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The backward written out from the equations above, rounded like the Pallas backward
    kernels: ``(dX [B, E, D] in x's dtype, dY shaped like y in y's dtype)``, summed over the
    batch when ``y`` is shared. Products run in ``x``'s dtype with float32 accumulation, ``T``
    and ``dT`` are rounded to it, and the two terms of ``dX`` are added in float32 (JAX's
    autodiff of :func:`fm_interaction` rounds each before adding, which loses the small
    differences of large terms in bfloat16/float16).

    This is the XLA path's backward (``api`` wraps :func:`fm_interaction` in a custom VJP with
    it); it recomputes ``T`` instead of keeping it from the forward. The tests check it against
    ``jax.vjp`` of :func:`fm_interaction` in float32.
    """
    cd, f32, y_dtype = x_bed.dtype, jnp.float32, y.dtype
    y, g = y.astype(cd), g_bek.astype(cd)
    spec = "bed,ek->bdk" if y.ndim == 2 else "bed,bek->bdk"
    t_bdk = jnp.einsum(spec, x_bed, y, preferred_element_type=f32).astype(cd)
    dt_bdk = jnp.einsum("bed,bek->bdk", x_bed, g, preferred_element_type=f32).astype(cd)
    dx_bed = jnp.einsum("bek,bdk->bed", g, t_bdk, preferred_element_type=f32)
    y_spec = "ek,bdk->bed" if y.ndim == 2 else "bek,bdk->bed"
    dx_bed += jnp.einsum(y_spec, y, dt_bdk, preferred_element_type=f32)
    dy_spec = "bed,bdk->ek" if y.ndim == 2 else "bed,bdk->bek"
    dy = jnp.einsum(dy_spec, x_bed, dt_bdk, preferred_element_type=f32)
    return dx_bed.astype(cd), dy.astype(y_dtype)
