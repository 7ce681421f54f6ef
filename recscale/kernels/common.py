"""What every kernel folder shares: implementation names, the choice of one, interpret mode on
CPU, and the one dtype-keyed tolerance table the kernel tests compare against.

Every op lives in ``recscale/kernels/<op>/``: ``reference.py`` (plain jnp from the equations:
the spec, the oracle and the XLA fallback), ``pallas_gpu.py`` (Pallas, Triton backend),
``pallas_tpu.py`` (Pallas, Mosaic TPU backend) and ``api.py``, which models call. ``api.py``
resolves the configured implementation with :func:`resolve` and falls back to the reference
when the chosen kernel does not support a shape, dtype or backend, counting why in
:data:`FALLBACKS` (and logging it once).

Pallas kernels run on CPU only in interpret mode: :func:`interpret_for` gives the setting a
kernel runs with when none is forced (``False`` on its own backend; on CPU, TPU kernels run
under ``pltpu.InterpretParams`` set to raise on out-of-bounds reads and fill uninitialised
memory with NaN, GPU kernels under the generic interpreter).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

Impl = Literal["auto", "xla", "pallas_gpu", "pallas_tpu", "cpu_ffi"]
PALLAS_BACKEND = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}

HARDWARE_VERIFIED: frozenset[tuple[str, str]] = frozenset(
    (op, "pallas_gpu")
    for op in (
        "embedding_bag",
        "embedding_update",
        "quantized_embedding_bag",
        "dot_interaction",
        "fm_interaction",
        "hstu_attention",
    )
)
"""``(op, impl)`` pairs whose Pallas kernel passed its device tests compiled on that hardware
(``tests/recscale/kernels/test_on_device.py``: ``pytest -m gpu`` on a GPU, ``-m tpu`` on a TPU).
``auto`` picks only these on GPU and TPU (except :data:`AUTO_KEEPS_XLA`) and keeps the XLA
reference otherwise; any kernel runs when named (``--kernels.dot-interaction pallas_gpu``).
GPU: all five passed on an NVIDIA H200 (jax 0.11.2, CUDA 13), 2026-11-26, and HSTU's attention
on 2026-11-28 (BENCHMARKS.md). TPU:
none yet (lowering and interpret-mode checks only). An op's ``api`` may plan ``xla`` under
``auto`` before this is asked, where its kernel measured slower on some shapes (the embedding
bag's one-id narrow bags: ``embedding_bag.api.auto_choice``)."""

AUTO_KEEPS_XLA: dict[tuple[str, str], frozenset[str]] = {
    ("dot_interaction", "pallas_gpu"): frozenset({"float32"}),
    ("fm_interaction", "pallas_gpu"): frozenset({"float32"}),
    ("hstu_attention", "pallas_gpu"): frozenset({"float32"}),
}
"""Input dtypes for which ``auto`` keeps XLA although the kernel is verified: measured slower
than XLA there (H200: the float32 dense kernels compute at float32 accuracy, IEEE or 3xTF32
dots, and run at 0.4-0.9x XLA at the same accuracy; their bfloat16 forms are 1.1-2.4x faster
with the backward; HSTU's float32 attention (3xTF32) 1.3x XLA forward but 0.5x with its backward
at N 8,192, d 256, where bfloat16 is 1.9x / 2.2x at N 4,096, d 128; BENCHMARKS.md)."""

FALLBACKS: collections.Counter = collections.Counter()
"""``(op, requested impl, reason) -> count`` of calls that fell back to the reference."""

_log = logging.getLogger("recscale.kernels")
_UNVERIFIED_LOGGED: set[tuple[str, str]] = set()

# Tolerances of a kernel's output and VJP against the reference computed in float32 at
# HIGHEST precision, keyed by the kernel's input dtype. float32: kernels accumulate in a
# different order (and MXU/tensor-core passes round differently), so a few ulps of the
# accumulated magnitude. bfloat16/float16: the inputs themselves carry 8/11 mantissa bits, and
# outputs are rounded to that dtype once (2^-8 = 3.9e-3, 2^-11 = 4.9e-4 relative), with
# headroom for one more rounding of intermediates. Changing a value needs a written reason.
TOLERANCES: dict[Any, dict[str, float]] = {
    jnp.dtype(jnp.float32): {"rtol": 1e-5, "atol": 1e-5},
    jnp.dtype(jnp.bfloat16): {"rtol": 1.6e-2, "atol": 1.6e-2},
    jnp.dtype(jnp.float16): {"rtol": 2e-3, "atol": 2e-3},
}


def tolerance(dtype) -> dict[str, float]:
    """``{"rtol", "atol"}`` for comparing a kernel run on ``dtype`` inputs with the reference."""
    return TOLERANCES[jnp.dtype(dtype)]


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "recscale_kernel_target", default=None
)


@contextlib.contextmanager
def target_backend(backend: str) -> Iterator[None]:
    """Within it, kernels are chosen and built for ``backend`` (``"gpu"`` or ``"tpu"``) rather
    than the default backend: ``auto`` resolves for it and Pallas kernels are not interpreted.
    For lowering whole steps from a CPU host: ``jax.jit(step).trace(...).lower(
    lowering_platforms=("cuda",))`` inside ``target_backend("gpu")``."""
    if backend not in ("gpu", "tpu"):
        raise ValueError(f"target_backend: expected gpu or tpu, got {backend!r}")
    token = _TARGET.set(backend)
    try:
        yield
    finally:
        _TARGET.reset(token)


def default_backend() -> str:
    """The backend kernels are chosen for: :func:`target_backend`'s, else JAX's default."""
    return _TARGET.get() or jax.default_backend()


def auto_impl(backend: str | None = None) -> str:
    """The implementation ``auto`` means on ``backend`` (default: JAX's default backend)."""
    backend = backend or default_backend()
    return {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend, "xla")


def interpret_for(impl: str) -> Any:
    """The ``interpret=`` a Pallas implementation runs with on the default backend."""
    backend = default_backend()
    want = PALLAS_BACKEND[impl]
    if backend == want or (want == "gpu" and backend == "cuda"):
        return False
    if impl == "pallas_tpu":
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415

        return pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
    return True


def resolve(
    op: str,
    impl: str,
    unsupported: dict[str, str | None],
    *,
    cpu_auto: str | None = None,
    dtype: Any = None,
) -> str:
    """The implementation to run: ``impl`` (``auto`` resolved for the default backend, to a
    Pallas kernel only if it is in :data:`HARDWARE_VERIFIED` and ``dtype`` is not in its
    :data:`AUTO_KEEPS_XLA`) unless ``unsupported[impl]`` gives a reason it cannot run this call,
    then ``xla``. ``cpu_auto``: the implementation ``auto`` means on CPU when ``unsupported``
    allows it (e.g. ``cpu_ffi``; default ``xla``).

    ``unsupported`` maps each non-reference implementation of the op to ``None`` (it supports
    this call) or the reason it does not (shape, dtype, variant). A requested implementation
    the op does not have is an error, not a fallback.
    """
    if impl == "auto" and default_backend() == "cpu":
        # On CPU ``auto`` is a plan, not a request: the op's CPU kernel where it supports the
        # call, else XLA; nothing to count as a fallback.
        return cpu_auto if cpu_auto and unsupported.get(cpu_auto) is None else "xla"
    requested = auto_impl() if impl == "auto" else impl
    if requested == "xla":
        return "xla"
    if impl == "auto" and requested in PALLAS_BACKEND and (op, requested) not in HARDWARE_VERIFIED:
        if (op, requested) not in _UNVERIFIED_LOGGED:
            _UNVERIFIED_LOGGED.add((op, requested))
            _log.info(
                "%s: auto keeps the XLA reference: %s is not verified on hardware yet "
                "(name it to run it)",
                op,
                requested,
            )
        return "xla"
    if (
        impl == "auto"
        and dtype is not None
        and jnp.dtype(dtype).name in AUTO_KEEPS_XLA.get((op, requested), ())
    ):
        return "xla"
    if requested not in unsupported:
        if impl == "auto":  # e.g. cpu_ffi-only ops on GPU
            return "xla"
        raise ValueError(f"{op}: unknown implementation {impl!r}; have xla, {sorted(unsupported)}")
    reason = unsupported[requested]
    if reason is None:
        return requested
    key = (op, requested, reason)
    if key not in FALLBACKS:
        _log.info("%s: %s falls back to the XLA reference: %s", op, requested, reason)
    FALLBACKS[key] += 1
    return "xla"


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def next_pow2(x: int) -> int:
    return 1 << max(0, int(np.ceil(np.log2(max(x, 1)))))
