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
// the result does not depend on scheduling: a row's repeats are summed in (s, b, h) order.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

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

// Per-process workspace: `slot[k]` is -1 for every row between calls (each call resets the
// rows it touched), so no call pays for a table-sized fill; per-thread gradient sums keep their
// capacity across calls. One call at a time (a step updates its buffers one after another).
struct Workspace {
  std::mutex mu;
  std::vector<int32_t> slot;
  std::vector<std::vector<float>> gsum;
  std::vector<std::vector<int32_t>> rows;
  std::vector<std::vector<int32_t>> row_slot;
};
Workspace& GetWorkspace() {
  static Workspace* ws = new Workspace();
  return *ws;
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

  Workspace& ws = GetWorkspace();
  std::lock_guard<std::mutex> lock(ws.mu);
  if (static_cast<int64_t>(ws.slot.size()) < rows) ws.slot.resize(rows, -1);
  const int threads = static_cast<int>(
      std::min<int64_t>(NumThreads(), std::max<int64_t>(1, slots * batch * h / 4096)));
  if (static_cast<int>(ws.gsum.size()) < threads) {
    ws.gsum.resize(threads);
    ws.rows.resize(threads);
    ws.row_slot.resize(threads);
  }
  std::vector<double> upd_sq(threads, 0.0), grad_sq(threads, 0.0);
  constexpr int64_t kAhead = 16;  // prefetch distance: rows are random reads, latency-bound
  ParallelFor(threads, [&](int t) {
    int32_t* slot = ws.slot.data();
    std::vector<float>& gsum = ws.gsum[t];
    std::vector<int32_t>& mine = ws.rows[t];  // distinct (row, slot), first-occurrence order
    std::vector<int32_t>& ent = ws.row_slot[t];   // (row, bag) pairs, then (row index, bag)
    mine.clear();
    ent.clear();
    // 1. this thread's ids (rows r with r % threads == t), in (s, b, h) order
    const int64_t nbags = slots * batch;
    for (int64_t bag = 0; bag < nbags; ++bag) {
      const int32_t* ids = k + bag * h;
      for (int64_t j = 0; j < h; ++j) {
        const int32_t r = ids[j];
        if (r >= 0 && r < rows && r % threads == t) {
          ent.push_back(r);
          ent.push_back(static_cast<int32_t>(bag));
        }
      }
    }
    const int64_t n = static_cast<int64_t>(ent.size()) / 2;
    // 2. distinct rows: slot[r] = its index (every slot entry is -1 between calls)
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) __builtin_prefetch(slot + ent[2 * (i + kAhead)], 1);
      const int32_t r = ent[2 * i];
      int32_t u = slot[r];
      if (u < 0) {
        u = slot[r] = static_cast<int32_t>(mine.size() / 2);
        mine.push_back(r);
        mine.push_back(static_cast<int32_t>(ent[2 * i + 1] / batch));
      }
      ent[2 * i] = u;
    }
    // 3. each row's gradient: the sum of the gradients of the bags that read it
    const int64_t nu = static_cast<int64_t>(mine.size()) / 2;
    gsum.assign(nu * w, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) PrefetchRow(gsum.data() + ent[2 * (i + kAhead)] * w, w, 1);
      float* dst = gsum.data() + static_cast<int64_t>(ent[2 * i]) * w;
      const float* src = g + static_cast<int64_t>(ent[2 * i + 1]) * w;
      for (int64_t d = 0; d < w; ++d) dst[d] += src[d];
    }
    // 4. the optimizer on each distinct row, in place
    double usq = 0.0, gsq = 0.0;
    for (int64_t u = 0; u < nu; ++u) {
      if (u + kAhead < nu) {
        PrefetchRow(table + static_cast<int64_t>(mine[2 * (u + kAhead)]) * w, w, 1);
        if (adagrad) __builtin_prefetch(accum + mine[2 * (u + kAhead)], 1);
      }
      const int32_t r = mine[2 * u];
      slot[r] = -1;
      const float* gr = gsum.data() + u * w;
      float sq = 0.0f;
      bool touched = false;
      for (int64_t d = 0; d < w; ++d) {
        sq += gr[d] * gr[d];
        touched |= gr[d] != 0.0f;
      }
      gsq += sq;
      float scale = -lr;
      if (adagrad) {
        const float a = accum[r] + sq / static_cast<float>(tdim[mine[2 * u + 1]]);
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
