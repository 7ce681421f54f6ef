"""The synthetic generator's C kernel (``synthetic_kernel.c``): built, cached, loaded and called.

Built with the system C compiler on first use (``$CC``, ``cc`` or ``gcc``), once per source and
compiler, into ``$RECSCALE_CACHE/data`` (default ``~/.cache/recscale/data``), as the embedding
engine's C++ kernels are; loaded with ctypes, which releases the GIL during the call. Without a
compiler, or with ``RECSCALE_CPU_KERNELS=0``, ``load()`` returns None and the generator runs its
numpy path, which gives the same batches bit for bit (the kernel is compiled without fast-math
or floating-point contraction; ``tests/data/test_synthetic.py`` compares the two).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("synthetic_kernel.c")
FLAGS = ("-O2", "-std=c99", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off")

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_U64 = ctypes.c_uint64
_I32 = ctypes.c_int32
# recscale_synth's parameters, in order (see synthetic_kernel.c).
_ARGTYPES = (
    [_I64, _P, _U64]  # examples
    + [_I64, _P, _P, _P]  # dense
    + [_I64, _I64, _P, _P, _I32]  # bags
    + [_I64, _P, _P, _P, _P, _P, _P, _P, _U64]  # ids
    + [_I64, _P, _P, _P, _P, _I32]  # teacher
    + [_P, _P, _P, _P, _P]  # outputs
)


def build_library(
    source: Path,
    compiler: str,
    flags: Sequence[str],
    *,
    subdir: str,
    stem: str,
    key: bytes,
    fallback: str,
) -> Path | None:
    """``source`` compiled into a shared library, cached, or None (with a warning) if it fails.

    The one build path of recscale's C/C++ kernels (this generator's and the embedding
    engine's, ``recscale/kernels/native.py``; it lives here, in the lowest layer, so that both
    can use it). The library is cached as
    ``$RECSCALE_CACHE/<subdir>/<stem>_<tag>.so`` (default root ``~/.cache/recscale``), the tag
    hashing the source and ``key`` (compiler, flags, anything else the binary depends on), and
    is built in a temporary file renamed into place, so concurrent builders never load a
    partial one. ``fallback`` ends the warning: what runs instead.
    """
    root = os.environ.get("RECSCALE_CACHE") or Path.home() / ".cache" / "recscale"
    tag = hashlib.sha256(source.read_bytes() + key).hexdigest()[:16]
    lib = Path(root) / subdir / f"{stem}_{tag}.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [compiler, *flags, str(source), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            warnings.warn(
                f"building {source.name} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}\n"
                f"{fallback}",
                stacklevel=3,
            )
            return None
        os.replace(out, lib)
    return lib


@functools.cache
def load():
    """The kernel's ``recscale_synth`` function, or None where it cannot be built."""
    if os.environ.get("RECSCALE_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    lib = build_library(
        SOURCE,
        cc,
        FLAGS,
        subdir="data",
        stem="recscale_synthetic",
        key=cc.encode() + " ".join(FLAGS).encode(),
        fallback="the synthetic generator uses its numpy path",
    )
    if lib is None:
        return None
    fn = ctypes.CDLL(str(lib)).recscale_synth
    fn.argtypes = _ARGTYPES
    fn.restype = ctypes.c_int
    return fn


def run(
    fn,
    tables: Sequence[np.ndarray],
    idx_b: np.ndarray,
    *,
    seed_key: int,
    num_dense: int,
    max_hotness: int,
    uniform_pooling: bool,
    alias_total: int,
    teacher_dim: int,
    interaction_order: int,
    num_orders: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One call of ``fn`` (``load()``) over examples ``idx_b``: dense values ``[B, N]``, ids
    ``[B, F, H]``, bag sizes ``[B, F]``, example keys ``[B]`` and raw teacher terms
    ``[num_orders, B]``, the numpy path's outputs bit for bit.

    ``tables`` are the generator's C-contiguous arrays, in the kernel's parameter order: dense
    salts, normal-table knots (lo, step), hotness per feature, bag salts, slot feature, slot
    position, slot salts, slot vocab size, slot alias offset, alias thresholds, alias rows,
    cached row parameters ``[rows, D + 1]``, cache offsets, dense projection ``[N, D]`` and dense
    weights ``[N]``.
    """
    (
        dense_salts,
        lo,
        step,
        hot,
        bag_salts,
        slot_f,
        slot_h,
        slot_salts,
        slot_v,
        slot_off,
        alias_thr,
        alias_rows,
        cache_rp,
        cache_off,
        proj_nd,
        w_n,
    ) = tables
    idx_b = np.ascontiguousarray(idx_b, np.int64)
    num_b, num_f = idx_b.shape[0], hot.shape[0]
    dense_bn = np.empty((num_b, num_dense), np.float32)
    ids_bfh = np.empty((num_b, num_f, max_hotness), np.int32)
    n_bf = np.empty((num_b, num_f), np.int64)
    terms = np.empty((num_orders, num_b))
    keys_b = np.empty(num_b, np.uint64)
    p = lambda a: a.ctypes.data  # noqa: E731
    rc = fn(
        num_b,
        p(idx_b),
        seed_key,
        num_dense,
        p(dense_salts),
        p(lo),
        p(step),
        num_f,
        max_hotness,
        p(hot),
        p(bag_salts),
        int(uniform_pooling),
        slot_f.shape[0],
        p(slot_f),
        p(slot_h),
        p(slot_salts),
        p(slot_v),
        p(slot_off),
        p(alias_thr),
        p(alias_rows),
        alias_total,
        teacher_dim,
        p(cache_rp),
        p(cache_off),
        p(proj_nd),
        p(w_n),
        interaction_order,
        p(dense_bn),
        p(ids_bfh),
        p(n_bf),
        p(terms),
        p(keys_b),
    )
    if rc != 0:
        raise RuntimeError(
            f"the synthetic generator's C kernel failed ({rc}: -1 latent dim "
            "over 64, -2 out of memory)"
        )
    return dense_bn, ids_bfh, n_bf, keys_b, terms
