"""``recscale.nn.MLP(scan=True)``: the equal-width tail of (column, row) pairs, stacked and run by
a scan, computes the unrolled MLP (forward, dropout, gradients) when it holds its weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recscale.nn import MLP


def _stack_unrolled(plain: MLP, scanned: MLP) -> None:
    """Copies ``plain``'s weights into ``scanned``: its first layers as they are, the rest as
    the stacked pairs."""
    u = len(scanned.layers)
    pairs = (len(plain.layers) - u) // 2
    state = nnx.state(plain, nnx.Param)
    layers, norms = state["layers"], state.get("norms")
    one = []
    for p in range(pairs):
        a, b = u + 2 * p, u + 2 * p + 1
        pair = {"column": layers[a], "row": layers[b]}
        if norms is not None:
            pair.update(column_norm=norms[a], row_norm=norms[b])
        one.append(pair)
    new = {"layers": {i: layers[i] for i in range(u)}}
    if norms is not None:
        new["norms"] = {i: norms[i] for i in range(u)}
    new["pairs"] = jax.tree.map(lambda *xs: jnp.stack(xs), *one)
    nnx.update(scanned, new)


@pytest.mark.parametrize(
    ("in_dim", "sizes", "unrolled", "layer_norm"),
    [
        (6, (8, 8, 8), 1, False),  # the first layer (6 -> 8) unrolled, one pair
        (8, (8, 8, 8, 8), 0, True),  # two pairs, nothing unrolled
        (5, (7, 8, 8, 8, 8), 3, True),  # 5->7, 7->8, 8->8 unrolled (an odd count), one pair
    ],
)
def test_scanned_mlp_computes_the_unrolled_one(in_dim, sizes, unrolled, layer_norm):
    kw = dict(final_relu=True, dropout=0.25, layer_norm=layer_norm)
    plain = MLP(in_dim, sizes, rngs=nnx.Rngs(0), **kw)
    scanned = MLP(in_dim, sizes, scan=True, rngs=nnx.Rngs(1), **kw)
    assert len(scanned.layers) == unrolled
    assert scanned.pairs.column.kernel[...].shape[0] == (len(sizes) - unrolled) // 2
    if layer_norm:  # exercised: not the ones and zeros they start at
        state = nnx.state(plain, nnx.Param)
        leaves, tree = jax.tree.flatten(state)
        rng = np.random.default_rng(3)
        nnx.update(
            plain, jax.tree.unflatten(tree, [x + 0.1 * rng.normal(size=x.shape) for x in leaves])
        )
    _stack_unrolled(plain, scanned)
    x = jax.random.normal(jax.random.key(0), (4, in_dim))
    key = jax.random.key(5)

    def loss(model):
        return jnp.sum(model(x, dropout_key=key) ** 2)

    np.testing.assert_allclose(np.asarray(loss(scanned)), np.asarray(loss(plain)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(scanned(x)), np.asarray(plain(x)), rtol=1e-6, atol=1e-7)
    g_plain, g_scan = nnx.grad(loss)(plain), nnx.grad(loss)(scanned)
    want = g_plain["layers"][len(sizes) - 1]["kernel"][...]
    got = g_scan["pairs"]["row"]["kernel"][...][-1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_scan_needs_final_relu_and_no_batch_norm():
    with pytest.raises(ValueError, match="MLP scan"):
        MLP(4, (4, 4), final_relu=False, scan=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="MLP scan"):
        MLP(4, (4, 4), final_relu=True, batch_norm=True, scan=True, rngs=nnx.Rngs(0))
