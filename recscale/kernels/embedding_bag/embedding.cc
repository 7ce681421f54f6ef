// CPU kernels of the embedding engine (XLA FFI), beside their plain-JAX references in
// recscale/embeddings/engine.py (`_pool`, `row_gradients` + `_update_rows`), which they match.
//
// Why hand-written: on CPU, XLA materialises every per-step temporary as a fresh allocation
// (large ones are mmapped, so each step page-faults them in again), does not fuse a gather into
// the sum that consumes it, and scatters ~5x slower than a plain loop. These two kernels do the
// embedding part of a training step in two passes over the touched rows and nothing else:
//
//   recscale_pool:   out[s, b, :] = sum_h buf[keys[s, b, h], :]           (keys == R: padding)
//   recscale_update: for every distinct row k of keys: g_k = sum of g[s, b, :] over the bags
//                    (s, b) that read k (repeats counted), then SGD or row-wise Adagrad on row k
//                    (acc[k] += mean(g_k^2); buf[k] -= lr * g_k / (sqrt(acc[k]) + eps)),
//                    in place (buf and acc are aliased to the outputs).
//
// Threads split the rows (row k belongs to thread k % T), so they never write the same row and
// the result does not depend on scheduling. Each thread sorts its (row, bag) pairs by row with a
// stable radix sort (as FBGEMM's CPU kernels do), so a row's repeats are summed in (s, b, h)
// order and the rows are updated in address order. Tables of 8 MiB and more are backed by
// transparent huge pages (UseHugePages below).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <sys/mman.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

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

// Backs a table with transparent huge pages, once per buffer: lookups and updates are random
// row accesses over gigabytes, where 4 KiB pages make nearly every access a TLB miss and a page
// walk. MADV_COLLAPSE (Linux >= 6.1) converts the existing pages synchronously; where it is not
// supported this does nothing. Buffers are donated step to step, so the address stays the same.
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

// Per-thread scratch, kept across calls so that no call page-faults fresh memory in.
struct Workspace {
  std::mutex mu;
  std::vector<std::vector<uint64_t>> keys, tmp;
  std::vector<std::vector<float>> row;
};
Workspace& GetWorkspace() {
  static Workspace* ws = new Workspace();
  return *ws;
}

// Stable LSD radix sort of `a` by bits [0, bits) of the high 32 bits (the row), 11 at a time.
void RadixSortByRow(std::vector<uint64_t>& a, std::vector<uint64_t>& tmp, int bits) {
  tmp.resize(a.size());
  for (int shift = 0; shift < bits; shift += 11) {
    size_t count[2049] = {0};
    for (uint64_t x : a) ++count[((x >> 32 >> shift) & 2047) + 1];
    for (int i = 0; i < 2048; ++i) count[i + 1] += count[i];
    for (uint64_t x : a) tmp[count[(x >> 32 >> shift) & 2047]++] = x;
    a.swap(tmp);
  }
}

ffi::Error UpdateImpl(ffi::Buffer<ffi::F32> buf, ffi::Buffer<ffi::F32> acc,
                      ffi::Buffer<ffi::S32> keys, ffi::Buffer<ffi::F32> grad,
                      ffi::Buffer<ffi::F32> lr_buf, ffi::Buffer<ffi::S32> table_dim,
                      float eps, int32_t adagrad, ffi::ResultBuffer<ffi::F32> buf_out,
                      ffi::ResultBuffer<ffi::F32> acc_out, ffi::ResultBuffer<ffi::F32> stats) {
  const auto bd = buf.dimensions();
  const auto kd = keys.dimensions();
  const auto gd = grad.dimensions();
  if (bd.size() != 2 || kd.size() != 3 || gd.size() != 3 || gd[0] != kd[0] ||
      gd[1] != kd[1] || gd[2] != bd[1]) {
    return ffi::Error::InvalidArgument(
        "recscale_update: buf [R, w], keys [S, B, H], grad [S, B, w] expected");
  }
  if (adagrad && acc.dimensions()[0] != bd[0]) {
    return ffi::Error::InvalidArgument("recscale_update: acc must be [R]");
  }
  const int64_t rows = bd[0], w = bd[1];
  const int64_t slots = kd[0], batch = kd[1], h = kd[2];
  // Outputs alias the inputs (input_output_aliases): update them in place.
  float* table = buf_out->typed_data();
  float* accum = acc_out->typed_data();
  const int32_t* k = keys.typed_data();
  const float* g = grad.typed_data();
  const int32_t* tdim = table_dim.typed_data();
  const float lr = lr_buf.typed_data()[0];
  UseHugePages(table, rows * w * sizeof(float));
  if (adagrad) UseHugePages(accum, rows * sizeof(float));

  Workspace& ws = GetWorkspace();
  std::lock_guard<std::mutex> lock(ws.mu);
  const int threads = static_cast<int>(
      std::min<int64_t>(NumThreads(), std::max<int64_t>(1, slots * batch * h / 4096)));
  if (static_cast<int>(ws.keys.size()) < threads) {
    ws.keys.resize(threads);
    ws.tmp.resize(threads);
    ws.row.resize(threads);
  }
  int bits = 1;
  while (bits < 31 && (int64_t{1} << bits) < rows) ++bits;
  std::vector<double> upd_sq(threads, 0.0), grad_sq(threads, 0.0);
  constexpr int64_t kAhead = 16;  // prefetch distance: rows are random reads, latency-bound
  ParallelFor(threads, [&](int t) {
    // 1. this thread's ids (rows r with r % threads == t) as (row, bag), in (s, b, h) order,
    // 2. sorted by row (stably: a row's repeats stay in (s, b, h) order), as FBGEMM does, so
    //    each row's gradient is a run of entries and the rows are visited in address order.
    std::vector<uint64_t>& e = ws.keys[t];
    e.clear();
    const int64_t nbags = slots * batch;
    for (int64_t bag = 0; bag < nbags; ++bag) {
      const int32_t* ids = k + bag * h;
      for (int64_t j = 0; j < h; ++j) {
        const int32_t r = ids[j];
        if (r >= 0 && r < rows && r % threads == t) {
          e.push_back((static_cast<uint64_t>(r) << 32) | static_cast<uint32_t>(bag));
        }
      }
    }
    RadixSortByRow(e, ws.tmp[t], bits);
    const int64_t n = static_cast<int64_t>(e.size());
    std::vector<float>& gr = ws.row[t];
    gr.resize(w);
    double usq = 0.0, gsq = 0.0;
    // 3. per row: the sum of the gradients of the bags that read it, then the optimizer
    for (int64_t i = 0; i < n;) {
      const int32_t r = static_cast<int32_t>(e[i] >> 32);
      const int64_t first_bag = static_cast<int64_t>(e[i] & 0xffffffffu);
      std::fill(gr.begin(), gr.end(), 0.0f);
      for (; i < n && static_cast<int32_t>(e[i] >> 32) == r; ++i) {
        if (i + kAhead < n) {
          const int64_t ahead = static_cast<int64_t>(e[i + kAhead] >> 32);
          PrefetchRow(table + ahead * w, w, 1);
          if (adagrad) __builtin_prefetch(accum + ahead, 1);
        }
        const float* src = g + static_cast<int64_t>(e[i] & 0xffffffffu) * w;
        for (int64_t d = 0; d < w; ++d) gr[d] += src[d];
      }
      float sq = 0.0f;
      bool touched = false;
      for (int64_t d = 0; d < w; ++d) {
        sq += gr[d] * gr[d];
        touched |= gr[d] != 0.0f;
      }
      gsq += sq;
      float scale = -lr;
      if (adagrad) {
        const float a = accum[r] + sq / static_cast<float>(tdim[first_bag / batch]);
        accum[r] = a;
        if (!touched) continue;
        scale = -lr / (std::sqrt(a) + eps);
      }
      float* row = table + static_cast<int64_t>(r) * w;
      for (int64_t d = 0; d < w; ++d) {
        const float up = scale * gr[d];
        row[d] += up;
        usq += static_cast<double>(up) * up;
      }
    }
    upd_sq[t] = usq;
    grad_sq[t] = gsq;
  });
  double usq = 0.0, gsq = 0.0;
  for (int t = 0; t < threads; ++t) {
    usq += upd_sq[t];
    gsq += grad_sq[t];
  }
  stats->typed_data()[0] = static_cast<float>(usq);
  stats->typed_data()[1] = static_cast<float>(gsq);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RecscalePool, PoolImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RecscaleUpdate, UpdateImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("adagrad")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
