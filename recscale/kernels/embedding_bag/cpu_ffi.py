"""CPU kernels of the embedding engine (``embedding.cc``, XLA FFI), built on first use.

``available()`` compiles ``embedding.cc`` with the system C++ compiler against jaxlib's FFI
headers (once per source / jaxlib version, cached under ``$RECSCALE_CACHE`` or
``~/.cache/recscale``), loads it and registers the targets with XLA. Without a compiler, or with
``RECSCALE_CPU_KERNELS=0``, it returns False and the engine uses its plain-JAX path, which the
kernels match (``tests/recscale/kernels/test_embedding_bag.py``, ``test_embedding_update.py``).

``pool(buf, keys)`` and ``update(buf, acc, keys, grad, lr, table_dim, eps=, adagrad=)`` follow
``recscale.embeddings.lookup._pool`` and ``recscale.embeddings.update`` (row gradients + row updates).
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
import jax.numpy as jnp
import numpy as np

from data._native import build_library

SOURCE = Path(__file__).with_name("embedding.cc")


@functools.cache
def available() -> bool:
    """Whether the kernels are built, loaded and registered (building them if need be)."""
    if os.environ.get("RECSCALE_CPU_KERNELS", "1") == "0":
        return False
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        warnings.warn(
            "no C++ compiler: the embedding engine uses its plain-JAX CPU path", stacklevel=2
        )
        return False
    flags = (
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-pthread",
        "-march=native",
        f"-I{jax.ffi.include_dir()}",
    )
    lib = build_library(
        SOURCE,
        cxx,
        flags,
        subdir="kernels",
        stem="recscale_embedding",
        key=jax.__version__.encode() + cxx.encode(),
        fallback="the embedding engine uses its plain-JAX CPU path",
    )
    if lib is None:
        return False
    handle = ctypes.cdll.LoadLibrary(str(lib))
    for name, symbol in (("recscale_pool", "RecscalePool"), ("recscale_update", "RecscaleUpdate")):
        jax.ffi.register_ffi_target(
            name, jax.ffi.pycapsule(getattr(handle, symbol)), platform="cpu"
        )
    print(f"recscale: CPU embedding kernels loaded from {lib}", file=sys.stderr)
    return True


def pool(buf: jax.Array, keys_sbh: jax.Array) -> jax.Array:
    """``[S, B, w]``: bags summed from rows ``keys`` of ``buf [R, w]`` (``R`` = padding)."""
    s, b, _ = keys_sbh.shape
    out = jax.ShapeDtypeStruct((s, b, buf.shape[1]), jnp.float32)
    return jax.ffi.ffi_call("recscale_pool", out)(buf, keys_sbh)


def update(buf, acc, keys_sbh, grad_sbw, lr, table_dim_s, *, eps: float, adagrad: bool):
    """SGD / row-wise Adagrad on the rows read at ``keys`` in place; returns ``(buf, acc,
    [sum of squared updates, sum of squared row gradients])``."""
    outs = (
        jax.ShapeDtypeStruct(buf.shape, jnp.float32),
        jax.ShapeDtypeStruct(acc.shape, jnp.float32),
        jax.ShapeDtypeStruct((2,), jnp.float32),
    )
    call = jax.ffi.ffi_call("recscale_update", outs, input_output_aliases={0: 0, 1: 1})
    return call(
        buf,
        acc,
        keys_sbh,
        grad_sbw.astype(jnp.float32),
        jnp.asarray(lr, jnp.float32).reshape(()),
        table_dim_s.astype(jnp.int32),
        eps=np.float32(eps),
        adagrad=np.int32(adagrad),
    )
