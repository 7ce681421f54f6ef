"""SASRec on jagged tokens (sequential/sasrec/model.py) against its padded form: the blocks as
the official code computes them on ``[B, N, D]`` (written here from the module docstring, with
the same parameters) give the same outputs and the same parameter gradients to float32
rounding, at several chunk sizes of the local attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recscale import jagged
from sequential.config import SASRecConfig
from sequential.layers import to_jagged, to_padded, token_layout
from sequential.sasrec import model as sasrec_model

V = 30
TOL = dict(rtol=2e-5, atol=2e-6)  # float32 rounding of sums taken in another order


def _padded_encode(model, x_td, offsets, tokens):
    """The blocks on the padded ``[B, N, D]`` layout (the official code's)."""
    cfg = model.cfg
    x_bnd, mask_bn = to_padded(x_td, offsets, cfg.max_seq_len)
    b, n, d = x_bnd.shape
    h = cfg.num_heads
    p = d // h
    for blk in model.blocks:
        q_bnd = blk.ln_attn(x_bnd)
        q = blk.query(q_bnd).reshape(b, n, h, p)
        k = blk.key(x_bnd).reshape(b, n, h, p)
        v = blk.value(x_bnd).reshape(b, n, h, p)
        s = jnp.einsum("bihp,bjhp->bhij", q, k) / p**0.5
        pos = jnp.arange(n)
        allowed = (pos[None, :] <= pos[:, None])[None, None] & mask_bn[:, None, None, :]
        s = jnp.where(allowed, s, jnp.finfo(s.dtype).min)
        a = jnp.einsum("bhij,bjhp->bihp", jax.nn.softmax(s, axis=-1), v).reshape(b, n, d)
        y = blk.ln_ffn(a + q_bnd)
        x_bnd = (blk.ffn_out(jax.nn.relu(blk.ffn_in(y))) + y) * mask_bn[:, :, None]
    return to_jagged(model.ln_out(x_bnd), tokens)


def _case(max_seq_len, lengths, t_pad, seed):
    cfg = SASRecConfig(
        n_items=V, d_model=8, num_layers=2, num_heads=2, max_seq_len=max_seq_len, dropout=0.5
    )
    model = sasrec_model.SASRec(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    values = rng.integers(1, V + 1, size=t_pad).astype(np.int32)  # garbage in the tail too
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return model, jnp.asarray(values), jnp.asarray(offsets)


# Sequences shorter than, as long as and longer than N (tokens past N are dropped), an empty
# one, chunk boundaries inside sequences, and tail padding.
CASES = [(6, (4, 3, 8, 0, 6), 27), (11, (11, 1, 15, 2, 0, 9), 64)]


def _call(model):
    """``(values, offsets, dropout_key) -> [T, D]``, the model's public call, jitted."""
    graphdef, params = nnx.split(model)
    return jax.jit(lambda v, o, k: nnx.merge(graphdef, params)(v, o, dropout_key=k))


def _outputs(model, values, offsets, *, padded):
    """``params -> [T, D]``: the model's eval-mode outputs, its blocks jagged or padded."""
    graphdef, _ = nnx.split(model)
    n, t_pad = model.cfg.max_seq_len, values.shape[0]

    def f(params):
        m = nnx.merge(graphdef, params)
        tokens = token_layout(offsets, t_pad, n)
        x_td = m.embed(values, tokens, None)
        if padded:
            out = _padded_encode(m, x_td, offsets, tokens)
        else:
            out = m.encode(x_td, offsets, tokens, None)
        return jnp.where(tokens.valid[:, None], out, 0.0)

    return f


def test_jagged_blocks_and_gradients_equal_the_padded_ones():
    max_seq_len, lengths, t_pad = CASES[0]
    model, values, offsets = _case(max_seq_len, lengths, t_pad, seed=0)
    params = nnx.split(model)[1]

    def with_grad(padded):
        f = _outputs(model, values, offsets, padded=padded)
        # The gradient of a loss that reads every output entry.
        return jax.value_and_grad(lambda q: (jnp.sum(jnp.sin(f(q))), f(q)), has_aux=True)

    (_, got), g_got = jax.jit(with_grad(False))(params)
    (_, want), g_want = jax.jit(with_grad(True))(params)
    assert np.abs(np.asarray(want)).max() > 0.1  # not trivially zero
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(_call(model)(values, offsets, None), got, **TOL)  # the public call
    want_grads = dict(jax.tree_util.tree_leaves_with_path(g_want))
    for path, g in jax.tree_util.tree_leaves_with_path(g_got):
        np.testing.assert_allclose(g, want_grads[path], **TOL, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("chunk", [4, 8, 16])
def test_every_chunk_size_equals_the_padded_blocks(monkeypatch, chunk):
    """Windows reaching three chunks back (4), two (8, the default at N = 11) and one (16):
    each equals the padded blocks."""
    max_seq_len, lengths, t_pad = CASES[1]
    model, values, offsets = _case(max_seq_len, lengths, t_pad, seed=3)
    params = nnx.split(model)[1]
    want = jax.jit(_outputs(model, values, offsets, padded=True))(params)
    monkeypatch.setattr(jagged, "chunk_size", lambda n: chunk)
    got = jax.jit(_outputs(model, values, offsets, padded=False))(params)
    np.testing.assert_allclose(got, want, **TOL)


def test_dropout_drops_attention_weights_of_real_keys_only():
    """Training calls differ from eval calls, are reproducible from the key, and a token's
    output still depends only on its own sequence's tokens at or before it."""
    max_seq_len, lengths, t_pad = CASES[0]
    model, values, offsets = _case(max_seq_len, lengths, t_pad, seed=5)
    key, call = jax.random.key(1), _call(model)
    a = np.asarray(call(values, offsets, key))
    np.testing.assert_array_equal(call(values, offsets, key), a)
    assert not np.allclose(a, call(values, offsets, None))
    # Changing sequence 1's last token (slot 6) changes nothing before it nor elsewhere.
    changed = values.at[6].set(values[6] % V + 1)
    b = np.asarray(call(changed, offsets, key))
    np.testing.assert_array_equal(np.delete(b, 6, axis=0), np.delete(a, 6, axis=0))
