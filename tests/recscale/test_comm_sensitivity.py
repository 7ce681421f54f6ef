"""Per-table bounds from measured sensitivity (issue 19): the measurement, the allocation."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dlrm.model import build_model
from recscale import sharding
from recscale.analysis import comm_sensitivity as cs
from recscale.config import MeshConfig
from recscale.embeddings import collection
from recscale.embeddings.compress import code_bits
from recscale.train.steps import weighted_bce
from tests.recscale.test_engine import SCHEMA, _batches, _cfg


def _loss(logits, b):
    return weighted_bce(logits, b.labels_b, b.weights_b)


def _measure(kind: str, n: int, batches):
    cfg = _cfg(kind, n)
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.activate(mesh, cfg.mesh):
        model = build_model(cfg, SCHEMA, nnx.Rngs(params=0))
        graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
        out = cs.measure(graphdef, params, stats, batches, blocks=8, loss_fn=_loss)
    return out, (graphdef, params, stats)


def test_the_measured_sensitivity_is_the_loss_deviation_of_uniform_block_errors():
    """``s`` is the first-order standard deviation of the loss per unit ε when each block of
    a table's pooled outputs moves by independent uniform errors of ``ε R_b``: checked by
    Monte Carlo against the model's real loss; and it is the same measured through the sharded
    engine (8 devices, row-wise) as through per-table arrays on one device."""
    batches = [jax.tree.map(jnp.asarray, b) for b in _batches(1)]
    ref, (graphdef, params, stats) = _measure("off", 1, batches)
    eng, _ = _measure("row_wise", 8, batches)
    assert set(ref) == set(eng) == {f"f{i}" for i in range(4)}
    for name in ref:
        assert ref[name]["values"] == eng[name]["values"] == 16 * 8
        for k in ("forward", "grad_rel_error"):
            np.testing.assert_allclose(eng[name][k], ref[name][k], rtol=1e-4, err_msg=name)
        assert ref[name]["forward"] > 0 and ref[name]["grad_rel_error"] > 0

    b = batches[0]
    eps, draws = 1e-3, 400
    cfg = _cfg("off", 1)

    @jax.jit
    def loss_with(deltas):
        with sharding.activate(sharding.make_mesh(cfg.mesh), cfg.mesh), collection.probe(deltas):
            logits = nnx.merge(graphdef, params, stats)(b.dense_bn, b.ids_bfh)
        return _loss(logits, b)

    with collection.probe(None) as p:
        nnx.merge(graphdef, params, stats)(b.dense_bn, b.ids_bfh)
    shapes = p.shapes
    zeros = {k: jnp.zeros(s.shape) for k, s in shapes.items()}
    with collection.probe(zeros) as p:
        nnx.merge(graphdef, params, stats)(b.dense_bn, b.ids_bfh)
    outs = {k: np.asarray(v) for k, v in p.outputs.items()}
    base = float(loss_with(zeros))
    rng = np.random.default_rng(0)
    for name in ("f0", "f3"):
        x = outs[name].reshape(8, -1)  # 8 blocks of 2 examples x 8 values
        r = (x.max(1) - x.min(1))[:, None]
        dl = []
        for _ in range(draws):
            noise = (rng.uniform(-1, 1, x.shape) * eps * r).reshape(outs[name].shape)
            dl.append(float(loss_with({**zeros, name: jnp.asarray(noise, jnp.float32)})) - base)
        measured = np.std(dl)
        # 400 draws: the standard deviation's own sampling error is about 1/sqrt(800) = 3.5%
        np.testing.assert_allclose(measured, eps * ref[name]["forward"], rtol=0.15, err_msg=name)


def _brute_force(s2, eps_of, lo, hi, budget_bits):
    best = None
    for bits in itertools.product(range(lo, hi + 1), repeat=len(s2)):
        if sum(bits) <= budget_bits:
            v = sum(s * eps_of[b] ** 2 for s, b in zip(s2, bits, strict=True))
            best = v if best is None or v < best else best
    return best


def test_the_greedy_allocation_is_optimal_and_keeps_its_budget():
    rng = np.random.default_rng(1)
    for trial in range(20):
        s = np.exp(rng.uniform(-4, 2, 4))
        sens = {f"t{i}": {"forward": float(v), "values": 160} for i, v in enumerate(s)}
        eps = (0.036, 0.0081, 0.002)[trial % 3]
        prop = cs.propose(sens, eps, budget="bytes", max_shift=3)
        base = code_bits(eps)
        lo, hi = max(2, base - 3), min(15, base + 3)
        # the table's bound is the tightest of its width, and takes that width
        for n, b in prop["bits"].items():
            assert code_bits(eps * prop["scales"][n]) == b == code_bits(prop["bounds"][n])
            assert lo <= b <= hi
        assert prop["bits_ratio"] <= 1.0
        eps_of = {b: cs.bound_for_bits(b) for b in range(lo, hi + 1)}
        names = sorted(sens)
        s2 = [sens[n]["forward"] ** 2 for n in names]
        got = sum(s2[i] * eps_of[prop["bits"][n]] ** 2 for i, n in enumerate(names))
        np.testing.assert_allclose(got, _brute_force(s2, eps_of, lo, hi, base * 4), rtol=1e-12)
        uniform = math.sqrt(sum(s2) * eps**2)
        np.testing.assert_allclose(prop["forward_error_ratio"], math.sqrt(got) / uniform)
        # "error": no more predicted error than the uniform bound, in no more bits than needed
        err = cs.propose(sens, eps, budget="error", max_shift=3)
        assert err["forward_error_ratio"] <= 1.0 + 1e-12
        assert err["bits_ratio"] <= 1.0 + 1e-12
    # equal sensitivities per value: the uniform bound's width everywhere
    same = {f"t{i}": {"forward": 1.0, "values": 100} for i in range(3)}
    assert set(cs.propose(same, 0.002)["bits"].values()) == {8}
    # the config entries: forward scales, gradients at the base bound (or scaled alike)
    from recscale.config import EmbeddingShardingConfig

    prop = cs.propose(sens, 0.036)
    for grad, tail in (("base", ":1"), ("same", "")):
        entries = cs.propose(sens, 0.036, grad=grad)["comm_error_bound_tables"]
        assert entries == [f"{n}={prop['scales'][n]:g}{tail}" for n in sorted(sens)]
        EmbeddingShardingConfig(
            sharding="row_wise",
            comm_compression="error_bounded",
            comm_error_bound=0.036,
            comm_error_bound_grad=0.036,
            comm_error_bound_tables=tuple(entries),
        )


def test_bounds_for_bits_and_clear_errors():
    for b in range(2, 16):
        e = cs.bound_for_bits(b)
        assert code_bits(e) == b  # the tightest of its width: 1% tighter takes another bit
        assert b == 15 or code_bits(e * 0.99) == b + 1  # (15: 1% tighter is below MIN_EPS)
    with pytest.raises(ValueError, match="2 to 15 bits"):
        cs.bound_for_bits(16)
    with pytest.raises(ValueError, match="budget 'speed'"):
        cs.propose({"t": {"forward": 1.0, "values": 1}}, 0.002, budget="speed")
    with pytest.raises(ValueError, match="cannot be split into 8 device blocks"):
        mesh = sharding.make_mesh(MeshConfig(data_parallel=1))
        with sharding.activate(mesh, "replicated"):
            model = build_model(_cfg("off", 1), SCHEMA, nnx.Rngs(params=0))
            g, p, st = nnx.split(model, nnx.Param, nnx.BatchStat)
            b = _batches(1)[0]
            cs.measure(
                g,
                p,
                st,
                [b._replace(ids_bfh=b.ids_bfh[:12], dense_bn=b.dense_bn[:12])],
                blocks=8,
                loss_fn=_loss,
            )
