"""Optimizers: row-wise Adagrad vs a NumPy reference, schedules, dense families, routing."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from recscale.config import DenseOptimConfig, EmbeddingOptimConfig
from recscale.optim import (
    DENSE,
    EMBEDDING,
    combine,
    config_schedule,
    cooldown_steps,
    decay_start,
    dense_optimizer,
    embedding_labels,
    embedding_optimizer,
    learning_rate_schedule,
    lr_for_batch_size,
    rowwise_adagrad,
)

# ------------------------------------------------------------------------------------------------
# Row-wise Adagrad.


def _numpy_rowwise_adagrad(table, grads, lrs, initial_accumulator, eps):
    """Independent reference: FBGEMM's exact row-wise Adagrad, row by row, in float64."""
    w = table.astype(np.float64).copy()
    acc = np.full(w.shape[0], initial_accumulator, np.float64)
    for g, lr in zip(grads, lrs, strict=True):
        for v in range(w.shape[0]):
            if not np.any(g[v]):
                continue  # row not looked up this step
            acc[v] += np.mean(g[v].astype(np.float64) ** 2)
            w[v] -= lr * g[v] / (np.sqrt(acc[v]) + eps)
    return w, acc


def _sparse_grads(rng, steps, v, d, frac_rows=0.4):
    grads = []
    for _ in range(steps):
        g = rng.normal(size=(v, d)).astype(np.float32)
        g[rng.random(v) > frac_rows] = 0.0
        grads.append(g)
    return grads


@pytest.mark.parametrize("initial_accumulator", [0.0, 0.1])
def test_rowwise_adagrad_matches_numpy_reference(initial_accumulator):
    rng = np.random.default_rng(0)
    v, d, steps, eps = 32, 8, 6, 1e-8
    tables = {
        "a": rng.normal(size=(v, d)).astype(np.float32),
        "b": rng.normal(size=(v // 2, d)).astype(np.float32),
    }
    grads = {k: _sparse_grads(rng, steps, t.shape[0], d) for k, t in tables.items()}
    grads["a"][2][:] = 0.0  # one step with no rows touched at all
    sched = optax.linear_schedule(0.05, 0.2, transition_steps=steps)
    tx = rowwise_adagrad(sched, initial_accumulator=initial_accumulator, eps=eps)

    params = jax.tree.map(jnp.asarray, tables)
    state = tx.init(params)
    step = jax.jit(tx.update)
    for i in range(steps):
        g = {k: jnp.asarray(grads[k][i]) for k in tables}
        updates, state = step(g, state, params)
        params = optax.apply_updates(params, updates)

    lrs = [float(sched(i)) for i in range(steps)]
    acc = state[0].sum_of_squares
    for k, t in tables.items():
        want_w, want_acc = _numpy_rowwise_adagrad(t, grads[k], lrs, initial_accumulator, eps)
        assert acc[k].shape == (t.shape[0],) and acc[k].dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(params[k]), want_w, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(acc[k]), want_acc, rtol=1e-6)
        # Rows never touched: parameters and accumulator bitwise unchanged.
        untouched = ~np.any(np.stack(grads[k]) != 0, axis=(0, 2))
        assert untouched.any() and not untouched.all()
        np.testing.assert_array_equal(np.asarray(params[k])[untouched], t[untouched])
        np.testing.assert_array_equal(
            np.asarray(acc[k])[untouched], np.float32(initial_accumulator)
        )


def test_rowwise_adagrad_zero_rows_exact_without_eps():
    """acc == eps == 0 on an untouched row must give an update of exactly 0, not 0/0."""
    tx = rowwise_adagrad(1.0, eps=0.0)
    params = jnp.ones((4, 3))
    g = jnp.zeros((4, 3)).at[1].set(jnp.array([3.0, 0.0, -4.0]))
    updates, state = tx.update(g, tx.init(params), params)
    u = np.asarray(updates)
    assert np.all(np.isfinite(u))
    np.testing.assert_array_equal(u[[0, 2, 3]], 0.0)
    rms = math.sqrt((9 + 16) / 3)
    np.testing.assert_allclose(u[1], [-3 / rms, 0.0, 4 / rms], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state[0].sum_of_squares), [0, 25 / 3, 0, 0], rtol=1e-6)


def test_rowwise_adagrad_stacked_and_bf16_tables():
    tx = rowwise_adagrad(0.1)
    params = {"stacked": jnp.ones((2, 5, 4)), "bf16": jnp.ones((5, 4), jnp.bfloat16)}
    state = tx.init(params)
    assert state[0].sum_of_squares["stacked"].shape == (2, 5)
    assert state[0].sum_of_squares["bf16"].dtype == jnp.float32
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    assert updates["bf16"].dtype == jnp.bfloat16


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_rowwise_adagrad_row_sharded_equals_single_device(axis_type):
    """Tables row-sharded over the 8-device mesh: same bits as one device; acc follows rows."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(3)
    table = rng.normal(size=(64, 4)).astype(np.float32)
    grad = _sparse_grads(rng, 1, 64, 4)[0]
    tx = rowwise_adagrad(0.1, initial_accumulator=0.1)
    want_u, want_s = jax.jit(tx.update)({"t": grad}, jax.jit(tx.init)({"t": table}), {"t": table})

    mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(AxisType, axis_type),))
    rows = NamedSharding(mesh, P("data", None))
    with jax.set_mesh(mesh):
        params = {"t": jax.device_put(table, rows)}
        state = jax.jit(tx.init)(params)
        if axis_type == "Explicit":
            assert state[0].sum_of_squares["t"].sharding.spec == P("data")
        u, s = jax.jit(tx.update)({"t": jax.device_put(grad, rows)}, state, params)
    assert u["t"].sharding.spec == P("data", None)
    assert s[0].sum_of_squares["t"].sharding.spec == P("data")
    np.testing.assert_array_equal(np.asarray(u["t"]), np.asarray(want_u["t"]))
    np.testing.assert_array_equal(
        np.asarray(s[0].sum_of_squares["t"]), np.asarray(want_s[0].sum_of_squares["t"])
    )


def test_rowwise_adagrad_accumulator_metadata_on_typed_state():
    """On an nnx.State of Variables the [V] accumulator drops the table's last logical axis."""

    class Table(nnx.Param):
        pass

    state = nnx.State(
        {"t": Table(jnp.ones((8, 4)), out_sharding=("vocab", "embed"), eager_sharding=False)}
    )
    for init in (rowwise_adagrad(0.1).init, jax.jit(rowwise_adagrad(0.1).init)):
        acc = init(state)[0].sum_of_squares["t"]
        assert isinstance(acc, Table) and acc[...].shape == (8,)
        assert tuple(acc.get_metadata("out_sharding")) == ("vocab",)
    specs = nnx.get_partition_spec(rowwise_adagrad(0.1).init(state))
    assert specs[0].sum_of_squares["t"].get_value() == jax.sharding.PartitionSpec("vocab")


def test_rowwise_adagrad_rejects_vectors():
    with pytest.raises(ValueError, match=r"rank >= 2.*\['bias'\]"):
        rowwise_adagrad(0.1).init({"bias": jnp.ones(3)})


# ------------------------------------------------------------------------------------------------
# Schedules and batch-size rules.


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_schedule_key_steps(decay):
    s = learning_rate_schedule(2.0, warmup_steps=10, decay=decay, total_steps=110, end_fraction=0.1)
    np.testing.assert_allclose(float(s(0)), 0.0)
    np.testing.assert_allclose(float(s(5)), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(s(10)), 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(s(60)), 1.1, rtol=1e-6)  # halfway: (peak + end) / 2
    np.testing.assert_allclose(float(s(110)), 0.2, rtol=1e-6)
    np.testing.assert_allclose(float(s(500)), 0.2, rtol=1e-6)
    np.testing.assert_allclose(float(jax.jit(s)(jnp.int32(10))), 2.0, rtol=1e-6)
    if decay == "cosine":
        want = 0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * 0.25))
        np.testing.assert_allclose(float(s(35)), want, rtol=1e-6)
    else:
        np.testing.assert_allclose(float(s(35)), 2.0 - 1.8 * 0.25, rtol=1e-6)


def test_schedule_constant_and_no_warmup():
    s = learning_rate_schedule(0.5, warmup_steps=4, decay="constant", total_steps=0)
    assert [float(s(i)) for i in (0, 2, 4, 1000)] == [0.0, 0.25, 0.5, 0.5]
    s = learning_rate_schedule(0.5, warmup_steps=0, decay="linear", total_steps=10)
    np.testing.assert_allclose([float(s(i)) for i in (0, 5, 10)], [0.5, 0.25, 0.0], atol=1e-7)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_schedule_equals_optax_and_takes_traced_arguments(decay):
    # optax's own composition of the same schedule, at every step.
    after = (
        optax.cosine_decay_schedule(2.0, 100, alpha=0.1)
        if decay == "cosine"
        else optax.linear_schedule(2.0, 0.2, 100)
    )
    ref = optax.join_schedules([optax.linear_schedule(0.0, 2.0, 10), after], [10])
    ours = learning_rate_schedule(
        2.0, warmup_steps=10, decay=decay, total_steps=110, end_fraction=0.1
    )
    steps = jnp.arange(0, 130)
    np.testing.assert_allclose(jax.vmap(ours)(steps), jax.vmap(ref)(steps), rtol=1e-6, atol=1e-7)

    # Peak, warmup and length as arguments: one compiled program for every run length.
    @jax.jit
    def traced(t, peak, warmup, total):
        return learning_rate_schedule(
            peak, warmup_steps=warmup, decay=decay, total_steps=total, end_fraction=0.1
        )(t)

    for peak, warmup, total in ((2.0, 10, 110), (0.5, 0, 40), (3e-3, 7, 1000)):
        plain = learning_rate_schedule(
            peak, warmup_steps=warmup, decay=decay, total_steps=total, end_fraction=0.1
        )
        for t in (0, 3, warmup, 25, total - 1, total, 5000):
            args = (jnp.int32(t), jnp.float32(peak), jnp.int32(warmup), jnp.int32(total))
            assert float(traced(*args)) == pytest.approx(float(plain(t)), rel=1e-6, abs=1e-9)
    assert traced._cache_size() == 1


@pytest.mark.parametrize("shape", ["1-sqrt", "linear"])
def test_wsd_schedule_key_steps(shape):
    """Warmup 10, stable to the decay start 90, cooldown 20 to 0.1 of the peak."""
    s = learning_rate_schedule(
        2.0,
        warmup_steps=10,
        decay="wsd",
        total_steps=110,
        end_fraction=0.1,
        cooldown=20,
        cooldown_shape=shape,
    )
    np.testing.assert_allclose([float(s(t)) for t in (0, 5)], [0.0, 1.0], rtol=1e-6)
    # The stable phase is exactly the peak, whatever the run's length.
    assert [float(s(t)) for t in (10, 50, 89, 90)] == [2.0] * 4
    left = {"1-sqrt": 1 - math.sqrt(0.25), "linear": 0.75}[shape]  # 5 of the 20 cooldown steps
    np.testing.assert_allclose(float(s(95)), 0.2 + 1.8 * left, rtol=1e-6)
    np.testing.assert_allclose([float(s(t)) for t in (110, 500)], [0.2, 0.2], rtol=1e-6)
    # Decreasing through the cooldown.
    cool = [float(s(t)) for t in range(90, 111)]
    assert all(a > b for a, b in zip(cool, cool[1:], strict=False))

    @jax.jit
    def traced(t, total, cooldown):
        return learning_rate_schedule(
            2.0,
            warmup_steps=10,
            decay="wsd",
            total_steps=total,
            end_fraction=0.1,
            cooldown=cooldown,
            cooldown_shape=shape,
        )(t)

    for total, cooldown in ((110, 20), (40, 8), (1000, 200)):
        plain = learning_rate_schedule(
            2.0,
            warmup_steps=10,
            decay="wsd",
            total_steps=total,
            end_fraction=0.1,
            cooldown=cooldown,
            cooldown_shape=shape,
        )
        for t in (0, 3, 10, total - cooldown - 1, total - cooldown, total - 1, total, 5000):
            got = traced(jnp.int32(t), jnp.int32(total), jnp.int32(cooldown))
            assert float(got) == pytest.approx(float(plain(t)), rel=1e-6)
    assert traced._cache_size() == 1


def test_wsd_stable_phase_is_the_same_bits_for_every_length():
    def lr(total):
        return learning_rate_schedule(
            3e-3, warmup_steps=4, decay="wsd", total_steps=total, cooldown=total // 5
        )

    steps = jnp.arange(0, 80)
    np.testing.assert_array_equal(jax.vmap(lr(100))(steps), jax.vmap(lr(1000))(steps))


def test_cooldown_steps_and_config_schedule():
    assert [cooldown_steps(n, 0.2) for n in (0, 1, 2, 3, 10, 12, 13, 1000)] == [
        0,
        1,
        1,
        1,
        2,
        2,
        3,
        200,
    ]
    assert cooldown_steps(10, 1.0) == 10
    with pytest.raises(ValueError, match="cooldown fraction"):
        cooldown_steps(10, 0.0)
    cfg = DenseOptimConfig(learning_rate=1.0, decay="wsd", cooldown_fraction=0.25)
    s = config_schedule(cfg, 100)
    assert float(s(75)) == 1.0 and float(s(76)) < 1.0 and float(s(100)) == 0.0
    assert decay_start(cfg, 100) == 75
    assert decay_start(dataclasses.replace(cfg, decay="cosine", warmup_steps=7), 100) == 7
    assert decay_start(dataclasses.replace(cfg, decay="constant"), 100) == 100
    with pytest.raises(ValueError, match="traced total_steps needs its cooldown"):
        jax.jit(lambda n: config_schedule(cfg, n)(0))(jnp.int32(100))


def test_wsd_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="inside the warmup"):
        learning_rate_schedule(1.0, warmup_steps=10, decay="wsd", total_steps=12, cooldown=4)
    with pytest.raises(ValueError, match=r"cooldown must be in \[1, 12\]"):
        learning_rate_schedule(1.0, warmup_steps=0, decay="wsd", total_steps=12, cooldown=0)
    with pytest.raises(ValueError, match="cooldown shape"):
        learning_rate_schedule(
            1.0, warmup_steps=0, decay="wsd", total_steps=12, cooldown=2, cooldown_shape="cos"
        )  # type: ignore[arg-type]


def test_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="total_steps"):
        learning_rate_schedule(1.0, warmup_steps=10, decay="cosine", total_steps=10)
    with pytest.raises(ValueError, match="unknown decay"):
        learning_rate_schedule(1.0, warmup_steps=0, decay="exp", total_steps=10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="peak"):
        learning_rate_schedule(0.0, warmup_steps=0, decay="constant", total_steps=10)


def test_lr_for_batch_size():
    assert lr_for_batch_size(0.1, 256, 1024, "linear") == pytest.approx(0.4)
    assert lr_for_batch_size(1e-3, 256, 1024, "sqrt") == pytest.approx(2e-3)
    assert lr_for_batch_size(1e-3, 256, 64, "sqrt") == pytest.approx(5e-4)
    assert lr_for_batch_size(1e-3, 256, 1024, "none") == 1e-3
    with pytest.raises(ValueError, match="unknown rule"):
        lr_for_batch_size(1e-3, 256, 1024, "cubic")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        lr_for_batch_size(1e-3, 0, 1024, "linear")


# ------------------------------------------------------------------------------------------------
# Dense optimizers.


def _quadratic_params():
    key_w, key_t = jax.random.split(jax.random.key(0))
    params = {"w": jax.random.normal(key_w, (4, 3)), "b": jnp.ones(3)}
    target = {"w": jax.random.normal(key_t, (4, 3)), "b": -jnp.ones(3)}
    return params, target


@pytest.mark.parametrize(
    "cfg",
    [
        DenseOptimConfig(name="adam", learning_rate=0.05),
        DenseOptimConfig(name="adamw", learning_rate=0.05, weight_decay=1e-2),
        DenseOptimConfig(name="sgd", learning_rate=0.05),
        DenseOptimConfig(name="sgd", learning_rate=0.05, b1=0.0),
        DenseOptimConfig(name="adagrad", learning_rate=0.1),
        DenseOptimConfig(name="lamb", learning_rate=0.05, weight_decay=1e-2),
        # LARS: 1-D leaves skip the trust ratio and see the raw LR, so it must suit them too.
        DenseOptimConfig(name="lars", learning_rate=0.5, weight_decay=1e-4),
        DenseOptimConfig(
            name="adam", learning_rate=0.05, warmup_steps=5, decay="cosine", grad_clip_norm=1.0
        ),
    ],
    ids=lambda c: f"{c.name}-b1={c.b1}-clip={c.grad_clip_norm}",
)
def test_dense_optimizer_decreases_quadratic(cfg):
    params, target = _quadratic_params()

    def loss(p):
        return sum(jnp.sum((p[k] - target[k]) ** 2) for k in p)

    tx = dense_optimizer(cfg, total_steps=60)
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        g = jax.grad(loss)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    start = float(loss(params))
    for _ in range(60):
        params, state = step(params, state)
    assert float(loss(params)) < 0.9 * start, cfg


def test_dense_optimizer_rejects_ignored_weight_decay():
    with pytest.raises(ValueError, match="adamw"):
        dense_optimizer(DenseOptimConfig(name="adam", weight_decay=0.1), 10)


def test_dense_weight_decay_skips_vectors_by_default():
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    tx = dense_optimizer(DenseOptimConfig(name="adamw", learning_rate=1.0, weight_decay=0.5), 10)
    u, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(u["w"]), -0.5)
    np.testing.assert_array_equal(np.asarray(u["b"]), 0.0)
    tx = dense_optimizer(
        DenseOptimConfig(name="adamw", learning_rate=1.0, weight_decay=0.5), 10, decay_mask=None
    )
    u, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(u["b"]), -0.5)


# ------------------------------------------------------------------------------------------------
# Embedding optimizers and routing.


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_embedding_optimizer_builds_and_warms_up(name):
    cfg = EmbeddingOptimConfig(name=name, learning_rate=0.1, warmup_steps=2)
    tx = embedding_optimizer(cfg, total_steps=10)
    params = {"t": jnp.ones((6, 4))}
    g = {"t": jnp.zeros((6, 4)).at[0].set(1.0)}
    state = tx.init(params)
    u0, state = tx.update(g, state, params)
    np.testing.assert_array_equal(np.asarray(u0["t"]), 0.0)  # warmup: lr(0) == 0
    u1, state = tx.update(g, state, params)
    assert float(u1["t"][0, 0]) < 0
    if name != "adam":  # dense Adam moves rows through its moments; the others do not
        np.testing.assert_array_equal(np.asarray(u1["t"][1:]), 0.0)


def test_embedding_adam_takes_its_betas_on_both_paths():
    """``embedding_optim.b1/b2`` (SASRec sets b2 = 0.98) reach the per-table optax Adam and the
    engine's update rule: two steps equal numpy Adam with those betas, not the defaults."""
    from recscale.embeddings.update import UpdateRule

    cfg = EmbeddingOptimConfig(name="adam", learning_rate=0.1, b1=0.5, b2=0.9)
    rule = UpdateRule.from_config(cfg)
    assert (rule.b1, rule.b2, rule.eps) == (0.5, 0.9, cfg.eps)
    tx = embedding_optimizer(cfg, total_steps=10)
    params = {"t": jnp.zeros((1, 3))}
    grads = [np.array([[1.0, -2.0, 0.5]]), np.array([[0.3, 1.0, -1.0]])]
    state = tx.init(params)
    m = v = np.zeros((1, 3))
    for t, g in enumerate(grads, 1):
        u, state = tx.update({"t": jnp.asarray(g, jnp.float32)}, state, params)
        m, v = 0.5 * m + 0.5 * g, 0.9 * v + 0.1 * g * g
        want = -0.1 * (m / (1 - 0.5**t)) / (np.sqrt(v / (1 - 0.9**t)) + cfg.eps)
        np.testing.assert_allclose(np.asarray(u["t"]), want, rtol=1e-5)
    default = embedding_optimizer(EmbeddingOptimConfig(name="adam", learning_rate=0.1), 10)
    st = default.init(params)
    for g in grads:
        u_default, st = default.update({"t": jnp.asarray(g, jnp.float32)}, st, params)
    assert not np.allclose(np.asarray(u_default["t"]), want, rtol=1e-3)


class EmbeddingTable(nnx.Param):
    """Stand-in for the embedding engine's table variable type."""


class _Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.table = EmbeddingTable(jax.random.normal(rngs.params(), (8, 4)))
        self.lin = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, ids):
        return self.lin(self.table[...][ids]).sum()


def _routing_tx(labels):
    emb = embedding_optimizer(EmbeddingOptimConfig(name="sgd", learning_rate=1.0), 10)
    return combine(optax.sgd(0.0), emb, labels)


def test_embedding_labels_on_nnx_state():
    params = nnx.state(_Tiny(nnx.Rngs(0)), nnx.Param)
    labels = embedding_labels(params, EmbeddingTable)
    assert labels["table"] == EMBEDDING
    assert labels["lin"]["kernel"] == DENSE and labels["lin"]["bias"] == DENSE
    # Same labels from a key-path predicate, which also works on a pure (type-less) state.
    by_path = embedding_labels(
        nnx.as_pure(params), lambda path, _: path[-1] == jax.tree_util.DictKey("table")
    )
    assert jax.tree.leaves(by_path) == jax.tree.leaves(labels)
    with pytest.raises(ValueError, match="no nnx.Variable"):
        embedding_labels(nnx.as_pure(params), EmbeddingTable)


@pytest.mark.parametrize("form", ["variables", "pure", "dict"])
def test_combine_routes_tables_and_dense(form):
    model = _Tiny(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    labels = embedding_labels(params, EmbeddingTable)

    def loss(p):
        return nnx.merge(graphdef, p)(jnp.array([1, 1, 5]))

    grads = jax.grad(loss)(params)
    if form == "pure":
        params, grads = nnx.as_pure(params), nnx.as_pure(grads)
    elif form == "dict":
        params, grads = params.to_pure_dict(), grads.to_pure_dict()
        labels = embedding_labels(params, lambda path, _: jax.tree_util.keystr(path) == "['table']")
    tx = _routing_tx(labels)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)

    def arr(tree, *keys):
        for k in keys:
            tree = tree[k]
        return np.asarray(tree[...] if isinstance(tree, nnx.Variable) else tree)

    np.testing.assert_array_equal(arr(new, "lin", "kernel"), arr(params, "lin", "kernel"))
    np.testing.assert_array_equal(arr(new, "lin", "bias"), arr(params, "lin", "bias"))
    table_g = arr(grads, "table")
    np.testing.assert_allclose(arr(new, "table"), arr(params, "table") - table_g, rtol=1e-6)
    assert np.any(table_g[[1, 5]] != 0)
    np.testing.assert_array_equal(
        arr(new, "table")[[0, 2, 3, 4, 6, 7]], arr(params, "table")[[0, 2, 3, 4, 6, 7]]
    )


def test_combine_with_nnx_optimizer_and_rowwise_adagrad():
    """nnx.Optimizer inits on a typed state and updates on pure arrays: a label tree serves both."""
    model = _Tiny(nnx.Rngs(1))
    labels = embedding_labels(nnx.state(model, nnx.Param), EmbeddingTable)
    dense = dense_optimizer(
        DenseOptimConfig(name="adam", learning_rate=0.01, grad_clip_norm=1.0), 10
    )
    emb = embedding_optimizer(EmbeddingOptimConfig(name="rowwise_adagrad", learning_rate=0.1), 10)
    optimizer = nnx.Optimizer(model, combine(dense, emb, labels), wrt=nnx.Param)
    before_table = np.asarray(model.table[...]).copy()
    before_kernel = np.asarray(model.lin.kernel[...]).copy()

    @nnx.jit
    def train_step(model, optimizer, ids):
        grads = nnx.grad(lambda m: m(ids))(model)
        optimizer.update(model, grads)

    for _ in range(3):
        train_step(model, optimizer, jnp.array([2, 3]))
    table = np.asarray(model.table[...])
    assert np.all(table[[2, 3]] != before_table[[2, 3]])
    np.testing.assert_array_equal(table[[0, 1, 4, 5, 6, 7]], before_table[[0, 1, 4, 5, 6, 7]])
    assert np.any(np.asarray(model.lin.kernel[...]) != before_kernel)


def test_cowclip_row_factor_scaling_rule_and_config_errors():
    from recscale.optim import cowclip

    # rows: zero gradient (kept); ||g|| = 2 over cnt·r·||w|| = 1 (halved); a zero row's
    # threshold is the floor ζ per occurrence: 2 · 0.5 = 1 (halved)
    s = cowclip.clip_scale(
        jnp.array([0.0, 4.0, 4.0]), jnp.array([1.0, 1.0, 0.0]), jnp.array([1.0, 1.0, 2.0]), 1.0, 0.5
    )
    np.testing.assert_allclose(s, [1.0, 0.5, 0.5])
    # The paper's Criteo rule, 1K -> 128K: dense lr 8e-4 -> 90.51e-4, L2 1e-4 -> 128e-4.
    h = cowclip.scale_hparams(1024, 131072, dense_lr=8e-4, embedding_lr=1e-4, l2=1e-4)
    assert h["dense_lr"] == pytest.approx(90.51e-4, rel=1e-4)
    assert h["l2"] == pytest.approx(128e-4) and h["embedding_lr"] == 1e-4
    assert cowclip.from_config(EmbeddingOptimConfig()) is None
    with pytest.raises(ValueError, match="cowclip_ratio=-1"):
        EmbeddingOptimConfig(cowclip_ratio=-1)
