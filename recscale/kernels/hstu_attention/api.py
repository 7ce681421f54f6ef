"""HSTU attention over jagged sequences: the function models call.

:func:`hstu_attention` picks an implementation (``xla``: :mod:`.chunked`, the reference's
maths in jnp on local windows of the tokens; ``pallas_gpu``: :mod:`.pallas_gpu`;
``pallas_tpu``: :mod:`.pallas_tpu`; ``auto``: the Pallas kernel of the default backend once
verified on that hardware (``common.HARDWARE_VERIFIED``: the GPU kernel on an H200 for bfloat16;
float32 keeps XLA, ``common.AUTO_KEEPS_XLA``), else XLA) and falls back to
XLA, counted in ``common.FALLBACKS``, when the chosen kernel does not support the call. Every
path carries a ``jax.custom_vjp``: the Pallas paths' backward is the Pallas backward kernels
(recomputing the scores, saving only the inputs), the XLA path's the same math in jnp
(``chunked.hstu_attention_vjp``, as ``reference.hstu_attention_vjp`` on padded sequences).

Not batch-sharded here: the jagged ``[T, ...]`` tokens split over devices only with their
sequences, so a caller under a mesh runs this inside its own ``shard_map`` (one shard of
whole sequences, and its own offsets, per device).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from recscale.kernels import common
from recscale.kernels.hstu_attention import chunked, layout, pallas_gpu, pallas_tpu, reference

OP = "hstu_attention"
_KERNELS = {"pallas_gpu": pallas_gpu, "pallas_tpu": pallas_tpu}


def _check(q, k, v, seq_offsets, num_targets, rel_bias) -> None:
    if q.ndim != 3 or k.shape != q.shape:
        raise ValueError(f"{OP}: q and k must be [T, H, D] alike, got {q.shape} and {k.shape}")
    if v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"{OP}: v must be [T, H, E] with q {q.shape}, got {v.shape}")
    if seq_offsets.ndim != 1 or seq_offsets.shape[0] < 1:
        raise ValueError(f"{OP}: seq_offsets must be [B+1], got {seq_offsets.shape}")
    if not jnp.issubdtype(seq_offsets.dtype, jnp.integer):
        raise ValueError(f"{OP}: seq_offsets must be integer, got {seq_offsets.dtype}")
    b = seq_offsets.shape[0] - 1
    if num_targets is not None and num_targets.shape != (b,):
        raise ValueError(f"{OP}: num_targets must be [B]=[{b}], got {num_targets.shape}")
    if rel_bias is not None and (rel_bias.ndim != 2 or rel_bias.shape[0] not in (1, q.shape[1])):
        raise ValueError(f"{OP}: rel_bias must be [1 or H, buckets], got {rel_bias.shape}")
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{OP}: {name} must be floating point, got {a.dtype}")


def _unsupported(kernels, q, v, seq_offsets, st: layout.Static) -> str | None:
    dtype = jnp.dtype(q.dtype)
    if dtype not in kernels.DTYPES:
        return f"dtype {dtype} (have {', '.join(map(str, kernels.DTYPES))})"
    if q.shape[0] == 0:
        return "no tokens"
    if st.num_buckets > 128:
        return f"{st.num_buckets} bias buckets (at most 128)"
    return kernels.unsupported_reason(q.shape, v.shape, seq_offsets.shape[0] - 1, st)


def _kernel_call(kernels, st: layout.Static, interpret: Any):
    """``f(q, k, v, offsets, num_targets, rel_bias) -> out`` on ``kernels``, with its VJP."""

    def prepare(q, k, v, seq_offsets, num_targets, rel_bias):
        t, _, d = q.shape
        lay = layout.blocks(seq_offsets, num_targets, t, st)
        rows = layout.num_blocks(t, seq_offsets.shape[0] - 1, st.block) * st.block
        dp, ep = kernels.pad_dim(d), kernels.pad_dim(v.shape[2])
        qh, kh = (layout.to_blocks(x, lay, rows, dp) for x in (q, k))
        deltas = None if rel_bias is None else layout.bias_deltas(rel_bias)
        return lay, rows, ep, qh, kh, layout.to_blocks(v, lay, rows, ep), deltas

    @jax.custom_vjp
    def op(q, k, v, seq_offsets, num_targets, rel_bias):
        lay, _, _, qh, kh, vh, deltas = prepare(q, k, v, seq_offsets, num_targets, rel_bias)
        out = kernels.forward(qh, kh, vh, lay, deltas, st=st, interpret=interpret)
        return layout.from_blocks(out, lay, v.shape[2])

    def op_fwd(*args):
        return op(*args), args

    def op_bwd(args, g):
        q, k, v, seq_offsets, num_targets, rel_bias = args
        lay, rows, ep, qh, kh, vh, deltas = prepare(*args)
        gh = layout.to_blocks(g.astype(q.dtype), lay, rows, ep)
        dq, dk, dv, d_delta = kernels.backward(
            qh, kh, vh, gh, lay, deltas, st=st, interpret=interpret
        )
        d = q.shape[2]
        grads = [layout.from_blocks(x, lay, w) for x, w in ((dq, d), (dk, d), (dv, v.shape[2]))]
        d_bias = None if rel_bias is None else layout.bias_grad(d_delta, rel_bias)
        return (*grads, None, None, d_bias)

    op.defvjp(op_fwd, op_bwd)
    return op


def _xla_call(cfg: dict):
    @jax.custom_vjp
    def op(q, k, v, seq_offsets, num_targets, rel_bias):
        return chunked.hstu_attention(q, k, v, seq_offsets, num_targets, rel_bias, cfg=cfg)

    def op_fwd(*args):
        return op(*args), args

    def op_bwd(args, g):
        grads = chunked.hstu_attention_vjp(*args, g, cfg=cfg)
        return (*grads[:3], None, None, grads[3])

    op.defvjp(op_fwd, op_bwd)
    return op


def hstu_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seq_offsets: jax.Array,
    num_targets: jax.Array | None = None,
    rel_bias: jax.Array | None = None,
    *,
    max_seq_len: int,
    alpha: float = 1.0,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    impl: str = "auto",
    interpret: Any = None,
    block: int | None = None,
) -> jax.Array:
    """HSTU's pointwise (SiLU, no softmax) causal attention over jagged sequences, exactly as
    ``reference``'s module docstring states (generative-recommenders' ``pytorch_hstu_mha`` mask
    and scaling, with a bucketed relative-position bias added before the SiLU):
    ``out_i = Σ_j SiLU(alpha q_i·k_j + rab(|i-j|)) / max_seq_len · valid(i, j) · v_j``.
    Output in ``q``'s dtype (``k``, ``v`` are cast to it), float32 accumulation.
    Differentiable w.r.t. ``q``, ``k``, ``v`` and ``rel_bias``.

    Args:
      q, k: ``[T, H, D]`` packed queries and keys of all sequences.
      v: ``[T, H, E]`` packed values.
      seq_offsets: ``[B+1]`` int32, sequence b is tokens ``offsets[b]:offsets[b+1]``.
      num_targets: optional ``[B]`` int32: the last ``num_targets[b]`` tokens of sequence b are
        targets (attend to the history and themselves only).
      rel_bias: optional ``[1 or H, num_buckets]`` learned table of the relative-position bias
        (shared or per head; ``reference.bucket_boundaries``).
      max_seq_len: ``N`` (static): the scale ``1/N``; tokens past position ``N`` are dropped.
      alpha: scale of ``q·k`` (static).
      contextual_seq_len: length of the contextual prefix (static; 0: none).
      max_attn_len: local window (static; 0: none).
      impl: ``auto``, ``xla``, ``pallas_gpu`` or ``pallas_tpu``.
      interpret: the Pallas ``interpret=`` setting; None: ``common.interpret_for(impl)``.
      block: the kernels' block size (tests; None: the kernel's default).

    Raises:
      ValueError: on inconsistent shapes or non-floating inputs.
    """
    _check(q, k, v, seq_offsets, num_targets, rel_bias)
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    cfg = reference.static_config(max_seq_len, alpha, contextual_seq_len, max_attn_len)
    statics = {
        name: layout.Static(
            **cfg,
            block=block or mod.default_block(q.shape[2], v.shape[2], q.dtype),
            num_buckets=0 if rel_bias is None else rel_bias.shape[1],
            bias_heads=0 if rel_bias is None else rel_bias.shape[0],
        )
        for name, mod in _KERNELS.items()
    }
    unsupported = (
        {}
        if impl == "xla"
        else {
            name: _unsupported(mod, q, v, seq_offsets, statics[name])
            for name, mod in _KERNELS.items()
        }
    )
    chosen = common.resolve(OP, impl, unsupported, dtype=q.dtype)
    args = (q, k, v, seq_offsets.astype(jnp.int32), num_targets, rel_bias)
    if num_targets is not None:
        args = (*args[:4], num_targets.astype(jnp.int32), rel_bias)
    if chosen == "xla":
        return _xla_call(cfg)(*args)
    if interpret is None:
        interpret = common.interpret_for(chosen)
    return _kernel_call(_KERNELS[chosen], statics[chosen], interpret)(*args)
