// The C++ CPU kernel of the embedding backward fused with the sparse SGD / row-wise Adagrad
// update (XLA FFI, built by recscale/kernels/native.py), beside its plain-JAX reference
// (embedding_update/reference.py, and the engine's recscale/embeddings/update.py
// `batched_row_gradients` + `_clip_rows` + `_update_rows`), which it matches.
//
// Why hand-written: on CPU, XLA materialises every per-step temporary as a fresh allocation
// (large ones are mmapped, so each step page-faults them in again) and scatters ~5x slower than
// a plain loop. This kernel does the embedding part of a training step's update in one pass over
// the touched rows and nothing else:
//
//   recscale_update: for every distinct row k of keys: g_k = sum of g[s, b, :] over the bags
//                    (s, b) that read k (repeats counted, c_k of them), then the row's L2 and
//                    CowClip (g_k += row_l2 * buf[k]; g_k *= min(1, c_k * max(r * |buf[k]|,
//                    zeta) / |g_k|) where r > 0), then SGD or row-wise Adagrad on row k
//                    (acc[k] += mean(g_k^2); buf[k] -= lr * g_k / (sqrt(acc[k]) + eps)),
//                    in place (buf and acc are aliased to the outputs).
//
// Threads split the rows (row k belongs to thread k % T), so they never write the same row and
// the result does not depend on scheduling. Each thread sorts its (row, bag) pairs by row with a
// stable radix sort (as FBGEMM's CPU kernels do), so a row's repeats are summed in (s, b, h)
// order and the rows are updated in address order. Tables of 8 MiB and more are backed by
// transparent huge pages (UseHugePages, native.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <vector>

#include "native.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace recscale {
namespace {

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

// Sum of squares of a row in 8 independent partial sums: one chain of dependent float adds (the
// kernel is built without -ffast-math, so the compiler may not reorder it) costs ~4 cycles an
// element, which the clip's extra reductions per row would pay several times over.
inline float SumSquares(const float* x, int64_t w) {
  float p[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t d = 0;
  for (; d + 8 <= w; d += 8) {
    for (int j = 0; j < 8; ++j) p[j] += x[d + j] * x[d + j];
  }
  for (; d < w; ++d) p[d % 8] += x[d] * x[d];
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

inline bool AnyNonzero(const float* x, int64_t w) {
  int any = 0;  // an int OR reduction: the compiler vectorizes it (a bool one it does not)
  for (int64_t d = 0; d < w; ++d) any |= x[d] != 0.0f ? 1 : 0;
  return any != 0;
}

// One pass over a row gradient g and its row t for the row's L2 and CowClip: g += l2 * t
// (l2 may be 0), and returns sum(g^2) after it and sum(t^2), each in 8 partial sums.
inline void AddL2AndSumSquares(float* g, const float* t, int64_t w, float l2, float* g2,
                               float* t2) {
  float pg[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  float pt[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t d = 0;
  for (; d + 8 <= w; d += 8) {
    for (int j = 0; j < 8; ++j) {
      const float x = g[d + j] + l2 * t[d + j];
      g[d + j] = x;
      pg[j] += x * x;
      pt[j] += t[d + j] * t[d + j];
    }
  }
  for (; d < w; ++d) {
    g[d] += l2 * t[d];
    pg[d % 8] += g[d] * g[d];
    pt[d % 8] += t[d] * t[d];
  }
  *g2 = ((pg[0] + pg[1]) + (pg[2] + pg[3])) + ((pg[4] + pg[5]) + (pg[6] + pg[7]));
  *t2 = ((pt[0] + pt[1]) + (pt[2] + pt[3])) + ((pt[4] + pt[5]) + (pt[6] + pt[7]));
}

ffi::Error UpdateImpl(ffi::Buffer<ffi::F32> buf, ffi::Buffer<ffi::F32> acc,
                      ffi::Buffer<ffi::S32> keys, ffi::Buffer<ffi::F32> grad,
                      ffi::Buffer<ffi::F32> lr_buf, ffi::Buffer<ffi::S32> table_dim,
                      float eps, int32_t adagrad, float clip_ratio, float clip_min_norm,
                      float row_l2, ffi::ResultBuffer<ffi::F32> buf_out,
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
  const bool clips = clip_ratio > 0.0f;
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
    // 3. per row: the sum of the gradients of the bags that read it, the row's L2 and CowClip,
    //    then the optimizer
    for (int64_t i = 0; i < n;) {
      const int32_t r = static_cast<int32_t>(e[i] >> 32);
      const int64_t first_bag = static_cast<int64_t>(e[i] & 0xffffffffu);
      const int64_t first = i;
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
      float sq = SumSquares(gr.data(), w);
      gsq += sq;  // the statistic is the row gradient's, before the L2 and the clip
      bool touched = AnyNonzero(gr.data(), w);
      float* row = table + static_cast<int64_t>(r) * w;
      if (clips) {
        // g += row_l2 * t, then g *= min(1, c * max(ratio * |t|, min_norm) / |g|), c the row's
        // pairs (reference.clip_rows)
        float t2 = 0.0f;
        AddL2AndSumSquares(gr.data(), row, w, row_l2, &sq, &t2);
        const float count = static_cast<float>(i - first);
        const float limit = count * std::max(clip_ratio * std::sqrt(t2), clip_min_norm);
        const float norm = std::sqrt(sq);
        if (norm > limit) {
          const float s = limit / norm;
          for (int64_t d = 0; d < w; ++d) gr[d] *= s;
          if (adagrad) sq = SumSquares(gr.data(), w);
        }
        if (adagrad) touched = AnyNonzero(gr.data(), w);
      } else if (row_l2 != 0.0f) {  // g += row_l2 * t alone
        for (int64_t d = 0; d < w; ++d) gr[d] += row_l2 * row[d];
        if (adagrad) {
          sq = SumSquares(gr.data(), w);
          touched = AnyNonzero(gr.data(), w);
        }
      }
      float scale = -lr;
      if (adagrad) {
        const float a = accum[r] + sq / static_cast<float>(tdim[first_bag / batch]);
        accum[r] = a;
        if (!touched) continue;
        scale = -lr / (std::sqrt(a) + eps);
      }
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
}  // namespace recscale

XLA_FFI_DEFINE_HANDLER_SYMBOL(RecscaleUpdate, recscale::UpdateImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("adagrad")
                                  .Attr<float>("clip_ratio")
                                  .Attr<float>("clip_min_norm")
                                  .Attr<float>("row_l2")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
