"""Small layers shared by the models (MLPs with logical axes and explicit-key dropout)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from recscale import sharding


class Linear(nnx.Module):
    """y = x W + b, with DLRM's init: W ~ N(0, 2/(in+out)), b ~ N(0, 1/out)."""

    def __init__(self, in_dim: int, out_dim: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        w_std = (2.0 / (in_dim + out_dim)) ** 0.5
        b_std = (1.0 / out_dim) ** 0.5
        self.kernel = sharding.param(
            nnx.Param, w_std * jax.random.normal(rngs.params(), (in_dim, out_dim), param_dtype), None, "mlp"
        )
        self.bias = sharding.param(
            nnx.Param, b_std * jax.random.normal(rngs.params(), (out_dim,), param_dtype), "mlp"
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...] + self.bias[...]


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis with a learned scale and bias."""

    def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32):
        self.scale = sharding.param(nnx.Param, jnp.ones((dim,), param_dtype), "mlp")
        self.bias = sharding.param(nnx.Param, jnp.zeros((dim,), param_dtype), "mlp")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]


class MLP(nnx.Module):
    """Stack of Linear layers with ReLU between them (and after the last if ``final_relu``).

    With ``layer_norm``, each hidden layer is Linear -> LayerNorm -> ReLU.
    Dropout (rate ``dropout``) follows each hidden ReLU and is active only when a ``dropout_key``
    is passed: randomness is explicit, so a train step is a pure function of (state, batch, key).
    """

    def __init__(
        self,
        in_dim: int,
        sizes: tuple[int, ...],
        *,
        final_relu: bool,
        dropout: float = 0.0,
        layer_norm: bool = False,
        rngs: nnx.Rngs,
    ):
        if not sizes:
            raise ValueError("MLP needs at least one layer size")
        dims = (in_dim, *sizes)
        self.layers = nnx.List([Linear(a, b, rngs=rngs) for a, b in zip(dims[:-1], dims[1:], strict=True)])
        # LayerNorm before the ReLU of each hidden layer (stateless, unlike BatchNorm).
        self.norms = nnx.List([LayerNorm(b) for b in sizes[:-1]]) if layer_norm else None
        self.final_relu = final_relu
        self.dropout = dropout

    def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            last = i == n - 1
            if self.norms is not None and not last:
                x = self.norms[i](x)
            if not last or self.final_relu:
                x = jax.nn.relu(x)
            if not last and self.dropout > 0 and dropout_key is not None:
                keep = jax.random.bernoulli(jax.random.fold_in(dropout_key, i), 1 - self.dropout, x.shape)
                x = jnp.where(keep, x / (1 - self.dropout), 0)
        return x
