"""DLRM dot interaction as Pallas Triton kernels (forward and backward).

Equations, glossary and the triangle's layout: ``reference.py``. Extra names: ``bB`` examples
per program, ``Np``/``Dc`` the power-of-two tile sizes Triton needs (``Np = max(16,
next_pow2(N))``, ``Dc = max(16, next_pow2(min(D, 128)))``; tensor-core dots want every side
>= 16).

Forward (grid ``cdiv(B, bB)``, one program per block of ``bB`` examples): a loop over the
block's examples (Triton pipelines the next example's load behind this one's dot) loads
``X[b]`` as ``[Np, Dc]`` tiles (masked loads, zeros past ``N``/``D``), forms ``Z = X·Xᵀ``
(``[Np, Np]``, float32 accumulation; tensor cores for 16-bit inputs, IEEE float32 FMAs for
float32 inputs so that float32 stays float32) in registers, ``D`` in chunks of ``Dc`` when
``D > 128``, and stores the triangle straight from registers with a scatter store: entry
``(i, j)`` goes to ``out[b, off(i) + j]``, masked to ``j < i`` (``j <= i``), ``i < N``. Each
row is a contiguous run of the output, so the stores coalesce. ``Z`` never reaches HBM; XLA
writes ``[B, N, N]`` and reads it back for the triangle gather.

Why a scatter store and not one-hot selection matmuls (``out = Σ_i Z_i·S_i``, ``S_i`` placing
row ``i``): at the Criteo shape (``N = 27``, ``D = 128``, float32) the selection costs
``2·N·N·P = 0.51`` MFLOP per example (1.0 MFLOP on the padded ``[Np·Np] x [Np·Np, 512]``
tiles), 2.7x (5.6x) the ``0.19`` MFLOP of ``Z`` itself and, at HIGHEST precision, on the
non-tensor-core float32 pipe: about 69 GFLOP, ~1 ms on an H100, for ``B = 65,536``, to save
the ``2·N·N·4 = 5.8`` KB per example (0.38 GB, ~0.1 ms at 3.35 TB/s) of ``Z``'s round trip.
The scatter store costs nothing extra: the masked lanes issue no memory traffic.

Backward (same grid): per example, one gather load builds ``S = G + Gᵀ`` (``[Np, Np]``)
directly from ``g`` (``S_ij = g[off(max(i, j)) + min(i, j)]``, twice that on the diagonal
with self-interaction, zero elsewhere), then ``dX = S·X`` (``[Np, Dc]`` per chunk) is stored
once, masked to ``N`` x ``D``: ``G`` is never materialised in HBM and there is one matmul.

Limits: ``N <= 128`` (``Np x Np`` float32 tiles in registers); any ``D`` (chunked); float32,
bfloat16, float16. ``S`` is cast to ``x``'s dtype for the tensor cores, exact since it holds
``g`` or ``2g`` (a float16 cotangent above 32,752 would overflow ``2g``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from recscale.kernels import common
from recscale.kernels.dot_interaction.reference import num_pairs

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_N = 128
D_CHUNK = 128
BLOCK_B = 8


def unsupported(shape: tuple[int, ...], dtype) -> str | None:
    """Why these kernels cannot run ``x`` of ``shape``/``dtype`` (None: they can)."""
    _, n, _ = shape
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (kernels: float32, bfloat16, float16)"
    if n > MAX_N:
        return f"N={n} > {MAX_N}: the [N, N] tile would not fit in registers"
    return None


def _tiles(n: int, d: int) -> tuple[int, int, int]:
    """``Np``, ``Dc`` and the number of ``D`` chunks."""
    np_ = max(16, common.next_pow2(n))
    dc = max(16, common.next_pow2(min(d, D_CHUNK)))
    return np_, dc, -(-d // dc)


def _precision(dtype) -> lax.Precision:
    # float32 inputs: IEEE float32 (Triton's default would be TF32, 10 mantissa bits)
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _compiler_params(np_: int, dc: int) -> plgpu.CompilerParams:
    # 8 warps once the [Np, Dc] float32 tile would take more than 64 registers a thread
    return plgpu.CompilerParams(num_warps=4 if np_ * dc <= 8192 else 8, num_stages=2)


def _x_tile(n: int, d: int, np_: int, dc: int, chunk: int):
    """Indices of chunk ``chunk`` of an example's ``[Np, Dc]`` tile and the mask of its real
    entries. Masked lanes touch no memory on a GPU; for the interpreter, which gathers and
    scatters every lane, loads clamp them into the array and stores point them past it
    (dropped; an in-range index would race with the real entry written there)."""
    r = lax.broadcasted_iota(jnp.int32, (np_, dc), 0)
    c = lax.broadcasted_iota(jnp.int32, (np_, dc), 1) + chunk * dc
    load = (jnp.minimum(r, n - 1), jnp.minimum(c, d - 1))
    return load, (r, c), (r < n) & (c < d)


def _fwd_kernel(x_ref, o_ref, *, b: int, n: int, d: int, bb: int, self_interaction: bool):
    np_, dc, chunks = _tiles(n, d)
    p = num_pairs(n, self_interaction)
    off = 1 if self_interaction else 0
    base = pl.program_id(0) * bb
    i = lax.broadcasted_iota(jnp.int32, (np_, np_), 0)
    j = lax.broadcasted_iota(jnp.int32, (np_, np_), 1)
    keep = (j < i + off) & (i < n)
    # masked lanes point past the row (see _x_tile)
    p_nn = jnp.where(keep, i * (i - 1 + 2 * off) // 2 + j, p)
    tiles = [_x_tile(n, d, np_, dc, c) for c in range(chunks)]
    precision = _precision(x_ref.dtype)

    def example(e, carry):
        live = base + e < b  # the last block may run past B
        z_nn = jnp.zeros((np_, np_), jnp.float32)
        for (rows, cols), _, mask in tiles:
            x_nd = plgpu.load(x_ref.at[e, rows, cols], mask=mask & live, other=0.0)
            z_nn += lax.dot_general(
                x_nd,
                x_nd,
                (((1,), (1,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
        plgpu.store(o_ref.at[e, p_nn], z_nn.astype(o_ref.dtype), mask=keep & live)
        return carry

    lax.fori_loop(0, bb, example, 0)


def _bwd_kernel(x_ref, g_ref, dx_ref, *, b: int, n: int, d: int, bb: int, self_interaction: bool):
    np_, dc, chunks = _tiles(n, d)
    off = 1 if self_interaction else 0
    base = pl.program_id(0) * bb
    i = lax.broadcasted_iota(jnp.int32, (np_, np_), 0)
    j = lax.broadcasted_iota(jnp.int32, (np_, np_), 1)
    hi, lo = jnp.maximum(i, j), jnp.minimum(i, j)
    valid = (hi < n) if self_interaction else (hi < n) & (i != j)
    g_nn = jnp.where(valid, hi * (hi - 1 + 2 * off) // 2 + lo, 0)  # S_ij's index into g
    diag_scale = jnp.where(i == j, 2.0, 1.0).astype(jnp.float32)
    tiles = [_x_tile(n, d, np_, dc, c) for c in range(chunks)]
    precision = _precision(x_ref.dtype)

    def example(e, carry):
        live = base + e < b
        s_nn = plgpu.load(g_ref.at[e, g_nn], mask=valid & live, other=0.0)
        s_nn = (s_nn.astype(jnp.float32) * diag_scale).astype(x_ref.dtype)
        for (rows, cols), (out_rows, out_cols), mask in tiles:
            x_nd = plgpu.load(x_ref.at[e, rows, cols], mask=mask & live, other=0.0)
            dx_nd = lax.dot_general(
                s_nn,
                x_nd,
                (((1,), (0,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            dx_nd = dx_nd.astype(dx_ref.dtype)
            plgpu.store(dx_ref.at[e, out_rows, out_cols], dx_nd, mask=mask & live)
        return carry

    lax.fori_loop(0, bb, example, 0)


@functools.partial(jax.jit, static_argnames=("self_interaction", "interpret", "block_b"))
def _call(x_bnd, g_bp, *, self_interaction: bool, interpret, block_b: int = BLOCK_B) -> jax.Array:
    """The forward kernel (``g_bp`` None; ``[B, P]``) or the backward one (``dX``, ``[B, N,
    D]``) over a grid of blocks of ``block_b`` examples, every array blocked along ``B`` only."""
    b, n, d = x_bnd.shape
    np_, dc, _ = _tiles(n, d)
    if g_bp is None:
        body, operands, name = _fwd_kernel, (x_bnd,), "dot_interaction_fwd"
        out_shape = (b, num_pairs(n, self_interaction))
    else:
        body, operands, name = _bwd_kernel, (x_bnd, g_bp.astype(x_bnd.dtype)), "dot_interaction_bwd"
        out_shape = x_bnd.shape

    def block(shape):
        return pl.BlockSpec((block_b, *shape[1:]), lambda k: (k,) + (0,) * (len(shape) - 1))

    return pl.pallas_call(
        functools.partial(body, b=b, n=n, d=d, bb=block_b, self_interaction=self_interaction),
        grid=(pl.cdiv(b, block_b),),
        in_specs=[block(a.shape) for a in operands],
        out_specs=block(out_shape),
        out_shape=jax.ShapeDtypeStruct(out_shape, x_bnd.dtype),
        compiler_params=_compiler_params(np_, dc),
        interpret=interpret,
        name=name,
    )(*operands)


def forward(x_bnd: jax.Array, **options) -> jax.Array:
    """``[B, P]`` dot interaction of ``x`` (``[B, N, D]``); see the module docstring.
    ``options``: ``self_interaction``, ``interpret``, ``block_b`` (``backward`` takes the same)."""
    return _call(x_bnd, None, **options)


def backward(x_bnd: jax.Array, g_bp: jax.Array, **options) -> jax.Array:
    """``dX`` (``[B, N, D]``) of the dot interaction for the cotangent ``g`` (``[B, P]``)."""
    return _call(x_bnd, g_bp, **options)
