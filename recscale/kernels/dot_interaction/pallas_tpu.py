"""DLRM dot interaction as Pallas Mosaic TPU kernels (forward and backward).

Equations, glossary and the triangle's layout: ``reference.py``. Extra names: ``bB`` examples
per grid step, ``Np = round_up(N, 8)`` (16 for 16-bit inputs: one sublane tile per example),
``Eb`` examples per matmul chunk (8).

On a TPU the batch has to sit in sublanes for the ``[B, P]`` output, while each example's
``Z = X·Xᵀ`` comes off the MXU as an ``[Np, Np]`` tile with ``i`` in sublanes: the kernel
bridges the two layouts in VMEM with strided loads and stores, which the vector load/store
units do natively, rather than with relayouts of values.

Forward (grid ``cdiv(B, bB)``, "parallel"): the ``X`` block is ``[bB, Np, D]`` (``Np`` past
``N`` reads as padding, never used: row ``i`` of ``Z`` depends on rows ``i`` and ``j`` of
``X`` only). A loop over chunks of ``Eb`` examples forms ``Z`` with a batched MXU matmul
(float32 accumulation, HIGHEST for float32 inputs) and stores it to a VMEM scratch as
``[bB·Np, Np]`` (a free reshape, ``Np`` being a multiple of the sublane tile). Then for each
row ``i`` one strided load (stride ``Np``) gives ``z[:, i, :]`` for the whole block
(``[bB, Np]``, the batch in sublanes) and its first ``i`` (``i + 1``) lanes are stored at the
static lane offset ``off(i)`` of the ``[bB, P]`` output (through a float32 scratch for 16-bit
outputs: unaligned lane stores are simplest on 32-bit data). ``Z`` never reaches HBM; XLA
writes ``[B, N, N]`` and reads it back for the triangle.

Why static per-row stores rather than one-hot selection matmuls (``out = Σ_i Z_i·S_i``):
the selection is ``2·N·Np·P`` FLOP per example (0.6 MFLOP at ``N = 27``, 3x ``Z`` itself) and,
for float32 at HIGHEST, six bf16 MXU passes, while the stores are ``N`` strided loads and
masked stores of ``bB/8`` vregs each per block, about ``N/2`` vector memory operations per
example; the memory they save (``Z``'s round trip, 5.8 KB per example in float32) is the
same either way.

Backward (same grid): ``g`` (``[bB, P]``) goes to a zero-padded float32 scratch; for each row
``i`` the window ``g[:, off(i) : off(i) + Np]``, masked to its first ``i`` (``i + 1``) lanes,
is the block's row ``i`` of ``G``, written with one strided store into ``[bB·Np, Np]``. A
loop over chunks of ``Eb`` examples then reads ``G`` back as ``[Eb, Np, Np]``, forms
``S = G + Gᵀ`` (an XLU transpose; the diagonal doubles by itself), ``dX = S·X`` on the MXU
and stores ``dX`` once.

Limits: float32 and bfloat16 (TPUs have no float16 arithmetic: float16 falls back to XLA);
``bB`` (a multiple of 16, at most 512) is the largest that keeps the block's buffers within
``VMEM_BUDGET``; shapes where even 16 examples do not fit fall back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from recscale.kernels import common
from recscale.kernels.dot_interaction.reference import num_pairs, row_offset

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
VMEM_BUDGET = 12 * 2**20  # under the 16 MiB default scoped VMEM of v4/v5e, with headroom
MIN_BLOCK_B, MAX_BLOCK_B = 16, 512  # 16: a bfloat16 sublane tile
CHUNK_B = 8  # examples per batched matmul: operands and result stay within the vreg file


def _np(n: int, dtype) -> int:
    return common.round_up(n, 8 if jnp.dtype(dtype).itemsize == 4 else 16)


def _bytes_per_example(n: int, d: int, dtype, self_interaction: bool, backward: bool) -> int:
    """VMEM one example takes in a block: double-buffered inputs and outputs, the scratches
    (lanes padded to 128, sublanes to the tile)."""
    np_ = _np(n, dtype)
    item = jnp.dtype(dtype).itemsize
    lanes_d = common.round_up(d, 128)
    lanes_p = common.round_up(num_pairs(n, self_interaction), 128)
    z_scr = np_ * common.round_up(np_, 128) * 4
    if backward:  # x, g, dx double-buffered; g and G scratches
        g_scr = common.round_up(num_pairs(n, self_interaction) + np_, 128) * 4
        return 2 * (2 * np_ * lanes_d + lanes_p) * item + g_scr + z_scr
    return 2 * (np_ * lanes_d + lanes_p) * item + z_scr + lanes_p * 4


def choose_block_b(b: int, n: int, d: int, dtype, self_interaction: bool, backward: bool) -> int:
    """Examples per grid step: the most that fit ``VMEM_BUDGET`` (0: not even 16)."""
    per = _bytes_per_example(n, d, dtype, self_interaction, backward)
    bb = min(MAX_BLOCK_B, VMEM_BUDGET // per // MIN_BLOCK_B * MIN_BLOCK_B)
    if bb < MIN_BLOCK_B:
        return 0
    return min(bb, common.round_up(b, MIN_BLOCK_B))  # small batches: one small block


def unsupported(shape: tuple[int, ...], dtype, self_interaction: bool) -> str | None:
    """Why these kernels cannot run ``x`` of ``shape``/``dtype`` (None: they can)."""
    b, n, d = shape
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (Mosaic TPU kernels: float32, bfloat16)"
    for backward in (False, True):
        if not choose_block_b(b, n, d, dtype, self_interaction, backward):
            return f"N={n}, D={d}: {MIN_BLOCK_B} examples exceed the {VMEM_BUDGET} B VMEM budget"
    return None


def _precision(dtype) -> lax.Precision:
    # float32 inputs: fp32 contract precision (the default rounds operands to bfloat16)
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _rows(n: int, self_interaction: bool):
    """``(i, off(i), width)`` of each row of the triangle with at least one entry."""
    off = 1 if self_interaction else 0
    return [(i, row_offset(i, self_interaction), i + off) for i in range(n) if i + off]


def _fwd_kernel(x_ref, o_ref, z_scr, *t_scr, n: int, self_interaction: bool):
    bb, np_, _ = x_ref.shape
    precision = _precision(x_ref.dtype)

    def chunk(k, carry):
        e0 = pl.multiple_of(k * CHUNK_B, CHUNK_B)
        x_end = x_ref[pl.ds(e0, CHUNK_B)]  # [Eb, Np, D]
        z_enn = jnp.einsum(
            "end,emd->enm",
            x_end,
            x_end,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        rows = pl.ds(pl.multiple_of(e0 * np_, CHUNK_B * np_), CHUNK_B * np_)
        z_scr[rows, :] = z_enn.reshape(CHUNK_B * np_, np_)
        return carry

    lax.fori_loop(0, bb // CHUNK_B, chunk, 0)
    out_ref = t_scr[0] if t_scr else o_ref  # 16-bit outputs: assemble in float32 first
    for i, start, width in _rows(n, self_interaction):
        z_bn = z_scr[pl.ds(i, bb, stride=np_), :]  # row i of every example's Z
        out_ref[:, start : start + width] = z_bn[:, :width].astype(out_ref.dtype)
    if t_scr:
        o_ref[...] = t_scr[0][...].astype(o_ref.dtype)


def _bwd_kernel(x_ref, g_ref, dx_ref, g_scr, l_scr, *, n: int, self_interaction: bool):
    bb, np_, _ = x_ref.shape
    p = g_ref.shape[1]
    precision = _precision(x_ref.dtype)
    # zero past P: the last rows' windows read up to Np lanes beyond their entries
    g_scr[...] = jnp.zeros(g_scr.shape, jnp.float32)
    g_scr[:, :p] = g_ref[...].astype(jnp.float32)
    lane = lax.broadcasted_iota(jnp.int32, (bb, np_), 1)
    off = 1 if self_interaction else 0
    for i in range(n):
        start, width = row_offset(i, self_interaction), i + off
        window = g_scr[:, start : start + np_]
        l_scr[pl.ds(i, bb, stride=np_), :] = jnp.where(lane < width, window, 0.0)

    def chunk(k, carry):
        e0 = pl.multiple_of(k * CHUNK_B, CHUNK_B)
        rows = pl.ds(pl.multiple_of(e0 * np_, CHUNK_B * np_), CHUNK_B * np_)
        l_enn = l_scr[rows, :].reshape(CHUNK_B, np_, np_)
        r = lax.broadcasted_iota(jnp.int32, l_enn.shape, 1)
        l_enn = jnp.where(r < n, l_enn, 0.0)  # rows N..Np of G were never written
        s_enn = (l_enn + jnp.swapaxes(l_enn, 1, 2)).astype(x_ref.dtype)  # exact: g or 2g
        x_end = x_ref[pl.ds(e0, CHUNK_B)]
        # padding rows of the X block are uninitialised: S has zeros there, but 0·NaN = NaN
        x_end = jnp.where(lax.broadcasted_iota(jnp.int32, x_end.shape, 1) < n, x_end, 0)
        dx_end = jnp.einsum(
            "enm,emd->end",
            s_enn,
            x_end,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        dx_ref[pl.ds(e0, CHUNK_B)] = dx_end.astype(dx_ref.dtype)
        return carry

    lax.fori_loop(0, bb // CHUNK_B, chunk, 0)


def _block_b(x_bnd: jax.Array, self_interaction: bool, backward: bool, bb: int | None) -> int:
    if bb is None:
        return choose_block_b(*x_bnd.shape, x_bnd.dtype, self_interaction, backward)
    if bb % MIN_BLOCK_B:
        raise ValueError(f"block_b={bb} is not a multiple of {MIN_BLOCK_B}")
    return bb


@functools.partial(jax.jit, static_argnames=("self_interaction", "interpret", "block_b"))
def _call(
    x_bnd, g_bp, *, self_interaction: bool, interpret, block_b: int | None = None
) -> jax.Array:
    """The forward kernel (``g_bp`` None; ``[B, P]``) or the backward one (``dX``, ``[B, N,
    D]``) over a grid of blocks of ``bB`` examples."""
    b, n, d = x_bnd.shape
    dtype = x_bnd.dtype
    p = num_pairs(n, self_interaction)
    np_ = _np(n, dtype)
    bb = _block_b(x_bnd, self_interaction, g_bp is not None, block_b)
    # Np > N: the forward never reads the block's padding rows back; the backward masks them
    x_spec = pl.BlockSpec((bb, np_, d), lambda k: (k, 0, 0))
    g_spec = pl.BlockSpec((bb, p), lambda k: (k, 0))
    if g_bp is None:
        body, name, operands, in_specs = _fwd_kernel, "dot_interaction_fwd", (x_bnd,), [x_spec]
        out_spec, out_shape = g_spec, (b, p)
        scratch = [pltpu.VMEM((bb * np_, np_), jnp.float32)]
        if jnp.dtype(dtype).itemsize != 4:
            scratch.append(pltpu.VMEM((bb, p), jnp.float32))
    else:
        body, name = _bwd_kernel, "dot_interaction_bwd"
        operands, in_specs = (x_bnd, g_bp.astype(dtype)), [x_spec, g_spec]
        out_spec, out_shape = x_spec, (b, n, d)
        scratch = [
            pltpu.VMEM((bb, common.round_up(p + np_, 128)), jnp.float32),
            pltpu.VMEM((bb * np_, np_), jnp.float32),
        ]
    return pl.pallas_call(
        functools.partial(body, n=n, self_interaction=self_interaction),
        grid=(pl.cdiv(b, bb),),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, dtype),
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name=name,
    )(*operands)


def forward(x_bnd: jax.Array, **options) -> jax.Array:
    """``[B, P]`` dot interaction of ``x`` (``[B, N, D]``); see the module docstring.
    ``options``: ``self_interaction``, ``interpret``, ``block_b`` (``backward`` takes the same).
    ``interpret``: False, or ``pltpu.InterpretParams`` to run on CPU; ``block_b``: examples
    per grid step (None: the most that fit ``VMEM_BUDGET``)."""
    return _call(x_bnd, None, **options)


def backward(x_bnd: jax.Array, g_bp: jax.Array, **options) -> jax.Array:
    """``dX`` (``[B, N, D]``) of the dot interaction for the cotangent ``g`` (``[B, P]``)."""
    return _call(x_bnd, g_bp, **options)
