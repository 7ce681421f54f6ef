"""HSTU attention in jnp on local windows of the packed tokens: the XLA path.

The maths, mask, bias and rounding of :mod:`.reference` (its module docstring), forward and
written-out backward, evaluated on ``recscale.jagged`` windows instead of a padded
``[B, H, N, N]`` layout: chunk g's ``C`` query slots score the ``W`` slots of the chunks around
it, ``[G, H, C, W]`` scores, and a pair counts only if both slots are tokens of the same
sequence within its first ``N`` and ``valid(i, j)`` holds for their positions. Every key a
query may see is within ``N - 1`` slots of it (behind it, or ahead of it for the contextual
prefix, whose windows then reach ahead too), so the sums are the reference's, taken in
another order. Slices and reshapes move the tokens in and out (no gather, no scatter): cheaper
than the reference's padding where histories are short against ``N`` (the packs' slots are
then mostly other sequences' tokens, not padding).

Dimension glossary: ``T`` packed tokens, ``G`` chunks, ``C`` slots per chunk, ``W`` window
slots, ``H`` heads, ``D`` q/k dim, ``E`` v dim, ``R`` bias buckets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from recscale import jagged
from recscale.kernels.hstu_attention import reference


def _scores(q, k, seq_offsets, num_targets, rel_bias, cfg):
    """``(windows, q chunks [G, C, H, D], k windows [G, W, H, D], s [G, H, C, W] f32,
    valid [G, 1, C, W])``."""
    t, n_max = q.shape[0], cfg["max_seq_len"]
    win = jagged.Windows.of(t, n_max, ahead=cfg["contextual_seq_len"] > 0)
    offsets = seq_offsets.astype(jnp.int32)
    n_b = reference.lengths(offsets, n_max)
    nt_b = jnp.zeros_like(n_b) if num_targets is None else num_targets.astype(jnp.int32)
    slot = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(offsets, slot, side="right") - 1, 0, n_b.shape[0] - 1)
    pos = slot - offsets[seq]
    seq = jnp.where((slot < offsets[-1]) & (pos < n_b[seq]), seq, -1)  # -1: not a token
    qc, kw = win.chunks(q), win.window(k)
    s = jnp.einsum("gihd,gjhd->ghij", qc, kw, preferred_element_type=jnp.float32)
    s = s * cfg["alpha"]
    dist = win.distance()  # [C, W]: i - j for a pair of one sequence
    if rel_bias is not None:
        table = rel_bias.astype(jnp.float32)  # [H or 1, R]
        s = s + table[:, reference.buckets(dist, table.shape[-1])][None]
    sq, pq = win.chunks(seq, -1)[:, :, None], win.chunks(pos)[:, :, None]
    valid = reference.valid_mask(
        pq,
        pq - dist,
        win.chunks(n_b[seq])[:, :, None],
        win.chunks(nt_b[seq])[:, :, None],
        contextual_seq_len=cfg["contextual_seq_len"],
        max_attn_len=cfg["max_attn_len"],
    )
    valid = valid & (sq >= 0) & (win.window(seq, -1)[:, None, :] == sq)
    return win, qc, kw, s, valid[:, None]


def hstu_attention(q, k, v, seq_offsets, num_targets, rel_bias, *, cfg: dict) -> jax.Array:
    """``out [T, H, E]`` of :func:`.reference.hstu_attention` (``cfg``:
    ``reference.static_config``), in ``q``'s dtype; ``k``, ``v`` already in it."""
    win, _, _, s, valid = _scores(q, k, seq_offsets, num_targets, rel_bias, cfg)
    attn = jnp.where(valid, jax.nn.silu(s) / cfg["max_seq_len"], 0.0).astype(v.dtype)
    out = jnp.einsum("ghij,gjhe->gihe", attn, win.window(v), preferred_element_type=jnp.float32)
    return win.unchunk(out.astype(q.dtype))


def hstu_attention_vjp(q, k, v, seq_offsets, num_targets, rel_bias, g, *, cfg: dict):
    """``(dq, dk, dv, drab)`` of :func:`.reference.hstu_attention_vjp`, on windows."""
    cd, f32, n_max = q.dtype, jnp.float32, cfg["max_seq_len"]
    win, qc, kw, s, valid = _scores(q, k, seq_offsets, num_targets, rel_bias, cfg)
    vw, gc = win.window(v.astype(cd)), win.chunks(g.astype(cd))
    sig = jax.nn.sigmoid(s)
    attn = jnp.where(valid, s * sig / n_max, 0.0).astype(cd)
    dv = jnp.einsum("ghij,gihe->gjhe", attn, gc, preferred_element_type=f32)
    dp = jnp.einsum("gihe,gjhe->ghij", gc, vw, preferred_element_type=f32)
    ds = jnp.where(valid, dp * sig * (1.0 + s * (1.0 - sig)) / n_max, 0.0)
    dsc = ds.astype(cd)
    dq = jnp.einsum("ghij,gjhd->gihd", dsc, kw, preferred_element_type=f32) * cfg["alpha"]
    dk = jnp.einsum("ghij,gihd->gjhd", dsc, qc, preferred_element_type=f32) * cfg["alpha"]
    drab = None
    if rel_bias is not None:
        r = rel_bias.shape[-1]
        onehot = jax.nn.one_hot(reference.buckets(win.distance(), r), r, dtype=f32)  # [C, W, R]
        ds_hij = ds.sum(0)  # over the chunks first: the one-hot product is then [H, C·W]
        drab = jnp.einsum("hij,ijr->hr", ds_hij, onehot, precision=jax.lax.Precision.HIGHEST)
        if rel_bias.shape[0] == 1:
            drab = drab.sum(0, keepdims=True)
        drab = drab.astype(rel_bias.dtype)
    # A key's window entries are summed in float32, then rounded once, as the reference's.
    dq = win.unchunk(dq).astype(cd)
    dk, dv = (win.unwindow(x).astype(cd) for x in (dk, dv))
    return dq, dk, dv.astype(v.dtype), drab
