"""Criteo's categorical hashing and integer transform (``data.criteo.reader`` applies them).

Categorical hashing (:func:`hash_categorical`): the 8 hex digits are a uint32 value ``v``.
With ``key = (feature_index << 32) | v`` (unique per feature and value) and the 64-bit splitmix64
finaliser ``fmix`` (the output mix of splitmix64, a bijection on uint64)::

    s = fmix((seed + 0x9E3779B97F4A7C15) mod 2**64)
    bucket = 1 + fmix((key + s) mod 2**64) mod (vocab_size - 1)

so valid ids are ``[1, vocab_size)`` and bucket 0 is reserved for a missing (empty) value. With
``vocab_size == 1`` every value maps to 0. The hash is fixed, seeded and independent of Python's
``hash`` (and so of ``PYTHONHASHSEED``); it is vectorised in numpy uint64 arithmetic.

Integer transform (:func:`transform_dense`): ``sign(x) * log1p(|x|)`` as float32, missing -> 0.
Negative values (they occur in I2 of the real data) stay distinguishable from positive ones. The
facebookresearch/dlrm reference instead clips negatives to 0 and then takes ``log(x + 1)``; for
``x >= 0`` ours equals theirs.
"""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

# ASCII byte -> hex nibble value, -1 for a non-hex byte.
HEX_LUT = np.full(256, -1, np.int16)
for _i, _c in enumerate(b"0123456789abcdef"):
    HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    HEX_LUT[_c] = 10 + _i


def fmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's output mix on uint64 arrays (wrapping arithmetic, a bijection); also the
    mix of ``data.id_guard``'s ``hash`` policy."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def seed_offset(seed: int) -> np.uint64:
    z = (int(seed) + GOLDEN) & _MASK64
    return fmix64(np.array([z], np.uint64))[0]


def hash_u32(
    values: np.ndarray, missing: np.ndarray, feature_index, vocab_size, seed: int
) -> np.ndarray:
    """Buckets of uint32 ``values``; ``feature_index``/``vocab_size`` broadcast against them."""
    f = np.asarray(feature_index, np.uint64)
    v = np.asarray(vocab_size, np.int64)
    if (v < 1).any():
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    key = (f << np.uint64(32)) | values.astype(np.uint64)
    z = fmix64(key + seed_offset(seed))
    span = np.maximum(v - 1, 1).astype(np.uint64)
    ids = (np.uint64(1) + z % span).astype(np.int32)
    return np.where(missing | (v == 1), np.int32(0), ids).astype(np.int32)


def _parse_hex_strings(hex_values) -> tuple[np.ndarray, np.ndarray]:
    vals = [v.encode("ascii", "replace") if isinstance(v, str) else bytes(v) for v in hex_values]
    out = np.zeros(len(vals), np.uint32)
    missing = np.zeros(len(vals), bool)
    for i, s in enumerate(vals):
        if not s:
            missing[i] = True
        elif len(s) != 8 or (HEX_LUT[np.frombuffer(s, np.uint8)] < 0).any():
            raise ValueError(
                f"bad hex {show_value(s)} at index {i}: expected 8 hex digits or empty"
            )
        else:
            out[i] = int(s, 16)
    return out, missing


def hash_categorical(hex_values, feature_index: int, vocab_size: int, seed: int) -> np.ndarray:
    """Hashes one categorical feature's values to ids in ``[0, vocab_size)`` (module docstring).

    Args:
      hex_values: 8-hex-digit strings (str or bytes; '' = missing -> 0), or unsigned integer
        values (uint32 range; none counts as missing).
      feature_index: 0-based index of the feature (0 for C1), so equal values of different
        features hash independently.
      vocab_size: number of buckets; bucket 0 is reserved for missing values.
      seed: hash seed.

    Returns:
      int32 ids, the shape of ``hex_values``.
    """
    arr = np.asarray(hex_values)
    if arr.dtype.kind in "iu":
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            raise ValueError("integer categorical values must be in uint32 range")
        return hash_u32(
            arr.astype(np.uint32), np.zeros(arr.shape, bool), feature_index, vocab_size, seed
        )
    flat, missing = _parse_hex_strings(arr.reshape(-1).tolist())
    ids = hash_u32(flat, missing, feature_index, vocab_size, seed)
    return ids.reshape(arr.shape)


def transform_dense(raw: np.ndarray, missing: np.ndarray | None = None) -> np.ndarray:
    """``sign(x) * log1p(|x|)`` as float32; entries where ``missing`` is True become 0.

    For ``x >= 0`` this equals facebookresearch/dlrm's ``log(x + 1)``; unlike dlrm, negatives
    are not clipped to 0 (so -1 maps to -log 2, not 0).
    """
    x = np.asarray(raw, np.float64)
    out = np.sign(x) * np.log1p(np.abs(x))
    if missing is not None:
        out = np.where(missing, 0.0, out)
    return out.astype(np.float32)


def show_value(value: bytes) -> str:
    """A raw field as an error message quotes it."""
    return repr(value.decode("utf-8", "backslashreplace"))
