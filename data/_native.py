"""The synthetic generator's C kernel (``synthetic_kernel.c``): built, cached and loaded.

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
