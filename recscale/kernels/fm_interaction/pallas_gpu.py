"""Wukong's optimized FM ``X (Xᵀ Y)`` in Pallas (Triton backend): forward and backward.

Design. XLA computes the op as two batched einsums, writing ``T = Xᵀ Y`` ([B, D, K]) to HBM
and reading it back (and, in the backward, ``T`` and ``dT = Xᵀ G`` again). Here each program
owns a block of ``block_b`` consecutive examples and walks them in a ``fori_loop`` (Triton
pipelines the next example's loads behind the current one's dots, ``num_stages``). Per example
it loads ``X_b`` [E, D] once, forms ``T_b`` in registers and immediately uses it:

    forward   T = Xᵀ Y,  O = X T                                      2 dots, reads X, writes O
    backward  T = Xᵀ Y,  dT = Xᵀ G,  dX = G Tᵀ + Y dTᵀ,  dY += X dT   5 dots, reads X and G once,
                                                                      writes dX

``T`` is recomputed in the backward rather than saved: saving it would write and re-read
B·D·K values (for D=128, K=24, E=32 that is 3/4 of X's own bytes) to spare one small dot per
example, and the op is bound by memory traffic, not by tensor-core time. The shared
projection ``Y`` [E, K] is loaded once per program. ``dY = Σ_b X_b dT_b`` is accumulated in a
float32 register tile over the program's examples and written as one partial per program
(``[num_programs, E, K]``, float32), which XLA sums (B=65536 with block_b=32: 2048 partials,
~0.3% of the backward's traffic). In the attentive variant (``y`` [B, E, K]) ``Y_b`` is loaded
per example and ``dY_b`` stored per example.

Triton constraints and how they are met. Pallas Triton's dot is 2-D only (no batch dims), so
the batch is the loop, one example's [E, D] x [D, K] products per step; transposed operands
(``Xᵀ``, ``Tᵀ``) are folded into the dot by the lowering. Values must have power-of-two shapes
(and tensor-core dots want every dim >= 16): E, D, K are padded to ``max(16, next_pow2(n))``
with masked loads (padding reads as zero, so it adds nothing to any sum) and masked stores.
Arrays are passed whole and addressed by row (``[B·E, D]`` views), so examples past ``B`` in the
last program are masked out, not padded in HBM.

Precision: bfloat16/float16 inputs run on tensor cores with float32 accumulation; ``T`` and
``dT`` are rounded to the input dtype before the dots that consume them, as XLA's einsums
would. float32 inputs use 3xTF32 (float32-accurate on tensor cores); under interpret mode
(CPU, which has no TF32) they use HIGHEST.

Limits: float32/bfloat16/float16; the padded per-example tiles must fit in registers
(``E_p·D_p <= 16384`` and ``D_p·K_p <= 8192``, e.g. E=56, D=192, K=32); larger shapes fall back
(see :func:`unsupported_reason`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from recscale.kernels import common

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_XTILE = 16384  # E_p·D_p: X and dX tiles live in registers.
MAX_TTILE = 8192  # D_p·K_p: T and dT tiles live in registers.
MIN_DIM = 16  # tensor-core dots want every dim >= 16


def _pad(n: int) -> int:
    return max(MIN_DIM, common.next_pow2(n))


def unsupported_reason(x_shape: tuple, y_shape: tuple, dtype) -> str | None:
    """Why these kernels cannot run a non-empty call of one of ``DTYPES`` (None when they can;
    ``api`` checks the dtype and the batch first)."""
    _, e, d = x_shape
    k = y_shape[-1]
    ep, dp, kp = _pad(e), _pad(d), _pad(k)
    if ep * dp > MAX_XTILE:
        return f"padded [E, D] tile {ep}x{dp} exceeds the register budget ({MAX_XTILE} values)"
    if dp * kp > MAX_TTILE:
        return f"padded [D, K] tile {dp}x{kp} exceeds the register budget ({MAX_TTILE} values)"
    return None


@dataclasses.dataclass(frozen=True)
class _Dims:
    """True sizes (``_pad`` gives the padded value shapes ``E_p``, ``D_p``, ``K_p``)."""

    b: int
    e: int
    d: int
    k: int


def _precision(dtype, interpret: bool):
    if jnp.dtype(dtype) != jnp.float32:
        return None  # bf16/f16 tensor-core dots, float32 accumulation
    return lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _dot(a, b, contract: tuple[int, int], precision) -> jax.Array:
    """2-D ``a·b`` contracting ``a``'s dim ``contract[0]`` with ``b``'s ``contract[1]``, in f32."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _compiler_params(dims: _Dims, num_stages: int) -> plgpu.CompilerParams:
    num_warps = 8 if _pad(dims.e) * _pad(dims.d) >= 8192 else 4
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


class _Tile:
    """Row/column index vectors and masks of one example's padded tiles."""

    def __init__(self, dims: _Dims):
        self.e_idx = jnp.arange(_pad(dims.e))
        self.d_idx = jnp.arange(_pad(dims.d))
        self.k_idx = jnp.arange(_pad(dims.k))
        e_ok = (self.e_idx < dims.e)[:, None]
        self.ed_ok = e_ok & (self.d_idx < dims.d)[None, :]
        self.ek_ok = e_ok & (self.k_idx < dims.k)[None, :]

    def _at(self, ref, first_row, cols):
        """``ref``'s ``[E_p, cols]`` tile of the example whose rows start at ``first_row``."""
        return ref.at[(first_row + self.e_idx)[:, None], cols[None, :]]

    def load_ed(self, ref, first_row, live):
        return plgpu.load(self._at(ref, first_row, self.d_idx), mask=self.ed_ok & live, other=0)

    def load_ek(self, ref, first_row, live):
        return plgpu.load(self._at(ref, first_row, self.k_idx), mask=self.ek_ok & live, other=0)

    def store_ed(self, ref, first_row, live, value):
        tile, mask = self._at(ref, first_row, self.d_idx), self.ed_ok & live
        plgpu.store(tile, value.astype(ref.dtype), mask=mask)

    def store_ek(self, ref, first_row, live, value):
        tile, mask = self._at(ref, first_row, self.k_idx), self.ek_ok & live
        plgpu.store(tile, value.astype(ref.dtype), mask=mask)


def _fwd_kernel(x_ref, y_ref, o_ref, *, dims: _Dims, block_b: int, shared_y: bool, precision):
    # x_ref [B·E, D]; y_ref [E, K] (shared) or [B·E, K]; o_ref [B·E, K].
    tile = _Tile(dims)
    first_b = pl.program_id(0) * block_b
    y_ek = tile.load_ek(y_ref, 0, True) if shared_y else None

    def body(i, carry):
        b = first_b + i
        live, row = b < dims.b, b * dims.e
        x_ed = tile.load_ed(x_ref, row, live)
        yb_ek = y_ek if shared_y else tile.load_ek(y_ref, row, live)
        t_dk = _dot(x_ed, yb_ek, (0, 0), precision).astype(x_ed.dtype)  # Xᵀ Y
        o_ek = _dot(x_ed, t_dk, (1, 0), precision)  # X T
        tile.store_ek(o_ref, row, live, o_ek)
        return carry

    lax.fori_loop(0, block_b, body, 0)


def _bwd_kernel(
    x_ref, y_ref, g_ref, dx_ref, dy_ref, *, dims: _Dims, block_b: int, shared_y: bool, precision
):
    # x_ref, dx_ref [B·E, D]; g_ref [B·E, K]; y_ref [E, K] or [B·E, K]; dy_ref: shared, this
    # program's float32 partial sum in [num_programs·E, K]; else [B·E, K] per example.
    tile = _Tile(dims)
    pid = pl.program_id(0)
    first_b = pid * block_b
    y_ek = tile.load_ek(y_ref, 0, True) if shared_y else None

    def body(i, dy_acc_ek):
        b = first_b + i
        live, row = b < dims.b, b * dims.e
        x_ed = tile.load_ed(x_ref, row, live)
        g_ek = tile.load_ek(g_ref, row, live)
        yb_ek = y_ek if shared_y else tile.load_ek(y_ref, row, live)
        cd = x_ed.dtype
        t_dk = _dot(x_ed, yb_ek, (0, 0), precision).astype(cd)  # T = Xᵀ Y
        dt_dk = _dot(x_ed, g_ek, (0, 0), precision).astype(cd)  # dT = Xᵀ G
        dx_ed = _dot(g_ek, t_dk, (1, 1), precision) + _dot(yb_ek, dt_dk, (1, 1), precision)
        tile.store_ed(dx_ref, row, live, dx_ed)  # dX = G Tᵀ + Y dTᵀ
        dy_ek = _dot(x_ed, dt_dk, (1, 0), precision)  # X dT (zero for masked examples)
        if shared_y:
            return dy_acc_ek + dy_ek
        tile.store_ek(dy_ref, row, live, dy_ek)
        return dy_acc_ek

    dy_acc_ek = lax.fori_loop(
        0, block_b, body, jnp.zeros((_pad(dims.e), _pad(dims.k)), jnp.float32)
    )
    if shared_y:
        tile.store_ek(dy_ref, pid * dims.e, True, dy_acc_ek)


def _dims(x_bed: jax.Array, y: jax.Array) -> _Dims:
    b, e, d = x_bed.shape
    return _Dims(b=b, e=e, d=d, k=y.shape[-1])


@functools.partial(jax.jit, static_argnames=("interpret", "block_b", "num_stages"))
def fm_interaction_fwd(
    x_bed: jax.Array,
    y: jax.Array,
    *,
    interpret: bool = False,
    block_b: int = 16,
    num_stages: int = 2,
) -> jax.Array:
    """``O = X (Xᵀ Y)`` ``[B, E, K]`` in ``x_bed``'s dtype; ``y`` ``[E, K]`` or ``[B, E, K]``."""
    dims = _dims(x_bed, y)
    block_b = min(block_b, dims.b)
    shared_y = y.ndim == 2
    y = y.astype(x_bed.dtype)
    kernel = functools.partial(
        _fwd_kernel,
        dims=dims,
        block_b=block_b,
        shared_y=shared_y,
        precision=_precision(x_bed.dtype, interpret),
    )
    o = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(dims.b, block_b),),
        out_shape=jax.ShapeDtypeStruct((dims.b * dims.e, dims.k), x_bed.dtype),
        compiler_params=_compiler_params(dims, num_stages),
        interpret=interpret,
        name="fm_interaction_fwd",
    )(x_bed.reshape(-1, dims.d), y if shared_y else y.reshape(-1, dims.k))
    return o.reshape(dims.b, dims.e, dims.k)


@functools.partial(jax.jit, static_argnames=("interpret", "block_b", "num_stages"))
def fm_interaction_bwd(
    x_bed: jax.Array,
    y: jax.Array,
    g_bek: jax.Array,
    *,
    interpret: bool = False,
    block_b: int = 32,
    num_stages: int = 2,
) -> tuple[jax.Array, jax.Array]:
    """``(dX [B, E, D], dY)`` for the cotangent ``g_bek`` of ``X (Xᵀ Y)``; ``dY`` is shaped like
    ``y`` and has its dtype (summed over the batch in float32 when ``y`` is shared)."""
    dims = _dims(x_bed, y)
    block_b = min(block_b, dims.b)
    shared_y = y.ndim == 2
    cd = x_bed.dtype
    num_programs = pl.cdiv(dims.b, block_b)
    dy_shape = (num_programs * dims.e, dims.k) if shared_y else (dims.b * dims.e, dims.k)
    kernel = functools.partial(
        _bwd_kernel,
        dims=dims,
        block_b=block_b,
        shared_y=shared_y,
        precision=_precision(cd, interpret),
    )
    yc = y.astype(cd)
    dx, dy = pl.pallas_call(
        kernel,
        grid=(num_programs,),
        out_shape=(
            jax.ShapeDtypeStruct((dims.b * dims.e, dims.d), cd),
            jax.ShapeDtypeStruct(dy_shape, jnp.float32 if shared_y else cd),
        ),
        compiler_params=_compiler_params(dims, num_stages),
        interpret=interpret,
        name="fm_interaction_bwd",
    )(
        x_bed.reshape(-1, dims.d),
        yc if shared_y else yc.reshape(-1, dims.k),
        g_bek.astype(cd).reshape(-1, dims.k),
    )
    if shared_y:
        dy = dy.reshape(num_programs, dims.e, dims.k).sum(0)
    return dx.reshape(x_bed.shape), dy.reshape(y.shape).astype(y.dtype)
