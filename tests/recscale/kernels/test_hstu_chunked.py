"""hstu_attention's XLA path on local windows (recscale/kernels/hstu_attention/chunked.py)
against the padded reference, forward and backward, at chunks smaller than ``N - 1`` (windows
reaching several chunks back, and ahead for the contextual prefix) and at the default chunk,
for every mask option."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recscale import jagged
from recscale.kernels import common
from recscale.kernels.hstu_attention import chunked, reference

N, H, D, E = 12, 2, 4, 6
LENS = [5, 0, 12, 1, 15, 9]  # 15 > N: its last 3 tokens are dropped
TARGETS = [1, 0, 3, 0, 2, 4]
# (num_targets?, contextual_seq_len, max_attn_len, bias heads)
CONFIGS = {
    "causal": (False, 0, 0, 0),
    "targets_window_bias": (True, 0, 4, H),
    "contextual_shared_bias": (True, 3, 0, 1),
}


def _inputs(config):
    targets, c, m_len, bias_heads = CONFIGS[config]
    offsets = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
    t = int(offsets[-1]) + 5  # tail slots outside every sequence
    ks = jax.random.split(jax.random.key(7), 5)
    q, k = (jax.random.normal(kk, (t, H, D)) for kk in ks[:2])
    v, g = (jax.random.normal(kk, (t, H, E)) for kk in ks[2:4])
    bias = jax.random.normal(ks[4], (bias_heads, 7)) if bias_heads else None
    nt = jnp.asarray(TARGETS, jnp.int32) if targets else None
    cfg = reference.static_config(N, 0.7, c, m_len)
    return (q, k, v, jnp.asarray(offsets), nt, bias), g, cfg


@pytest.mark.parametrize("chunk", [4, 0])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_chunked_equals_the_reference(monkeypatch, config, chunk):
    args, g, cfg = _inputs(config)
    if chunk:  # 4 < N - 1: windows reach 3 chunks back (and ahead)
        monkeypatch.setattr(jagged, "chunk_size", lambda n: chunk)
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda *a: chunked.hstu_attention(*a, cfg=cfg))(*args)
        got_grads = jax.jit(lambda *a: chunked.hstu_attention_vjp(*a, cfg=cfg))(*args, g)
        want = jax.jit(lambda *a: reference.hstu_attention(*a, **cfg))(*args)
        want_grads = jax.jit(lambda *a: reference.hstu_attention_vjp(*a, **cfg))(*args, g)
    assert np.abs(np.asarray(want)).max() > 0.1
    tol = common.tolerance(jnp.float32)
    np.testing.assert_allclose(got, want, **tol)
    for name, a, b in zip(("dq", "dk", "dv", "drab"), got_grads, want_grads, strict=True):
        if b is None:
            assert a is None, name
            continue
        assert np.abs(np.asarray(b)).max() > 0.01, name
        np.testing.assert_allclose(a, b, err_msg=name, **tol)
