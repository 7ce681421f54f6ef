// The C++ CPU kernel of the pooled embedding lookup (XLA FFI, built by
// recscale/kernels/native.py), beside its plain-JAX reference (embedding_bag/reference.py and the
// engine's lookup, recscale/embeddings/lookup.py `_pool`), which it matches.
//
// Why hand-written: on CPU, XLA materialises every per-step temporary as a fresh allocation
// (large ones are mmapped, so each step page-faults them in again) and does not fuse a gather
// into the sum that consumes it. This kernel sums each bag's rows in one pass:
//
//   recscale_pool:   out[s, b, :] = sum_h buf[keys[s, b, h], :]   (keys outside [0, R): padding)
//
// Threads split the bags. Rows of width 4 to 128 (powers of two) are summed in registers by
// loops of compile-time width. Tables of 8 MiB and more are backed by transparent huge pages
// (UseHugePages, native.h).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "native.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace recscale {
namespace {

// Bag slots (ids and padding) per thread. Measured on the 2-core VM at a study model's batch
// (26 slots x 1,024 bags x 5 = 133k slots, width 4): one thread 1.6-1.8x faster than two, the
// second thread's start, join and scheduling costing more than half the work it takes.
constexpr int64_t kSlotsPerThread = int64_t{1} << 18;

// How many bags ahead rows are prefetched: a bag of a small model holds one or two ids (most of
// its slots padding), and a row out of cache takes longer than one bag's sums to arrive.
constexpr int64_t kAheadBags = 8;

// Bags [lo, hi): W > 0 is the width as a compile-time constant (the row sums held in registers
// and vectorized), else w.
template <int64_t W>
void PoolBags(const float* table, const int32_t* k, float* o, int64_t rows, int64_t h,
              int64_t w_runtime, int64_t lo, int64_t hi) {
  const int64_t w = W > 0 ? W : w_runtime;
  for (int64_t bag = lo; bag < hi; ++bag) {
    float* dst = o + bag * w;
    const int32_t* ids = k + bag * h;
    if (bag + kAheadBags < hi) {  // rows are random reads: start fetching them early
      const int32_t* next = k + (bag + kAheadBags) * h;
      for (int64_t j = 0; j < h; ++j) {
        if (next[j] >= 0 && next[j] < rows) PrefetchRow(table + next[j] * w, w, 0);
      }
    }
    if constexpr (W > 0) {
      float acc[W] = {};
      for (int64_t j = 0; j < h; ++j) {
        const int32_t r = ids[j];
        if (r < 0 || r >= rows) continue;
        const float* src = table + static_cast<int64_t>(r) * W;
        for (int64_t d = 0; d < W; ++d) acc[d] += src[d];
      }
      for (int64_t d = 0; d < W; ++d) dst[d] = acc[d];
    } else {
      std::memset(dst, 0, sizeof(float) * w);
      for (int64_t j = 0; j < h; ++j) {
        const int32_t r = ids[j];
        if (r < 0 || r >= rows) continue;
        const float* src = table + static_cast<int64_t>(r) * w;
        for (int64_t d = 0; d < w; ++d) dst[d] += src[d];
      }
    }
  }
}

// One member's bags: out[s, b, :] = sum_h table[keys[s, b, h], :].
void PoolOne(const float* table, const int32_t* k, float* o, int64_t rows, int64_t w,
             int64_t bags, int64_t h) {
  UseHugePages(table, rows * w * sizeof(float));
  const int threads = static_cast<int>(
      std::min<int64_t>(NumThreads(), std::max<int64_t>(1, bags * h / kSlotsPerThread)));
  ParallelFor(threads, [&](int t) {
    const int64_t lo = bags * t / threads, hi = bags * (t + 1) / threads;
    switch (w) {
      case 4: return PoolBags<4>(table, k, o, rows, h, w, lo, hi);
      case 8: return PoolBags<8>(table, k, o, rows, h, w, lo, hi);
      case 16: return PoolBags<16>(table, k, o, rows, h, w, lo, hi);
      case 32: return PoolBags<32>(table, k, o, rows, h, w, lo, hi);
      case 64: return PoolBags<64>(table, k, o, rows, h, w, lo, hi);
      case 128: return PoolBags<128>(table, k, o, rows, h, w, lo, hi);
      default: return PoolBags<0>(table, k, o, rows, h, w, lo, hi);
    }
  });
}

// buf [R, w], keys [S, B, H] -> out [S, B, w]; under jax.vmap (vmap_method="broadcast_all",
// cpu_ffi.py) every operand has a leading member axis K: buf [K, R, w], keys [K, S, B, H], each
// member pooled from its own table, one after another.
ffi::Error PoolImpl(ffi::Buffer<ffi::F32> buf, ffi::Buffer<ffi::S32> keys,
                    ffi::ResultBuffer<ffi::F32> out) {
  const auto bd = buf.dimensions();
  const auto kd = keys.dimensions();
  const bool batched = bd.size() == 3 && kd.size() == 4 && bd[0] == kd[0];
  if (!batched && (bd.size() != 2 || kd.size() != 3)) {
    return ffi::Error::InvalidArgument(
        "recscale_pool: buf must be [R, w], keys [S, B, H] (or both with a member axis)");
  }
  const int64_t members = batched ? bd[0] : 1, o = batched ? 1 : 0;
  const int64_t rows = bd[o], w = bd[o + 1];
  const int64_t bags = kd[o] * kd[o + 1], h = kd[o + 2];
  for (int64_t m = 0; m < members; ++m) {
    PoolOne(buf.typed_data() + m * rows * w, keys.typed_data() + m * bags * h,
            out->typed_data() + m * bags * w, rows, w, bags, h);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace recscale

XLA_FFI_DEFINE_HANDLER_SYMBOL(RecscalePool, recscale::PoolImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
