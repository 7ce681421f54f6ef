"""Stateless synthetic CTR data with Zipf-skewed ids and labels from a planted teacher.

Every example is a pure function of ``(cfg, seed, index)``: nothing is carried between calls, so
the data of step ``s`` is the same whether training ran straight through or resumed at ``s``,
and any host can generate any slice of a global batch without talking to the others.

Shapes (dimension glossary): ``B`` batch, ``N`` dense features, ``F`` sparse features, ``H`` max
hotness (bag slots), ``D`` teacher latent dim, ``M`` teacher fields (``F`` bags plus one dense
field when ``N > 0``), ``V`` rows of one table.

Randomness (counter-based, no RNG state):
  * ``mix`` is the splitmix64 finaliser (``data.counter_rng``).
  * An example's key is ``mix(index * golden + seed_key)``; every random quantity of the example
    is ``mix(example_key ^ salt)`` where the salt is a fixed hash of (stream, feature, slot, ...):
    streams are dense values, bag sizes, ids, and the label. Teacher parameters of a table row
    are ``mix(mix(row * golden + salt(seed, feature)) ^ salt(j))``: a function of (seed, feature,
    row) only, never of the example.
  * A uint64 hash gives a uniform in [0, 1) or two standard normals (``data.counter_rng``).
  * Example indices ``[0, 2**62)`` are training data; ``EVAL_INDEX_OFFSET + j`` (``2**62 + j``)
    is held-out example ``j``; a third range (from ``3 * 2**61``) is a fixed calibration sample.
    Disjoint index ranges give distinct example keys (the key map is a bijection of the index).

Sparse features:
  * Bag size: ``pooling='fixed'`` always ``max_hotness_f``; ``'uniform'`` uniform on
    ``[1, max_hotness_f]``. Ids are left-aligned, ``PAD_ID`` after them and in every slot beyond
    ``max_hotness_f`` (the ``data.batch`` convention). Ids in a bag are drawn independently, so
    duplicates happen (often, for hot rows).
  * Id skew: a rank ``r`` (0-based) is drawn with ``P(r) ~ (r + 1)^-s``, ``s = zipf_exponent``
    (``s = 0``: uniform), then mapped to a row by a seeded affine bijection
    ``row = (a * r + b) mod V`` with ``gcd(a, V) = 1``, so hot rows are spread over the table.
    Tables of at most ``2**22`` rows sample ranks exactly with a Walker alias table (built
    vectorised at init, 16 bytes per row; O(1) per id). Larger tables invert the CDF of the
    continuous power law ``x^-s`` on ``[0.5, V + 0.5)`` analytically (O(1) memory), which matches
    the discrete law to ~10% on the first ranks (rank 0 is 1.1x as likely at s = 1.1) and
    closely beyond.

Teacher (the labels' ground truth):
  * Each (feature, row) has a latent ``u in R^D`` (normal, scaled ``1/sqrt(D)``) and a scalar
    weight ``w`` (normal). For tables of at most ``2**20`` rows these are precomputed at init
    (``4 (D + 1)`` bytes per row, same values); larger tables compute them per lookup.
  * Field vectors: each bag's ``v_f`` is the mean of its rows' latents; dense features add one
    field ``v_dense = dense @ P`` with a seeded ``P`` of variance ``1 / (N D)``.
  * Terms: ``t1 = sum_f mean_bag(w) + dense @ w_dense`` (first order);
    ``t2 = sum_{f<g} <v_f, v_g>`` (all field pairs); ``t3 = sum_{f<g<h} sum_k v_f[k] v_g[k] v_h[k]``
    (all field triples) and ``t4`` likewise over all field quadruples, via the power sums
    ``p_j = sum_f v_f^j`` (Newton's identities): ``e2 = (p1^2 - p2) / 2``,
    ``e3 = (p1^3 - 3 p1 p2 + 2 p3) / 6``, ``e4 = (p1^4 - 6 p1^2 p2 + 3 p2^2 + 8 p1 p3 - 6 p4) / 24``
    per latent dimension, so the cost is O(M D).
  * ``logit = bias + sum_{o < interaction_order} order_scales[o] * t_{o+1} / std(t_{o+1})``: each
    term is scaled to unit standard deviation (estimated once at init on a fixed sample of
    16,384 examples), so ``order_scales`` are the terms' standard deviations in logit units. The
    bias is found by bisection on that sample so that ``mean(sigmoid(logit)) = positive_rate``.
  * ``label = 1`` iff ``uniform(example, label stream) < sigmoid(logit)``: Bernoulli labels whose
    Bayes-optimal predictor is the teacher logit itself.

What is learnable: the oracle (the teacher logit) reaches ROC AUC ~0.86 with the default
``SyntheticConfig`` (0.855-0.860 over seeds 0-2; ~0.88 with ``interaction_order=3``;
``tests/data/test_synthetic.py`` checks > 0.75). With ``interaction_order >= 2`` most of the
signal is invisible to a first-order model: logistic regression on one-hot ids and dense
features reaches ~0.70 where the oracle reaches 0.86 (8 tables of 100 rows, 20k examples), while
for an order-1 teacher it comes within 0.03 of the oracle. So interaction layers (DLRM's dot
products, Wukong's FM blocks) measurably help, and order 3 rewards higher-order crosses. Unlike
DLRM's random-label generator, labels here carry signal.

Determinism: within one machine, batches are bitwise equal however the indices are batched
(reductions over slots, fields and latent dims run in a fixed order, and no BLAS is used). The
label's ``sigmoid``, the init-time tables and calibration, and the analytic Zipf inverse use
libm/numpy transcendentals, which may differ in the last ulp between CPUs or numpy builds; that
could flip a label or id with probability of order 1e-15 per value.

Cost: a C kernel (``synthetic_kernel.c``, built with the system C compiler on first use,
``data/_native.py``) computes ids, dense values and teacher terms in one loop per example when
every table is alias-sampled and teacher-cached (at most 2**20 rows, as in every sweep spec);
it gives the numpy path's bits exactly, releases the GIL, and is 2-3x faster than it
(``benchmarks/synthetic_data.py``: ~0.6 us per example for the showcase's data, ~1.9 us for the
study's 26-feature order-4 teacher, on a 2-core VM). The numpy path (vectorised over the batch,
single-threaded, no jax) covers everything else and is the reference: per 4096 examples ~3 ms at
the default config (13 dense, 8 one-hot features of 1000 rows); ~90 ms with 26 features of
max_hotness 20 (2 M ids); ~0.25 s with the Criteo Terabyte sizes at max_hotness 20 (six tables
too large to cache the teacher). Since examples do not depend on how indices are batched, a
caller may split a batch over threads or worker processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from data import _native
from data import counter_rng as rng
from data.batch import PAD_ID, Batch, FeatureInfo, Schema
from data.config import SyntheticConfig

EVAL_INDEX_OFFSET = 2**62
"""Held-out example ``j`` is example index ``EVAL_INDEX_OFFSET + j``; training uses ``[0, 2**62)``."""
_CALIBRATION_INDEX_OFFSET = 3 * 2**61
_CALIBRATION_SIZE = 16384
_MAX_EVAL_EXAMPLES = 2**61  # keeps the eval range below the calibration range

_ALIAS_MAX_ROWS = 2**22  # tables up to this size sample ranks exactly (alias table)
_CACHE_MAX_ROWS = 2**20  # tables up to this size precompute teacher row parameters

# Stream ids, mixed into every salt so the streams are independent.
_S_SEED, _S_DENSE, _S_BAG, _S_ID, _S_LABEL, _S_ROW, _S_ROWPARAM, _S_TEACHER, _S_PERM = range(1, 10)

_MAX_ORDER = 4  # highest teacher interaction order (SyntheticConfig.interaction_order)


def synthetic_schema(cfg: SyntheticConfig) -> Schema:
    """Dense features ``d0..``, sparse features ``f0..`` with the config's sizes."""
    return Schema(
        dense_names=tuple(f"d{n}" for n in range(cfg.num_dense)),
        features=tuple(
            FeatureInfo(name=f"f{f}", vocab_size=int(v), max_hotness=int(h))
            for f, (v, h) in enumerate(zip(cfg.vocab_sizes, cfg.max_hotness, strict=True))
        ),
    )


class SyntheticGenerator:
    """Index-based synthetic CTR examples with a planted teacher (see the module docstring).

    Args:
        cfg: Table sizes, hotness, skew and teacher settings.
        seed: Seed of everything: ids, dense values, teacher parameters and labels.
    """

    def __init__(self, cfg: SyntheticConfig, seed: int):
        if not cfg.vocab_sizes:
            raise ValueError("SyntheticConfig needs at least one sparse feature (vocab_sizes)")
        if cfg.pooling not in ("fixed", "uniform"):
            raise ValueError(f"pooling must be 'fixed' or 'uniform', got {cfg.pooling!r}")
        if cfg.num_dense < 0:
            raise ValueError(f"num_dense must be >= 0, got {cfg.num_dense}")
        if not (math.isfinite(cfg.zipf_exponent) and cfg.zipf_exponent >= 0):
            raise ValueError(f"zipf_exponent must be finite and >= 0, got {cfg.zipf_exponent}")
        if cfg.teacher_dim < 1:
            raise ValueError(f"teacher_dim must be >= 1, got {cfg.teacher_dim}")
        if not 0 <= cfg.num_eval_examples <= _MAX_EVAL_EXAMPLES:
            raise ValueError(
                f"num_eval_examples must be in [0, 2**61], got {cfg.num_eval_examples}"
            )
        for f, v in enumerate(cfg.vocab_sizes):
            if not 1 <= v < 2**31:
                raise ValueError(f"vocab_sizes[{f}] = {v} must be in [1, 2**31) (int32 ids)")
        self.cfg = cfg
        self.seed = int(seed)
        self.schema = synthetic_schema(cfg)
        s = self.seed
        num_f, num_n, dim = self.schema.num_sparse, cfg.num_dense, cfg.teacher_dim
        self._vocab = np.array(cfg.vocab_sizes, np.int64)
        self._hot = np.array(cfg.max_hotness, np.int64)
        self._seed_key = np.uint64(rng.salt(_S_SEED, s))
        self._dense_salts = np.array(
            [rng.salt(_S_DENSE, s, j) for j in range((num_n + 1) // 2)], np.uint64
        )
        self._bag_salts = np.array([rng.salt(_S_BAG, s, f) for f in range(num_f)], np.uint64)
        self._label_salt = np.uint64(rng.salt(_S_LABEL, s))
        # Slot pairs (f, h) with h < max_hotness_f, flattened: axis S of the id computation.
        self._slot_f = np.repeat(np.arange(num_f), self._hot)
        self._slot_h = np.concatenate([np.arange(h) for h in self._hot])
        self._slot_salts = np.array(
            [rng.salt(_S_ID, s, f, h) for f, h in zip(self._slot_f, self._slot_h, strict=True)],
            np.uint64,
        )
        self._row_salts = [np.uint64(rng.salt(_S_ROW, s, f)) for f in range(num_f)]
        self._param_salts = np.array(
            [rng.salt(_S_ROWPARAM, j) for j in range((dim + 2) // 2)], np.uint64
        )

        # Zipf samplers: alias tables (concatenated over features) for small tables, analytic
        # otherwise. Rows are stored already permuted: own rows, then alias rows, in one array.
        self._perm = []
        thr, own, alt = [], [], []
        alias_off = np.zeros(num_f, np.uint64)
        total = 0
        for f, v in enumerate(cfg.vocab_sizes):
            a = rng.coprime_multiplier(v, rng.salt(_S_PERM, s, f, 0))
            b = rng.salt(_S_PERM, s, f, 1) % v
            self._perm.append((a, b))
            if v <= _ALIAS_MAX_ROWS:
                ranks = np.arange(v, dtype=np.int64)
                if cfg.zipf_exponent == 0:
                    prob, alias = np.ones(v), ranks
                else:
                    w = np.power(ranks + 1.0, -cfg.zipf_exponent)
                    prob, alias = rng.alias_table(w / w.sum())
                thr.append(np.round(prob * 2.0**32).astype(np.uint64))
                own.append(((a * ranks + b) % v).astype(np.int32))
                alt.append(((a * alias + b) % v).astype(np.int32))
                alias_off[f] = total
                total += v
        self._alias_total = np.uint64(total)
        self._alias_thr = np.concatenate(thr) if thr else np.zeros(0, np.uint64)
        self._alias_rows = np.concatenate(own + alt) if own else np.zeros(0, np.int32)
        is_alias = self._vocab <= _ALIAS_MAX_ROWS
        self._alias_cols = np.flatnonzero(is_alias[self._slot_f])
        self._analytic_cols = np.flatnonzero(~is_alias[self._slot_f])
        self._alias_slot_v = self._vocab[self._slot_f[self._alias_cols]].astype(np.uint64)
        self._alias_slot_off = alias_off[self._slot_f[self._alias_cols]]
        # Slot pair s sits at flat position f * H + h of ids_bfh; a plain reshape when all
        # features share one max_hotness.
        self._slot_pos = self._slot_f * self.schema.max_hotness + self._slot_h

        # Teacher parameters of tables up to _CACHE_MAX_ROWS rows, concatenated: [D + 1, rows].
        cached = self._vocab <= _CACHE_MAX_ROWS
        self._cached_f = np.flatnonzero(cached)
        self._uncached_f = np.flatnonzero(~cached)
        # Each cached table is preceded by a zero row, so id + offset maps PAD_ID (-1) to it.
        self._cache_off = np.concatenate([[1], np.cumsum(self._vocab[cached] + 1) + 1])[:-1]
        zero_row = np.zeros((1, dim + 1), np.float32)
        self._cache_pr = np.ascontiguousarray(
            np.concatenate(
                [
                    x
                    for f in self._cached_f
                    for x in (zero_row, self._row_params(int(f), np.arange(self._vocab[f])))
                ]
                or [zero_row]
            ).T
        )  # [D + 1, rows]
        hot_c = self._hot[cached]
        # Per slot h, the cached features (positions in _cached_f) that have it; None = all.
        self._cached_by_h = [
            None if (hot_c > h).all() else np.flatnonzero(hot_c > h)
            for h in range(int(hot_c.max(initial=0)))
        ]
        num_g = num_n * (dim + 1)
        h = rng.mix(
            np.uint64(rng.salt(_S_TEACHER, s)) ^ np.arange((num_g + 1) // 2, dtype=np.uint64)
        )
        g = rng.normals(h)[:num_g].reshape(num_n, dim + 1)
        self._dense_proj_nd = g[:, :dim] / math.sqrt(max(num_n, 1) * dim)
        self._dense_w_n = g[:, dim] / math.sqrt(max(num_n, 1))

        self._native = self._native_args()

        # Calibration: unit-variance terms and the bias that gives positive_rate.
        self._term_scales = np.zeros(_MAX_ORDER)
        self._bias = 0.0
        *_, terms = self._generate(
            _CALIBRATION_INDEX_OFFSET + np.arange(_CALIBRATION_SIZE, dtype=np.int64)
        )
        for o in range(cfg.interaction_order):
            std = float(np.std(terms[o]))
            self._term_scales[o] = cfg.order_scales[o] / std if std > 1e-12 else 0.0
        z = self._combine(terms)
        lo_b, hi_b = -60.0, 60.0
        for _ in range(100):
            mid = 0.5 * (lo_b + hi_b)
            if np.mean(_sigmoid(z + mid)) < cfg.positive_rate:
                lo_b = mid
            else:
                hi_b = mid
        self._bias = 0.5 * (lo_b + hi_b)

    # ----------------------------------------------------------------------------- public API

    def examples(self, indices: np.ndarray) -> Batch:
        """The examples at int64 ``indices`` (weights 1), a pure function of (cfg, seed, index).

        Training examples are ``[0, 2**62)``; held-out example ``j`` is ``EVAL_INDEX_OFFSET + j``.
        """
        idx = self._check_indices(indices)
        dense_bn, ids_bfh, _, keys_b, terms = self._generate(idx)
        logit_b = self._combine(terms)
        u_b = rng.uniform(rng.mix(keys_b ^ self._label_salt))
        labels_b = (u_b < _sigmoid(logit_b)).astype(np.float32)
        return Batch(
            dense_bn=dense_bn,
            ids_bfh=ids_bfh,
            labels_b=labels_b,
            weights_b=np.ones(idx.shape[0], np.float32),
        )

    def teacher_logits(self, indices: np.ndarray) -> np.ndarray:
        """float64 [B]: the planted teacher's logit of each example (the Bayes-optimal score)."""
        idx = self._check_indices(indices)
        return self._combine(self._generate(idx)[-1])

    def train_batch(
        self, step: int, batch_size: int, *, process_index: int = 0, process_count: int = 1
    ) -> Batch:
        """This host's slice of global training batch ``step``.

        The global batch covers example indices ``[step * batch_size, (step + 1) * batch_size)``;
        host ``process_index`` gets the contiguous ``1 / process_count`` part of it.
        """
        local = _local_size(batch_size, process_index, process_count)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = step * batch_size + process_index * local
        if start + local > EVAL_INDEX_OFFSET:
            raise ValueError(
                f"step {step} x batch_size {batch_size} runs past 2**62 training examples"
            )
        return self.examples(np.arange(start, start + local, dtype=np.int64))

    def num_eval_batches(self, batch_size: int) -> int:
        """How many batches ``eval_batches(batch_size)`` yields (on every host)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return -(-self.cfg.num_eval_examples // batch_size)

    def eval_batches(
        self, batch_size: int, *, process_index: int = 0, process_count: int = 1
    ) -> Iterator[Batch]:
        """The held-out set, each of its ``cfg.num_eval_examples`` examples exactly once.

        Global batch ``k`` holds eval examples ``[k * batch_size, (k + 1) * batch_size)``, this
        host its contiguous ``1 / process_count`` part; positions past the end are weight-0
        padding (``Schema.empty_batch``), so every batch has the same shape on every host.
        """
        local = _local_size(batch_size, process_index, process_count)
        return self._eval_iter(batch_size, local, process_index)

    # ----------------------------------------------------------------------------- internals

    def _eval_iter(self, batch_size: int, local: int, process_index: int) -> Iterator[Batch]:
        n = self.cfg.num_eval_examples
        for k in range(self.num_eval_batches(batch_size)):
            start = k * batch_size + process_index * local
            stop = min(start + local, n)
            real = np.arange(start, max(start, stop), dtype=np.int64)
            batch = self.examples(EVAL_INDEX_OFFSET + real)
            if real.shape[0] < local:
                pad = self.schema.empty_batch(local - real.shape[0])
                batch = Batch(*(np.concatenate([a, p]) for a, p in zip(batch, pad, strict=True)))
            yield batch

    @staticmethod
    def _check_indices(indices: np.ndarray) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
            raise ValueError(
                f"indices must be a 1-D integer array, got shape {idx.shape} {idx.dtype}"
            )
        idx = idx.astype(np.int64)
        if idx.size and idx.min() < 0:
            raise ValueError(f"indices must be >= 0, got {int(idx.min())}")
        return idx

    def _native_args(self) -> tuple | None:
        """The C kernel and its table arguments, when it covers this config: every table
        alias-sampled and teacher-cached (at most 2**20 rows), latent dim at most 64."""
        fn = _native.load()
        if (
            fn is None
            or self._analytic_cols.size
            or self._uncached_f.size
            or self.cfg.teacher_dim > 64
        ):
            return None
        lo, step = rng.normal_tables()
        keep = (  # the kernel's table arguments (``_native.run``), kept alive with the pointers
            self._dense_salts,
            lo,
            step,
            self._hot,
            self._bag_salts,
            self._slot_f,
            self._slot_h,
            self._slot_salts,
            self._alias_slot_v,
            self._alias_slot_off,
            self._alias_thr,
            self._alias_rows,
            np.ascontiguousarray(self._cache_pr.T),
            self._cache_off,
            np.ascontiguousarray(self._dense_proj_nd),
            np.ascontiguousarray(self._dense_w_n),
        )
        assert all(a.flags.c_contiguous for a in keep)
        return fn, keep

    def _generate(self, idx_b: np.ndarray):
        """Dense values, ids, bag sizes, example keys and raw teacher terms of ``idx_b``: the C
        kernel where it covers the config, else numpy (the same bits either way)."""
        if self._native is None:
            feats = self._features(idx_b)
            return (*feats, self._raw_terms(feats))
        fn, keep = self._native
        return _native.run(
            fn,
            keep,
            idx_b,
            seed_key=int(self._seed_key),
            num_dense=self.cfg.num_dense,
            max_hotness=self.schema.max_hotness,
            uniform_pooling=self.cfg.pooling == "uniform",
            alias_total=int(self._alias_total),
            teacher_dim=self.cfg.teacher_dim,
            interaction_order=self.cfg.interaction_order,
            num_orders=_MAX_ORDER,
        )

    def _row_params(self, f: int, rows: np.ndarray) -> np.ndarray:
        """float32 [..., D + 1]: latent (scaled 1/sqrt(D)) and linear weight of table rows."""
        dim = self.cfg.teacher_dim
        base = rng.mix(rows.astype(np.uint64) * rng.U64_GOLDEN + self._row_salts[f])
        g = rng.normals(rng.mix(base[..., None] ^ self._param_salts))[..., : dim + 1]
        g[..., :dim] *= 1.0 / math.sqrt(dim)
        return g.astype(np.float32)

    def _features(self, idx_b: np.ndarray):
        """Dense values, ids, bag sizes and example keys of examples ``idx_b``."""
        num_b = idx_b.shape[0]
        num_f, num_h = self.schema.num_sparse, self.schema.max_hotness
        keys_b = rng.mix(idx_b.astype(np.uint64) * rng.U64_GOLDEN + self._seed_key)
        if self.cfg.num_dense:
            h = rng.mix(keys_b[:, None] ^ self._dense_salts)
            dense_bn = rng.normals(h)[:, : self.cfg.num_dense].astype(np.float32)
        else:
            dense_bn = np.zeros((num_b, 0), np.float32)
        if self.cfg.pooling == "fixed":
            n_bf = np.broadcast_to(self._hot, (num_b, num_f))
        else:
            hb = rng.mix(keys_b[:, None] ^ self._bag_salts) >> np.uint64(32)
            n_bf = ((hb * self._hot.astype(np.uint64)) >> np.uint64(32)).astype(np.int64) + 1
        # Ids of every slot pair (f, h < max_hotness_f), axis S.
        h_bs = rng.mix(keys_b[:, None] ^ self._slot_salts)
        all_alias = self._analytic_cols.size == 0
        if all_alias:
            rows_bs = self._alias_ids(h_bs)
        else:
            rows_bs = np.empty(h_bs.shape, np.int32)
            if self._alias_cols.size:
                rows_bs[:, self._alias_cols] = self._alias_ids(h_bs[:, self._alias_cols])
            for f in np.unique(self._slot_f[self._analytic_cols]):
                cols = self._analytic_cols[self._slot_f[self._analytic_cols] == f]
                rows_bs[:, cols] = self._analytic_rows(int(f), rng.uniform(h_bs[:, cols]))
        if self._slot_pos.shape[0] == num_f * num_h:  # every feature has H slots
            valid_bfh = np.arange(num_h) < n_bf[:, :, None]
            ids_bfh = np.where(valid_bfh, rows_bs.reshape(num_b, num_f, num_h), np.int32(PAD_ID))
        else:
            valid_bs = self._slot_h < n_bf[:, self._slot_f]
            ids_bfh = np.full((num_b, num_f * num_h), PAD_ID, np.int32)
            ids_bfh[:, self._slot_pos] = np.where(valid_bs, rows_bs, PAD_ID)
            ids_bfh = ids_bfh.reshape(num_b, num_f, num_h)
        return dense_bn, ids_bfh, n_bf, keys_b

    def _alias_ids(self, h: np.ndarray) -> np.ndarray:
        """int32 rows of alias-sampled slots: column from the high 32 bits, coin from the low."""
        col = ((h >> np.uint64(32)) * self._alias_slot_v) >> np.uint64(32)
        col += self._alias_slot_off
        use_alias = (h & rng.U64_MASK32) >= self._alias_thr[col]
        return self._alias_rows[col + use_alias * self._alias_total]

    def _analytic_rows(self, f: int, u: np.ndarray) -> np.ndarray:
        """Rows from uniforms by inverting the continuous power law on [0.5, V + 0.5)."""
        v = int(self._vocab[f])
        t = 1.0 - self.cfg.zipf_exponent
        log_ratio = math.log((v + 0.5) / 0.5)
        if abs(t) < 1e-9:
            x = 0.5 * np.exp(u * log_ratio)
        else:
            x = 0.5 * np.exp(np.log1p(u * math.expm1(t * log_ratio)) / t)
        rank = np.clip(np.floor(x - 0.5), 0, v - 1).astype(np.int64)
        a, b = self._perm[f]
        return (a * rank + b) % v

    def _raw_terms(self, feats) -> np.ndarray:
        """float64 [4, B]: unnormalised first- to fourth-order teacher terms (the orders above
        ``interaction_order`` are left zero).

        Vectorised over fields and latent dims; every sum over fields, dense features or latent
        dims is taken one slice after another (``_sum_leading``; no numpy reduction, whose
        pairwise summation would depend on the array's shape, no BLAS), and each elementwise
        expression keeps the operation order of the per-dim formula, so the result does not
        depend on the batch size and equals the per-field loops it replaced bitwise
        (``tests/data/test_synthetic.py`` keeps them as the reference).
        """
        dense_bn, ids_bfh, n_bf, _ = feats
        num_b, num_f = ids_bfh.shape[:2]
        dim, order = self.cfg.teacher_dim, self.cfg.interaction_order
        # Batch-last layout [F, P, B] (P = D + 1 row parameters, the latent then the weight).
        acc_fpb = np.zeros((num_f, dim + 1, num_b))
        if self._cached_f.size:
            all_cached = self._cached_f.size == num_f
            ids_bch = ids_bfh if all_cached else ids_bfh[:, self._cached_f]
            idx_hcb = ids_bch.transpose(2, 1, 0) + self._cache_off[:, None]
            part_pcb = np.zeros((dim + 1, self._cached_f.size, num_b), np.float32)
            for h, sel in enumerate(self._cached_by_h):  # float32 sums over slots, in order
                if sel is None:
                    part_pcb += np.take(self._cache_pr, idx_hcb[h], axis=1)
                else:
                    part_pcb[:, sel] += np.take(self._cache_pr, idx_hcb[h][sel], axis=1)
            acc_fpb[self._cached_f] = part_pcb.transpose(1, 0, 2)
        for f in self._uncached_f:
            hot = int(self._hot[f])
            rows_hb = ids_bfh[:, f, :hot].T
            valid_hb = rows_hb >= 0
            params_hbp = self._row_params(int(f), np.where(valid_hb, rows_hb, 0))
            params_hbp = np.where(valid_hb[..., None], params_hbp, np.float32(0))
            part_pb = np.zeros((dim + 1, num_b), np.float32)
            for h in range(hot):
                part_pb += params_hbp[h].T
            acc_fpb[f] = part_pb
        acc_fpb /= np.maximum(n_bf, 1).T[:, None, :]
        # First order: the bags' mean weights, then the dense features' terms, summed in order.
        # Field vectors [M, D, B]: each bag's mean latent, then the dense field.
        if dense_bn.shape[1]:
            x_nb = dense_bn.T.astype(np.float64)
            v_db = _sum_leading(self._dense_proj_nd[:, :, None] * x_nb[:, None, :])
            lin_b = _sum_leading(np.concatenate([acc_fpb[:, dim], self._dense_w_n[:, None] * x_nb]))
            v_mdb = np.concatenate([acc_fpb[:, :dim], v_db[None]])
        else:
            lin_b = _sum_leading(acc_fpb[:, dim])
            v_mdb = np.ascontiguousarray(acc_fpb[:, :dim])
        terms = np.zeros((_MAX_ORDER, num_b))
        terms[0] = lin_b
        if order < 2:
            return terms
        a = _sum_leading(v_mdb)  # power sums p1..p4, [D, B]
        sq_mdb = v_mdb * v_mdb
        b = _sum_leading(sq_mdb)
        terms[1] = _sum_leading(0.5 * (a * a - b))
        if order >= 3:
            c = _sum_leading(sq_mdb * v_mdb)
            terms[2] = _sum_leading((a * a * a - 3.0 * a * b + 2.0 * c) / 6.0)
        if order >= 4:  # Newton's identity for e4
            d = _sum_leading(sq_mdb * sq_mdb)
            aa = a * a
            terms[3] = _sum_leading(
                (aa * aa - 6.0 * aa * b + 3.0 * b * b + 8.0 * a * c - 6.0 * d) / 24.0
            )
        return terms

    def _combine(self, terms: np.ndarray) -> np.ndarray:
        z = np.full(terms.shape[1], self._bias)
        for o in range(self.cfg.interaction_order):
            z += self._term_scales[o] * terms[o]
        return z


def _sum_leading(x: np.ndarray) -> np.ndarray:
    """``x[0] + x[1] + ...`` over the leading axis, added in that order from zero (float64)."""
    out = np.zeros(x.shape[1:])
    for x_i in x:
        out += x_i
    return out


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _local_size(batch_size: int, process_index: int, process_count: int) -> int:
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(
            f"process_index {process_index} must be in [0, process_count={process_count})"
        )
    if batch_size < 1 or batch_size % process_count:
        raise ValueError(
            f"batch_size {batch_size} must be a positive multiple of process_count {process_count}"
        )
    return batch_size // process_count
