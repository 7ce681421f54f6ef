"""Compressed all-to-all of the engine's pooled embeddings and their gradients (issue 19).

ZionEX-style training exchanges every example's pooled embedding between the device holding
the table and the device holding the example, forward and, for the gradients, backward; at
scale that exchange dominates the step. Two compressors, chosen by
``embeddings.comm_compression``:

* ``error_bounded``: a guaranteed bound per element, as the error-bounded lossy compressors of
  the seed work (SZ-style linear quantisation). Every block the all-to-all sends (one table
  slot's outputs for one destination device: ``[B / n, w]`` values) is quantised to bins of
  width ``2 ε (max - min)`` on a grid anchored at zero, so each decoded value is within
  ``ε (max - min)`` of the sent one and exact zeros stay zero (a row-wise shard's partial
  outputs are mostly zeros: their sum over the shards then carries only the nonzero parts'
  errors, not a bias per shard). The bound is relative to the block's range, which is what
  keeps the code width static under ``jit`` (:func:`code_bits`). The codes are packed densely
  into 32-bit words, sent with the block's anchor and bin width in the same all-to-all, and
  decoded on arrival. ε = 0.002 gives 8-bit codes (4x fewer bytes than float32), ε = 0.0081
  6 bits (5.3x), ε = 0.036 4 bits (8x).
* ``fp8_e4m3`` / ``fp8_e5m2``: each block scaled by its largest magnitude to the format's
  largest finite value, cast, and scaled back on arrival (no bound: a relative error of 2^-4
  (e4m3) or 2^-3 (e5m2) of each value; values below 2^-18 (e4m3) or 2^-32 (e5m2) of the
  block's largest round to zero).

Gradients travel back compressed the same way, with their own bound
(``comm_error_bound_grad``). Everything is plain ``jnp`` inside the engine's ``shard_map``: the
codes are packed by bit arithmetic, which XLA fuses; no backend needs a kernel for it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

Kind = Literal["none", "error_bounded", "fp8_e4m3", "fp8_e5m2"]
FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


MARGIN = 1 - 2.0**-12
"""Bins are this much narrower than ``2 ε range``: room for the float32 rounding of a decoded
value (the bound holds strictly wherever the range is wide against the values' magnitude)."""
MIN_EPS = 2.0**-16
"""The tightest bound offered (16-bit codes); below it a block costs about as much as float32."""


def _top(eps: float) -> int:
    """The largest code: codes count bins from the one holding the block's minimum, on a grid
    anchored at zero (so an exact zero, most of a row-wise shard's partial outputs, decodes to
    exactly zero), which can take one bin more than the range spans."""
    return math.ceil(1 / (2 * eps * MARGIN)) + 1


def code_bits(eps: float) -> int:
    """Bits per code for a relative bound ``eps`` (0.002: 8; 0.0081: 6; 0.036: 4)."""
    if not MIN_EPS <= eps < 0.5:
        raise ValueError(
            f"error bound {eps}: must be in [{MIN_EPS:.3g}, 0.5) (relative to a "
            "block's range; below it the codes cost about as much as float32)"
        )
    return math.ceil(math.log2(_top(eps) + 1))


def _words(n: int, bits: int) -> int:
    return -(-n * bits // 32)


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """Packs unsigned ``codes [..., n]`` (each < 2^bits) densely into ``uint32 [..., words]``,
    code ``i`` at bits ``i·bits .. i·bits + bits - 1`` of the concatenated words (little end
    first); the tail of the last word is zero."""
    *lead, n = codes.shape
    if 32 % bits == 0:  # whole codes per word (1, 2, 4, 8, 16 bits): shift and or, no bit planes
        k, words = 32 // bits, _words(n, bits)
        c = jnp.pad(codes.astype(jnp.uint32), [(0, 0)] * len(lead) + [(0, words * k - n)])
        c = c.reshape(*lead, words, k) << (jnp.arange(k, dtype=jnp.uint32) * bits)
        return jnp.sum(c, axis=-1, dtype=jnp.uint32)  # disjoint bits: a sum is an or
    return _pack_planes(codes, bits)


def _pack_planes(codes: jax.Array, bits: int) -> jax.Array:
    """:func:`pack_bits` for any width: every code split into bit planes (``bits`` words per
    code before the sum, so 6-bit codes cost what 8-bit ones did before the fast path)."""
    *lead, n = codes.shape
    total = _words(n, bits) * 32
    shifts = jnp.arange(bits, dtype=jnp.uint32)
    flat = ((codes.astype(jnp.uint32)[..., None] >> shifts) & 1).reshape(*lead, n * bits)
    flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, total - n * bits)])
    words = flat.reshape(*lead, total // 32, 32) << jnp.arange(32, dtype=jnp.uint32)
    # the bits are disjoint: a sum is an or
    return jnp.sum(words, axis=-1, dtype=jnp.uint32)


def unpack_bits(words: jax.Array, bits: int, n: int) -> jax.Array:
    """The inverse of :func:`pack_bits`: ``uint32 [..., n]`` codes."""
    *lead, w = words.shape
    if 32 % bits == 0:
        k = 32 // bits
        c = (words[..., None] >> (jnp.arange(k, dtype=jnp.uint32) * bits)) & ((1 << bits) - 1)
        return c.reshape(*lead, w * k)[..., :n]
    flat = (words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    flat = flat.reshape(*lead, w * 32)[..., : n * bits].reshape(*lead, n, bits)
    return jnp.sum(flat << jnp.arange(bits, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def encode(x: jax.Array, eps: float) -> jax.Array:
    """Blocks ``x [..., m]`` (float32) to ``uint32 [..., 2 + words]``: the block's anchor (the
    multiple of the bin width nearest its minimum) and bin width (bit patterns), then its
    packed codes. Decoded values are within ``eps · (max - min)`` of ``x``'s
    (:func:`decode`), exact zeros stay exactly zero, and a constant block is exact; up to the
    float32 rounding of the decoded value itself (a block whose range is under about
    ``1 / (2 eps)`` ulps of its magnitude can be off by an ulp or two). A block holding a NaN
    or an infinity decodes to NaN throughout (the train step's finite check skips the step);
    magnitudes must stay below 1e37 (float32 overflows in the decoded sum beyond it)."""
    bits = code_bits(eps)
    x = x.astype(jnp.float32)
    lo = jnp.min(x, axis=-1, keepdims=True)
    hi = jnp.max(x, axis=-1, keepdims=True)
    width = 4 * eps * MARGIN * (hi / 2 - lo / 2)  # halves: a ±3e38 block's range is finite
    safe = jnp.where(width > 0, width, 1.0)
    anchor = jnp.round(lo / safe) * safe  # on the zero-anchored grid, within a bin of lo
    anchor = jnp.where((width > 0) & jnp.isfinite(anchor), anchor, lo)
    codes = jnp.clip(jnp.round((x - anchor) / safe), 0, _top(eps)).astype(jnp.uint32)
    head = jax.lax.bitcast_convert_type(jnp.concatenate([anchor, width], axis=-1), jnp.uint32)
    return jnp.concatenate([head, pack_bits(codes, bits)], axis=-1)


def decode(payload: jax.Array, eps: float, m: int) -> jax.Array:
    """Float32 ``[..., m]`` from :func:`encode`'s ``payload``."""
    bits = code_bits(eps)
    head = jax.lax.bitcast_convert_type(payload[..., :2], jnp.float32)
    anchor, width = head[..., :1], head[..., 1:2]
    codes = unpack_bits(payload[..., 2:], bits, m)
    return anchor + codes.astype(jnp.float32) * width


def encode_fp8(x: jax.Array, kind: str) -> jax.Array:
    """Blocks ``x [..., m]`` to ``uint8 [..., 4 + m]``: the block's scale (float32 bytes), then
    its values scaled to the format's range and cast."""
    dt = FP8[kind]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    # floored at float32's smallest normal: a block of values below 1e-34 would otherwise
    # divide by zero (its values then round to the format's subnormals, or to zero)
    tiny = float(jnp.finfo(jnp.float32).tiny)
    scale = jnp.where(amax > 0, jnp.maximum(amax / float(jnp.finfo(dt).max), tiny), 1.0)
    q = jax.lax.bitcast_convert_type((x / scale).astype(dt), jnp.uint8)
    s = jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(*x.shape[:-1], 4)
    return jnp.concatenate([s, q], axis=-1)


def decode_fp8(payload: jax.Array, kind: str) -> jax.Array:
    """Float32 ``[..., m]`` from :func:`encode_fp8`'s ``payload``."""
    scale = jax.lax.bitcast_convert_type(payload[..., :4], jnp.float32)[..., None]
    q = jax.lax.bitcast_convert_type(payload[..., 4:], FP8[kind]).astype(jnp.float32)
    return q * scale


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compression:
    """How the pooled embeddings (``eps``) and their gradients (``eps_grad``) are exchanged."""

    kind: Kind = "none"
    eps: float = 0.0
    eps_grad: float = 0.0

    @property
    def lossless(self) -> bool:
        return self.kind == "none" or (
            self.kind == "error_bounded" and self.eps == 0 and self.eps_grad == 0
        )

    def payload_bytes(self, m: int, grad: bool = False) -> float:
        """Bytes one block of ``m`` float32 values costs on the wire."""
        if self.kind == "none":
            return 4.0 * m
        if self.kind == "error_bounded":
            eps = self.eps_grad if grad else self.eps
            return 4.0 * m if eps == 0 else 4.0 * (2 + _words(m, code_bits(eps)))
        return 4.0 + m

    def describe(self) -> str:
        """``none``, ``fp8_e4m3``, or ``error_bounded, 8-bit codes forward, 6-bit back``."""
        if self.kind != "error_bounded":
            return self.kind
        bits = [f"{code_bits(e)}-bit codes" if e else "float32" for e in (self.eps, self.eps_grad)]
        return f"error_bounded, {bits[0]} forward, {bits[1]} back"

    def ratio(self, m: int) -> float:
        """Compression ratio against float32 of one block of ``m`` values (forward)."""
        return 4.0 * m / self.payload_bytes(m)


def _codec(eps: float, kind: str):
    if kind == "error_bounded" and eps > 0:
        return functools.partial(encode, eps=eps), lambda p, m: decode(p, eps, m)
    if kind in FP8:
        return functools.partial(encode_fp8, kind=kind), lambda p, m: decode_fp8(p, kind)
    return None


def _forward(x: jax.Array, axis: str, codec) -> jax.Array:
    """``all_to_all(x [S, B, w], split 1, concat 0, tiled)``: ``[n·S, B / n, w]``, row
    ``source · S + slot``, with each (slot, destination) block compressed."""
    if codec is None:
        return jax.lax.all_to_all(x, axis, 1, 0, tiled=True)
    enc, dec = codec
    n = jax.lax.axis_size(axis)
    s, b, w = x.shape
    m = (b // n) * w
    sent = jax.lax.all_to_all(enc(x.reshape(s, n, m)), axis, 1, 0, tiled=True)  # [n·S, 1, K]
    return dec(sent, m).reshape(n * s, b // n, w)


def _backward(g: jax.Array, axis: str, codec) -> jax.Array:
    """The transpose of :func:`_forward`: ``all_to_all(g [n·S, B / n, w], split 0, concat 1,
    tiled)``, ``[S, B, w]``, each (slot, destination) block compressed."""
    if codec is None:
        return jax.lax.all_to_all(g, axis, 0, 1, tiled=True)
    enc, dec = codec
    n = jax.lax.axis_size(axis)
    ns, bn, w = g.shape
    s, m = ns // n, bn * w
    got = jax.lax.all_to_all(enc(g.reshape(n, s, m)), axis, 0, 0, tiled=True)  # [n(src), S, K]
    return jnp.swapaxes(dec(got, m).reshape(n, s, bn, w), 0, 1).reshape(s, n * bn, w)


def exchange(x: jax.Array, axis: str, comp: Compression) -> jax.Array:
    """The engine's pooled-output all-to-all of ``x [S, B, w]`` (inside ``shard_map`` over
    ``axis``): every device gets its examples' outputs from every device, ``[n·S, B / n, w]``,
    compressed as ``comp`` says both ways (the gradient's all-to-all with ``comp.eps_grad``)."""
    fwd_codec = _codec(comp.eps, comp.kind)
    bwd_codec = _codec(comp.eps_grad, comp.kind)

    @jax.custom_vjp
    def f(v):
        return _forward(v, axis, fwd_codec)

    def f_fwd(v):
        return f(v), None

    def f_bwd(_, g):
        return (_backward(g, axis, bwd_codec),)

    f.defvjp(f_fwd, f_bwd)
    return f(x)
