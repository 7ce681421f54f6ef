// The C++ CPU kernel of the pooled embedding lookup (XLA FFI, built by
// recscale/kernels/native.py), beside its plain-JAX reference (embedding_bag/reference.py and the
// engine's lookup, recscale/embeddings/lookup.py `_pool`), which it matches.
//
// Why hand-written: on CPU, XLA materialises every per-step temporary as a fresh allocation
// (large ones are mmapped, so each step page-faults them in again) and does not fuse a gather
// into the sum that consumes it. This kernel sums each bag's rows in one pass:
//
//   recscale_pool:   out[s, b, :] = sum_h buf[keys[s, b, h], :]           (keys == R: padding)
//
// Threads split the bags. Tables of 8 MiB and more are backed by transparent huge pages
// (UseHugePages, native.h).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "native.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace recscale {
namespace {

ffi::Error PoolImpl(ffi::Buffer<ffi::F32> buf, ffi::Buffer<ffi::S32> keys,
                    ffi::ResultBuffer<ffi::F32> out) {
  const auto bd = buf.dimensions();
  const auto kd = keys.dimensions();
  if (bd.size() != 2 || kd.size() != 3) {
    return ffi::Error::InvalidArgument("recscale_pool: buf must be [R, w], keys [S, B, H]");
  }
  const int64_t rows = bd[0], w = bd[1];
  const int64_t bags = kd[0] * kd[1], h = kd[2];
  const float* table = buf.typed_data();
  const int32_t* k = keys.typed_data();
  float* o = out->typed_data();
  UseHugePages(table, rows * w * sizeof(float));
  const int threads = static_cast<int>(std::min<int64_t>(NumThreads(), std::max<int64_t>(1, bags / 64)));
  ParallelFor(threads, [&](int t) {
    const int64_t lo = bags * t / threads, hi = bags * (t + 1) / threads;
    for (int64_t bag = lo; bag < hi; ++bag) {
      float* dst = o + bag * w;
      std::memset(dst, 0, sizeof(float) * w);
      const int32_t* ids = k + bag * h;
      if (bag + 1 < hi) {  // the next bag's rows are random reads: start fetching them now
        const int32_t* next = k + (bag + 1) * h;
        for (int64_t j = 0; j < h; ++j) {
          if (next[j] >= 0 && next[j] < rows) PrefetchRow(table + next[j] * w, w, 0);
        }
      }
      for (int64_t j = 0; j < h; ++j) {
        const int32_t r = ids[j];
        if (r < 0 || r >= rows) continue;
        const float* src = table + static_cast<int64_t>(r) * w;
        for (int64_t d = 0; d < w; ++d) dst[d] += src[d];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace recscale

XLA_FFI_DEFINE_HANDLER_SYMBOL(RecscalePool, recscale::PoolImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
