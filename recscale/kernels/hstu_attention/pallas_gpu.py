"""HSTU attention in Pallas (Triton backend): forward and backward over the block-aligned
layout of :mod:`.layout`.

Design (as generative-recommenders' ``ops/triton/triton_hstu_attention.py``, without softmax
statistics: the SiLU scores need no running max or normaliser, so every key block adds to the
output independently). One program per (query block, head); it loads its ``q`` block once and
walks the key blocks :func:`layout.k_range` gives in a ``fori_loop`` with dynamic bounds
(causal, window, contextual prefix), per block forming ``s = alpha q·kᵀ + rab`` in registers,
masking it (``reference.valid_mask`` on the tile's positions), and accumulating
``SiLU(s)/N · v`` in float32. Nothing of size ``N²`` reaches HBM.

Backward: two kernels, no atomics (deterministic). ``dkdv``: one program per (key block,
head), looping over the query blocks that may attend to it (:func:`layout.q_steps`: the
contextual rows' blocks, then the causal/window range), recomputing ``s`` and accumulating
``dv += attnᵀ g`` and ``dk += alpha dSᵀ q``. ``dq``: one program per (query block, head) over
the forward's key range, ``dq += alpha dS k``, and the relative bias's delta gradients
(``layout.add_bias_sums``: a masked reduction per bucket edge that cuts the tile) written as one float32 partial
row per program, summed by XLA.

Triton constraints: power-of-two tiles of at least 16 per dim; block, warps and pipeline
stages per dtype and width as measured (:data:`TUNED`); ``D``/``E`` are zero-padded to
``max(16, next_pow2)`` in the layout. The relative bias costs a scalar add for each bucket edge
a tile lies wholly past and an elementwise select only for the edges that cut it
(``layout.tile_span``): a select per edge on every tile cost more than the tile's matmul. Precision: bfloat16 on tensor cores with float32 accumulation;
the scores are rounded to the inputs' dtype before their products (as the reference).
float32 uses 3xTF32 (HIGHEST under interpret mode on CPU).

Limits: float32/bfloat16 (float16 untested: not listed); ``D, E <= 256`` (registers).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from recscale.kernels import common
from recscale.kernels.hstu_attention import layout

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
MAX_DIM = 256
MIN_DIM = 16


def pad_dim(d: int) -> int:
    return max(MIN_DIM, common.next_pow2(d))


KERNELS = ("fwd", "dkdv", "dq")

TUNED: dict[tuple[str, int], tuple[int, dict[str, tuple[int, int]]]] = {
    ("bfloat16", 128): (64, {"fwd": (4, 3), "dkdv": (4, 2), "dq": (4, 2)}),
    ("bfloat16", 256): (64, {"fwd": (8, 1), "dkdv": (8, 1), "dq": (8, 1)}),
    ("float32", 128): (32, {"fwd": (4, 1), "dkdv": (4, 1), "dq": (4, 1)}),
    ("float32", 256): (16, {"fwd": (4, 1), "dkdv": (4, 1), "dq": (4, 1)}),
}
"""``(dtype name, padded head width) -> (block, {kernel: (num_warps, num_stages)})``, the
fastest forward and backward of ``benchmarks/hstu_tiling.py`` on an H200 at N 4,096 (d 128)
and 8,192 (d 256) (BENCHMARKS.md, issue 37); other keys take :func:`_untuned`. float32 tiles
hold twice the bytes: block 64 at d 128 overflows shared memory, block 32 at d 256 spills
(its backward 4x slower than block 16)."""


def _untuned(width: int, dtype) -> tuple[int, dict[str, tuple[int, int]]]:
    block = 64 if width <= 128 else 32
    if jnp.dtype(dtype) == jnp.float32:
        block //= 2  # float32 tiles twice the bytes: block 64 at D 128 overflows shared memory
    return block, dict.fromkeys(KERNELS, (8 if width > 64 else 4, 2))


def tiling(d: int, e: int, dtype) -> tuple[int, dict[str, tuple[int, int]]]:
    """Block size and each kernel's ``(num_warps, num_stages)`` for head dims ``d``, ``e``."""
    width = max(pad_dim(d), pad_dim(e))
    return TUNED.get((jnp.dtype(dtype).name, width)) or _untuned(width, dtype)


def default_block(d: int, e: int, dtype=jnp.bfloat16) -> int:
    return tiling(d, e, dtype)[0]


def unsupported_reason(q_shape, v_shape, num_seqs: int, st: layout.Static) -> str | None:
    """Why these kernels cannot run a non-empty call of one of ``DTYPES`` (None: they can)."""
    del num_seqs, st
    d, e = q_shape[2], v_shape[2]
    if max(d, e) > MAX_DIM:
        return f"head dims {d}/{e} exceed {MAX_DIM} (register tiles)"
    return None


def _precision(dtype, interpret):
    if jnp.dtype(dtype) != jnp.float32:
        return None
    return lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _dot(a, b, contract, precision):
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _compiler_params(kernel: str, dp: int, ep: int, dtype) -> plgpu.CompilerParams:
    warps, stages = tiling(dp, ep, dtype)[1][kernel]
    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


class _Seq:
    """The sequence of the program's block ``r`` (scalars loaded from the layout refs)."""

    def __init__(self, seq_ref, first_ref, len_ref, nt_ref, r, st: layout.Static):
        seq = seq_ref[r]
        self.first, self.n, self.nt = first_ref[seq], len_ref[seq], nt_ref[seq]
        self.pos0 = (r - self.first) * st.block  # position of block r in its sequence


def _bias_scalars(bias_ref, h, st: layout.Static):
    if bias_ref is None:
        return []
    row = (h if st.bias_heads > 1 else 0) * st.num_buckets
    return [bias_ref[row + m] for m in range(st.num_buckets)]


def _split(refs, has_bias, num_out):
    scalars, rest = refs[:4], refs[4:]
    bias_ref = rest[0] if has_bias else None
    rest = rest[1:] if has_bias else rest
    return scalars, bias_ref, rest[: len(rest) - num_out], rest[len(rest) - num_out :]


def _fwd_kernel(*refs, st: layout.Static, rows: int, has_bias: bool, precision):
    scalars, bias_ref, (q_ref, k_ref, v_ref), (o_ref,) = _split(refs, has_bias, 1)
    r, h = pl.program_id(0), pl.program_id(1)
    blk, base = st.block, h * rows
    seq = _Seq(*scalars, r, st)
    q = q_ref[pl.ds(base + r * blk, blk), :]
    i = seq.pos0 + jnp.arange(blk)[:, None]
    bias = _bias_scalars(bias_ref, h, st)
    lo, hi = layout.k_range(seq.pos0, seq.n, seq.nt, st)

    def body(kb, acc):
        row = base + (seq.first + kb) * blk
        k, v = k_ref[pl.ds(row, blk), :], v_ref[pl.ds(row, blk), :]
        j = kb * blk + jnp.arange(blk)[None, :]
        dot = functools.partial(_dot, contract=(1, 1), precision=precision)
        span = layout.tile_span(seq.pos0, kb * blk, blk)
        s, valid = layout.tile_scores(q, k, i, j, seq.n, seq.nt, bias, st, dot, span)
        attn = jnp.where(valid, s / (1.0 + jnp.exp(-s)), 0.0) * (1.0 / st.max_seq_len)
        return acc + _dot(attn.astype(v.dtype), v, (1, 0), precision)

    acc = lax.fori_loop(lo, hi, body, jnp.zeros((blk, v_ref.shape[1]), jnp.float32))
    o_ref[pl.ds(base + r * blk, blk), :] = acc.astype(o_ref.dtype)


def _grad_tile(q, k, v, g, i, j, seq, bias, st, precision, span):
    """``(attn, dS)`` of one tile (float32, masked)."""
    dot = functools.partial(_dot, contract=(1, 1), precision=precision)
    s, valid = layout.tile_scores(q, k, i, j, seq.n, seq.nt, bias, st, dot, span)
    sig = 1.0 / (1.0 + jnp.exp(-s))
    inv_n = 1.0 / st.max_seq_len
    attn = jnp.where(valid, s * sig * inv_n, 0.0)
    dp = _dot(g, v, (1, 1), precision)
    ds = jnp.where(valid, dp * sig * (1.0 + s * (1.0 - sig)) * inv_n, 0.0)
    return attn, ds


def _dkdv_kernel(*refs, st: layout.Static, rows: int, has_bias: bool, precision):
    scalars, bias_ref, (q_ref, k_ref, v_ref, g_ref), (dk_ref, dv_ref) = _split(refs, has_bias, 2)
    r, h = pl.program_id(0), pl.program_id(1)
    blk, base = st.block, h * rows
    seq = _Seq(*scalars, r, st)
    k, v = k_ref[pl.ds(base + r * blk, blk), :], v_ref[pl.ds(base + r * blk, blk), :]
    j = seq.pos0 + jnp.arange(blk)[None, :]
    bias = _bias_scalars(bias_ref, h, st)
    prefix, lo, hi = layout.q_steps(seq.pos0, seq.n, seq.nt, st)

    def body(step, carry):
        dk, dv = carry
        qb = layout.q_block_at(step, prefix, lo)
        row = base + (seq.first + qb) * blk
        q, g = q_ref[pl.ds(row, blk), :], g_ref[pl.ds(row, blk), :]
        i = qb * blk + jnp.arange(blk)[:, None]
        span = layout.tile_span(qb * blk, seq.pos0, blk)
        attn, ds = _grad_tile(q, k, v, g, i, j, seq, bias, st, precision, span)
        dv = dv + _dot(attn.astype(g.dtype), g, (0, 0), precision)
        dk = dk + _dot(ds.astype(q.dtype), q, (0, 0), precision)
        return dk, dv

    zeros = (
        jnp.zeros((blk, k_ref.shape[1]), jnp.float32),
        jnp.zeros((blk, v_ref.shape[1]), jnp.float32),
    )
    dk, dv = lax.fori_loop(0, prefix + hi - lo, body, zeros)
    dk_ref[pl.ds(base + r * blk, blk), :] = (dk * st.alpha).astype(dk_ref.dtype)
    dv_ref[pl.ds(base + r * blk, blk), :] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, st: layout.Static, rows: int, has_bias: bool, precision, num_blocks):
    num_out = 2 if has_bias else 1
    scalars, bias_ref, (q_ref, k_ref, v_ref, g_ref), outs = _split(refs, has_bias, num_out)
    r, h = pl.program_id(0), pl.program_id(1)
    blk, base = st.block, h * rows
    seq = _Seq(*scalars, r, st)
    q, g = q_ref[pl.ds(base + r * blk, blk), :], g_ref[pl.ds(base + r * blk, blk), :]
    i = seq.pos0 + jnp.arange(blk)[:, None]
    bias = _bias_scalars(bias_ref, h, st)
    lo, hi = layout.k_range(seq.pos0, seq.n, seq.nt, st)

    def body(kb, carry):
        dq, sums = carry
        row = base + (seq.first + kb) * blk
        k, v = k_ref[pl.ds(row, blk), :], v_ref[pl.ds(row, blk), :]
        j = kb * blk + jnp.arange(blk)[None, :]
        span = layout.tile_span(seq.pos0, kb * blk, blk)
        _, ds = _grad_tile(q, k, v, g, i, j, seq, bias, st, precision, span)
        dq = dq + _dot(ds.astype(k.dtype), k, (1, 0), precision)
        if has_bias:
            sums = layout.add_bias_sums(sums, ds, i, j, st, span)
        return dq, sums

    sums0 = tuple(jnp.float32(0) for _ in range(st.num_buckets)) if has_bias else ()
    init = (jnp.zeros((blk, q_ref.shape[1]), jnp.float32), sums0)
    dq, sums = lax.fori_loop(lo, hi, body, init)
    outs[0][pl.ds(base + r * blk, blk), :] = (dq * st.alpha).astype(outs[0].dtype)
    if has_bias:
        width = outs[1].shape[1]
        lane = jnp.arange(width)
        vec = jnp.zeros((width,), jnp.float32)
        for m, total in enumerate(sums):
            vec = vec + jnp.where(lane == m, total, 0.0)
        outs[1][pl.ds(h * num_blocks + r, 1), :] = vec[None, :]


def _layout_args(lay: layout.Blocks, bias_deltas):
    return (*lay.scalars, *(() if bias_deltas is None else (bias_deltas,)))


def forward(q_hrd, k_hrd, v_hre, lay, bias_deltas, *, st: layout.Static, interpret=False):
    """``out [H, R, E_p]`` over the layout (``q``, ``k`` ``[H, R, D_p]``, ``v`` ``[H, R,
    E_p]``; ``bias_deltas``: ``layout.bias_deltas`` or None)."""
    h, rows, dp = q_hrd.shape
    ep = v_hre.shape[2]
    flat = [x.reshape(h * rows, -1) for x in (q_hrd, k_hrd, v_hre)]
    kernel = functools.partial(
        _fwd_kernel,
        st=st,
        rows=rows,
        has_bias=bias_deltas is not None,
        precision=_precision(q_hrd.dtype, interpret),
    )
    out = pl.pallas_call(
        kernel,
        grid=(rows // st.block, h),
        out_shape=jax.ShapeDtypeStruct((h * rows, ep), q_hrd.dtype),
        compiler_params=_compiler_params("fwd", dp, ep, q_hrd.dtype),
        interpret=interpret,
        name="hstu_attention_fwd",
    )(*_layout_args(lay, bias_deltas), *flat)
    return out.reshape(h, rows, ep)


def backward(q_hrd, k_hrd, v_hre, g_hre, lay, bias_deltas, *, st: layout.Static, interpret=False):
    """``(dq, dk, dv, d_delta)`` over the layout; ``d_delta [Hb, num_buckets]`` float32 (the
    gradient of ``bias_deltas``) or None."""
    h, rows, dp = q_hrd.shape
    ep = v_hre.shape[2]
    nb = rows // st.block
    has_bias = bias_deltas is not None
    flat = [x.reshape(h * rows, -1) for x in (q_hrd, k_hrd, v_hre, g_hre)]
    common_kw = dict(
        st=st, rows=rows, has_bias=has_bias, precision=_precision(q_hrd.dtype, interpret)
    )
    args = (*_layout_args(lay, bias_deltas), *flat)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, **common_kw),
        grid=(nb, h),
        out_shape=(
            jax.ShapeDtypeStruct((h * rows, dp), q_hrd.dtype),
            jax.ShapeDtypeStruct((h * rows, ep), q_hrd.dtype),
        ),
        compiler_params=_compiler_params("dkdv", dp, ep, q_hrd.dtype),
        interpret=interpret,
        name="hstu_attention_bwd_dkdv",
    )(*args)
    width = pad_dim(st.num_buckets) if has_bias else 0
    out_shape = [jax.ShapeDtypeStruct((h * rows, dp), q_hrd.dtype)]
    if has_bias:
        out_shape.append(jax.ShapeDtypeStruct((h * nb, width), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_dq_kernel, num_blocks=nb, **common_kw),
        grid=(nb, h),
        out_shape=tuple(out_shape),
        compiler_params=_compiler_params("dq", dp, ep, q_hrd.dtype),
        interpret=interpret,
        name="hstu_attention_bwd_dq",
    )(*args)
    d_delta = None
    if has_bias:
        d_delta = outs[1].reshape(h, nb, width).sum(1)[:, : st.num_buckets]
        if st.bias_heads == 1:
            d_delta = d_delta.sum(0, keepdims=True)
    shape = (h, rows, -1)
    return outs[0].reshape(shape), dk.reshape(shape), dv.reshape(shape), d_delta
