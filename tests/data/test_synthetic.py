"""Tests of the stateless synthetic generator (data/synthetic.py)."""

import dataclasses
import os
import shutil

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from data import counter_rng, synthetic
from data.batch import PAD_ID, Batch
from data.config import SyntheticConfig
from data.synthetic import EVAL_INDEX_OFFSET, SyntheticGenerator

SMALL = SyntheticConfig(
    num_dense=5,
    vocab_sizes=(1, 7, 1000, 50),
    max_hotness=(1, 3, 5, 2),
    pooling="uniform",
    num_eval_examples=1000,
)


@pytest.fixture(scope="module")
def gen() -> SyntheticGenerator:
    return SyntheticGenerator(SMALL, seed=3)


@pytest.fixture(scope="module")
def default_gen() -> SyntheticGenerator:
    return SyntheticGenerator(SyntheticConfig(), seed=0)


def assert_batches_equal(a: Batch, b: Batch) -> None:
    for name, x, y in zip(Batch._fields, a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def concat(batches) -> Batch:
    return Batch(*(np.concatenate(parts) for parts in zip(*batches, strict=True)))


def test_examples_are_pure_function_of_seed_and_index(gen):
    whole = gen.examples(np.arange(100))
    assert_batches_equal(
        whole, concat([gen.examples(np.arange(50)), gen.examples(np.arange(50, 100))])
    )
    perm = np.random.default_rng(0).permutation(100)
    assert_batches_equal(gen.examples(perm), Batch(*(x[perm] for x in whole)))
    assert_batches_equal(gen.examples(np.array([7])), Batch(*(x[7:8] for x in whole)))
    assert_batches_equal(SyntheticGenerator(SMALL, seed=3).examples(np.arange(100)), whole)

    other = SyntheticGenerator(SMALL, seed=4).examples(np.arange(100))
    assert not np.array_equal(other.dense_bn, whole.dense_bn)
    assert not np.array_equal(other.ids_bfh[:, 2], whole.ids_bfh[:, 2])
    assert not np.array_equal(other.labels_b, whole.labels_b)


def test_train_batch_host_slices_concatenate_to_the_global_batch(gen):
    one = gen.train_batch(3, 64)
    assert_batches_equal(one, gen.examples(np.arange(3 * 64, 4 * 64)))
    for count in (2, 4):
        parts = [gen.train_batch(3, 64, process_index=p, process_count=count) for p in range(count)]
        assert all(p.batch_size == 64 // count for p in parts)
        assert_batches_equal(concat(parts), one)
    assert not np.array_equal(gen.train_batch(4, 64).dense_bn, one.dense_bn)


def test_bad_arguments_raise_clear_errors(gen):
    with pytest.raises(ValueError, match=r"batch_size 10 .* process_count 4"):
        gen.train_batch(0, 10, process_count=4)
    with pytest.raises(ValueError, match=r"batch_size 10 .* process_count 3"):
        gen.eval_batches(10, process_count=3)
    with pytest.raises(ValueError, match="process_index 2"):
        gen.train_batch(0, 8, process_index=2, process_count=2)
    with pytest.raises(ValueError, match=">= 0"):
        gen.examples(np.array([-1, 2]))
    with pytest.raises(ValueError, match="1-D integer"):
        gen.examples(np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match="zipf_exponent"):
        SyntheticGenerator(dataclasses.replace(SMALL, zipf_exponent=-1.0), seed=0)


def test_eval_set_covers_each_held_out_example_once_and_is_disjoint_from_train(gen):
    n = SMALL.num_eval_examples
    batches = list(gen.eval_batches(256))
    assert len(batches) == gen.num_eval_batches(256) == 4
    assert all(b.batch_size == 256 for b in batches)
    merged = concat(batches)
    assert merged.weights_b.sum() == n
    np.testing.assert_array_equal(merged.weights_b, np.arange(4 * 256) < n)
    real = Batch(*(x[:n] for x in merged))
    assert_batches_equal(real, gen.examples(EVAL_INDEX_OFFSET + np.arange(n)))
    pads = Batch(*(x[n:] for x in merged))
    assert_batches_equal(pads, gen.schema.empty_batch(4 * 256 - n))

    # Two hosts: each yields the same number of batches; side by side they are the global ones.
    hosts = [list(gen.eval_batches(256, process_index=p, process_count=2)) for p in range(2)]
    assert len(hosts[0]) == len(hosts[1]) == 4
    for k in range(4):
        assert_batches_equal(concat([hosts[0][k], hosts[1][k]]), batches[k])

    # No held-out example repeats a training example (dense rows are a fingerprint).
    train = gen.examples(np.arange(2 * n))
    train_rows = {row.tobytes() for row in train.dense_bn}
    assert not any(row.tobytes() in train_rows for row in real.dense_bn)
    assert len({row.tobytes() for row in real.dense_bn}) == n


@pytest.mark.parametrize("pooling", ["fixed", "uniform"])
def test_batches_follow_schema_and_hotness(pooling):
    cfg = dataclasses.replace(SMALL, pooling=pooling)
    g = SyntheticGenerator(cfg, seed=1)
    b = g.train_batch(0, 2000)
    g.schema.validate(b)
    assert g.schema.dense_names == tuple(f"d{n}" for n in range(cfg.num_dense))
    assert [(f.name, f.vocab_size, f.max_hotness) for f in g.schema.features] == [
        (f"f{f}", v, h)
        for f, (v, h) in enumerate(zip(cfg.vocab_sizes, cfg.max_hotness, strict=True))
    ]
    assert set(np.unique(b.labels_b)) == {0.0, 1.0}
    np.testing.assert_array_equal(b.weights_b, 1.0)
    for f, (vocab, hot) in enumerate(zip(cfg.vocab_sizes, cfg.max_hotness, strict=True)):
        ids = b.ids_bfh[:, f]
        valid = ids != PAD_ID
        assert ids.max() < vocab and ids[valid].min() >= 0
        assert not valid[:, hot:].any()
        sizes = valid.sum(axis=1)
        # Left-aligned: the valid slots of every bag are exactly its first `size` slots.
        np.testing.assert_array_equal(valid, np.arange(ids.shape[1]) < sizes[:, None])
        if pooling == "fixed":
            np.testing.assert_array_equal(sizes, hot)
        else:
            counts = np.bincount(sizes, minlength=hot + 1)
            assert counts[0] == 0 and (counts[1:] > 2000 / hot * 0.8).all(), counts


def top_share(ids: np.ndarray, vocab: int, k: int) -> float:
    counts = np.bincount(ids[ids != PAD_ID], minlength=vocab)
    return np.sort(counts)[::-1][:k].sum() / counts.sum()


def test_zipf_skew_matches_theory():
    vocab, s = 1000, 1.1
    cfg = SyntheticConfig(vocab_sizes=(vocab,), max_hotness=(20,), pooling="fixed", zipf_exponent=s)
    ids = SyntheticGenerator(cfg, seed=0).train_batch(0, 5000).ids_bfh[:, 0]
    weights = np.arange(1, vocab + 1.0) ** -s
    expect = weights[:10].sum() / weights.sum()  # top 1% of rows: ~0.48
    assert expect > 0.45
    assert abs(top_share(ids, vocab, 10) - expect) < 0.01
    # Hot rows are spread over the table by the seeded permutation, not rows 0..9.
    counts = np.bincount(ids.ravel(), minlength=vocab)
    assert np.argsort(counts)[::-1][:10].max() > 10

    uniform = dataclasses.replace(cfg, zipf_exponent=0.0)
    counts = np.bincount(SyntheticGenerator(uniform, seed=0).train_batch(0, 10000).ids_bfh.ravel())
    assert counts.shape == (vocab,)
    mean = counts.mean()  # 200 per row; chi-square with 999 dof has std ~45
    assert ((counts - mean) ** 2 / mean).sum() < 1200


def test_alias_table_reproduces_probabilities():
    for s in (0.5, 1.1, 3.0):
        for vocab in (1, 2, 17, 5000):
            w = np.arange(1, vocab + 1.0) ** -s
            p = w / w.sum()
            prob, alias = counter_rng.alias_table(p)
            implied = prob.copy()
            np.add.at(implied, alias, 1.0 - prob)
            np.testing.assert_allclose(implied / vocab, p, rtol=0, atol=1e-12)


def test_large_tables_use_analytic_zipf_and_uncached_teacher(monkeypatch):
    cfg = SyntheticConfig(vocab_sizes=(1000, 30), max_hotness=(20, 2), pooling="fixed")
    exact = SyntheticGenerator(cfg, seed=5)
    # Teacher rows computed per lookup equal the precomputed ones, bitwise.
    monkeypatch.setattr(synthetic, "_CACHE_MAX_ROWS", 0)
    uncached = SyntheticGenerator(cfg, seed=5)
    assert uncached._cached_f.size == 0
    idx = np.arange(3000)
    np.testing.assert_array_equal(uncached.teacher_logits(idx), exact.teacher_logits(idx))
    assert_batches_equal(uncached.examples(idx), exact.examples(idx))
    # The analytic (continuous power law) sampler is close to the exact discrete law.
    monkeypatch.setattr(synthetic, "_ALIAS_MAX_ROWS", 0)
    analytic = SyntheticGenerator(cfg, seed=5)
    ids = analytic.train_batch(0, 5000).ids_bfh[:, 0]
    analytic.schema.validate(analytic.train_batch(0, 5000))
    x = np.array([10.5, 1000.5, 0.5]) ** -0.1
    expect = (x[2] - x[0]) / (x[2] - x[1])  # continuous CDF at rank 10: ~0.49
    assert abs(top_share(ids, 1000, 10) - expect) < 0.01
    # A table too big for an alias table still works in O(1) memory per table.
    huge = SyntheticGenerator(SyntheticConfig(vocab_sizes=(2**30,), max_hotness=(1,)), seed=0)
    b = huge.train_batch(0, 8000)
    huge.schema.validate(b)
    top = np.unique(b.ids_bfh, return_counts=True)[1].max() / 8000
    assert 0.10 < top < 0.135  # P(rank 0) of the continuous law on [0.5, 2**30 + 0.5): 0.118


def test_labels_follow_the_teacher(default_gen):
    cfg = default_gen.cfg
    idx = np.arange(20000)
    b = default_gen.examples(idx)
    z = default_gen.teacher_logits(idx)
    assert z.dtype == np.float64 and z.shape == (20000,)
    assert abs(b.labels_b.mean() - cfg.positive_rate) < 0.03
    assert roc_auc_score(b.labels_b, z) > 0.75
    rare = SyntheticGenerator(
        dataclasses.replace(cfg, positive_rate=0.05, interaction_order=3), seed=0
    )
    assert abs(rare.train_batch(0, 20000).labels_b.mean() - 0.05) < 0.01


def test_order_scales_are_logit_standard_deviations():
    idx = np.arange(30000)
    pair_only = SyntheticGenerator(SyntheticConfig(order_scales=(0.0, 2.0)), seed=0)
    assert pair_only.teacher_logits(idx).std() == pytest.approx(2.0, rel=0.05)
    linear_only = SyntheticGenerator(SyntheticConfig(order_scales=(3.0, 0.0)), seed=0)
    assert linear_only.teacher_logits(idx).std() == pytest.approx(3.0, rel=0.05)


def one_hot(b: Batch, vocab_sizes) -> sp.csr_matrix:
    num_b, num_f, _ = b.ids_bfh.shape
    offsets = np.concatenate([[0], np.cumsum(vocab_sizes)])
    rows, cols = [], []
    for f in range(num_f):
        r, h = np.nonzero(b.ids_bfh[:, f] != PAD_ID)
        rows.append(r)
        cols.append(b.ids_bfh[r, f, h] + offsets[f])
    rows, cols = np.concatenate(rows), np.concatenate(cols)
    x = sp.csr_matrix((np.ones(rows.shape[0]), (rows, cols)), shape=(num_b, offsets[-1]))
    return sp.hstack([x, sp.csr_matrix(b.dense_bn)]).tocsr()


@pytest.mark.parametrize("order", [1, 2])
def test_interactions_are_needed_to_reach_the_oracle(order):
    """A first-order model nearly matches a linear teacher but falls far short of a pairwise one."""
    cfg = SyntheticConfig(vocab_sizes=(100,) * 8, max_hotness=(1,) * 8, interaction_order=order)
    g = SyntheticGenerator(cfg, seed=0)
    train = g.train_batch(0, 20000)
    test_idx = EVAL_INDEX_OFFSET + np.arange(20000)
    test = g.examples(test_idx)
    model = LogisticRegression(max_iter=1000).fit(one_hot(train, cfg.vocab_sizes), train.labels_b)
    linear_auc = roc_auc_score(
        test.labels_b, model.decision_function(one_hot(test, cfg.vocab_sizes))
    )
    oracle_auc = roc_auc_score(test.labels_b, g.teacher_logits(test_idx))
    if order == 1:
        assert oracle_auc - 0.03 < linear_auc <= oracle_auc + 0.005
    else:
        assert oracle_auc > 0.8
        assert linear_auc < oracle_auc - 0.1


def test_higher_order_terms_are_sums_over_distinct_field_tuples():
    """t2..t4 (power sums, Newton's identities) equal the brute-force sums over all 2-, 3- and
    4-subsets of distinct fields of the product of their latent vectors, per example."""
    import itertools  # noqa: PLC0415

    cfg = dataclasses.replace(SMALL, interaction_order=4, order_scales=(1.0, 1.0, 1.0, 1.0))
    g = SyntheticGenerator(cfg, seed=5)
    feats = g._features(np.arange(64, dtype=np.int64))
    terms = g._raw_terms(feats)
    dense_bn, ids_bfh, n_bf, _ = feats
    dim = cfg.teacher_dim
    fields = []  # [M, B, D] field vectors: each bag's mean latent, then the dense projection
    for f in range(ids_bfh.shape[1]):
        rows = ids_bfh[:, f]
        params = g._row_params(f, np.where(rows >= 0, rows, 0)).astype(np.float64)
        params = np.where((rows >= 0)[..., None], params, 0.0)
        fields.append(params.sum(1)[:, :dim] / np.maximum(n_bf[:, f], 1)[:, None])
    fields.append(dense_bn.astype(np.float64) @ g._dense_proj_nd)
    v = np.stack(fields)
    for order in (2, 3, 4):
        brute = sum(
            np.prod(v[list(q)], axis=0).sum(-1)
            for q in itertools.combinations(range(v.shape[0]), order)
        )
        np.testing.assert_allclose(terms[order - 1], brute, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="interaction_order must be 1 to 4"):
        SyntheticConfig(interaction_order=5)


def test_source_reuses_the_held_out_set_and_still_checks_every_batch(monkeypatch):
    """A process's second run on one config reads the cached eval batches: the same batches as
    generating them, read-only, and each one still goes through the id guard."""
    from data import sources  # noqa: PLC0415
    from data.config import DataConfig  # noqa: PLC0415

    cfg = DataConfig(kind="synthetic", batch_size=64, eval_batch_size=300, synthetic=SMALL)
    sources._EVAL_CACHE.clear()
    first = list(sources.SyntheticSource(cfg).eval_batches())
    source = sources.SyntheticSource(cfg)
    calls = []
    guard = source._guard
    monkeypatch.setattr(
        source, "_guard", lambda b, where: calls.append(where) or guard(b, where=where)
    )
    monkeypatch.setattr(source._gen, "eval_batches", lambda *a, **k: pytest.fail("regenerated"))
    second = list(source.eval_batches())
    assert len(calls) == len(second) == len(first) == 4  # 1000 examples in batches of 300
    direct = SyntheticGenerator(SMALL, seed=0).eval_batches(300)
    for a, b, c in zip(first, second, direct, strict=True):
        assert_batches_equal(a, c)
        assert_batches_equal(b, c)
        assert not b.ids_bfh.flags.writeable
    other = dataclasses.replace(cfg, shuffle_seed=1)  # another dataset is generated, not reused
    assert not np.array_equal(
        next(sources.SyntheticSource(other).eval_batches()).labels_b, first[0].labels_b
    )


def test_capped_tables_fold_ids_and_count_them():
    """data.max_table_rows: the model's schema has capped tables, every id lands in them (by the
    id policy), the fold is counted per feature, and the teacher's labels are unchanged."""
    from data import sources  # noqa: PLC0415
    from data.config import DataConfig  # noqa: PLC0415
    from data.schemas import schema_of  # noqa: PLC0415

    cfg = DataConfig(
        kind="synthetic", batch_size=512, synthetic=SMALL, max_table_rows=20, id_policy="hash"
    )
    src = sources.SyntheticSource(cfg)
    assert [f.vocab_size for f in src.schema.features] == [1, 7, 20, 20]
    assert schema_of(cfg) == src.schema
    b = src.train_batch(0)
    full = sources.SyntheticSource(dataclasses.replace(cfg, max_table_rows=0)).train_batch(0)
    np.testing.assert_array_equal(b.labels_b, full.labels_b)
    for f, info in enumerate(src.schema.features):
        ids = b.ids_bfh[:, f]
        assert ids[ids != PAD_ID].max() < info.vocab_size
        np.testing.assert_array_equal(ids == PAD_ID, full.ids_bfh[:, f] == PAD_ID)
    mapped = src.stats["ids"]["mapped"]
    folded = [int((full.ids_bfh[:, f] >= 20).sum()) for f in range(4)]
    assert [mapped.get(f"f{f}", 0) for f in range(4)] == folded and folded[2] > 0
    with pytest.raises(ValueError, match="'hash' or 'modulo'"):
        DataConfig(kind="synthetic", max_table_rows=20)


def _loop_raw_terms(g: SyntheticGenerator, feats) -> np.ndarray:
    """The teacher terms as the generator computed them before they were vectorised: one field
    and one latent dim at a time (the reference ``_raw_terms`` and the C kernel must equal
    bitwise, so that data, and the trial ids and results of committed sweeps, do not change)."""
    dense_bn, ids_bfh, n_bf, _ = feats
    num_b, num_f = ids_bfh.shape[:2]
    dim, order = g.cfg.teacher_dim, g.cfg.interaction_order
    acc_pfb = np.zeros((dim + 1, num_f, num_b))
    for f in range(num_f):
        hot = int(g._hot[f])
        rows_hb = ids_bfh[:, f, :hot].T
        params_hbp = g._row_params(f, np.where(rows_hb >= 0, rows_hb, 0))
        params_hbp = np.where((rows_hb >= 0)[..., None], params_hbp, np.float32(0))
        part_pb = np.zeros((dim + 1, num_b), np.float32)
        for h in range(hot):
            part_pb += params_hbp[h].T
        acc_pfb[:, f] = part_pb
    acc_pfb /= np.maximum(n_bf, 1).T
    lin_b = np.zeros(num_b)
    fields = []
    for f in range(num_f):
        lin_b += acc_pfb[dim, f]
        fields.append(acc_pfb[:dim, f])
    if dense_bn.shape[1]:
        x_nb = dense_bn.T.astype(np.float64)
        v_db = np.zeros((dim, num_b))
        for n in range(x_nb.shape[0]):
            v_db += g._dense_proj_nd[n][:, None] * x_nb[n]
            lin_b += g._dense_w_n[n] * x_nb[n]
        fields.append(v_db)
    p1, p2, p3, p4 = (np.zeros((dim, num_b)) for _ in range(4))
    for v in fields:
        p1 += v
        p2 += v * v
        p3 += v * v * v
        p4 += (v * v) * (v * v)
    terms = np.zeros((4, num_b))
    terms[0] = lin_b
    for k in range(dim):
        a, b, c, d = p1[k], p2[k], p3[k], p4[k]
        if order >= 2:
            terms[1] += 0.5 * (a * a - b)
        if order >= 3:
            terms[2] += (a * a * a - 3.0 * a * b + 2.0 * c) / 6.0
        if order >= 4:
            aa = a * a
            terms[3] += (aa * aa - 6.0 * aa * b + 3.0 * b * b + 8.0 * a * c - 6.0 * d) / 24.0
    return terms


BITWISE_CONFIGS = [
    SMALL,
    dataclasses.replace(SMALL, pooling="fixed", num_dense=4),
    SyntheticConfig(num_dense=0, vocab_sizes=(5, 7000), max_hotness=(3, 1)),
    SyntheticConfig(
        num_dense=13, vocab_sizes=(100000, 20, 500, 10), max_hotness=(1, 5, 2, 1), teacher_dim=5
    ),
    SyntheticConfig(num_dense=3, vocab_sizes=(2**20 + 5, 7), max_hotness=(2, 1)),  # uncached
]
# Index sets: one example, an odd batch, a permutation, held-out examples.
BITWISE_INDICES = [
    np.array([0]),
    np.arange(10**6, 10**6 + 257),
    np.random.default_rng(1).permutation(300),
    EVAL_INDEX_OFFSET + np.arange(64),
]


@pytest.mark.parametrize("cfg", BITWISE_CONFIGS)
@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_generator_paths_agree_bitwise(cfg, order):
    """The vectorised numpy terms equal the per-field loops, and the C kernel (where it is
    built) equals the numpy path, bit for bit: every output of every example, at every order,
    batch size and index set, and therefore the calibration and the labels too."""
    cfg = dataclasses.replace(cfg, interaction_order=order, order_scales=(1.0,) * order)
    g = SyntheticGenerator(cfg, seed=7)
    numpy_g = SyntheticGenerator(cfg, seed=7)
    numpy_g._native = None
    assert numpy_g._bias == g._bias  # calibrated on the same terms
    for idx in BITWISE_INDICES:
        feats = numpy_g._features(idx.astype(np.int64))
        terms = numpy_g._raw_terms(feats)
        assert terms.tobytes() == _loop_raw_terms(numpy_g, feats).tobytes()
        if g._native is not None:
            for x, y in zip(g._generate(idx.astype(np.int64)), (*feats, terms), strict=True):
                assert x.dtype == y.dtype and x.shape == y.shape
                assert x.tobytes() == y.tobytes()
        assert_batches_equal(g.examples(idx), numpy_g.examples(idx))


def test_c_kernel_is_built_where_a_compiler_is():
    """Where a C compiler exists (CI has one), the kernel builds and covers the sweeps' data:
    cached, alias-sampled tables; the numpy path remains for tables beyond the caches."""
    if os.environ.get("RECSCALE_CPU_KERNELS") == "0" or not (
        os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    ):
        pytest.skip("no C compiler, or RECSCALE_CPU_KERNELS=0: the numpy path runs")
    from sweeps.specs.study import DATA  # noqa: PLC0415

    assert SyntheticGenerator(DATA.synthetic, seed=0)._native is not None
    huge = SyntheticConfig(vocab_sizes=(2**21, 10), max_hotness=(1, 1))
    assert SyntheticGenerator(huge, seed=0)._native is None
