"""The C++ CPU kernel of the fused backward + sparse update (``embedding_update.cc``, XLA FFI),
built on first use.

``available()`` builds, loads and registers it (``recscale.kernels.native``; False without a
compiler or with ``RECSCALE_CPU_KERNELS=0``, and the update runs its plain-JAX path, which the
kernel matches: ``tests/recscale/kernels/test_embedding_update.py``). ``update(...)`` follows
``recscale.embeddings.update`` (row gradients, the clip, the row updates).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from recscale.kernels import native
from recscale.kernels.embedding_update.reference import RowClip

SOURCE = Path(__file__).with_name("embedding_update.cc")


def available() -> bool:
    """Whether the kernel is built, loaded and registered (building it if need be)."""
    return native.load(
        SOURCE, "recscale_embedding_update", (("recscale_update", "RecscaleUpdate"),)
    )


def update(
    buf,
    acc,
    keys_sbh,
    grad_sbw,
    lr,
    table_dim_s,
    *,
    eps: float,
    adagrad: bool,
    clip: RowClip | None = None,
):
    """SGD / row-wise Adagrad on the rows read at ``keys`` in place, after ``clip`` (None:
    none); returns ``(buf, acc, [sum of squared updates, sum of squared row gradients])``."""
    clip = clip or RowClip()
    outs = (
        jax.ShapeDtypeStruct(buf.shape, jnp.float32),
        jax.ShapeDtypeStruct(acc.shape, jnp.float32),
        jax.ShapeDtypeStruct((2,), jnp.float32),
    )
    call = jax.ffi.ffi_call(
        "recscale_update", outs, input_output_aliases={0: 0, 1: 1}, vmap_method=native.VMAP
    )
    return call(
        buf,
        acc,
        keys_sbh,
        grad_sbw.astype(jnp.float32),
        jnp.asarray(lr, jnp.float32).reshape(()),
        table_dim_s.astype(jnp.int32),
        eps=np.float32(eps),
        adagrad=np.int32(adagrad),
        clip_ratio=np.float32(clip.ratio),
        clip_min_norm=np.float32(clip.min_norm),
        row_l2=np.float32(clip.row_l2),
    )
