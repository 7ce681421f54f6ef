"""Small layers shared by the models (MLPs with logical axes and explicit-key dropout).

Training mode is explicit: a layer trains when its caller passes a ``dropout_key`` (dropout
active, BatchNorm normalising with the batch's statistics and updating its running ones) and
evaluates otherwise, so a train step is a pure function of (state, batch, key).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from recscale import sharding


class Linear(nnx.Module):
    """y = x W + b, with DLRM's init: W ~ N(0, 2/(in+out)), b ~ N(0, 1/out).

    ``parallel``: how tensor parallelism (``mlp`` over the ``model`` mesh axis) splits it:
    ``column`` by its outputs (W ``[in, out/m]``, its output split), ``row`` by its inputs
    (W ``[in/m, out]``: each device's partial product, summed by one all-reduce, the output
    whole). A column layer feeding a row layer keeps the activation between them split
    (Megatron's pair)."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        parallel: str = "column",
    ):
        if parallel not in ("column", "row"):
            raise ValueError(f"Linear: parallel must be 'column' or 'row', got {parallel!r}")
        w_std = (2.0 / (in_dim + out_dim)) ** 0.5
        b_std = (1.0 / out_dim) ** 0.5
        kernel_axes = (None, "mlp") if parallel == "column" else ("mlp", None)
        self.kernel = sharding.param(
            nnx.Param,
            w_std * jax.random.normal(rngs.params(), (in_dim, out_dim), param_dtype),
            *kernel_axes,
        )
        self.bias = sharding.param(
            nnx.Param,
            b_std * jax.random.normal(rngs.params(), (out_dim,), param_dtype),
            kernel_axes[1],
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...] + self.bias[...]


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis with a learned scale and bias."""

    def __init__(
        self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32, axis: str | None = "mlp"
    ):
        self.scale = sharding.param(nnx.Param, jnp.ones((dim,), param_dtype), axis)
        self.bias = sharding.param(nnx.Param, jnp.zeros((dim,), param_dtype), axis)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout, active only when a ``key`` is passed (a training call)."""
    if rate <= 0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0)


class BatchNorm(nnx.Module):
    """BatchNorm over the batch axis of ``[B, C]`` inputs (torch ``BatchNorm1d`` semantics).

    Training: normalise with the batch mean and biased variance, and update the running
    statistics (``nnx.BatchStat``, not parameters: the optimizer never sees them) as
    ``r <- momentum * r + (1 - momentum) * batch`` with the unbiased batch variance, as torch
    does. Evaluation: normalise with the running statistics. Under a mesh whose batch axis is
    sharded, the batch mean is a global one (XLA inserts the all-reduce): synchronised BN.
    """

    def __init__(
        self,
        dim: int,
        *,
        momentum: float = 0.9,
        eps: float = 1e-5,
        param_dtype=jnp.float32,
        axis: str | None = "mlp",
    ):
        self.scale = sharding.param(nnx.Param, jnp.ones((dim,), param_dtype), axis)
        self.bias = sharding.param(nnx.Param, jnp.zeros((dim,), param_dtype), axis)
        self.mean = sharding.param(nnx.BatchStat, jnp.zeros((dim,), jnp.float32), axis)
        self.var = sharding.param(nnx.BatchStat, jnp.ones((dim,), jnp.float32), axis)
        self.momentum = momentum
        self.eps = eps

    def __call__(self, x_bc: jax.Array, *, train: bool) -> jax.Array:
        if train:
            mean_c = x_bc.mean(0)
            var_c = jnp.square(x_bc - mean_c).mean(0)
            n = x_bc.shape[0]
            unbiased_c = var_c * (n / max(n - 1, 1))
            m = self.momentum
            self.mean[...] = m * self.mean[...] + (1 - m) * jax.lax.stop_gradient(mean_c)
            self.var[...] = m * self.var[...] + (1 - m) * jax.lax.stop_gradient(unbiased_c)
        else:
            mean_c, var_c = self.mean[...], self.var[...]
        return (x_bc - mean_c) * jax.lax.rsqrt(var_c + self.eps) * self.scale[...] + self.bias[...]


class MLP(nnx.Module):
    """Stack of Linear layers with ReLU between them (and after the last if ``final_relu``).

    With ``layer_norm`` (or ``batch_norm``), each layer followed by a ReLU is Linear -> norm ->
    ReLU, the order of FuxiCTR's ``MLP_Block``; a linear output layer is never normalised.
    Dropout (rate ``dropout``) follows each hidden ReLU and is active only when a ``dropout_key``
    is passed: randomness is explicit, so a train step is a pure function of (state, batch, key).

    Under tensor parallelism the layers alternate column- and row-parallel (``Linear``), the last
    one row-parallel: each column/row pair keeps its hidden activation split over ``model`` and
    ends in one all-reduce, and the MLP's output is whole (no all-gather of activations between
    layers). A norm after a row layer has whole inputs: its parameters are replicated.

    ``scan``: the longest tail of equal-width (column, row) pairs is one :func:`stacked` module of
    :class:`LayerPair` run by :func:`scan_stacked` (layer-wise FSDP, rematerialised); the layers
    before it stay unrolled. Needs ``final_relu`` (the last pair must be like the others) and
    no BatchNorm (its statistics update per layer).
    """

    def __init__(
        self,
        in_dim: int,
        sizes: tuple[int, ...],
        *,
        final_relu: bool,
        dropout: float = 0.0,
        layer_norm: bool = False,
        batch_norm: bool = False,
        scan: bool = False,
        rngs: nnx.Rngs,
    ):
        if not sizes:
            raise ValueError("MLP needs at least one layer size")
        if layer_norm and batch_norm:
            raise ValueError("MLP: choose layer_norm or batch_norm, not both")
        if scan and (batch_norm or not final_relu):
            raise ValueError("MLP scan: needs final_relu and no batch_norm")
        dims = (in_dim, *sizes)
        n = len(sizes)
        unrolled = n
        while scan and unrolled >= 2 and set(dims[unrolled - 2 :]) == {sizes[-1]}:
            unrolled -= 2  # layers unrolled-2, unrolled-1: a (column, row) pair of width h
        parallel = ["row" if (n - 1 - i) % 2 == 0 else "column" for i in range(n)]
        self.layers = nnx.List(
            [
                Linear(a, b, rngs=rngs, parallel=p)
                for a, b, p in zip(dims[:unrolled], dims[1 : unrolled + 1], parallel, strict=False)
            ]
        )
        norm = LayerNorm if layer_norm else BatchNorm if batch_norm else None
        normed = unrolled if final_relu else n - 1
        self.norms = (
            nnx.List(
                [
                    norm(sizes[i], axis="mlp" if parallel[i] == "column" else None)
                    for i in range(normed)
                ]
            )
            if norm is not None
            else None
        )
        self.pairs = (
            stacked(lambda r: LayerPair(sizes[-1], layer_norm, rngs=r), (n - unrolled) // 2, rngs)
            if unrolled < n
            else None
        )
        self.final_relu = final_relu
        self.dropout = dropout

    def _after(self, x, i: int | jax.Array, norm, relu: bool, dropout_key):
        """Layer ``i``'s norm, ReLU and dropout."""
        if norm is not None:
            x = norm(x, train=dropout_key is not None) if isinstance(norm, BatchNorm) else norm(x)
        if relu:
            x = jax.nn.relu(x)
            if dropout_key is not None:
                x = dropout(x, self.dropout, jax.random.fold_in(dropout_key, i))
        return x

    def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        n = len(self.layers)
        last = n - 1 if self.pairs is None else n  # the last layer, if unrolled
        for i, layer in enumerate(self.layers):
            relu = i != last or self.final_relu
            norm = self.norms[i] if self.norms is not None and relu else None
            x = self._after(layer(x), i, norm, relu, dropout_key)
        if self.pairs is not None:

            def step(pair: LayerPair, x, p):
                for j, (layer, norm) in enumerate(pair.sublayers()):
                    x = self._after(layer(x), n + 2 * p + j, norm, True, dropout_key)
                return x

            x = scan_stacked(self.pairs, x, step)
        return x


class LayerPair(nnx.Module):
    """Two ``[h, h]`` layers of an :class:`MLP`, column- then row-parallel, each with its
    optional LayerNorm: the unit a scanned MLP stacks."""

    def __init__(self, width: int, layer_norm: bool, *, rngs: nnx.Rngs):
        self.column = Linear(width, width, rngs=rngs, parallel="column")
        self.row = Linear(width, width, rngs=rngs, parallel="row")
        self.column_norm = LayerNorm(width, axis="mlp") if layer_norm else None
        self.row_norm = LayerNorm(width, axis=None) if layer_norm else None

    def sublayers(self):
        return ((self.column, self.column_norm), (self.row, self.row_norm))


def stacked(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
    """``n`` modules ``make(rngs)`` as one whose every array has a leading layer axis (logical
    axis ``layers``, ``sharding.stack_axes``), each initialised from its own split of ``rngs``:
    what :func:`scan_stacked` runs."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def one(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return sharding.stack_axes(one(rngs))


def scan_stacked(
    stack: nnx.Module,
    carry: Any,
    step: Callable[[nnx.Module, Any, jax.Array], Any],
    *,
    first: int = 0,
) -> Any:
    """``carry`` through the layers of a :func:`stacked` module in order by a ``lax.scan``:
    ``carry = step(layer, carry, index)`` with ``index`` counting from ``first``. Layer-wise
    FSDP: each layer's slice is gathered over ``data`` inside the loop
    (``sharding.gather_fsdp``: its gradient constrained back to the shards), and the body is
    rematerialised in the backward, so one layer's weights are whole at a time."""
    carry, _ = _scan_layers(stack, lambda layer, c, i: (step(layer, c, i), None), carry, first)
    return carry


def map_stacked(
    stack: nnx.Module, fn: Callable[[nnx.Module, jax.Array], Any], *, first: int = 0
) -> Any:
    """``fn(layer, index)`` of every layer of a :func:`stacked` module, stacked on a leading
    layer axis: side-by-side blocks (a parallel MaskNet's) run one layer at a time, as
    :func:`scan_stacked` runs a chain of them (layer-wise gathering and remat alike)."""
    _, ys = _scan_layers(stack, lambda layer, c, i: (c, fn(layer, i)), None, first)
    return ys


def _scan_layers(stack: nnx.Module, step, carry: Any, first: int) -> tuple[Any, Any]:
    graphdef, state = nnx.split(stack)
    n = jax.tree.leaves(state)[0].shape[0]

    @jax.checkpoint
    def body(c, xs):
        layer_state, i = xs
        layer = nnx.merge(graphdef, sharding.gather_fsdp(sharding.unstack_axes(layer_state)))
        return step(layer, c, i)

    return jax.lax.scan(body, carry, (state, first + jnp.arange(n)))
