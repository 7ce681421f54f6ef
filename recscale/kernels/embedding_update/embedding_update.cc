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
// the result does not depend on scheduling. Each thread reads the pairs in (s, b, h) order and
// sums a row's gradients where the row is first seen (a row -> index map kept across calls,
// reset after each), so a row's repeats are summed in (s, b, h) order and the bags' gradients
// are read in order; then it radix-sorts its distinct rows and updates them in address order
// (as FBGEMM does). Where the first-seen sums' scratch ([distinct rows, w]) would exceed 32 MiB
// (wide rows, many ids), writing and re-reading it at random costs more than sorting: each thread
// then radix-sorts its (row, bag) pairs and sums each row's run of pairs into one cache-resident
// row (UpdateRowsSorted). Both paths give the same bits.
// Rows of width 4 to 128 (powers of two) run loops of compile-time width.
// Tables of 8 MiB and more are backed by transparent huge pages (UseHugePages, native.h).

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

// Bag slots (ids and padding) per thread: every thread reads all of them and keeps its own rows.
// Measured on the 2-core VM at a study model's batch (133k slots, width 4): one thread 1.8-3x
// faster than two.
constexpr int64_t kPairsPerThread = int64_t{1} << 18;

// Calls whose first-seen sums would need a scratch of more than this many bytes ([distinct rows,
// w] floats, bounded by min(slots, rows)) take the sorted path (UpdateRowsSorted) instead, split
// over threads from 4,096 slots a thread: measured on the 2-core VM, width 64 with 20 ids a bag
// (272 MiB of scratch) 1.8x faster sorted, width 128 with one id (109 MiB) ~1.1x; width 64 with
// one id at batch 2048 (14 MiB) and the study's width 4 (2 MiB) faster first-seen.
constexpr int64_t kFirstSeenMaxScratch = int64_t{32} << 20;
constexpr int64_t kSortedPairsPerThread = 4096;

// Scratch kept across calls, so that no call page-faults fresh memory in. `pos[r]` is row r's
// index among the distinct rows of the call in progress (-1: none); every call resets the entries
// it set, so it is all -1 between calls. Threads own disjoint rows (r % threads), hence disjoint
// entries of `pos`.
struct ThreadScratch {
  std::vector<float> grad;         // [U, w]: each distinct row's summed gradient
  std::vector<int32_t> row, count;  // [U]: the row, the pairs that read it
  std::vector<int64_t> first;       // [U]: the first bag that read it
  std::vector<uint64_t> order, tmp;  // (row, index) pairs, sorted by row
};
struct Workspace {
  std::mutex mu;
  std::vector<int32_t> pos;
  std::vector<ThreadScratch> threads;
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
// (l2 may be 0), and returns sum(g^2) after it and sum(t^2), each in 8 partial sums. Never
// inlined: compiled once for a width known at run time, its float contractions (FMA) are the same
// at every width (inlined into a loop of compile-time width 4, GCC contracts it differently).
__attribute__((noinline)) void AddL2AndSumSquares(float* g, const float* t, int64_t w, float l2, float* g2,
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

struct Args {
  float* table;
  float* accum;
  const int32_t* keys;
  const float* grad;
  const int32_t* tdim;
  int32_t* pos;
  int64_t rows, nbags, batch, h;
  int bits, threads;
  float lr, eps, clip_ratio, clip_min_norm, row_l2;
  bool adagrad;
};

// One distinct row r: its summed gradient gr (c pairs read it, the first in bag `first_bag`),
// the row's L2 and CowClip, then the optimizer; adds to the sums of squared updates and row
// gradients. W as in UpdateRows.
template <int64_t W>
inline void UpdateRow(const Args& a, int32_t r, float* gr, int64_t w_runtime, int32_t c,
                      int64_t first_bag, double* usq, double* gsq) {
  const int64_t w = W > 0 ? W : w_runtime;
  float sq = SumSquares(gr, w);
  *gsq += sq;  // the statistic is the row gradient's, before the L2 and the clip
  bool touched = AnyNonzero(gr, w);
  float* row = a.table + static_cast<int64_t>(r) * w;
  if (a.clip_ratio > 0.0f) {
    // g += row_l2 * t, then g *= min(1, c * max(ratio * |t|, min_norm) / |g|), c the row's
    // pairs (reference.clip_rows)
    float t2 = 0.0f;
    AddL2AndSumSquares(gr, row, w, a.row_l2, &sq, &t2);
    const float count = static_cast<float>(c);
    const float limit = count * std::max(a.clip_ratio * std::sqrt(t2), a.clip_min_norm);
    const float norm = std::sqrt(sq);
    if (norm > limit) {
      const float s = limit / norm;
      for (int64_t d = 0; d < w; ++d) gr[d] *= s;
      if (a.adagrad) sq = SumSquares(gr, w);
    }
    if (a.adagrad) touched = AnyNonzero(gr, w);
  } else if (a.row_l2 != 0.0f) {  // g += row_l2 * t alone
    for (int64_t d = 0; d < w; ++d) gr[d] += a.row_l2 * row[d];
    if (a.adagrad) {
      sq = SumSquares(gr, w);
      touched = AnyNonzero(gr, w);
    }
  }
  float scale = -a.lr;
  if (a.adagrad) {
    const float acc = a.accum[r] + sq / static_cast<float>(a.tdim[first_bag / a.batch]);
    a.accum[r] = acc;
    if (!touched) return;
    scale = -a.lr / (std::sqrt(acc) + a.eps);
  }
  double u = *usq;  // continues the running sum (the same order of additions)
  for (int64_t d = 0; d < w; ++d) {
    const float up = scale * gr[d];
    row[d] += up;
    u += static_cast<double>(up) * up;
  }
  *usq = u;
}

// Thread t's rows (r % threads == t): returns the sums of squared updates and row gradients.
// W > 0: the width as a compile-time constant (the row loops unrolled and vectorized), else w.
template <int64_t W>
void UpdateRows(const Args& a, ThreadScratch& ts, int t, int64_t w_runtime, double* upd_sq,
                double* grad_sq) {
  const int64_t w = W > 0 ? W : w_runtime;
  // 1. Each distinct row's gradient: the bags that read it summed in (s, b, h) order (a row's
  //    repeats in the order of the batch), each row gathered where it is first seen.
  ts.row.clear();
  ts.count.clear();
  ts.first.clear();
  const int64_t cap = std::min<int64_t>(a.nbags * a.h, a.rows) * w;
  if (static_cast<int64_t>(ts.grad.size()) < cap) ts.grad.resize(cap);
  float* grad = ts.grad.data();
  int32_t n = 0;
  for (int64_t bag = 0; bag < a.nbags; ++bag) {
    const int32_t* ids = a.keys + bag * a.h;
    const float* src = a.grad + bag * w;
    for (int64_t j = 0; j < a.h; ++j) {
      const int32_t r = ids[j];
      if (r < 0 || r >= a.rows || (a.threads > 1 && r % a.threads != t)) continue;
      int32_t p = a.pos[r];
      float* acc;
      if (p < 0) {
        p = n++;
        a.pos[r] = p;
        ts.row.push_back(r);
        ts.count.push_back(0);
        ts.first.push_back(bag);
        acc = grad + static_cast<int64_t>(p) * w;
        for (int64_t d = 0; d < w; ++d) acc[d] = 0.0f;
      } else {
        acc = grad + static_cast<int64_t>(p) * w;
      }
      for (int64_t d = 0; d < w; ++d) acc[d] += src[d];
      ++ts.count[p];
    }
  }
  // 2. The rows in address order (as FBGEMM visits them; the statistics' sums keep one order).
  ts.order.resize(n);
  for (int32_t p = 0; p < n; ++p) {
    ts.order[p] = (static_cast<uint64_t>(ts.row[p]) << 32) | static_cast<uint32_t>(p);
    a.pos[ts.row[p]] = -1;
  }
  RadixSortByRow(ts.order, ts.tmp, a.bits);
  // 3. Per row: the row's L2 and CowClip, then the optimizer.
  constexpr int64_t kAhead = 8;  // prefetch distance: rows are random reads, latency-bound
  double usq = 0.0, gsq = 0.0;
  for (int32_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const int64_t ahead = static_cast<int64_t>(ts.order[i + kAhead] >> 32);
      PrefetchRow(a.table + ahead * w, w, 1);
      if (a.adagrad) __builtin_prefetch(a.accum + ahead, 1);
    }
    const int32_t p = static_cast<int32_t>(ts.order[i] & 0xffffffffu);
    UpdateRow<W>(a, ts.row[p], grad + static_cast<int64_t>(p) * w, w, ts.count[p], ts.first[p],
                 &usq, &gsq);
  }
  *upd_sq = usq;
  *grad_sq = gsq;
}

// Thread t's rows as UpdateRows, for wide rows: the thread's (row, bag) pairs radix-sorted by
// row (stably: a row's repeats stay in (s, b, h) order), as FBGEMM's CPU kernels do, so each
// row's gradient is a run of pairs summed into one cache-resident row. Summing where first seen
// instead writes and re-reads a [distinct rows, w] scratch at random: at width 64 and 20 ids a
// bag that is hundreds of MiB, where this reads only the bags' gradients (half the time).
template <int64_t W>
void UpdateRowsSorted(const Args& a, ThreadScratch& ts, int t, int64_t w_runtime,
                      double* upd_sq, double* grad_sq) {
  const int64_t w = W > 0 ? W : w_runtime;
  std::vector<uint64_t>& e = ts.order;
  e.clear();
  for (int64_t bag = 0; bag < a.nbags; ++bag) {
    const int32_t* ids = a.keys + bag * a.h;
    for (int64_t j = 0; j < a.h; ++j) {
      const int32_t r = ids[j];
      if (r >= 0 && r < a.rows && r % a.threads == t) {
        e.push_back((static_cast<uint64_t>(r) << 32) | static_cast<uint32_t>(bag));
      }
    }
  }
  RadixSortByRow(e, ts.tmp, a.bits);
  const int64_t n = static_cast<int64_t>(e.size());
  if (static_cast<int64_t>(ts.grad.size()) < w) ts.grad.resize(w);
  float* gr = ts.grad.data();
  constexpr int64_t kAhead = 16;  // prefetch distance: rows are random reads, latency-bound
  double usq = 0.0, gsq = 0.0;
  for (int64_t i = 0; i < n;) {
    const int32_t r = static_cast<int32_t>(e[i] >> 32);
    const int64_t first_bag = static_cast<int64_t>(e[i] & 0xffffffffu);
    const int64_t first = i;
    for (int64_t d = 0; d < w; ++d) gr[d] = 0.0f;
    for (; i < n && static_cast<int32_t>(e[i] >> 32) == r; ++i) {
      if (i + kAhead < n) {
        const int64_t ahead = static_cast<int64_t>(e[i + kAhead] >> 32);
        PrefetchRow(a.table + ahead * w, w, 1);
        if (a.adagrad) __builtin_prefetch(a.accum + ahead, 1);
      }
      const float* src = a.grad + static_cast<int64_t>(e[i] & 0xffffffffu) * w;
      for (int64_t d = 0; d < w; ++d) gr[d] += src[d];
    }
    UpdateRow<W>(a, r, gr, w, static_cast<int32_t>(i - first), first_bag, &usq, &gsq);
  }
  *upd_sq = usq;
  *grad_sq = gsq;
}

// One member's update (Args filled but for the scratch and thread count): its rows in place,
// and [sum of squared updates, sum of squared row gradients] into stats.
void UpdateOne(Args a, int64_t w, float* stats) {
  UseHugePages(a.table, a.rows * w * sizeof(float));
  if (a.adagrad) UseHugePages(a.accum, a.rows * sizeof(float));
  Workspace& ws = GetWorkspace();
  std::lock_guard<std::mutex> lock(ws.mu);
  const bool sorted = std::min<int64_t>(a.nbags * a.h, a.rows) * w * int64_t{sizeof(float)} >
                      kFirstSeenMaxScratch;
  a.threads = static_cast<int>(std::min<int64_t>(
      NumThreads(),
      std::max<int64_t>(1, a.nbags * a.h / (sorted ? kSortedPairsPerThread : kPairsPerThread))));
  if (static_cast<int>(ws.threads.size()) < a.threads) ws.threads.resize(a.threads);
  if (!sorted && static_cast<int64_t>(ws.pos.size()) < a.rows) ws.pos.resize(a.rows, -1);
  a.pos = ws.pos.data();
  a.bits = 1;
  while (a.bits < 31 && (int64_t{1} << a.bits) < a.rows) ++a.bits;
  std::vector<double> upd_sq(a.threads, 0.0), grad_sq(a.threads, 0.0);
  ParallelFor(a.threads, [&](int t) {
    ThreadScratch& ts = ws.threads[t];
    double* u = &upd_sq[t];
    double* g = &grad_sq[t];
    if (sorted) {
      switch (w) {
        case 32: return UpdateRowsSorted<32>(a, ts, t, w, u, g);
        case 64: return UpdateRowsSorted<64>(a, ts, t, w, u, g);
        case 128: return UpdateRowsSorted<128>(a, ts, t, w, u, g);
        default: return UpdateRowsSorted<0>(a, ts, t, w, u, g);
      }
    }
    switch (w) {
      case 4: return UpdateRows<4>(a, ts, t, w, u, g);
      case 8: return UpdateRows<8>(a, ts, t, w, u, g);
      case 16: return UpdateRows<16>(a, ts, t, w, u, g);
      case 32: return UpdateRows<32>(a, ts, t, w, u, g);
      case 64: return UpdateRows<64>(a, ts, t, w, u, g);
      case 128: return UpdateRows<128>(a, ts, t, w, u, g);
      default: return UpdateRows<0>(a, ts, t, w, u, g);
    }
  });
  double usq = 0.0, gsq = 0.0;
  for (int t = 0; t < a.threads; ++t) {
    usq += upd_sq[t];
    gsq += grad_sq[t];
  }
  stats[0] = static_cast<float>(usq);
  stats[1] = static_cast<float>(gsq);
}

// buf [R, w], acc [R] (any shape without adagrad), keys [S, B, H], grad [S, B, w], lr [],
// table_dim [S] -> buf, acc in place, stats [2]. Under jax.vmap (vmap_method="broadcast_all",
// cpu_ffi.py) every operand and result has a leading member axis K: each member's rows are
// updated from its own keys, gradients and learning rate, one member after another.
ffi::Error UpdateImpl(ffi::Buffer<ffi::F32> buf, ffi::Buffer<ffi::F32> acc,
                      ffi::Buffer<ffi::S32> keys, ffi::Buffer<ffi::F32> grad,
                      ffi::Buffer<ffi::F32> lr_buf, ffi::Buffer<ffi::S32> table_dim,
                      float eps, int32_t adagrad, float clip_ratio, float clip_min_norm,
                      float row_l2, ffi::ResultBuffer<ffi::F32> buf_out,
                      ffi::ResultBuffer<ffi::F32> acc_out, ffi::ResultBuffer<ffi::F32> stats) {
  const auto bd = buf.dimensions();
  const auto kd = keys.dimensions();
  const auto gd = grad.dimensions();
  const bool batched = bd.size() == 3;
  const int64_t members = batched ? bd[0] : 1, o = batched ? 1 : 0;
  if (bd.size() != static_cast<size_t>(2 + o) || kd.size() != static_cast<size_t>(3 + o) ||
      gd.size() != static_cast<size_t>(3 + o) || (batched && (kd[0] != members ||
      gd[0] != members || lr_buf.element_count() != members)) || gd[o] != kd[o] ||
      gd[o + 1] != kd[o + 1] || gd[o + 2] != bd[o + 1]) {
    return ffi::Error::InvalidArgument(
        "recscale_update: buf [R, w], keys [S, B, H], grad [S, B, w] expected (or all with a "
        "member axis)");
  }
  const int64_t rows = bd[o], w = bd[o + 1];
  if (adagrad && acc.element_count() != members * rows) {
    return ffi::Error::InvalidArgument("recscale_update: acc must be [R]");
  }
  const int64_t nbags = kd[o] * kd[o + 1], h = kd[o + 2];
  const int64_t acc_stride = acc.element_count() / members;
  const int64_t tdim_stride = table_dim.element_count() / members;
  for (int64_t m = 0; m < members; ++m) {
    Args a;
    // Outputs alias the inputs (input_output_aliases): update them in place.
    a.table = buf_out->typed_data() + m * rows * w;
    a.accum = acc_out->typed_data() + m * acc_stride;
    a.keys = keys.typed_data() + m * nbags * h;
    a.grad = grad.typed_data() + m * nbags * w;
    a.tdim = table_dim.typed_data() + m * tdim_stride;
    a.rows = rows;
    a.nbags = nbags;
    a.batch = kd[o + 1];
    a.h = h;
    a.lr = lr_buf.typed_data()[m];
    a.eps = eps;
    a.clip_ratio = clip_ratio;
    a.clip_min_norm = clip_min_norm;
    a.row_l2 = row_l2;
    a.adagrad = adagrad != 0;
    UpdateOne(a, w, stats->typed_data() + 2 * m);
  }
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
