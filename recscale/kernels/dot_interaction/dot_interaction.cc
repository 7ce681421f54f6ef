// The C++ CPU kernel of the DLRM dot interaction (XLA FFI, built by recscale/kernels/native.py),
// beside its plain-JAX reference (dot_interaction/reference.py), which it matches.
//
// Why hand-written: XLA:CPU runs the reference's per-example [N, D] x [D, N] matmuls (N = 27,
// D = 4 in the study's models) far below peak, then gathers the triangle out of the full
// [N, N] product in a second pass. This kernel writes the triangle directly:
//
//   recscale_dot_fwd:  out[b, off(i) + j] = x[b, i] . x[b, j]     for j < i (j <= i: diagonal)
//   recscale_dot_bwd:  dx[b] = (G[b] + G[b]^T) x[b]               G: g[b] scattered into the
//                                                                 lower triangle
//
// off(i) = i(i-1)/2 (i(i+1)/2 with the diagonal); which of the two is read from P, the output's
// (g's) width: N(N-1)/2 and N(N+1)/2 differ for every N >= 1.
//
// Forward: each example's x is transposed into xt [D, Np] (Np = N rounded up to kChunk, zero
// padded), then row i of the triangle is computed kChunk columns at a time, acc[j] += x[i, d] *
// xt[d, j] over d in order (vectorized across j). Backward: pair by pair, dx_i accumulated in
// registers, dx_j updated in place, rows of compile-time width for D in {4, ..., 128} (D = 4
// and 8 with AVX-512: four and two pairs per register, Backward4 and Backward8). Summation orders differ from XLA's: the
// results agree to float32 rounding (tests/recscale/kernels/test_dot_interaction.py).
// Threads split the batch above kMacsPerThread multiply-adds.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "native.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace recscale {
namespace {

// Multiply-adds per thread (forward: B * P * D). The study's d2 at batch 1,024 (27 vectors of
// width 4) is 1.4M: one thread, as h-step's embedding kernels do below their threshold.
constexpr int64_t kMacsPerThread = int64_t{1} << 23;

// Output columns computed together in the forward (one AVX-512 register, two AVX2 ones).
constexpr int64_t kChunk = 16;

int Threads(int64_t macs) {
  return static_cast<int>(
      std::min<int64_t>(NumThreads(), std::max<int64_t>(1, macs / kMacsPerThread)));
}

// Examples [lo, hi) of the forward; W > 0: D as a compile-time constant.
template <int64_t W>
void Forward(const float* x, float* out, int64_t n, int64_t d_runtime, int64_t p, bool diag,
             int64_t lo, int64_t hi) {
  const int64_t d = W > 0 ? W : d_runtime;
  const int64_t np = (n + kChunk - 1) / kChunk * kChunk;
  std::vector<float> xt(d * np, 0.0f);
  // The triangle is written a whole chunk at a time (no tail loop): columns past a row's end
  // land on the next row's place, which that row overwrites, and past the example's end on the
  // next examples', which they overwrite. The range's last examples (those fewer than kChunk
  // outputs from its end: the next may be another thread's, or past the buffer) go through a
  // scratch with room for the overrun. (Writing
  // every example to the scratch and copying it out was up to 4x slower: the copy's loads span
  // several of the overlapping stores, which the CPU cannot forward.)
  std::vector<float> tri(p + kChunk);
  for (int64_t b = lo; b < hi; ++b) {
    const float* xb = x + b * n * d;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t k = 0; k < d; ++k) xt[k * np + i] = xb[i * d + k];
    }
    const bool last = (hi - b - 1) * p < kChunk;
    float* o = last ? tri.data() : out + b * p;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t len = diag ? i + 1 : i;  // columns j < len of row i
      const float* xi = xb + i * d;
      for (int64_t j0 = 0; j0 < len; j0 += kChunk) {
#ifdef __AVX512F__
        // explicit: GCC's own vectorization of the loop below ran 3-5x slower at some widths
        // (D = 8 compile-time, D = 32); two sums (even and odd d) halve the FMA latency chain
        const float* col = xt.data() + j0;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 2 <= d; k += 2) {
          a0 = _mm512_fmadd_ps(_mm512_set1_ps(xi[k]), _mm512_loadu_ps(col + k * np), a0);
          a1 = _mm512_fmadd_ps(_mm512_set1_ps(xi[k + 1]), _mm512_loadu_ps(col + (k + 1) * np), a1);
        }
        if (k < d) a0 = _mm512_fmadd_ps(_mm512_set1_ps(xi[k]), _mm512_loadu_ps(col + k * np), a0);
        _mm512_storeu_ps(o + j0, _mm512_add_ps(a0, a1));
#else
        float acc[kChunk] = {};
        for (int64_t k = 0; k < d; ++k) {
          const float a = xi[k];
          const float* col = xt.data() + k * np + j0;
          for (int64_t jj = 0; jj < kChunk; ++jj) acc[jj] += a * col[jj];
        }
        std::memcpy(o + j0, acc, sizeof(acc));
#endif
      }
      o += len;
    }
    if (last) std::memcpy(out + b * p, tri.data(), sizeof(float) * p);
  }
}

// One example's backward, pair by pair: dx_i accumulates g_ij x_j in `acc` (two accumulators,
// even and odd j, so consecutive multiply-adds do not wait on each other), dx_j gets g_ij x_i in
// place. Nothing reaches dx_i before row i (rows before it touch only j < their own index), so
// row i stores it and rows after it add to it.
template <int64_t W>
inline void BackwardOne(const float* __restrict xb, const float* __restrict gb,
                        float* __restrict db, int64_t n, int64_t d, bool diag,
                        float* __restrict acc_rt) {
  if constexpr (W > 0) d = W;
  float acc_ct[W > 0 ? 2 * W : 1];
  float* __restrict acc = W > 0 ? acc_ct : acc_rt;
  for (int64_t i = 0; i < n; ++i) {
    const float* __restrict xi = xb + i * d;
    for (int64_t k = 0; k < 2 * d; ++k) acc[k] = 0.0f;
    int64_t j = 0;
    for (; j + 2 <= i; j += 2) {
      const float g0 = gb[j], g1 = gb[j + 1];
      const float* __restrict x0 = xb + j * d;
      const float* __restrict x1 = x0 + d;
      float* __restrict d0 = db + j * d;
      float* __restrict d1 = d0 + d;
      for (int64_t k = 0; k < d; ++k) {
        acc[k] += g0 * x0[k];
        acc[d + k] += g1 * x1[k];
        d0[k] += g0 * xi[k];
        d1[k] += g1 * xi[k];
      }
    }
    if (j < i) {
      const float g0 = gb[j];
      for (int64_t k = 0; k < d; ++k) {
        acc[k] += g0 * xb[j * d + k];
        db[j * d + k] += g0 * xi[k];
      }
    }
    if (diag) {
      const float gii = gb[i] + gb[i];
      for (int64_t k = 0; k < d; ++k) acc[k] += gii * xi[k];
    }
    for (int64_t k = 0; k < d; ++k) db[i * d + k] = acc[k] + acc[d + k];
    gb += diag ? i + 1 : i;
  }
}

#ifdef __AVX512F__
// D = 4 with AVX-512: BackwardOne's pairs four at a time, x_j..x_{j+3} and dx_j..dx_{j+3} one
// 16-float register each, g_j..g_{j+3} spread to match (eight pairs per step, two accumulators).
// 2.5-3x BackwardOne<4> at N = 27 (B = 1,024).
inline void Backward4(const float* __restrict xb, const float* __restrict gb,
                      float* __restrict db, int64_t n, bool diag) {
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = xb + i * 4;
    const __m512 xi16 = _mm512_broadcast_f32x4(_mm_loadu_ps(xi));
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= i; j += 8) {
      const __m512 g0 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(gb + j)));
      const __m512 g1 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(gb + j + 4)));
      acc0 = _mm512_fmadd_ps(g0, _mm512_loadu_ps(xb + j * 4), acc0);
      acc1 = _mm512_fmadd_ps(g1, _mm512_loadu_ps(xb + j * 4 + 16), acc1);
      _mm512_storeu_ps(db + j * 4, _mm512_fmadd_ps(g0, xi16, _mm512_loadu_ps(db + j * 4)));
      _mm512_storeu_ps(db + j * 4 + 16, _mm512_fmadd_ps(g1, xi16, _mm512_loadu_ps(db + j * 4 + 16)));
    }
    for (; j + 4 <= i; j += 4) {
      const __m512 g0 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(gb + j)));
      acc0 = _mm512_fmadd_ps(g0, _mm512_loadu_ps(xb + j * 4), acc0);
      _mm512_storeu_ps(db + j * 4, _mm512_fmadd_ps(g0, xi16, _mm512_loadu_ps(db + j * 4)));
    }
    acc0 = _mm512_add_ps(acc0, acc1);
    __m128 s = _mm_add_ps(_mm_add_ps(_mm512_extractf32x4_ps(acc0, 0), _mm512_extractf32x4_ps(acc0, 1)),
                          _mm_add_ps(_mm512_extractf32x4_ps(acc0, 2), _mm512_extractf32x4_ps(acc0, 3)));
    const __m128 xi4 = _mm_loadu_ps(xi);
    for (; j < i; ++j) {
      const __m128 g0 = _mm_set1_ps(gb[j]);
      s = _mm_fmadd_ps(g0, _mm_loadu_ps(xb + j * 4), s);
      _mm_storeu_ps(db + j * 4, _mm_fmadd_ps(g0, xi4, _mm_loadu_ps(db + j * 4)));
    }
    if (diag) s = _mm_fmadd_ps(_mm_set1_ps(gb[i] + gb[i]), xi4, s);
    _mm_storeu_ps(db + i * 4, s);
    gb += diag ? i + 1 : i;
  }
}

// D = 8 with AVX-512: the same, two pairs per 16-float register (four per step).
inline void Backward8(const float* __restrict xb, const float* __restrict gb,
                      float* __restrict db, int64_t n, bool diag) {
  const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  auto pair = [&](int64_t j) {  // g_j (lanes 0-7), g_{j+1} (8-15): reads exactly two floats
    const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(gb + j)));
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(two));
  };
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = xb + i * 8;
    const __m256 xi8 = _mm256_loadu_ps(xi);
    const __m512 xi16 = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(xi8)));
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 4 <= i; j += 4) {
      const __m512 g0 = pair(j), g1 = pair(j + 2);
      acc0 = _mm512_fmadd_ps(g0, _mm512_loadu_ps(xb + j * 8), acc0);
      acc1 = _mm512_fmadd_ps(g1, _mm512_loadu_ps(xb + j * 8 + 16), acc1);
      _mm512_storeu_ps(db + j * 8, _mm512_fmadd_ps(g0, xi16, _mm512_loadu_ps(db + j * 8)));
      _mm512_storeu_ps(db + j * 8 + 16, _mm512_fmadd_ps(g1, xi16, _mm512_loadu_ps(db + j * 8 + 16)));
    }
    acc0 = _mm512_add_ps(acc0, acc1);
    __m256 s = _mm256_add_ps(
        _mm512_castps512_ps256(acc0),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc0), 1)));
    for (; j < i; ++j) {
      const __m256 g0 = _mm256_set1_ps(gb[j]);
      s = _mm256_fmadd_ps(g0, _mm256_loadu_ps(xb + j * 8), s);
      _mm256_storeu_ps(db + j * 8, _mm256_fmadd_ps(g0, xi8, _mm256_loadu_ps(db + j * 8)));
    }
    if (diag) s = _mm256_fmadd_ps(_mm256_set1_ps(gb[i] + gb[i]), xi8, s);
    _mm256_storeu_ps(db + i * 8, s);
    gb += diag ? i + 1 : i;
  }
}
#endif

// Examples [lo, hi) of the backward; W > 0: D as a compile-time constant.
template <int64_t W>
void Backward(const float* x, const float* g, float* dx, int64_t n, int64_t d_runtime, int64_t p,
              bool diag, int64_t lo, int64_t hi) {
  const int64_t d = W > 0 ? W : d_runtime;
  std::vector<float> acc(2 * d);
#ifdef __AVX512F__
  if constexpr (W == 4) {
    for (int64_t b = lo; b < hi; ++b) Backward4(x + b * n * 4, g + b * p, dx + b * n * 4, n, diag);
    return;
  }
  if constexpr (W == 8) {
    for (int64_t b = lo; b < hi; ++b) Backward8(x + b * n * 8, g + b * p, dx + b * n * 8, n, diag);
    return;
  }
#endif
  for (int64_t b = lo; b < hi; ++b) {
    BackwardOne<W>(x + b * n * d, g + b * p, dx + b * n * d, n, d, diag, acc.data());
  }
}

// Reads [B, N, D] and the triangle's width P; whether the diagonal is in it, or an error.
// x [B, N, D] and a [B, P] operand (the output or g); under jax.vmap (vmap_method=
// "broadcast_all", cpu_ffi.py) both have leading member axes, folded into B: members are
// examples of one larger batch to this op.
ffi::Error Shape(const char* name, ffi::Span<const int64_t> xd, ffi::Span<const int64_t> pd,
                 int64_t* b, int64_t* n, int64_t* d, int64_t* p, bool* diag) {
  if (xd.size() < 3 || pd.size() != xd.size() - 1) {
    return ffi::Error::InvalidArgument(std::string(name) + ": x must be [..., B, N, D], the "
                                       "pairs [..., B, P]");
  }
  const size_t lead = xd.size() - 3;
  int64_t bp = 1;
  *b = 1;
  for (size_t i = 0; i <= lead; ++i) *b *= xd[i], bp *= pd[i];
  *n = xd[lead + 1], *d = xd[lead + 2], *p = pd[lead + 1];
  const int64_t p_ = *p;
  if (bp != *b) return ffi::Error::InvalidArgument(std::string(name) + ": batch sizes differ");
  if (p_ == *n * (*n - 1) / 2) {
    *diag = false;
  } else if (p_ == *n * (*n + 1) / 2) {
    *diag = true;
  } else {
    return ffi::Error::InvalidArgument(std::string(name) + ": P is not N(N-1)/2 or N(N+1)/2");
  }
  return ffi::Error::Success();
}

#define RECSCALE_DISPATCH_D(FN, D, ...)                        \
  switch (D) {                                                 \
    case 4: return FN<4>(__VA_ARGS__);                         \
    case 8: return FN<8>(__VA_ARGS__);                         \
    case 16: return FN<16>(__VA_ARGS__);                       \
    case 32: return FN<32>(__VA_ARGS__);                       \
    case 64: return FN<64>(__VA_ARGS__);                       \
    case 128: return FN<128>(__VA_ARGS__);                     \
    default: return FN<0>(__VA_ARGS__);                        \
  }

ffi::Error ForwardImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  int64_t b, n, d, p;
  bool diag;
  ffi::Error e = Shape("recscale_dot_fwd", x.dimensions(), out->dimensions(), &b, &n, &d, &p,
                       &diag);
  if (e.failure()) return e;
  const float* xp = x.typed_data();
  float* op = out->typed_data();
  const int threads = Threads(b * p * std::max<int64_t>(d, 1));
  ParallelFor(threads, [&](int t) {
    const int64_t lo = b * t / threads, hi = b * (t + 1) / threads;
    RECSCALE_DISPATCH_D(Forward, d, xp, op, n, d, p, diag, lo, hi);
  });
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> g,
                        ffi::ResultBuffer<ffi::F32> dx) {
  int64_t b, n, d, p;
  bool diag;
  ffi::Error e = Shape("recscale_dot_bwd", x.dimensions(), g.dimensions(), &b, &n, &d, &p, &diag);
  if (e.failure()) return e;
  const float* xp = x.typed_data();
  const float* gp = g.typed_data();
  float* dp = dx->typed_data();
  const int threads = Threads(2 * b * p * std::max<int64_t>(d, 1));
  ParallelFor(threads, [&](int t) {
    const int64_t lo = b * t / threads, hi = b * (t + 1) / threads;
    RECSCALE_DISPATCH_D(Backward, d, xp, gp, dp, n, d, p, diag, lo, hi);
  });
  return ffi::Error::Success();
}

#undef RECSCALE_DISPATCH_D

}  // namespace
}  // namespace recscale

XLA_FFI_DEFINE_HANDLER_SYMBOL(RecscaleDotFwd, recscale::ForwardImpl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<
                                  ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RecscaleDotBwd, recscale::BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
