"""The C++ CPU kernel of the dot interaction (``dot_interaction.cc``, XLA FFI), built on first use.

``available()`` builds, loads and registers it (``recscale.kernels.native``; False without a
compiler or with ``RECSCALE_CPU_KERNELS=0``, and the op runs its plain-JAX reference, which the
kernel matches: ``tests/recscale/kernels/test_dot_interaction.py``). :func:`forward` and
:func:`backward` follow ``reference._dot_interaction`` and its VJP, float32 only.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from recscale.kernels import native
from recscale.kernels.dot_interaction import reference

SOURCE = Path(__file__).with_name("dot_interaction.cc")


def available() -> bool:
    """Whether the kernel is built, loaded and registered (building it if need be)."""
    return native.load(
        SOURCE,
        "recscale_dot_interaction",
        (("recscale_dot_fwd", "RecscaleDotFwd"), ("recscale_dot_bwd", "RecscaleDotBwd")),
    )


def forward(x_bnd: jax.Array, *, self_interaction: bool) -> jax.Array:
    """``[B, P]`` float32: the triangle of each example's ``X·Xᵀ`` (``x`` float32 ``[B, N, D]``)."""
    b, n, _ = x_bnd.shape
    out = jax.ShapeDtypeStruct((b, reference.num_pairs(n, self_interaction)), jnp.float32)
    return jax.ffi.ffi_call("recscale_dot_fwd", out, vmap_method=native.VMAP)(x_bnd)


def backward(x_bnd: jax.Array, g_bp: jax.Array) -> jax.Array:
    """``[B, N, D]`` float32: ``(G + Gᵀ)·X`` per example, ``G`` the triangle ``g`` scattered
    (the diagonal is in it when ``g``'s width is ``N(N+1)/2``)."""
    out = jax.ShapeDtypeStruct(x_bnd.shape, jnp.float32)
    return jax.ffi.ffi_call("recscale_dot_bwd", out, vmap_method=native.VMAP)(x_bnd, g_bp)
