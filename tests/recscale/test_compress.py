"""The compressed all-to-all (issue 19): bit packing round-trips, the error bound holds element
by element on adversarial blocks, fp8 stays within its format's rounding, and the compressed
exchange on 8 devices is the plain all-to-all (forward and gradient) within the bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from recscale.embeddings import compress

# compiled once per static argument: eager dispatch of the bit arithmetic is slow on CPU
pack = jax.jit(compress.pack_bits, static_argnums=1)
unpack = jax.jit(compress.unpack_bits, static_argnums=(1, 2))
encode = jax.jit(compress.encode, static_argnums=1)
decode = jax.jit(compress.decode, static_argnums=(1, 2))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8, 13, 16])
def test_codes_pack_densely_and_unpack_exactly(bits):
    rng = np.random.default_rng(bits)
    for n in (1, 31, 32, 33, 100):
        codes = rng.integers(0, 2**bits, size=(3, n)).astype(np.uint32)
        codes[0, -1] = 2**bits - 1  # the largest code, at the end
        words = pack(jnp.asarray(codes), bits)
        assert words.shape == (3, -(-n * bits // 32)) and words.dtype == jnp.uint32
        np.testing.assert_array_equal(unpack(words, bits, n), codes)
        # widths dividing 32 take the shift-and-or path: the same words as the bit planes
        np.testing.assert_array_equal(words, compress._pack_planes(jnp.asarray(codes), bits))
    # code i at bits i*bits.. of the little-endian stream: 3-bit codes 1, 2 -> 0b010_001
    assert int(compress.pack_bits(jnp.array([1, 2], jnp.uint32), 3)[0]) == 0b010001


def _adversarial(rng: np.random.Generator) -> dict[str, np.ndarray]:
    m = 48
    mid = np.linspace(-1, 1, m)  # values on bin edges and midpoints for many bounds
    return {
        "normal": rng.normal(size=(6, m)),
        "constant": np.full((2, m), 3.25),
        "one outlier": np.where(np.arange(m) == 7, 1e4, rng.normal(size=(2, m)) * 1e-3),
        "huge": rng.normal(size=(2, m)) * 1e30,
        "tiny": rng.normal(size=(2, m)) * 1e-30,  # subnormal-scale ranges
        "grid": np.stack([mid, mid**3]),
        "offset": 1e3 + rng.normal(size=(2, m)) * 1e-2,  # range a few thousand ulps of 1e3
        "signs": np.sign(rng.normal(size=(2, m))) * 5.0,
        "single": rng.normal(size=(2, 1)),
        # a row-wise shard's partial outputs: mostly exact zeros, the minimum negative
        "sparse": np.where(rng.random((4, m)) < 0.8, 0.0, rng.normal(size=(4, m))),
        "wide range": np.stack([np.linspace(-1e37, 1e37, m)] * 2),
    }


@pytest.mark.parametrize("eps", [2.0**-16, 1e-4, 0.002, 0.0081, 0.2, 0.45])
def test_the_error_bound_holds_element_wise_on_adversarial_blocks(eps):
    rng = np.random.default_rng(0)
    for name, x in _adversarial(rng).items():
        x = x.astype(np.float32)
        payload = encode(jnp.asarray(x), eps)
        bits = compress.code_bits(eps)
        assert payload.shape == (x.shape[0], 2 + -(-x.shape[1] * bits // 32)), name
        y = np.asarray(decode(payload, eps, x.shape[1]))
        rng_ = x.max(axis=1, keepdims=True).astype(np.float64) - x.min(axis=1, keepdims=True)
        err = np.abs(y.astype(np.float64) - x)
        # the bound, plus the float32 rounding of the decoded value (an ulp or two of the
        # block's magnitude: it matters where the range is a few ulps / (2 eps) wide)
        ulp = np.spacing(np.abs(x).max(axis=1, keepdims=True)).astype(np.float64)
        assert np.all(err <= eps * rng_ + 2 * ulp), (name, float((err - eps * rng_).max()))
        wide = ("normal", "grid", "signs", "one outlier", "huge", "sparse", "wide range")
        if name in wide and eps >= 2.0**-11:  # the bins' margin covers the rounding there
            assert np.all(err <= eps * rng_), name
        if name in ("constant", "sparse"):
            np.testing.assert_array_equal(y[x == 0], 0.0)  # zeros stay exactly zero
        if name == "constant":
            np.testing.assert_array_equal(y, x)
    assert [compress.code_bits(e) for e in (0.002, 0.0081, 0.036, 2.0**-16)] == [8, 6, 4, 16]
    for bad in (0.0, 1e-6, 0.5):
        with pytest.raises(ValueError, match="must be in"):
            compress.code_bits(bad)


@pytest.mark.parametrize(
    ("kind", "rel", "floor"),
    [("fp8_e4m3", 2.0**-4, 2.0**-10 / 448), ("fp8_e5m2", 2.0**-3, 2.0**-17 / 57344)],
)
def test_fp8_blocks_round_within_the_format(kind, rel, floor):
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(8, 64)) * np.logspace(-6, 2, 8)[:, None]).astype(np.float32)
    x[0, :4] = 0.0
    payload = compress.encode_fp8(jnp.asarray(x), kind)
    assert payload.shape == (8, 4 + 64) and payload.dtype == jnp.uint8
    y = np.asarray(compress.decode_fp8(payload, kind))
    amax = np.abs(x).max(axis=1, keepdims=True)
    # relative rounding of a normal number, or half the subnormal spacing, in the block's scale
    assert np.all(np.abs(y - x) <= rel * np.abs(x) + floor * amax * 1.0001)
    assert np.all(y[0, :4] == 0.0)
    # a block of values too small for the format's scale (amax / 448 underflows float32)
    tiny = np.full((1, 8), 1e-36, np.float32)
    assert np.all(
        np.isfinite(np.asarray(compress.decode_fp8(compress.encode_fp8(tiny, kind), kind)))
    )


def _exchange(comp: compress.Compression):
    mesh = jax.make_mesh((8,), ("d",))
    s, b, w = 3, 64, 4
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8 * s, b, w)).astype(np.float32)
    x[:s] *= 1e-3  # one device's slots on another scale: blocks are bounded by their own range
    weights = (np.arange(8 * 8 * s * (b // 8) * w) % 7 - 3.0).reshape(8 * 8 * s, b // 8, w)
    xs = jax.device_put(x, NamedSharding(mesh, P("d")))
    f = jax.shard_map(
        lambda v: compress.exchange(v, "d", comp),
        mesh=mesh,
        in_specs=P("d"),
        out_specs=P("d"),
        check_vma=False,
    )
    y = jax.jit(f)(xs)
    g = jax.jit(jax.grad(lambda v: jnp.sum(f(v) * weights)))(xs)
    return x, weights, np.asarray(y), np.asarray(g)


def _plain_exchange(x: np.ndarray, n: int = 8) -> np.ndarray:
    """NumPy of the tiled all-to-all: device d's ``[S, B, w]`` block j goes to device j, row
    ``d·S + s``."""
    s = x.shape[0] // n
    per = x.reshape(n, s, n, x.shape[1] // n, x.shape[2])  # [src, S, dst, B/n, w]
    return np.transpose(per, (2, 0, 1, 3, 4)).reshape(n * n * s, x.shape[1] // n, x.shape[2])


def _plain_backward(g: np.ndarray, n: int = 8) -> np.ndarray:
    """NumPy of the transposed all-to-all: device d's ``[n·S, B/n, w]`` row ``j·S + s`` goes to
    device j's slot s, examples of chunk d."""
    s = g.shape[0] // (n * n)
    per = g.reshape(n, n, s, g.shape[1], g.shape[2])  # [src d, dst j, S, B/n, w]
    return np.transpose(per, (1, 2, 0, 3, 4)).reshape(n * s, n * g.shape[1], g.shape[2])


def _ranges(blocks: np.ndarray) -> np.ndarray:
    """Each block's range (last axis), broadcast back over the block."""
    r = blocks.max(axis=-1, keepdims=True) - blocks.min(axis=-1, keepdims=True)
    return np.broadcast_to(r, blocks.shape)


def test_the_compressed_exchange_is_the_all_to_all_within_the_bound_both_ways():
    x, weights, y0, g0 = _exchange(compress.Compression(kind="none"))
    np.testing.assert_array_equal(y0, _plain_exchange(x))
    np.testing.assert_array_equal(g0, _plain_backward(weights))
    eps, eps_g = 0.002, 0.0081
    _, _, y, g = _exchange(compress.Compression(kind="error_bounded", eps=eps, eps_grad=eps_g))
    # forward blocks: per device [S, B, w], one per (slot, destination chunk of B)
    n, s = 8, x.shape[0] // 8
    fwd = _ranges(x.reshape(n * s, n, -1)).reshape(x.shape)
    assert np.all(np.abs(y - y0) <= eps * _plain_exchange(fwd)) and np.any(y != y0)
    # backward blocks: per device [n·S, B/n, w], one per row (destination, slot)
    bwd = _ranges(weights.reshape(weights.shape[0], -1)).reshape(weights.shape)
    assert np.all(np.abs(g - g0) <= eps_g * _plain_backward(bwd)) and np.any(g != g0)
    _, _, y8, g8 = _exchange(compress.Compression(kind="fp8_e4m3"))
    assert np.all(np.abs(y8 - y0) <= 2.0**-4 * np.abs(y0) + 1e-6) and np.any(y8 != y0)
    assert np.all(np.abs(g8 - g0) <= 2.0**-4 * np.abs(g0) + 1e-6) and np.any(g8 != g0)


def test_payload_sizes_and_ratios():
    m = 8 * 16  # a destination's 8 examples of a 16-wide slot
    assert compress.Compression(kind="none").payload_bytes(m) == 4 * m
    eb = compress.Compression(kind="error_bounded", eps=0.002)
    assert eb.payload_bytes(m) == 4 * (2 + m * 8 // 32)
    assert eb.ratio(m) == pytest.approx(4 * m / (8 + m))
    assert compress.Compression(kind="fp8_e5m2").payload_bytes(m) == 4 + m
    assert compress.Compression(kind="error_bounded").lossless
