"""HSTU's pointwise attention over jagged sequences in plain jnp: the spec, the oracle and the
XLA path.

Matched against github:facebookresearch/generative-recommenders at commit
``2e81fab69a497fb5e24cd23569adf1e78070e4ec``: ``generative_recommenders/ops/pytorch/
pt_hstu_attention.py`` (``pytorch_hstu_mha`` and its ``_get_valid_attn_mask``; the Triton
kernel ``ops/triton/triton_hstu_attention.py`` computes the same mask tile by tile) with the
additive relative bias of the research form (``research/modeling/sequential/hstu.py``,
``_hstu_attention_maybe_from_cache``: bias added to ``q·k`` before the SiLU). For sequence b of
length ``n = min(offsets[b+1] - offsets[b], N)`` (``N = max_seq_len``; tokens past ``N`` are
dropped, as ``jagged_to_padded_dense`` drops them: their output and gradients are zero), query
position ``i`` and key position ``j`` (both in ``[0, n)``), head ``h``:

    s(i, j)    = alpha · q_i·k_j + rab_h(|i - j|)
    attn(i, j) = SiLU(s(i, j)) / N · valid(i, j)          (divided by N, not n, as the reference)
    out_i      = Σ_j attn(i, j) v_j                        (no softmax)

``valid(i, j)`` is ``_get_valid_attn_mask`` with ``causal=True`` (the only mode the reference
kernels support). With ``c = contextual_seq_len``, ``nt = num_targets[b]`` (0 without targets),
``M = max_attn_len``: ids ``r(x) = max(x - c + 1, 0)`` if ``c > 0`` else ``x``, clamped to at
most ``m = n - nt (- c + 1 if c > 0)``; ``dist = r(i) - r(j)``;

    valid = (i == j or dist > 0) and (M == 0 or dist <= M)   or   (c > 0 and r(i) == 0 and r(j) < m)

So: causal; the last ``nt`` tokens (targets) all take the id of the first target, so each
attends to the history (within the window) and to itself only, and no token attends to a
target but itself; the first ``c`` tokens (contextual prefix) attend to every non-target token,
and every later token attends to them while its ``r(i) <= M`` (the reference's window applies
to the prefix too). Preconditions (as the reference assumes): ``0 <= nt <= n - c``.

Relative bias (``rab``, optional): a learned table ``[H or 1, num_buckets]`` (one row shared by
all heads, or one per head), indexed by the bucket of the position distance ``|i - j|``:
``bucket(d) = #{m : boundaries[m] <= d}`` with :func:`bucket_boundaries` (exact 0..3, then two
buckets per octave: 4, 6, 8, 12, 16, ...; the last bucket takes all longer distances). This is
the research form's ``RelativePositionalBias`` (one weight per distance) bucketed so that the
kernels compute it in-tile from ``num_buckets`` scalars, without a dense ``[B, H, N, N]`` bias
or a gather. The research form's timestamp buckets are not supported.

Backward (``g`` the cotangent of ``out``; ``σ`` the logistic sigmoid):

    dv_j = Σ_i attn(i, j) g_i
    dS   = (g_i·v_j) · valid / N · σ(s) (1 + s (1 - σ(s)))
    dq_i = alpha Σ_j dS(i, j) k_j,   dk_j = alpha Σ_i dS(i, j) q_i,   drab_h[b] = Σ dS over bucket b

Rounding, as the kernels: products in the inputs' dtype with float32 accumulation; ``attn`` is
rounded to ``v``'s dtype before ``attn·v`` and ``attn``/``dS`` to the inputs' dtype before the
backward's products. Outputs in the inputs' dtype; ``drab`` in the table's dtype.

This reference is dense per padded sequence (``[B, H, N, N]`` scores, quadratic in memory at
long ``N``; the kernels are not): the spec and the oracle. The XLA path evaluates the same maths
on local windows of the packed tokens (:mod:`.chunked`), without the padding.

Dimension glossary: ``T`` packed tokens, ``B`` sequences, ``H`` heads, ``N`` max_seq_len,
``D`` q/k dim, ``E`` v dim, ``R`` bias buckets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def bucket_boundaries(num_buckets: int) -> tuple[int, ...]:
    """The ``num_buckets - 1`` increasing distances at which a new bucket starts: 1, 2, 3, then
    two per octave (4, 6, 8, 12, 16, 24, ...)."""
    out: list[int] = [1, 2, 3]
    p = 4
    while len(out) < num_buckets - 1:
        out += [p, p + p // 2]
        p *= 2
    return tuple(out[: max(num_buckets - 1, 0)])


def buckets(d: jax.Array, num_buckets: int) -> jax.Array:
    """``bucket(|d|)`` (int32) of position distances ``d``."""
    d = jnp.abs(d)
    out = jnp.zeros(d.shape, jnp.int32)
    for edge in bucket_boundaries(num_buckets):
        out += (d >= edge).astype(jnp.int32)
    return out


def valid_mask(i, j, n, nt, *, contextual_seq_len: int, max_attn_len: int):
    """``valid(i, j)`` (module docstring) for broadcastable int32 positions ``i`` (query), ``j``
    (key), sequence length ``n`` and target count ``nt``, and only for ``i, j < n``. Plain jnp
    elementwise ops: the Pallas kernels evaluate it on their tiles."""
    c, m_len = contextual_seq_len, max_attn_len
    ri, rj, max_ids = i, j, n
    if c > 0:
        ri, rj, max_ids = jnp.maximum(i - c + 1, 0), jnp.maximum(j - c + 1, 0), n - c + 1
    max_ids = max_ids - nt
    ri, rj = jnp.minimum(ri, max_ids), jnp.minimum(rj, max_ids)
    dist = ri - rj
    valid = (i == j) | (dist > 0)
    if m_len > 0:
        valid = valid & (dist <= m_len)
    if c > 0:
        valid = valid | ((ri == 0) & (rj < max_ids))
    return valid & (i < n) & (j < n)


def lengths(seq_offsets: jax.Array, max_seq_len: int) -> jax.Array:
    """``n_b = min(offsets[b+1] - offsets[b], N)``, int32 [B]."""
    return jnp.minimum(jnp.diff(seq_offsets.astype(jnp.int32)), max_seq_len)


def _to_padded(x_thd, seq_offsets, n_b, max_seq_len):
    """Jagged ``[T, H, D]`` -> ``[B, N, H, D]``, zeros past each sequence's end."""
    pos = jnp.arange(max_seq_len, dtype=jnp.int32)
    idx = seq_offsets[:-1, None].astype(jnp.int32) + pos[None, :]
    ok = pos[None, :] < n_b[:, None]
    rows = jnp.take(x_thd, jnp.where(ok, idx, 0), axis=0, mode="clip")
    return jnp.where(ok[:, :, None, None], rows, jnp.zeros((), x_thd.dtype))


def _to_jagged(x_bnhd, seq_offsets, n_b, num_tokens):
    """``[B, N, H, D]`` -> jagged ``[T, H, D]``: token t of sequence b at position t -
    offsets[b] (zero for tokens past N or outside every sequence)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    offsets = seq_offsets.astype(jnp.int32)
    b = jnp.clip(jnp.searchsorted(offsets, t, side="right") - 1, 0, n_b.shape[0] - 1)
    pos = t - offsets[b]
    ok = (pos >= 0) & (pos < n_b[b]) & (t < offsets[-1])
    rows = x_bnhd[b, jnp.clip(pos, 0, x_bnhd.shape[1] - 1)]
    return jnp.where(ok[:, None, None], rows, jnp.zeros((), x_bnhd.dtype))


def _scores(q, k, seq_offsets, num_targets, rel_bias, cfg):
    """(padded q, k, s [B, H, N, N] f32, valid [B, 1, N, N], n_b) of the module docstring."""
    n_max = cfg["max_seq_len"]
    n_b = lengths(seq_offsets, n_max)
    nt = jnp.zeros_like(n_b) if num_targets is None else num_targets.astype(jnp.int32)
    qp, kp = (_to_padded(x, seq_offsets, n_b, n_max) for x in (q, k))
    s = jnp.einsum("bihd,bjhd->bhij", qp, kp, preferred_element_type=jnp.float32)
    s = s * cfg["alpha"]
    pos = jnp.arange(n_max, dtype=jnp.int32)
    if rel_bias is not None:
        table = rel_bias.astype(jnp.float32)  # [H or 1, R]
        bias = table[:, buckets(pos[:, None] - pos[None, :], table.shape[-1])]  # [H|1, N, N]
        s = s + bias[None]
    valid = valid_mask(
        pos[None, None, :, None],
        pos[None, None, None, :],
        n_b[:, None, None, None],
        nt[:, None, None, None],
        contextual_seq_len=cfg["contextual_seq_len"],
        max_attn_len=cfg["max_attn_len"],
    )
    return qp, kp, s, valid, n_b


def static_config(max_seq_len, alpha, contextual_seq_len, max_attn_len) -> dict:
    """The static options as the reference, the api and the kernels take them."""
    return dict(
        max_seq_len=int(max_seq_len),
        alpha=float(alpha),
        contextual_seq_len=int(contextual_seq_len),
        max_attn_len=int(max_attn_len),
    )


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
) -> jax.Array:
    """``out [T, H, E]`` of the module docstring, in ``q``'s dtype. Differentiable by JAX."""
    cfg = static_config(max_seq_len, alpha, contextual_seq_len, max_attn_len)
    _, _, s, valid, n_b = _scores(q, k, seq_offsets, num_targets, rel_bias, cfg)
    attn = jnp.where(valid, jax.nn.silu(s) / cfg["max_seq_len"], 0.0).astype(v.dtype)
    vp = _to_padded(v.astype(q.dtype), seq_offsets, n_b, cfg["max_seq_len"])
    out = jnp.einsum("bhij,bjhe->bihe", attn, vp, preferred_element_type=jnp.float32)
    return _to_jagged(out.astype(q.dtype), seq_offsets, n_b, q.shape[0])


def hstu_attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seq_offsets: jax.Array,
    num_targets: jax.Array | None,
    rel_bias: jax.Array | None,
    g: jax.Array,
    *,
    max_seq_len: int,
    alpha: float = 1.0,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """``(dq, dk, dv, drab)`` for the cotangent ``g [T, H, E]``, written out from the module
    docstring's backward and rounded as the kernels round (``drab`` None without a bias). The
    XLA path's backward; the tests check it against ``jax.vjp`` of :func:`hstu_attention`."""
    cfg = static_config(max_seq_len, alpha, contextual_seq_len, max_attn_len)
    cd, f32, n_max = q.dtype, jnp.float32, cfg["max_seq_len"]
    qp, kp, s, valid, n_b = _scores(q, k, seq_offsets, num_targets, rel_bias, cfg)
    vp = _to_padded(v.astype(cd), seq_offsets, n_b, n_max)
    gp = _to_padded(g.astype(cd), seq_offsets, n_b, n_max)
    sig = jax.nn.sigmoid(s)
    attn = jnp.where(valid, s * sig / n_max, 0.0).astype(cd)
    dv = jnp.einsum("bhij,bihe->bjhe", attn, gp, preferred_element_type=f32)
    dp = jnp.einsum("bihe,bjhe->bhij", gp, vp, preferred_element_type=f32)
    ds = jnp.where(valid, dp * sig * (1.0 + s * (1.0 - sig)) / n_max, 0.0)
    dsc = ds.astype(cd)
    dq = jnp.einsum("bhij,bjhd->bihd", dsc, kp, preferred_element_type=f32) * cfg["alpha"]
    dk = jnp.einsum("bhij,bihd->bjhd", dsc, qp, preferred_element_type=f32) * cfg["alpha"]
    drab = None
    if rel_bias is not None:
        pos = jnp.arange(n_max, dtype=jnp.int32)
        bk = buckets(pos[:, None] - pos[None, :], rel_bias.shape[-1])  # [N, N]
        onehot = jax.nn.one_hot(bk, rel_bias.shape[-1], dtype=f32)  # [N, N, R]
        drab = jnp.einsum("bhij,ijr->hr", ds, onehot, precision=jax.lax.Precision.HIGHEST)
        if rel_bias.shape[0] == 1:
            drab = drab.sum(0, keepdims=True)
        drab = drab.astype(rel_bias.dtype)
    t = q.shape[0]
    dq, dk, dv = (_to_jagged(x.astype(cd), seq_offsets, n_b, t) for x in (dq, dk, dv))
    return dq, dk, dv.astype(v.dtype), drab
