"""HSTU, SASRec and the bag over jagged tokens (sequential/{hstu,sasrec,bag}/model.py): shapes
and masks, causality, the bag's indifference to order, the kernel implementations agreeing,
parameter counts against the analytic ones, and a few Adam steps learning a planted batch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from data.sequences import JaggedBatch, PackConfig, Packer, PlantedConfig, PlantedSequences
from recscale.kernels import common
from sequential.bag.model import Bag
from sequential.config import BagConfig, HSTUConfig, LossConfig, SASRecConfig
from sequential.hstu.model import HSTU
from sequential.losses import next_item_loss
from sequential.sasrec.model import SASRec

V, N = 20, 6
HSTU_CFG = HSTUConfig(
    n_items=V, d_model=8, num_layers=2, num_heads=2, d_qk=4, d_v=4, max_seq_len=N, num_buckets=8
)
SASREC_CFG = SASRecConfig(n_items=V, d_model=8, num_layers=2, num_heads=2, max_seq_len=N)
BAG_CFG = BagConfig(n_items=V, d_model=8, num_layers=2, max_seq_len=N)
CFGS = {"hstu": HSTU_CFG, "sasrec": SASREC_CFG, "bag": BAG_CFG}
NAMES = list(CFGS)
# Sequences of 4, 3 and 8 tokens (the last two past N = 6), one empty padding sequence, and
# three tail slots.
LENGTHS = (4, 3, 8, 0)
T_PAD = 18


def _batch(values: np.ndarray, lengths=LENGTHS, t_pad=T_PAD) -> JaggedBatch:
    # The tail slots keep ``values``' garbage: the models must ignore them.
    b, vals = len(lengths), values[:t_pad].astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    weights = (np.asarray(lengths) > 0).astype(np.float32)
    z = np.zeros(b, np.int32)
    return JaggedBatch(vals, offsets, np.zeros(t_pad, np.int32), z, weights, z - 1, {})


def _models():
    return {
        "hstu": HSTU(HSTU_CFG, impl="xla", rngs=nnx.Rngs(0)),
        "sasrec": SASRec(SASREC_CFG, rngs=nnx.Rngs(0)),
        "bag": Bag(BAG_CFG, rngs=nnx.Rngs(0)),
    }


def _jitted(model):
    """``(values, offsets) -> [T, D]`` of ``model``, jitted."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda v, o: nnx.merge(graphdef, state)(v, o))


@pytest.fixture(scope="module")
def applied():
    """name -> each model's jitted call (one compile each for the batch's shapes)."""
    return {name: _jitted(model) for name, model in _models().items()}


VALUES = np.random.default_rng(0).integers(1, V + 1, size=T_PAD).astype(np.int32)


@pytest.mark.parametrize("name", NAMES)
def test_shapes_and_invalid_slots(applied, name):
    b = _batch(VALUES)
    out = np.asarray(applied[name](b.values, b.offsets))
    assert out.shape == (T_PAD, 8) and np.isfinite(out).all()
    real = np.abs(out).sum(1) > 0
    # Sequence 2's tokens 6, 7 are past N; the tail (15..17) belongs to no sequence.
    want = np.ones(T_PAD, bool)
    want[[13, 14, 15, 16, 17]] = False
    np.testing.assert_array_equal(real, want)


@pytest.mark.parametrize("name", NAMES)
def test_causal_and_sequences_independent(applied, name):
    """Changing token 2 of sequence 0 changes its positions >= 2 only: nothing of its past,
    of the other sequences; changing a token past N or in the tail changes nothing."""
    base = _batch(VALUES)
    out0 = np.asarray(applied[name](base.values, base.offsets))
    vals = VALUES.copy()
    vals[2] = vals[2] % V + 1
    out1 = np.asarray(applied[name](_batch(vals).values, base.offsets))
    np.testing.assert_array_equal(out1[:2], out0[:2])
    np.testing.assert_array_equal(out1[4:], out0[4:])
    assert np.abs(out1[2:4] - out0[2:4]).max() > 1e-4
    vals = VALUES.copy()
    vals[[13, 16]] = vals[[13, 16]] % V + 1  # past N in sequence 2; a tail slot
    out2 = np.asarray(applied[name](_batch(vals).values, base.offsets))
    np.testing.assert_array_equal(out2, out0)


@pytest.mark.parametrize("name", NAMES)
def test_padding_sequences_contribute_nothing(applied, name):
    """The same tokens with more empty padding sequences, or a longer tail, give the same
    outputs."""
    base = _batch(VALUES)
    out0 = np.asarray(applied[name](base.values, base.offsets))
    more = _batch(VALUES, lengths=(*LENGTHS, 0, 0), t_pad=T_PAD)
    out1 = np.asarray(_jitted(_models()[name])(more.values, more.offsets))
    np.testing.assert_allclose(out1, out0, rtol=1e-6, atol=1e-6)


def test_hstu_xla_matches_pallas_gpu_interpreted():
    """Forward and parameter gradients of the same HSTU with the XLA reference and with the
    Triton kernel in interpret mode."""
    b = _batch(VALUES)
    cfg = dataclasses.replace(HSTU_CFG, num_layers=1)  # interpreted kernels are slow: one layer
    models = {impl: HSTU(cfg, impl=impl, rngs=nnx.Rngs(0)) for impl in ("xla", "pallas_gpu")}

    def run(model):
        graphdef, params = nnx.split(model, nnx.Param)

        def f(p):
            return jnp.sum(jnp.sin(nnx.merge(graphdef, p)(b.values, b.offsets)))

        return jax.jit(jax.value_and_grad(f))(params)

    before = sum(n for (op, *_), n in common.FALLBACKS.items() if op == "hstu_attention")
    (v_x, g_x), (v_p, g_p) = run(models["xla"]), run(models["pallas_gpu"])
    after = sum(n for (op, *_), n in common.FALLBACKS.items() if op == "hstu_attention")
    assert after == before  # the kernel ran, no fallback to the reference
    np.testing.assert_allclose(v_p, v_x, rtol=1e-5, atol=1e-5)
    for a, c in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_x), strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5)


def test_bag_ignores_order():
    """Swapping sequence 0's first two items changes its position-0 output only: from position
    1 on, the bag holds the same items; the order-aware models see the swap."""
    base = _batch(VALUES)
    vals = VALUES.copy()
    vals[[0, 1]] = VALUES[[1, 0]]
    assert VALUES[0] != VALUES[1]
    out = {}
    for name, model in _models().items():
        f = _jitted(model)
        out[name] = np.asarray(f(base.values, base.offsets)), np.asarray(f(vals, base.offsets))
    before, after = out["bag"]
    np.testing.assert_allclose(after[1:], before[1:], rtol=1e-6, atol=1e-7)
    assert np.abs(after[0] - before[0]).max() > 1e-4
    for name in ("hstu", "sasrec"):
        assert np.abs(out[name][1][1:4] - out[name][0][1:4]).max() > 1e-4, name


@pytest.mark.parametrize("name", NAMES)
def test_parameter_counts_match_the_cost(name):
    cfg = CFGS[name]
    model = _models()[name]
    table = model.embeddings.tables["item"][...]
    total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    cost = cfg.cost()
    assert cost.dense_params == total - table.size
    assert cost.sparse_params == V * cfg.d_model  # row 0 (padding) is never read


def test_costs_by_hand():
    """One configuration's per-token FLOPs, written out (sequential/flops.py)."""
    d, h, a, e, n, lay = 8, 2, 4, 4, 6, 2
    hstu = HSTU_CFG.cost(loss=LossConfig(num_negatives=16))
    attn = lay * 2 * h * (a + e) * (n + 1) / 2  # the causal half: (n + 1) / 2 keys a token
    want = lay * 2 * d * h * (2 * e + 2 * a) + attn + lay * 2 * h * e * d + 2 * d * 17
    assert hstu.forward_flops == want
    assert hstu.train_flops == 3 * want + 2 * d  # scatter: the input and the target rows
    sas = SASREC_CFG.cost(seq_len=3)
    assert dict(sas.components)["attention"] == lay * 2 * d * (3 + 1)
    assert sas.forward_flops == lay * (6 * d * d + 2 * d * (3 + 1) + 4 * d * d)
    f = 4 * d  # the bag's default hidden width
    bag = BAG_CFG.cost(loss=LossConfig(kind="full_softmax"))
    want = 2 * d * f + 2 * f * f + 2 * f * d + 2 * d * V  # MLP d-f-f-d, the full softmax
    assert bag.forward_flops == want and bag.train_flops == 3 * want + d  # scatter: input row
    assert BAG_CFG.cost(seq_len=3).forward_flops == BAG_CFG.cost(seq_len=6).forward_flops


PLANTED = dict(n_items=30, max_seq_len=10, num_layers=1)


@pytest.fixture(scope="module")
def planted_batch():
    cfg = PlantedConfig(n_items=30, num_tastes=3, min_len=6, max_len=10, lag=2)
    hist = PlantedSequences(cfg, seed=0).train_histories(0, 12)
    pack = PackConfig(token_budget=128, max_sequences=16, block_size=32, shuffle=False)
    return Packer(hist, pack).batch(0)


@pytest.mark.parametrize(
    "name,loss",
    [
        ("hstu", LossConfig(num_negatives=16)),
        ("sasrec", LossConfig(kind="bce", l2_norm=False, temperature=1.0)),
        ("bag", LossConfig(kind="full_softmax")),
    ],
)
def test_adam_steps_reduce_the_loss(planted_batch, name, loss):
    """Ten Adam steps on one planted batch lower the training loss (a fixed key per step: the
    same negatives, so the losses are comparable)."""
    if name == "hstu":
        model = HSTU(dataclasses.replace(HSTU_CFG, **PLANTED), impl="xla", rngs=nnx.Rngs(1))
    elif name == "sasrec":
        model = SASRec(dataclasses.replace(SASREC_CFG, **PLANTED), rngs=nnx.Rngs(1))
    else:
        model = Bag(dataclasses.replace(BAG_CFG, **PLANTED), rngs=nnx.Rngs(1))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adam(3e-2)
    key = jax.random.key(0)

    @jax.jit
    def step(params, opt):
        def f(p):
            return next_item_loss(nnx.merge(graphdef, p), planted_batch, key, loss)[0]

        val, g = jax.value_and_grad(f)(params)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, val

    opt = tx.init(params)
    losses = []
    for _ in range(10):
        params, opt, val = step(params, opt)
        losses.append(float(val))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.gpu
def test_hstu_pallas_gpu_matches_xla_on_device():
    """The compiled Triton kernel inside a 2-layer HSTU at a realistic size: outputs and
    parameter gradients equal the XLA path's, every matmul at float32 accuracy (unverified:
    no GPU was lent when it was written; ``JAX_PLATFORMS=cuda pytest -m gpu tests/sequential``)."""
    cfg = HSTUConfig(
        n_items=1000, d_model=64, num_layers=2, num_heads=2, d_qk=32, d_v=32, max_seq_len=128
    )
    r = np.random.default_rng(0)
    lengths = r.integers(1, 129, size=48)
    lengths = lengths[np.cumsum(lengths) <= 4096]
    values = r.integers(1, 1001, size=4096).astype(np.int32)
    b = _batch(values, lengths=(*lengths, 0), t_pad=4096)
    with jax.default_matmul_precision("highest"):
        got = {}
        for impl in ("xla", "pallas_gpu"):
            graphdef, params = nnx.split(HSTU(cfg, impl=impl, rngs=nnx.Rngs(0)), nnx.Param)

            def f(p, g=graphdef):
                return jnp.sum(jnp.sin(nnx.merge(g, p)(b.values, b.offsets)))

            got[impl] = jax.jit(jax.value_and_grad(f))(params)
    np.testing.assert_allclose(got["pallas_gpu"][0], got["xla"][0], rtol=1e-4)
    for a, c in zip(
        jax.tree.leaves(got["pallas_gpu"][1]), jax.tree.leaves(got["xla"][1]), strict=True
    ):
        np.testing.assert_allclose(a, c, rtol=1e-3, atol=1e-4)
