/* The synthetic generator's per-example work in one pass (data/synthetic.py, ``_native.py``).

   It computes, for examples whose tables are all alias-sampled and teacher-cached (every
   table of at most 2**20 rows), exactly what SyntheticGenerator._features and ._raw_terms
   compute with numpy, bit for bit: the same integer hashing, the same float64 operations in
   the same order (a left fold from zero for every sum), compiled without fast-math and
   without floating-point contraction (-ffp-contract=off), so each operation is one IEEE
   rounding, as numpy's elementwise ufuncs are. The label's sigmoid (libm tanh) and the
   combination of the terms stay in numpy. tests/data/test_synthetic.py compares the two
   paths bitwise.

   Why C: the numpy path runs ~100 array operations per batch over [fields, dims, batch]
   temporaries; at a study's batch of 256 their dispatch dominates, and at any batch the
   temporaries go through memory. One loop per example keeps everything in registers and L1.
   ctypes releases the GIL for the call, so the prefetch threads run it in parallel. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DIM 64
#define PREFETCH 4

static inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

static inline double normal_u32(uint64_t x, const double* lo, const double* step) {
  uint64_t i = x >> 16;
  double frac = (double)(x & 0xFFFFULL) * (1.0 / 65536.0);
  double t = frac * step[i];
  return lo[i] + t;
}

/* Returns 0, -1 when the latent dim exceeds MAX_DIM, or -2 when scratch memory cannot be
   allocated (the scratch that grows with the fields and dense features is on the heap, not on
   a prefetch thread's stack). */
int recscale_synth(
    int64_t num_b, const int64_t* idx_b, uint64_t seed_key,
    /* dense features */
    int64_t num_n, const uint64_t* dense_salts, const double* knot_lo, const double* knot_step,
    /* bags */
    int64_t num_f, int64_t num_h, const int64_t* hot_f, const uint64_t* bag_salts,
    int32_t uniform_pooling,
    /* ids: slot s = (slot_f[s], slot_h[s]), features in order, h < hot_f */
    int64_t num_s, const int64_t* slot_f, const int64_t* slot_h, const uint64_t* slot_salts,
    const uint64_t* slot_v, const uint64_t* slot_off, const uint64_t* alias_thr,
    const int32_t* alias_rows, uint64_t alias_total,
    /* teacher: cached row parameters [rows, dim + 1] row-major, table f starts at cache_off[f]
       (its row cache_off[f] - 1 is zeros, the PAD row) */
    int64_t dim, const float* cache_rp, const int64_t* cache_off, const double* proj_nd,
    const double* w_n, int32_t order,
    /* outputs */
    float* dense_bn, int32_t* ids_bfh, int64_t* n_bf, double* terms_ob, uint64_t* keys_b) {
  if (dim > MAX_DIM) return -1;
  const int64_t p = dim + 1;
  float part_p[MAX_DIM + 1];
  double* acc_fp = malloc(sizeof(double) * (size_t)((num_f + 1) * p + num_n + 1));
  if (acc_fp == NULL) return -2;
  double* x_n = acc_fp + (num_f + 1) * p;
  for (int64_t bi = 0; bi < num_b; ++bi) {
    const uint64_t key = mix((uint64_t)idx_b[bi] * 0x9E3779B97F4A7C15ULL + seed_key);
    keys_b[bi] = key;
    /* Dense values: two normals per hash, the high half first. */
    for (int64_t j = 0; 2 * j < num_n; ++j) {
      const uint64_t h = mix(key ^ dense_salts[j]);
      dense_bn[bi * num_n + 2 * j] = (float)normal_u32(h >> 32, knot_lo, knot_step);
      if (2 * j + 1 < num_n)
        dense_bn[bi * num_n + 2 * j + 1] =
            (float)normal_u32(h & 0xFFFFFFFFULL, knot_lo, knot_step);
    }
    /* Bag sizes. */
    int64_t* n_f = n_bf + bi * num_f;
    for (int64_t f = 0; f < num_f; ++f) {
      if (uniform_pooling) {
        const uint64_t hb = mix(key ^ bag_salts[f]) >> 32;
        n_f[f] = (int64_t)((hb * (uint64_t)hot_f[f]) >> 32) + 1;
      } else {
        n_f[f] = hot_f[f];
      }
    }
    /* Ids: PAD everywhere, then each slot below its bag's size. */
    int32_t* ids = ids_bfh + bi * num_f * num_h;
    for (int64_t k = 0; k < num_f * num_h; ++k) ids[k] = -1;
    for (int64_t s = 0; s < num_s; ++s) {
      const int64_t f = slot_f[s], h = slot_h[s];
      if (h >= n_f[f]) continue;
      const uint64_t hs = mix(key ^ slot_salts[s]);
      const uint64_t col = (((hs >> 32) * slot_v[s]) >> 32) + slot_off[s];
      const uint64_t use_alias = (hs & 0xFFFFFFFFULL) >= alias_thr[col] ? 1 : 0;
      ids[f * num_h + h] = alias_rows[col + use_alias * alias_total];
    }
  }
  /* Second pass, the teacher. Its reads of cached row parameters are random over tables of up
     to 2**20 rows, so the rows of example bi + PREFETCH are requested while bi is computed. */
  for (int64_t bi = 0; bi < num_b; ++bi) {
    if (bi + PREFETCH < num_b) {
      const int32_t* ahead = ids_bfh + (bi + PREFETCH) * num_f * num_h;
      for (int64_t f = 0; f < num_f; ++f)
        for (int64_t h = 0; h < hot_f[f]; ++h)
          __builtin_prefetch(cache_rp + (cache_off[f] + ahead[f * num_h + h]) * p);
    }
    const int32_t* ids = ids_bfh + bi * num_f * num_h;
    const int64_t* n_f = n_bf + bi * num_f;
    /* Each bag's float32 sum over its slots (PAD adds the zero row), as float64, divided by
       the bag size. */
    for (int64_t f = 0; f < num_f; ++f) {
      for (int64_t q = 0; q < p; ++q) part_p[q] = 0.0f;
      for (int64_t h = 0; h < hot_f[f]; ++h) {
        const float* row = cache_rp + (cache_off[f] + ids[f * num_h + h]) * p;
        for (int64_t q = 0; q < p; ++q) part_p[q] += row[q];
      }
      if (n_f[f] > 1) {
        const double n = (double)n_f[f];
        for (int64_t q = 0; q < p; ++q) acc_fp[f * p + q] = (double)part_p[q] / n;
      } else { /* x / 1 is x exactly: skip the division (most bags hold one id) */
        for (int64_t q = 0; q < p; ++q) acc_fp[f * p + q] = (double)part_p[q];
      }
    }
    double lin = 0.0;
    for (int64_t f = 0; f < num_f; ++f) lin += acc_fp[f * p + dim];
    int64_t num_m = num_f;
    if (num_n > 0) {
      for (int64_t n = 0; n < num_n; ++n) x_n[n] = (double)dense_bn[bi * num_n + n];
      double* v_dense = acc_fp + num_f * p; /* the dense field, after the bags */
      for (int64_t d = 0; d < dim; ++d) v_dense[d] = 0.0;
      for (int64_t n = 0; n < num_n; ++n) { /* n outer, d inner: one sum per d, in n order */
        for (int64_t d = 0; d < dim; ++d) {
          const double t = proj_nd[n * dim + d] * x_n[n];
          v_dense[d] += t;
        }
      }
      for (int64_t n = 0; n < num_n; ++n) {
        const double t = w_n[n] * x_n[n];
        lin += t;
      }
      num_m = num_f + 1;
    }
    /* Power sums over fields, fields outer and dims inner (each dim's sum in field order). */
    double a_d[MAX_DIM], b_d[MAX_DIM], c_d[MAX_DIM], e_d[MAX_DIM];
    for (int64_t d = 0; d < dim; ++d) a_d[d] = b_d[d] = c_d[d] = e_d[d] = 0.0;
    for (int64_t m = 0; m < num_m; ++m) {
      const double* v_d = acc_fp + m * p;
      for (int64_t d = 0; d < dim; ++d) {
        const double v = v_d[d];
        const double sq = v * v;
        const double cu = sq * v;
        const double qu = sq * sq;
        a_d[d] += v;
        b_d[d] += sq;
        c_d[d] += cu;
        e_d[d] += qu;
      }
    }
    double t2 = 0.0, t3 = 0.0, t4 = 0.0;
    for (int64_t d = 0; d < dim; ++d) {
      const double a = a_d[d], b = b_d[d], c = c_d[d], e = e_d[d];
      {
        const double aa_ = a * a;
        const double diff = aa_ - b;
        const double t = 0.5 * diff;
        t2 += t;
      }
      {
        const double aa_ = a * a;
        const double aaa = aa_ * a;
        const double a3 = 3.0 * a;
        const double a3b = a3 * b;
        const double c2 = 2.0 * c;
        const double num = (aaa - a3b) + c2;
        const double t = num / 6.0;
        t3 += t;
      }
      {
        const double aa = a * a;
        const double aaaa = aa * aa;
        const double aa6 = 6.0 * aa;
        const double aa6b = aa6 * b;
        const double b3 = 3.0 * b;
        const double b3b = b3 * b;
        const double a8 = 8.0 * a;
        const double a8c = a8 * c;
        const double e6 = 6.0 * e;
        const double num = (((aaaa - aa6b) + b3b) + a8c) - e6;
        const double t = num / 24.0;
        t4 += t;
      }
    }
    terms_ob[0 * num_b + bi] = lin;
    terms_ob[1 * num_b + bi] = order >= 2 ? t2 : 0.0;
    terms_ob[2 * num_b + bi] = order >= 3 ? t3 : 0.0;
    terms_ob[3 * num_b + bi] = order >= 4 ? t4 : 0.0;
  }
  free(acc_fp);
  return 0;
}
