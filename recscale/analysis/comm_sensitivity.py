"""How sensitive the loss is to each table's compressed exchange, and per-table error bounds
from it (issue 19: the table-wise adaptive bounds of the error-bounded compression work).

The engine's ``error_bounded`` exchange (``recscale.embeddings.compress``) moves every pooled
value ``x`` of a block (one table slot's outputs for one destination device: ``B / n``
examples of ``D`` values) to within ``ε R_b`` of itself, ``R_b`` the block's range. Taking the
errors as independent and uniform in ``[-ε R_b, ε R_b]`` (what rounding to a grid gives), the
loss moves to first order by ``Σ g·δ``, ``g = ∂L/∂x``, whose variance is

    ε² · s²,   s² = Σ_b R_b² ‖g_b‖² / 3                                  (forward sensitivity)

— a table whose outputs span a wide range where the loss is steep is sensitive; one whose
gradients are small is not. The gradients sent back are quantised the same way; their error
relative to the gradient, ``ε · ρ`` with ``ρ² = Σ_b R_{g,b}² m_b / 3 / ‖g‖²``, is reported
too (row-wise Adagrad divides it out of the scale, so it is a relative error that matters). It
is about the same for every table (ρ ≈ 21 on Frappe), so it does not rank them; a row's update
error reaches the loss through the same ``∂L/∂x`` as its forward error, so by default the
proposed scales apply both ways (``--comm-grad base``: forward only).

**Allocation.** Codes of a table with bound ``ε_t`` cost about ``log2(1 / ε_t)`` bits per
value, ``n_t`` values per step. Minimising the forward variance ``Σ s_t² ε_t²`` for a fixed
number of bits ``Σ n_t log2(1 / ε_t)`` (or the bits for a fixed variance) gives, from the
Lagrangian, ``ε_t ∝ √n_t / s_t``. The bounds are then the base bound times a power of two per
table (one code width per all-to-all, so few distinct scales), centred so that the bits sum to
the uniform bound's (``budget="bytes"``: less error at about the same bytes) or so that the
predicted variance equals the uniform bound's (``budget="error"``: fewer bytes at about the same
error); :func:`propose` says what each would give.

Measured from a checkpoint on training batches in evaluation mode
(``python -m dlrm.evaluate --workdir DIR --comm-sensitivity``), with the pooled embeddings
probed where the model reads them (``recscale.embeddings.collection.probe``), so the numbers
do not depend on the layout the measurement runs on. Hand-written: no library allocates
quantisation bits from measured gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recscale.embeddings import collection
from recscale.embeddings.compress import MARGIN, MIN_EPS, code_bits


def _block_stats(x: jax.Array, g: jax.Array, blocks: int) -> jax.Array:
    """``[forward s², gradient ρ² numerator, ‖g‖²]`` of one feature's ``x, g [B, D]`` split into
    ``blocks`` blocks of examples (the exchange's blocks on ``blocks`` devices)."""
    b, d = x.shape
    xb = x.reshape(blocks, (b // blocks) * d)
    gb = g.reshape(blocks, (b // blocks) * d)
    rx = xb.max(axis=1) - xb.min(axis=1)
    rg = gb.max(axis=1) - gb.min(axis=1)
    g2 = jnp.sum(gb * gb, axis=1)
    return jnp.stack([jnp.sum(rx * rx * g2) / 3, jnp.sum(rg * rg) * xb.shape[1] / 3, jnp.sum(g2)])


def measure(
    graphdef: nnx.GraphDef,
    params: Any,
    batch_stats: Any,
    batches: Sequence[Any],
    *,
    blocks: int,
    loss_fn,
) -> dict[str, dict[str, float]]:
    """Per table: ``forward`` (``s``, the loss's first-order standard deviation per unit ε,
    summed over ``batches``), ``grad_rel_error`` (``ρ``), ``values`` (pooled values per batch,
    ``n_t``) and ``features``. ``loss_fn(logits, batch)``: the batch's mean loss."""
    b = int(batches[0].ids_bfh.shape[0])
    if b % blocks:
        raise ValueError(f"batch of {b} examples cannot be split into {blocks} device blocks")

    def run(deltas, batch):
        with collection.probe(deltas) as p:
            logits = nnx.merge(graphdef, params, batch_stats)(batch.dense_bn, batch.ids_bfh)
        return loss_fn(logits, batch), p

    tables: dict[str, str] = {}  # feature -> table

    def discover(batch):
        p = run(None, batch)[1]
        tables.update(p.tables)
        return p.shapes

    shapes = jax.eval_shape(discover, batches[0])
    if not shapes:
        raise ValueError("the model looked up no embeddings: nothing to measure")

    @jax.jit
    def stats(batch):
        zeros = {k: jnp.zeros(s.shape, jnp.float32) for k, s in shapes.items()}

        def f(deltas):
            loss, p = run(deltas, batch)
            return loss, p.outputs

        g, xs = jax.grad(f, has_aux=True)(zeros)
        return {k: _block_stats(xs[k].astype(jnp.float32), g[k], blocks) for k in shapes}

    total: dict[str, np.ndarray] = {}
    for batch in batches:
        for k, v in jax.device_get(stats(batch)).items():
            total[k] = total.get(k, 0.0) + np.asarray(v, np.float64)
    out: dict[str, dict[str, Any]] = {}
    for feat, (s2, rho_num, g2) in total.items():
        t = out.setdefault(
            tables[feat], {"s2": 0.0, "rho_num": 0.0, "g2": 0.0, "values": 0, "features": []}
        )
        t["s2"] += s2
        t["rho_num"] += rho_num
        t["g2"] += g2
        t["values"] += int(math.prod(shapes[feat].shape))
        t["features"].append(feat)
    return {
        name: {
            "forward": math.sqrt(t["s2"]),
            "grad_rel_error": math.sqrt(t["rho_num"] / t["g2"]) if t["g2"] > 0 else 0.0,
            "values": t["values"],
            "features": t["features"],
        }
        for name, t in out.items()
    }


def bound_for_bits(bits: int) -> float:
    """The tightest bound whose codes take ``bits`` bits (``compress.code_bits``), rounded up
    to three significant digits."""
    if not 2 <= bits <= 15:  # 16-bit codes: only MIN_EPS itself, no room to round
        raise ValueError(f"{bits}-bit codes: bounds for 2 to 15 bits are offered")
    eps = 1 / (2 * MARGIN * (2**bits - 2))  # _top(eps) = 2^bits - 1 from here up
    unit = 10.0 ** (math.floor(math.log10(eps)) - 2)
    eps = math.ceil(eps * (1 + 1e-9) / unit) * unit  # up: a looser bound never takes more bits
    if code_bits(eps) != bits:
        raise AssertionError(f"bound_for_bits({bits}) = {eps} takes {code_bits(eps)} bits")
    return float(f"{eps:.3g}")


def propose(
    sens: dict[str, dict[str, Any]],
    eps: float,
    *,
    budget: Literal["bytes", "error"] = "bytes",
    max_shift: int = 3,
    grad: Literal["base", "same"] = "same",
) -> dict[str, Any]:
    """Per-table code widths (within ``max_shift`` bits of the base bound's) chosen greedily:
    starting from the narrowest, a bit at a time to the table whose forward variance
    ``s_t² ε_t²`` drops most per value it costs (optimal for this separable problem, as each
    bit gains less than the one before). ``budget="bytes"``: until the uniform bound's bits are
    spent; ``"error"``: until the predicted variance is the uniform bound's. Each table's bound
    is the tightest of its width (:func:`bound_for_bits`), given as a scale of ``eps``.

    The allocation is of the forward exchange, whose sensitivity it measures; ``grad="same"``
    scales the gradients' bounds alike (a row's update error moves the loss through the same
    ``∂L/∂x``), ``"base"`` leaves them at the base bound (``TABLE=SCALE:1``). On Frappe at a
    4-bit budget, ``same`` lost 40% less AUC than uniform codes and ``base`` about 15% less
    (BENCHMARKS.md).

    Returned: ``scales``, ``bits``, ``bounds`` per table, ``comm_error_bound_tables`` (the
    config entries), and against the uniform ``eps``: ``bits_ratio`` (bits on the wire) and
    ``forward_error_ratio`` (the first-order loss deviation, ``√Σ s_t² ε_t² / √Σ s_t² ε²``)."""
    if not MIN_EPS <= eps < 0.5:
        raise ValueError(f"base bound {eps}: must be in [{MIN_EPS:.3g}, 0.5)")
    if budget not in ("bytes", "error"):
        raise ValueError(f"budget {budget!r}: expected bytes or error")
    if grad not in ("base", "same"):
        raise ValueError(f"grad {grad!r}: expected base or same")
    names = sorted(sens)
    s2 = {n: float(sens[n]["forward"]) ** 2 for n in names}
    nv = {n: float(sens[n]["values"]) for n in names}
    base = code_bits(eps)
    lo, hi = max(2, base - max_shift), min(15, base + max_shift)
    bits = dict.fromkeys(names, lo)
    bound = {b: bound_for_bits(b) for b in range(lo, hi + 1)}

    def spent() -> float:
        return sum(nv[n] * bits[n] for n in names)

    def var(b: dict[str, int] | None = None, e: float | None = None) -> float:
        return sum(s2[n] * (e if e is not None else bound[b[n]]) ** 2 for n in names)

    bits_budget, var_budget = sum(nv[n] * base for n in names), var(e=eps)
    while True:
        if budget == "error" and var(bits) <= var_budget:
            break
        gains = {
            n: s2[n] * (bound[bits[n]] ** 2 - bound[bits[n] + 1] ** 2) / nv[n]
            for n in names
            if bits[n] < hi and (budget == "error" or spent() + nv[n] <= bits_budget)
        }
        if not gains or max(gains.values()) <= 0:
            break
        bits[max(gains, key=lambda n: (gains[n], n))] += 1
    scales = {}
    for n in names:  # four significant digits, rounded up: the same code width
        x = bound[bits[n]] / eps
        unit = 10.0 ** (math.floor(math.log10(x)) - 3)
        scales[n] = float(f"{math.ceil(x * (1 - 1e-12) / unit) * unit:.4g}")
        if code_bits(eps * scales[n]) != bits[n]:
            raise AssertionError(f"{n}: scale {scales[n]} of {eps} is not {bits[n]}-bit codes")
    return {
        "base_bound": eps,
        "base_bits": base,
        "budget": budget,
        "bits": bits,
        "bounds": {n: bound[bits[n]] for n in names},
        "scales": scales,
        "bits_ratio": spent() / bits_budget,
        "forward_error_ratio": math.sqrt(var(bits) / var_budget) if var_budget > 0 else 0.0,
        "grad": grad,
        "comm_error_bound_tables": [
            f"{n}={scales[n]:g}" + (":1" if grad == "base" else "") for n in names
        ],
    }
