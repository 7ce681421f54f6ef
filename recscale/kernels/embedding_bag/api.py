"""Pooled embedding-bag lookup: the function models call.

:func:`pool` picks an implementation and falls back to the XLA reference, counted in
``common.FALLBACKS``, when the chosen one does not support the call:

- ``xla``: :mod:`.reference` (a masked row gather per bag slot, float32 accumulation);
- ``cpu_ffi``: the C++ XLA-FFI CPU kernel (:mod:`.cpu_ffi`): float32 tables, bags of two or
  more slots (one-id bags are a single gather, where XLA is as fast), built on first use;
- ``pallas_gpu``: :mod:`.pallas_gpu` (Triton: masked vector gathers summed in registers);
- ``pallas_tpu``: :mod:`.pallas_tpu` (Mosaic: rows DMA'd from HBM into VMEM, summed there);
- ``auto``: by backend, bag hotness and width (:func:`auto_choice`): on CPU ``cpu_ffi`` for
  multi-id bags where it supports the call, else ``xla``; on GPU ``xla`` for one-id bags up to
  :data:`ONE_ID_XLA_MAX_WIDTH` wide and that backend's Pallas kernel otherwise, on TPU its
  Pallas kernel, each once verified on that hardware (``common.HARDWARE_VERIFIED``), else
  ``xla``.

Every implementation is differentiable w.r.t. the table through one ``jax.custom_vjp`` whose
backward is the reference's scatter-add (:func:`.reference.pool_bwd`): a dense table-shaped
gradient in the table's dtype, used only by the plain per-table model path (the sharded engine
never differentiates through ``pool``). Ids are not differentiable.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from recscale.kernels import common, members
from recscale.kernels.embedding_bag import pallas_gpu, pallas_tpu, reference

OP = "embedding_bag"
TABLE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

ONE_ID_XLA_MAX_WIDTH = 128
"""The widest one-id bags ``auto`` keeps on XLA on a GPU (the widths measured; wider one-id bags
were not, and keep the kernel)."""


def auto_choice(backend: str, hotness: int, width: int) -> str:
    """The implementation ``auto`` plans for bags of ``hotness`` id slots over a table
    ``width`` columns wide on ``backend`` (``cpu``, ``gpu``/``cuda``, ``tpu``), before asking
    whether that kernel supports the call and is verified on the hardware.

    - CPU: ``cpu_ffi`` for multi-id bags, ``xla`` for one-id bags (a single gather, where XLA
      is as fast: BENCHMARKS.md, "On this CPU", 0.99x at H = 1 against 1.31x at H = 20).
    - GPU: ``xla`` for one-id bags up to :data:`ONE_ID_XLA_MAX_WIDTH` wide, ``pallas_gpu``
      otherwise. Measured on an NVIDIA H200 (BENCHMARKS.md, 2026-11-26): one-id bags have
      nothing to fuse and the kernel never gained on them: 1.00-1.01x XLA at width 128 (the
      lookup alone), and DLRM config A (26 one-id tables of width 16) ran 12% slower in
      training and 27% slower in inference with the kernels (inference: the lookup is its
      only embedding kernel). Multi-id bags gained: 2.67-2.72x XLA at H = 20, width 128 (the
      lookup alone), and configs C and B (20 and 100 ids, width 64) trained 1.58x and 1.76x
      and inferred 2.0-5.5x faster.
    - TPU: ``pallas_tpu`` (not measured on hardware yet, so ``common.HARDWARE_VERIFIED`` keeps
      it off under ``auto``).
    """
    if backend == "cpu":
        return "cpu_ffi" if hotness >= 2 else "xla"
    if backend in ("gpu", "cuda"):
        return "xla" if hotness <= 1 and width <= ONE_ID_XLA_MAX_WIDTH else "pallas_gpu"
    if backend == "tpu":
        return "pallas_tpu"
    return "xla"


def check_ids(op: str, ids: jax.Array, pooling: str) -> None:
    """Raises ValueError unless ``ids`` is ``[N, H]`` integer and ``pooling`` is known."""
    if ids.ndim != 2:
        raise ValueError(f"{op}: ids must be [N, H] (bags x slots), got shape {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{op}: ids must be integers, got {ids.dtype}")
    if pooling not in reference.POOLINGS:
        raise ValueError(f"{op}: pooling must be one of {reference.POOLINGS}, got {pooling!r}")


def _check(table: jax.Array, ids: jax.Array, pooling: str) -> None:
    if table.ndim != 2:
        raise ValueError(f"{OP}: table must be [V, D], got shape {table.shape}")
    if jnp.dtype(table.dtype) not in TABLE_DTYPES:
        raise ValueError(
            f"{OP}: table must be float32, bfloat16 or float16, got {table.dtype} (int8 "
            "tables: recscale.kernels.quantized_embedding_bag)"
        )
    check_ids(OP, ids, pooling)


def _cpu_ffi_unsupported(table: jax.Array, ids: jax.Array) -> str | None:
    """Why the C++ CPU kernel cannot run this call (None: it can). Builds it on first use."""
    if common.default_backend() != "cpu":
        return f"the C++ kernel runs on CPU only (backend is {common.default_backend()})"
    if jnp.dtype(table.dtype) != jnp.float32:
        return f"the C++ kernel reads float32 tables, got {table.dtype}"
    if ids.shape[1] < 2:
        return "one-id bags: a single gather, where XLA is as fast"
    if ids.shape[0] == 0 or table.shape[1] == 0:
        return "empty input (no bags or columns)"
    from recscale.kernels.embedding_bag import cpu_ffi  # noqa: PLC0415 (compiles on first use)

    if not cpu_ffi.available():
        return "the C++ kernel did not build here (no compiler, or RECSCALE_CPU_KERNELS=0)"
    return None


def _choose(table: jax.Array, ids: jax.Array, impl: str) -> str:
    """The implementation :func:`pool` runs for this call (``impl`` resolved, or ``xla``)."""
    n, h = ids.shape
    if impl == "auto" and auto_choice(common.default_backend(), h, table.shape[1]) == "xla":
        return "xla"  # a plan, not a fallback
    tables = (jax.ShapeDtypeStruct(table.shape, table.dtype),)
    unsupported: dict[str, str | None] = {
        "pallas_gpu": pallas_gpu.unsupported(n, h, table.shape[1]),
        "pallas_tpu": pallas_tpu.unsupported(n, h, tables),
        "cpu_ffi": "not requested",
    }
    if impl in ("cpu_ffi", "auto"):  # only then: asking may build the C++ kernel
        unsupported["cpu_ffi"] = _cpu_ffi_unsupported(table, ids)
    return common.resolve(OP, impl, unsupported, cpu_auto="cpu_ffi")


def _cpu_ffi_pool(table_vd: jax.Array, ids_nh: jax.Array, *, pooling: str) -> jax.Array:
    from recscale.kernels.embedding_bag import cpu_ffi  # noqa: PLC0415

    num_rows = table_vd.shape[0]
    # The C++ kernel skips keys outside [0, R) (R: its buffer's row count) itself.
    out_nd = cpu_ffi.pool(table_vd, ids_nh[None])[0]
    if pooling == "mean":
        out_nd = out_nd / reference.bag_counts(ids_nh, num_rows)
    return out_nd


def _forward(impl: str, pooling: str, interpret: Any):
    if impl == "xla":
        return functools.partial(reference.pool, pooling=pooling)
    if impl == "cpu_ffi":
        return functools.partial(_cpu_ffi_pool, pooling=pooling)
    kernel = {"pallas_gpu": pallas_gpu.pool, "pallas_tpu": pallas_tpu.pool}[impl]
    if interpret is None:
        interpret = common.interpret_for(impl)
    return functools.partial(kernel, pooling=pooling, interpret=interpret)


def pool(
    table: jax.Array,
    ids: jax.Array,
    *,
    pooling: str = "sum",
    impl: str = "auto",
    interpret: Any = None,
    pack: int = 1,
) -> jax.Array:
    """[N, D] float32: bag n is the sum (or mean) of rows table[ids[n, h]] over h.

    table [V, D] (float32, bfloat16 or float16), ids [N, H] int32. Ids outside [0, V) are
    padding: they contribute nothing (models pad with -1; the sharded engine uses V as its
    padding id). mean divides by max(number of valid ids, 1). Accumulates in float32.

    Args:
      table: ``[V, D]`` embedding table.
      ids: ``[N, H]`` integer ids (cast to int32).
      pooling: ``"sum"`` or ``"mean"``.
      impl: ``"auto"``, ``"xla"``, ``"cpu_ffi"``, ``"pallas_gpu"`` or ``"pallas_tpu"``; an
        implementation that does not support the call falls back to ``"xla"``.
      interpret: the Pallas ``interpret=`` (None: ``common.interpret_for(impl)``; ``False``
        lowers for the real backend, e.g. to check lowering from CPU).
      pack: ``table`` is stored packed, ``[V/pack, pack·D]``: the row-major ``[V, D]``
        reshaped, ``pack`` rows side by side per stored row (``recscale.embeddings.layout``
        packs narrow buffers so for the TPU kernel, which reads them in place; every other
        implementation reads the ``[V, D]`` view, which on a TPU is a copy).

    Returns:
      ``[N, D]`` float32, differentiable w.r.t. ``table`` (the gradient has its dtype and
      shape).
    """
    _check(table, ids, pooling)
    ids = jnp.asarray(ids, jnp.int32)
    stored = table.shape
    if pack > 1 and stored[1] % pack:
        raise ValueError(f"{OP}: a table packed {pack} rows a row needs a width they divide")
    rows = table.reshape(stored[0] * pack, stored[1] // pack) if pack > 1 else table  # [V, D]
    chosen = _choose(rows, ids, impl)
    if pack > 1 and chosen != "pallas_tpu":
        return pool(rows, ids, pooling=pooling, impl=chosen, interpret=interpret)
    forward = _forward(chosen, pooling, interpret)
    if pack > 1:
        forward = functools.partial(forward, pack=pack)
    num_rows, dtype = rows.shape[0], table.dtype
    if chosen.startswith("pallas"):  # a population's members: one kernel over their tables
        forward = members.stacked_rows(forward, num_rows)

    @jax.custom_vjp
    def op(table, ids):
        return forward(table, ids)

    def op_fwd(table, ids):
        return forward(table, ids), ids

    def op_bwd(ids, g_nd):
        grad = reference.pool_bwd(ids, g_nd, num_rows, dtype, pooling=pooling)
        return grad.reshape(stored), None

    op.defvjp(op_fwd, op_bwd)
    return op(table, ids)
