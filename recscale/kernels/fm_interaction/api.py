"""Wukong's optimized FM ``X (Xᵀ Y)``: the function models call.

:func:`fm_interaction` picks an implementation (``xla``: :mod:`.reference`; ``pallas_gpu``:
:mod:`.pallas_gpu`; ``pallas_tpu``: :mod:`.pallas_tpu`; ``auto``: the Pallas kernel of the
default backend once verified on that hardware (``common.HARDWARE_VERIFIED``), else XLA) and falls back to the reference, counted in
``common.FALLBACKS``, when the chosen kernel does not support the call. The Pallas paths carry
a ``jax.custom_vjp`` whose backward is the op's Pallas backward kernel; it saves only ``x`` and
``y`` and recomputes ``T = Xᵀ Y`` (cheaper than writing it to HBM and reading it back). The
XLA path's VJP is the same backward in jnp (``reference.fm_interaction_vjp``), so every path
rounds alike.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from recscale import sharding
from recscale.kernels import common
from recscale.kernels.fm_interaction import pallas_gpu, pallas_tpu, reference

OP = "fm_interaction"
_KERNELS = {"pallas_gpu": pallas_gpu, "pallas_tpu": pallas_tpu}


def _check(x: jax.Array, y: jax.Array) -> None:
    if x.ndim != 3:
        raise ValueError(f"{OP}: x must be [B, E, D], got shape {x.shape}")
    b, e, _ = x.shape
    k = y.shape[-1] if y.ndim in (2, 3) else None
    if k is None or y.shape not in ((e, k), (b, e, k)):
        raise ValueError(f"{OP}: y must be [E, K] or [B, E, K] with x {x.shape}, got {y.shape}")
    for name, a in (("x", x), ("y", y)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{OP}: {name} must be floating point, got {a.dtype}")


def _unsupported(kernels, x: jax.Array, y: jax.Array) -> str | None:
    """Why the Pallas module ``kernels`` cannot run this call (None: it can)."""
    dtype = jnp.dtype(x.dtype)
    if dtype not in kernels.DTYPES:
        return f"dtype {dtype} (have {', '.join(map(str, kernels.DTYPES))})"
    if x.shape[0] == 0:
        return "empty batch"
    return kernels.unsupported_reason(x.shape, y.shape, dtype)


def _with_vjp(forward, backward, x: jax.Array, y: jax.Array) -> jax.Array:
    """``forward(x, y)`` differentiated by ``backward(x, y, g) -> (dx, dy)``."""

    @jax.custom_vjp
    def op(x, y):
        return forward(x, y)

    def op_fwd(x, y):
        return forward(x, y), (x, y)

    def op_bwd(res, g):
        return backward(*res, g)

    op.defvjp(op_fwd, op_bwd)
    return op(x, y)


def fm_interaction(
    x: jax.Array, y: jax.Array, *, impl: str = "auto", interpret: Any = None
) -> jax.Array:
    """Wukong's optimized factorization machine: [B, E, K] = X·(Xᵀ·Y) per example, where
    x [B, E, D] and y [E, K] (a learned projection shared by all examples) or [B, E, K] (the
    attentive variant: one per example). Never forms X·Xᵀ. Output dtype = x's dtype, float32
    accumulation. Differentiable w.r.t. x and y.

    Args:
      x: ``[B, E, D]`` embeddings entering the layer (float32, bfloat16 or float16).
      y: ``[E, K]`` projection, or ``[B, E, K]`` per example; cast to ``x``'s dtype for the
        products (its gradient comes back in its own dtype).
      impl: ``auto``, ``xla``, ``pallas_gpu`` or ``pallas_tpu``.
      interpret: the Pallas ``interpret=`` setting; None: ``common.interpret_for(impl)``
        (compiled on its own backend, interpreted on CPU).

    Raises:
      ValueError: on shapes that are not ``[B, E, D]`` with ``[E, K]`` / ``[B, E, K]``.
    """
    _check(x, y)
    # (the reference asks no kernel: its shapes may be symbolic, as in ``jax.export``)
    unsupported = (
        {} if impl == "xla" else {name: _unsupported(mod, x, y) for name, mod in _KERNELS.items()}
    )
    chosen = common.resolve(OP, impl, unsupported, dtype=x.dtype)
    if chosen == "xla":
        return _with_vjp(reference.fm_interaction, reference.fm_interaction_vjp, x, y)
    if interpret is None:
        interpret = common.interpret_for(chosen)
    kernels = _KERNELS[chosen]
    fwd = functools.partial(kernels.fm_interaction_fwd, interpret=interpret)
    bwd = functools.partial(kernels.fm_interaction_bwd, interpret=interpret)
    # Per device under an active mesh: XLA cannot split a custom call over the batch.
    return sharding.map_batch(
        lambda x, y: _with_vjp(fwd, bwd, x, y), x, y, batched=(True, y.ndim == 3)
    )
