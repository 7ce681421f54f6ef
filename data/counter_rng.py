"""Counter-based randomness (no RNG state) for the synthetic generator (``data.synthetic``):
every random quantity is a pure function of integer keys.

* ``mix`` is the splitmix64 finaliser (a bijection of uint64 with full avalanche), applied
  elementwise with numpy's wrapping uint64 arithmetic.
* A uint64 hash gives a uniform in [0, 1) from its top 53 bits, or two standard normals, one
  per 32-bit half: the top 16 bits pick an interval of a 65,537-knot table of normal quantiles
  ``Phi^-1((t + 0.5) / 65537)`` (built once per process with ``statistics.NormalDist``) and the
  low 16 bits interpolate linearly inside it. Per value that is integer ops, gathers and one
  IEEE multiply-add, so unlike Box-Muller's ``log``/``cos`` the result never depends on which
  SIMD or libm path numpy takes. The normals are truncated at +-4.33 sigma (a 2e-5 tail).
"""

from __future__ import annotations

import functools
import math
import statistics

import numpy as np

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX_C1 = 0xBF58476D1CE4E5B9
MIX_C2 = 0x94D049BB133111EB
U64_GOLDEN = np.uint64(GOLDEN)
U64_C1 = np.uint64(MIX_C1)
U64_C2 = np.uint64(MIX_C2)
U64_MASK32 = np.uint64(0xFFFFFFFF)
NORMAL_KNOTS = 65537


def mix_int(x: int) -> int:
    """splitmix64 finaliser on a Python int (for salts computed once)."""
    x &= M64
    x ^= x >> 30
    x = (x * MIX_C1) & M64
    x ^= x >> 27
    x = (x * MIX_C2) & M64
    x ^= x >> 31
    return x


def salt(*parts: int) -> int:
    """A uint64 salt that is a hash of the integer tuple ``parts``."""
    k = 0x243F6A8885A308D3
    for p in parts:
        k = mix_int(k ^ mix_int((int(p) & M64) + GOLDEN))
    return k


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, elementwise on a uint64 array (arrays wrap without warnings)."""
    x = x ^ (x >> np.uint64(30))
    x *= U64_C1
    x ^= x >> np.uint64(27)
    x *= U64_C2
    x ^= x >> np.uint64(31)
    return x


def uniform(h: np.ndarray) -> np.ndarray:
    """float64 uniform in [0, 1) from the top 53 bits of each hash."""
    return (h >> np.uint64(11)).astype(np.float64) * (2.0**-53)


@functools.cache
def normal_tables() -> tuple[np.ndarray, np.ndarray]:
    """Knots ``Phi^-1((t + 0.5) / 65537)`` and their differences (float64)."""
    nd = statistics.NormalDist()
    knots = np.array([nd.inv_cdf((t + 0.5) / NORMAL_KNOTS) for t in range(NORMAL_KNOTS)])
    return knots[:-1].copy(), np.diff(knots)


def normal_u32(x: np.ndarray) -> np.ndarray:
    """float64 standard normal (interpolated quantile table) from uint64 values < 2**32."""
    lo, step = normal_tables()
    i = (x >> np.uint64(16)).astype(np.intp)
    frac = (x & np.uint64(0xFFFF)).astype(np.float64) * (2.0**-16)
    return lo[i] + frac * step[i]


def normals(h: np.ndarray) -> np.ndarray:
    """Two normals per hash: ``[..., K]`` uint64 -> ``[..., 2K]`` float64."""
    out = np.stack([normal_u32(h >> np.uint64(32)), normal_u32(h & U64_MASK32)], axis=-1)
    return out.reshape(*h.shape[:-1], 2 * h.shape[-1])


def coprime_multiplier(v: int, key: int) -> int:
    """A seeded multiplier in [1, v) coprime to v (1 when v <= 2)."""
    if v <= 2:
        return 1
    a = 1 + key % (v - 1)
    while math.gcd(a, v) != 1:
        a = a % (v - 1) + 1
    return a


def alias_table(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker alias table for probabilities ``p`` sorted in decreasing order.

    Returns ``(prob, alias)``: column ``c`` (chosen uniformly) yields ``c`` with probability
    ``prob[c]``, else ``alias[c]``. Vectorised Vose construction, valid because the "large"
    entries (``V p >= 1``) are a prefix: lay the larges' surpluses ``V p - 1`` end to end on a
    tape (ends ``E_j``) and the smalls' deficits ``1 - V p`` on the same tape (intervals
    ``[S_s, D_s)``). Small ``s`` takes its whole deficit from the large whose surplus holds
    ``S_s``. A large ``j`` whose end ``E_j`` falls strictly inside a small's interval has been
    over-drawn by ``D_s - E_j``; it becomes a column of its own with that deficit, filled from
    large ``j + 1`` (exactly Vose's algorithm with this processing order).
    """
    v = p.shape[0]
    q = p * v
    prob = np.ones(v)
    alias = np.arange(v)
    m = int(np.count_nonzero(q >= 1.0))
    if m in (0, v):  # uniform (m == v up to rounding)
        return prob, alias
    ends = np.cumsum(q[:m] - 1.0)  # E_j
    deficit = 1.0 - q[m:]
    d_end = np.cumsum(deficit)  # D_s
    d_start = d_end - deficit  # S_s
    prob[m:] = q[m:]
    alias[m:] = np.minimum(np.searchsorted(ends, d_start, side="right"), m - 1)
    s = np.minimum(np.searchsorted(d_end, ends[:-1], side="right"), v - m - 1)
    inside = (d_start[s] < ends[:-1]) & (d_end[s] > ends[:-1])
    prob[: m - 1] = np.where(inside, 1.0 - (d_end[s] - ends[:-1]), 1.0)
    alias[: m - 1] = np.where(inside, np.arange(1, m), np.arange(m - 1))
    return np.clip(prob, 0.0, 1.0), alias
