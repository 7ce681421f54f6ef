"""The C++ CPU kernel of the pooled lookup (``embedding_bag.cc``, XLA FFI), built on first use.

``available()`` builds, loads and registers it (``recscale.kernels.native``; False without a
compiler or with ``RECSCALE_CPU_KERNELS=0``, and the lookup runs its plain-JAX path, which the
kernel matches: ``tests/recscale/kernels/test_embedding_bag.py``). ``pool(buf, keys)`` follows
``recscale.embeddings.lookup._pool``.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from recscale.kernels import native

SOURCE = Path(__file__).with_name("embedding_bag.cc")


def available() -> bool:
    """Whether the kernel is built, loaded and registered (building it if need be)."""
    return native.load(SOURCE, "recscale_embedding_bag", (("recscale_pool", "RecscalePool"),))


def pool(buf: jax.Array, keys_sbh: jax.Array) -> jax.Array:
    """``[S, B, w]``: bags summed from rows ``keys`` of ``buf [R, w]`` (``R`` = padding)."""
    s, b, _ = keys_sbh.shape
    out = jax.ShapeDtypeStruct((s, b, buf.shape[1]), jnp.float32)
    return jax.ffi.ffi_call("recscale_pool", out, vmap_method=native.VMAP)(buf, keys_sbh)
