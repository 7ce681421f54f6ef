// What the C++ CPU kernels of the embedding engine share (XLA FFI; built by
// recscale/kernels/native.py): thread count, row prefetch, huge pages, a parallel for.
//
// Each op's kernel is its own library (embedding_bag/embedding_bag.cc,
// embedding_update/embedding_update.cc), so everything here has internal linkage.

#ifndef RECSCALE_KERNELS_NATIVE_H_
#define RECSCALE_KERNELS_NATIVE_H_

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <sys/mman.h>

namespace recscale {
namespace {

int NumThreads() {
  unsigned n = std::thread::hardware_concurrency();
  return static_cast<int>(std::max(1u, std::min(n, 64u)));
}

// Prefetches all cache lines of a row of `w` floats (rows are random reads: latency-bound).
inline void PrefetchRow(const float* p, int64_t w, int rw) {
  for (int64_t d = 0; d < w; d += 16) {
    if (rw) {
      __builtin_prefetch(p + d, 1);
    } else {
      __builtin_prefetch(p + d, 0);
    }
  }
}

// Backs a table with transparent huge pages, once per buffer (per library): lookups and updates
// are random row accesses over gigabytes, where 4 KiB pages make nearly every access a TLB miss
// and a page walk. MADV_COLLAPSE (Linux >= 6.1) converts the existing pages synchronously; where
// it is not supported this does nothing. Buffers are donated step to step, so the address stays
// the same.
void UseHugePages(const void* data, int64_t bytes) {
  constexpr int64_t kHuge = 2 << 20;
  if (bytes < 4 * kHuge) return;
  static std::mutex mu;
  static std::vector<std::pair<uintptr_t, int64_t>> done;
  std::lock_guard<std::mutex> lock(mu);
  const uintptr_t p = reinterpret_cast<uintptr_t>(data);
  for (const auto& d : done) {
    if (d.first == p && d.second == bytes) return;
  }
  done.emplace_back(p, bytes);
  const uintptr_t lo = (p + kHuge - 1) / kHuge * kHuge;
  const uintptr_t hi = (p + bytes) / kHuge * kHuge;
  if (hi <= lo) return;
  void* start = reinterpret_cast<void*>(lo);
  madvise(start, hi - lo, MADV_HUGEPAGE);
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
  madvise(start, hi - lo, MADV_COLLAPSE);
}

template <typename F>
void ParallelFor(int threads, F&& fn) {
  if (threads == 1) {
    fn(0);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) pool.emplace_back(fn, t);
  fn(0);
  for (auto& th : pool) th.join();
}

}  // namespace
}  // namespace recscale

#endif  // RECSCALE_KERNELS_NATIVE_H_
