"""The DLRM dot interaction models call: picks the implementation, falls back to the reference.

``impl``: ``"auto"`` (Pallas on GPU/TPU once verified on that hardware (``common.HARDWARE_VERIFIED``), else XLA; on CPU
:func:`cpu_auto_choice`), ``"xla"`` (``reference.py``), ``"cpu_ffi"`` (the C++ XLA-FFI CPU
kernel, ``cpu_ffi.py``: float32, built on first use),
``"pallas_gpu"`` (Triton, ``pallas_gpu.py``) or ``"pallas_tpu"`` (Mosaic, ``pallas_tpu.py``).
A kernel that does not support the call's shape, dtype or backend falls back to the
reference, counted in ``common.FALLBACKS``. The kernel paths are differentiable through a
``jax.custom_vjp`` whose backward is the matching backward kernel.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from recscale import sharding
from recscale.kernels import common
from recscale.kernels.dot_interaction import pallas_gpu, pallas_tpu, reference

OP = "dot_interaction"
_KERNELS = {"pallas_gpu": pallas_gpu, "pallas_tpu": pallas_tpu}

CPU_AUTO_WIDTHS = frozenset({4, 8, 16})
"""The widths ``D`` at which ``auto`` runs the C++ kernel on a CPU with AVX-512: faster there in
the whole training step, every round (``benchmarks/step_overhead.py --rungs d2 d3 d5 d8 w1
--batch 256 1024 --dot-interaction xla cpu_ffi``, 2 shared cores, medians of 3 alternating
rounds): the study's d2 (D = 4) 1.39x at batch 256 and 1.70x at 1,024, d3 (D = 8) 1.30x / 1.44x,
d5 (D = 16) 1.13x / 1.23x. d8 (D = 32) measured even (1.02x at 1,024) and keeps XLA, as do
widths not measured in a step (the generic loop, e.g. D = 10, ran 0.4-0.8x XLA on the op
alone)."""


@functools.cache
def _has_avx512() -> bool:
    """Whether this CPU has AVX-512F (the kernel is built with ``-march=native``)."""
    try:
        return " avx512f " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


def cpu_auto_choice(shape: tuple[int, ...], dtype) -> str:
    """What ``auto`` plans on CPU for ``x`` of ``shape``/``dtype``: ``cpu_ffi`` for float32 at
    a width in :data:`CPU_AUTO_WIDTHS` on an AVX-512 CPU (the widths' AVX-512 loops are what
    was measured), else ``xla``."""
    if jnp.dtype(dtype) == jnp.float32 and shape[2] in CPU_AUTO_WIDTHS and _has_avx512():
        return "cpu_ffi"
    return "xla"


def unsupported(
    shape: tuple[int, ...], dtype, self_interaction: bool, impl: str = "auto"
) -> dict[str, str | None]:
    """For each kernel, why it cannot run ``x`` of ``shape``/``dtype`` (None: it can). The C++
    kernel is asked (and built) only when ``impl`` may run it: ``cpu_ffi``, or ``auto`` where
    :func:`cpu_auto_choice` plans it."""
    n = shape[1]
    if reference.num_pairs(n, self_interaction) == 0:
        no_pairs = f"N={n} without self-interaction has no pairs"
        return dict.fromkeys((*_KERNELS, "cpu_ffi"), no_pairs)
    return {
        "pallas_gpu": pallas_gpu.unsupported(shape, dtype),
        "pallas_tpu": pallas_tpu.unsupported(shape, dtype, self_interaction),
        "cpu_ffi": _cpu_ffi_unsupported(shape, dtype)
        if impl == "cpu_ffi" or (impl == "auto" and cpu_auto_choice(shape, dtype) == "cpu_ffi")
        else "not requested",
    }


def _cpu_ffi_unsupported(shape: tuple[int, ...], dtype) -> str | None:
    """Why the C++ CPU kernel cannot run ``x`` of ``shape``/``dtype`` (None: it can). Builds it
    on first use."""
    if common.default_backend() != "cpu":
        return f"the C++ kernel runs on CPU only (backend is {common.default_backend()})"
    if jnp.dtype(dtype) != jnp.float32:
        return f"the C++ kernel reads float32, got {jnp.dtype(dtype).name}"
    if shape[0] == 0:
        return "empty batch"
    from recscale.kernels.dot_interaction import cpu_ffi  # noqa: PLC0415 (compiles on first use)

    if not cpu_ffi.available():
        return "the C++ kernel did not build here (no compiler, or RECSCALE_CPU_KERNELS=0)"
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _pallas(x_bnd: jax.Array, self_interaction: bool, impl: str, interpret: Any) -> jax.Array:
    kernels = _KERNELS[impl]
    return kernels.forward(x_bnd, self_interaction=self_interaction, interpret=interpret)


def _pallas_fwd(x_bnd, self_interaction, impl, interpret):
    return _pallas(x_bnd, self_interaction, impl, interpret), x_bnd


def _pallas_bwd(self_interaction, impl, interpret, x_bnd, g_bp):
    kernels = _KERNELS[impl]
    dx = kernels.backward(x_bnd, g_bp, self_interaction=self_interaction, interpret=interpret)
    return (dx,)


_pallas.defvjp(_pallas_fwd, _pallas_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _cpu_ffi(x_bnd: jax.Array, self_interaction: bool) -> jax.Array:
    from recscale.kernels.dot_interaction import cpu_ffi  # noqa: PLC0415

    return cpu_ffi.forward(x_bnd, self_interaction=self_interaction)


def _cpu_ffi_fwd(x_bnd, self_interaction):
    return _cpu_ffi(x_bnd, self_interaction), x_bnd


def _cpu_ffi_bwd(self_interaction, x_bnd, g_bp):
    return (_cpu_ffi_grad(x_bnd, g_bp.astype(x_bnd.dtype), self_interaction),)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cpu_ffi_grad(x_bnd: jax.Array, g_bp: jax.Array, self_interaction: bool) -> jax.Array:
    """The C++ backward, itself differentiable (a gradient of the gradient: Hessian-vector
    products in ``analysis.curvature`` and ``optim.hessian_free``) through the reference's."""
    from recscale.kernels.dot_interaction import cpu_ffi  # noqa: PLC0415

    return cpu_ffi.backward(x_bnd, g_bp)


def _reference_grad(x_bnd, g_bp, self_interaction):
    pull = jax.vjp(lambda x: reference.dot_interaction(x, self_interaction=self_interaction), x_bnd)
    return pull[1](g_bp)[0]


def _cpu_ffi_grad_fwd(x_bnd, g_bp, self_interaction):
    return _cpu_ffi_grad(x_bnd, g_bp, self_interaction), (x_bnd, g_bp)


def _cpu_ffi_grad_bwd(self_interaction, res, ct):
    _, pull = jax.vjp(lambda x, g: _reference_grad(x, g, self_interaction), *res)
    return pull(ct)


_cpu_ffi_grad.defvjp(_cpu_ffi_grad_fwd, _cpu_ffi_grad_bwd)


_cpu_ffi.defvjp(_cpu_ffi_fwd, _cpu_ffi_bwd)


def dot_interaction(
    x: jax.Array, *, self_interaction: bool = False, impl: str = "auto", interpret: Any = None
) -> jax.Array:
    """[B, P]: for each example the pairwise dot products of its N vectors x[b] ([B, N, D]),
    lower triangle of X·Xᵀ row by row: z[b, i, j] for j < i (j <= i with self_interaction),
    ordered as numpy's tril_indices(N, -1 or 0). P = N(N-1)/2 or N(N+1)/2. Output dtype = x's
    dtype, accumulated in float32. Differentiable w.r.t. x.

    Args:
        x: ``[B, N, D]`` interacting vectors (float32, bfloat16 or float16 for the kernels).
        self_interaction: keep the diagonal ``x_i · x_i`` too.
        impl: ``"auto"``, ``"xla"``, ``"cpu_ffi"``, ``"pallas_gpu"`` or ``"pallas_tpu"``; a
            kernel that does not support this call falls back to ``"xla"`` (counted in
            ``common.FALLBACKS``).
        interpret: the Pallas ``interpret=`` setting; None: ``common.interpret_for(impl)``
            (interpret mode off the kernel's own backend). ``False`` lowers for the real
            backend, e.g. to check GPU/TPU lowering from a CPU host.

    Raises:
        ValueError: ``x`` is not 3-D, or ``impl`` is unknown.
    """
    if x.ndim != 3:
        raise ValueError(f"{OP}: x must be [B, N, D], got shape {x.shape}")
    self_interaction = bool(self_interaction)
    # (the reference asks no kernel: its shapes may be symbolic, as in ``jax.export``)
    why = {} if impl == "xla" else unsupported(x.shape, x.dtype, self_interaction, impl)
    cpu_auto = cpu_auto_choice(x.shape, x.dtype) if impl == "auto" else None
    chosen = common.resolve(OP, impl, why, dtype=x.dtype, cpu_auto=cpu_auto)
    if chosen == "xla":
        return reference.dot_interaction(x, self_interaction=self_interaction)
    if chosen == "cpu_ffi":
        return sharding.map_batch(lambda x: _cpu_ffi(x, self_interaction), x, batched=(True,))
    if interpret is None:
        interpret = common.interpret_for(chosen)
    # Per device under an active mesh: XLA cannot split a custom call over the batch.
    return sharding.map_batch(
        lambda x: _pallas(x, self_interaction, chosen, interpret), x, batched=(True,)
    )
