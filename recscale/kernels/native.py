"""The build and registration of the C++ CPU kernels (XLA FFI), shared by the ops that have one.

Each op's kernel is one C++ source beside its reference (``embedding_bag/embedding_bag.cc``,
``embedding_update/embedding_update.cc``) that includes this folder's ``native.h``, and one
``cpu_ffi.py`` whose ``available()`` calls :func:`load`. :func:`load` compiles the source with
the system C++ compiler against jaxlib's FFI headers (once per source, header and jaxlib
version; cached under ``$RECSCALE_CACHE`` or ``~/.cache/recscale``, by
``data._native.build_library``), loads it and registers its handlers with XLA as CPU targets.
Without a compiler, or with ``RECSCALE_CPU_KERNELS=0``, it returns False and the op runs its
plain-JAX reference, which the kernels match (``tests/recscale/kernels/``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import sys
import warnings
from pathlib import Path

import jax

from data._native import build_library

HEADER = Path(__file__).with_name("native.h")

VMAP = "broadcast_all"
"""How every kernel here batches under ``jax.vmap`` (``jax.ffi.ffi_call``'s ``vmap_method``): each
operand gets the batch axis, an unbatched one broadcast to it, and one call of the kernel runs
the batch's members one after another (the ``Impl`` functions of the ``.cc`` files). This is how
a population of models (``recscale.train.population``) runs its members' lookups and row
updates in one custom call each, not one per member."""


@functools.cache
def load(source: Path, stem: str, targets: tuple[tuple[str, str], ...]) -> bool:
    """Builds ``source`` into ``<stem>_<hash>.so`` (if not cached), loads it and registers each
    ``(target name, handler symbol)`` of ``targets`` for CPU; whether that succeeded."""
    if os.environ.get("RECSCALE_CPU_KERNELS", "1") == "0":
        return False
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        warnings.warn(
            f"no C++ compiler: {source.name}'s op runs its plain-JAX CPU path", stacklevel=2
        )
        return False
    flags = (
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-pthread",
        "-march=native",
        f"-I{HEADER.parent}",
        f"-I{jax.ffi.include_dir()}",
    )
    lib = build_library(
        source,
        cxx,
        flags,
        subdir="kernels",
        stem=stem,
        key=jax.__version__.encode()
        + cxx.encode()
        + " ".join(flags).encode()
        + HEADER.read_bytes(),
        fallback=f"{source.name}'s op runs its plain-JAX CPU path",
    )
    if lib is None:
        return False
    handle = ctypes.cdll.LoadLibrary(str(lib))
    for name, symbol in targets:
        jax.ffi.register_ffi_target(
            name, jax.ffi.pycapsule(getattr(handle, symbol)), platform="cpu"
        )
    print(f"recscale: CPU kernel {stem} loaded from {lib}", file=sys.stderr)
    return True
