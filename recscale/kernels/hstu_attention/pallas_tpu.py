"""HSTU attention in Pallas (Mosaic TPU backend): forward and backward over the block-aligned
layout of :mod:`.layout`.

Design: flash-attention's TPU form without softmax statistics. The grid is (head, block,
step); the layout's scalars (block -> sequence, each sequence's first block, length, targets)
are scalar-prefetched into SMEM and the BlockSpecs' index maps use them to DMA, per step, the
key/value block (forward, ``dq``) or query/cotangent block (``dkdv``) the schedule of
:mod:`.layout` names (:func:`layout.k_range` / :func:`layout.q_steps`); steps past the
schedule's end keep the last block's index, so Pallas fetches nothing new, and skip compute.
The block's own rows stay resident across the step axis ("arbitrary"), accumulating in
float32 VMEM scratch, written at the last step. Scores ``s = alpha q·kᵀ + rab`` are formed per
[blk, blk] tile on the MXU and masked on the VPU (``reference.valid_mask``); the relative
bias adds SMEM scalars for the bucket edges a tile lies past and selects (under a cond) only
at the edges that cut it (``layout.tile_scores``, as the GPU kernel).

Backward: ``dkdv`` (grid over key blocks, steps over the query blocks that may attend to
them) and ``dq`` (grid over query blocks, steps over the forward's key range), recomputing the
scores; no atomics. The relative bias's delta gradients accumulate in a per-head output block
resident across the whole grid (so the block axis is "arbitrary" when there is a bias; heads
stay "parallel").

Sizes: ``blk`` = 128 rows; ``D``/``E`` zero-padded to multiples of 128 lanes in the layout.
float32 runs at HIGHEST precision, bfloat16 on the MXU with float32 accumulation (float16:
falls back). Limits: the SMEM scalars (``NB + 3(B+1)`` int32) must fit :data:`SMEM_BUDGET`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from recscale.kernels import common
from recscale.kernels.hstu_attention import layout

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
SMEM_BUDGET = 512 * 1024
BLOCK = 128


def pad_dim(d: int) -> int:
    return common.round_up(d, 128)


def default_block(d: int, e: int, dtype=None) -> int:
    del d, e, dtype
    return BLOCK


def unsupported_reason(q_shape, v_shape, num_seqs: int, st: layout.Static) -> str | None:
    """Why these kernels cannot run a non-empty call of one of ``DTYPES`` (None: they can)."""
    nb = layout.num_blocks(q_shape[0], num_seqs, st.block)
    smem = 4 * (nb + 3 * (num_seqs + 1) + st.bias_heads * st.num_buckets)
    if smem > SMEM_BUDGET:
        return f"layout scalars ({smem} bytes) exceed the SMEM budget ({SMEM_BUDGET})"
    if st.block % 16:
        return f"block {st.block} is not a multiple of 16 rows"
    return None


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot(a, b, contract, precision):
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


class _Seq:
    def __init__(self, seq_ref, first_ref, len_ref, nt_ref, r, st: layout.Static):
        seq = seq_ref[r]
        self.first, self.n, self.nt = first_ref[seq], len_ref[seq], nt_ref[seq]
        self.pos0 = (r - self.first) * st.block


def _k_block(st):
    """Index map of the key/value block at step ``kk`` of query block ``r``."""

    def index(h, r, kk, *scalars):
        seq = _Seq(*scalars, r, st)
        lo, hi = layout.k_range(seq.pos0, seq.n, seq.nt, st)
        return h, seq.first + jnp.minimum(lo + kk, jnp.maximum(hi - 1, 0)), 0

    return index


def _q_block(st):
    """Index map of the query/cotangent block at step ``s`` of key block ``r``."""

    def index(h, r, s, *scalars):
        seq = _Seq(*scalars, r, st)
        prefix, lo, hi = layout.q_steps(seq.pos0, seq.n, seq.nt, st)
        last = jnp.maximum(prefix + hi - lo - 1, 0)
        qb = layout.q_block_at(jnp.minimum(s, last), prefix, lo)
        qb = jnp.clip(qb, 0, jnp.maximum((seq.n + st.block - 1) // st.block - 1, 0))
        return h, seq.first + qb, 0

    return index


def _own_block(h, r, s, *scalars):
    return h, r, 0


def _iotas(blk):
    return (
        lax.broadcasted_iota(jnp.int32, (blk, blk), 0),
        lax.broadcasted_iota(jnp.int32, (blk, blk), 1),
    )


def _bias_scalars(bias_ref, h, st):
    if bias_ref is None:
        return []
    row = (h if st.bias_heads > 1 else 0) * st.num_buckets
    return [bias_ref[row + m] for m in range(st.num_buckets)]


def _tile(q, k, v, g, i, j, seq, bias, st, precision, span):
    """``(attn, dS)`` (float32, masked) of one tile; ``dS`` None when ``g`` is None."""
    dot = functools.partial(_dot, contract=(1, 1), precision=precision)
    s, valid = layout.tile_scores(q, k, i, j, seq.n, seq.nt, bias, st, dot, span)
    sig = 1.0 / (1.0 + jnp.exp(-s))
    inv_n = 1.0 / st.max_seq_len
    attn = jnp.where(valid, s * sig * inv_n, 0.0)
    if g is None:
        return attn, None
    dp = _dot(g, v, (1, 1), precision)
    return attn, jnp.where(valid, dp * sig * (1.0 + s * (1.0 - sig)) * inv_n, 0.0)


def _fwd_kernel(*refs, st, has_bias, precision):
    scalars, rest = refs[:4], refs[4:]
    bias_ref, rest = (rest[0], rest[1:]) if has_bias else (None, rest)
    q_ref, k_ref, v_ref, o_ref, acc_ref = rest
    h, r, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = _Seq(*scalars, r, st)
    lo, hi = layout.k_range(seq.pos0, seq.n, seq.nt, st)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(lo + kk < hi)
    def _step():
        ii, jj = _iotas(st.block)
        i, j = seq.pos0 + ii, (lo + kk) * st.block + jj
        bias = _bias_scalars(bias_ref, h, st)
        span = layout.tile_span(seq.pos0, (lo + kk) * st.block, st.block)
        attn, _ = _tile(q_ref[...], k_ref[...], None, None, i, j, seq, bias, st, precision, span)
        acc_ref[...] += _dot(attn.astype(v_ref.dtype), v_ref[...], (1, 0), precision)

    @pl.when(kk == pl.num_programs(2) - 1)
    def _write():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _dkdv_kernel(*refs, st, has_bias, precision):
    scalars, rest = refs[:4], refs[4:]
    bias_ref, rest = (rest[0], rest[1:]) if has_bias else (None, rest)
    q_ref, k_ref, v_ref, g_ref, dk_ref, dv_ref, dk_acc, dv_acc = rest
    h, r, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = _Seq(*scalars, r, st)
    prefix, lo, hi = layout.q_steps(seq.pos0, seq.n, seq.nt, st)

    @pl.when(s == 0)
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    @pl.when(s < prefix + hi - lo)
    def _step():
        ii, jj = _iotas(st.block)
        qb = layout.q_block_at(s, prefix, lo)
        i, j = qb * st.block + ii, seq.pos0 + jj
        bias = _bias_scalars(bias_ref, h, st)
        q, g = q_ref[...], g_ref[...]
        span = layout.tile_span(qb * st.block, seq.pos0, st.block)
        attn, ds = _tile(q, k_ref[...], v_ref[...], g, i, j, seq, bias, st, precision, span)
        dv_acc[...] += _dot(attn.astype(g.dtype), g, (0, 0), precision)
        dk_acc[...] += _dot(ds.astype(q.dtype), q, (0, 0), precision)

    @pl.when(s == pl.num_programs(2) - 1)
    def _write():
        dk_ref[...] = (dk_acc[...] * st.alpha).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(*refs, st, has_bias, precision):
    scalars, rest = refs[:4], refs[4:]
    bias_ref, rest = (rest[0], rest[1:]) if has_bias else (None, rest)
    if has_bias:
        q_ref, k_ref, v_ref, g_ref, dq_ref, db_ref, dq_acc = rest
    else:
        (q_ref, k_ref, v_ref, g_ref, dq_ref, dq_acc), db_ref = rest, None
    h, r, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = _Seq(*scalars, r, st)
    lo, hi = layout.k_range(seq.pos0, seq.n, seq.nt, st)

    @pl.when(kk == 0)
    def _init():
        dq_acc[...] = jnp.zeros_like(dq_acc)

    if has_bias:

        @pl.when((r == 0) & (kk == 0))
        def _init_bias():
            db_ref[...] = jnp.zeros_like(db_ref)

    @pl.when(lo + kk < hi)
    def _step():
        ii, jj = _iotas(st.block)
        i, j = seq.pos0 + ii, (lo + kk) * st.block + jj
        bias = _bias_scalars(bias_ref, h, st)
        k = k_ref[...]
        span = layout.tile_span(seq.pos0, (lo + kk) * st.block, st.block)
        _, ds = _tile(q_ref[...], k, v_ref[...], g_ref[...], i, j, seq, bias, st, precision, span)
        dq_acc[...] += _dot(ds.astype(k.dtype), k, (1, 0), precision)
        if has_bias:
            lane = lax.broadcasted_iota(jnp.int32, db_ref.shape, 1)
            vec = jnp.zeros(db_ref.shape, jnp.float32)
            zeros = tuple(jnp.float32(0) for _ in range(st.num_buckets))
            for m, total in enumerate(layout.add_bias_sums(zeros, ds, i, j, st, span)):
                vec = vec + jnp.where(lane == m, total, 0.0)
            db_ref[...] += vec

    @pl.when(kk == pl.num_programs(2) - 1)
    def _write():
        dq_ref[...] = (dq_acc[...] * st.alpha).astype(dq_ref.dtype)


def _call(kernel, grid, in_specs, out_specs, out_shape, scratch, semantics, name, interpret):
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=interpret,
        name=name,
    )


def forward(q_hrd, k_hrd, v_hre, lay, bias_deltas, *, st: layout.Static, interpret=False):
    """``out [H, R, E_p]`` over the layout (as ``pallas_gpu.forward``)."""
    h, rows, dp = q_hrd.shape
    ep, blk = v_hre.shape[2], st.block
    has_bias = bias_deltas is not None
    bias_spec = [pl.BlockSpec(memory_space=pltpu.SMEM)] if has_bias else []
    in_specs = [
        *bias_spec,
        pl.BlockSpec((None, blk, dp), _own_block),
        pl.BlockSpec((None, blk, dp), _k_block(st)),
        pl.BlockSpec((None, blk, ep), _k_block(st)),
    ]
    kernel = functools.partial(
        _fwd_kernel, st=st, has_bias=has_bias, precision=_precision(q_hrd.dtype)
    )
    return _call(
        kernel,
        (h, rows // blk, st.max_blocks),
        in_specs,
        pl.BlockSpec((None, blk, ep), _own_block),
        jax.ShapeDtypeStruct((h, rows, ep), q_hrd.dtype),
        [pltpu.VMEM((blk, ep), jnp.float32)],
        ("parallel", "parallel", "arbitrary"),
        "hstu_attention_fwd",
        interpret,
    )(*lay.scalars, *([bias_deltas] if has_bias else []), q_hrd, k_hrd, v_hre)


def backward(q_hrd, k_hrd, v_hre, g_hre, lay, bias_deltas, *, st: layout.Static, interpret=False):
    """``(dq, dk, dv, d_delta)`` over the layout (as ``pallas_gpu.backward``)."""
    h, rows, dp = q_hrd.shape
    ep, blk, nb = v_hre.shape[2], st.block, rows // st.block
    has_bias = bias_deltas is not None
    cd = q_hrd.dtype
    bias_spec = [pl.BlockSpec(memory_space=pltpu.SMEM)] if has_bias else []
    operands = (*lay.scalars, *([bias_deltas] if has_bias else []), q_hrd, k_hrd, v_hre, g_hre)
    kw = dict(st=st, has_bias=has_bias, precision=_precision(cd))
    own_d, own_e = (pl.BlockSpec((None, blk, w), _own_block) for w in (dp, ep))
    dk, dv = _call(
        functools.partial(_dkdv_kernel, **kw),
        (h, nb, layout.max_q_steps(st)),
        [
            *bias_spec,
            pl.BlockSpec((None, blk, dp), _q_block(st)),
            own_d,
            own_e,
            pl.BlockSpec((None, blk, ep), _q_block(st)),
        ],
        [own_d, own_e],
        [jax.ShapeDtypeStruct((h, rows, dp), cd), jax.ShapeDtypeStruct((h, rows, ep), cd)],
        [pltpu.VMEM((blk, dp), jnp.float32), pltpu.VMEM((blk, ep), jnp.float32)],
        ("parallel", "parallel", "arbitrary"),
        "hstu_attention_bwd_dkdv",
        interpret,
    )(*operands)
    out_specs = [own_d]
    out_shape = [jax.ShapeDtypeStruct((h, rows, dp), cd)]
    if has_bias:
        out_specs.append(pl.BlockSpec((None, 1, st.num_buckets), lambda h, r, s, *_: (h, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((h, 1, st.num_buckets), jnp.float32))
    outs = _call(
        functools.partial(_dq_kernel, **kw),
        (h, nb, st.max_blocks),
        [
            *bias_spec,
            own_d,
            pl.BlockSpec((None, blk, dp), _k_block(st)),
            pl.BlockSpec((None, blk, ep), _k_block(st)),
            own_e,
        ],
        out_specs,
        out_shape,
        [pltpu.VMEM((blk, dp), jnp.float32)],
        ("parallel", "arbitrary" if has_bias else "parallel", "arbitrary"),
        "hstu_attention_bwd_dq",
        interpret,
    )(*operands)
    d_delta = None
    if has_bias:
        d_delta = outs[1][:, 0, :]
        if st.bias_heads == 1:
            d_delta = d_delta.sum(0, keepdims=True)
    return outs[0], dk, dv, d_delta
