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


def _cache_dir() -> Path:
    root = os.environ.get("RECSCALE_CACHE") or Path.home() / ".cache" / "recscale"
    return Path(root) / "data"


@functools.cache
def load():
    """The kernel's ``recscale_synth`` function, or None where it cannot be built."""
    if os.environ.get("RECSCALE_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + cc.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"recscale_synthetic_{tag}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            out = Path(tmp) / lib.name
            cmd = [cc, *FLAGS, str(SOURCE), "-o", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                warnings.warn(
                    f"building {SOURCE.name} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}\n"
                    "the synthetic generator uses its numpy path",
                    stacklevel=2,
                )
                return None
            os.replace(out, lib)  # atomic: concurrent builders never load a partial file
    fn = ctypes.CDLL(str(lib)).recscale_synth
    fn.argtypes = _ARGTYPES
    fn.restype = ctypes.c_int
    return fn
