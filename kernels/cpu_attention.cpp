// Paged attention on CPU over FlashInfer's NHD page layout, attending to the pages in place.
//
// Why by hand: torch has no CPU op that reads a paged KV cache. The torch reference
// (kernels/cpu_attention.py: paged_attention_ref) gathers every request's keys and values into
// contiguous copies per layer, then calls SDPA; at 32 decode rows that copy alone was ~10 ms of a
// step. These loops read each K/V row once, where it lies, in bf16 or float32, and accumulate in
// float32. Built once per machine by torch.utils.cpp_extension (-O3 -march=native: gcc vectorizes
// the head_dim loops) and registered as torch ops, so a compiled graph calls them without Python.
//
// Layouts (engine/attention/backend.py): kv_cache [num_pages, 2, block_size, Hkv, D] (K then V);
// q [T, Hq, D]; qo_indptr [B+1] and kv_indptr [B+1] int32, kv_indices int32 page ids,
// kv_last_page_len [B] int32; query head hq reads KV head hq / (Hq / Hkv) (GQA, as SDPA's
// enable_gqa). Request i's query rows are causal against its keys: row j of its q_len rows sees
// keys 0 .. seq_len - q_len + j.

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using fp4serve_cpu::from_float;
using fp4serve_cpu::load_vec;
using fp4serve_cpu::to_float;
using fp4serve_cpu::Vec;

// Work (multiply-adds) below which a call runs on the calling thread: waking OpenMP's workers
// costs more than a small decode batch's attention (engine/cpu_threads.py has the measurements).
constexpr int64_t kSerialMacs = 1 << 20;
// The next work item's first pages (K and V halves, at most this many bytes) are prefetched into
// L2 while an item is computed (a quarter of the L2 of the CPUs we run on).
constexpr int64_t kPrefetchBytes = 256 << 10;

struct Meta {
  const int32_t* qo_indptr;
  const int32_t* kv_indptr;
  const int32_t* kv_indices;
  const int32_t* kv_last_page_len;
  int64_t num_requests;
  int64_t block_size;
  int64_t num_kv_heads;
  int64_t group;  // query heads per KV head
  int64_t head_dim;
  // Strides of the cache in elements: page, K/V half, row within the page; heads are contiguous.
  int64_t page_stride;
  int64_t half_stride;
  int64_t row_stride;
};

// Pulls [p, p + bytes) toward L1 ahead of its use. A request's pages lie anywhere in the cache and
// each page is only 16 rows, too short for the hardware's stream prefetchers to catch up: reading
// the next page while this one is computed hid most of the misses (docs/PERF.md).
template <int Hint = _MM_HINT_T0>
inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, static_cast<_mm_hint>(Hint));
}

// Where a request's keys (half 0) or values (half 1) of page p begin: rows of Hkv contiguous heads.
template <typename CT>
inline const CT* page_rows(const CT* cache, const int32_t* pages, const Meta& m, int64_t p, int64_t half) {
  return cache + pages[p] * m.page_stride + half * m.half_stride;
}

// scores[b * n + i] = q_b . k_i for NB query heads (q: NB rows of D floats, scaled) and `count` key
// rows of one KV head (k: the first, rows `stride` apart). NV: D in vectors, 0 when D is not a
// multiple of the vector width (then runtime loops). The heads and vectors are compile-time, so
// the sums stay in registers.
template <int64_t NV, int64_t NB, typename CT>
inline void score_rows(const float* q, const CT* k, int64_t stride, int64_t count, int64_t D, float* scores,
                       int64_t n) {
  constexpr int64_t W = Vec::size();
  for (int64_t i = 0; i < count; ++i, k += stride) {
    if constexpr (NV > 0) {
      Vec kv[NV];
      for (int64_t d = 0; d < NV; ++d) kv[d] = load_vec(k + d * W);
      for (int64_t b = 0; b < NB; ++b) {
        Vec acc = Vec::loadu(q + b * D) * kv[0];
        for (int64_t d = 1; d < NV; ++d) acc = at::vec::fmadd(Vec::loadu(q + b * D + d * W), kv[d], acc);
        scores[b * n + i] = acc.reduce_add();
      }
    } else {
      const int64_t Dv = D - D % W;
      for (int64_t b = 0; b < NB; ++b) {
        Vec acc(0.f);
        for (int64_t d = 0; d < Dv; d += W) acc = at::vec::fmadd(Vec::loadu(q + b * D + d), load_vec(k + d), acc);
        float dot = acc.reduce_add();
        for (int64_t d = Dv; d < D; ++d) dot += q[b * D + d] * to_float(k[d]);
        scores[b * n + i] = dot;
      }
    }
  }
}

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
// score_rows for bf16 queries and keys, D = 32 * NP: VDPBF16PS multiplies the bf16 pairs exactly
// and sums them in float32, so the keys are never widened to floats (half the instructions of the
// float loop); q is unscaled, the scale applied to each sum.
template <int64_t NP, int64_t NB>
inline void score_rows_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t stride, int64_t count,
                            int64_t D, float scale, float* scores, int64_t n) {
  __m512bh qv[NB][NP];
  for (int64_t b = 0; b < NB; ++b) {
    for (int64_t d = 0; d < NP; ++d) qv[b][d] = (__m512bh)_mm512_loadu_si512(q + b * D + d * 32);
  }
  for (int64_t i = 0; i < count; ++i, k += stride) {
    __m512bh kv[NP];
    for (int64_t d = 0; d < NP; ++d) kv[d] = (__m512bh)_mm512_loadu_si512(k + d * 32);
    for (int64_t b = 0; b < NB; ++b) {
      __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[b][0], kv[0]);
      for (int64_t d = 1; d < NP; ++d) acc = _mm512_dpbf16_ps(acc, qv[b][d], kv[d]);
      scores[b * n + i] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}
#endif

// acc_b += sum_i p[b * n + i] v_i for NB query heads (acc: NB rows of D floats) over `count` value
// rows of one KV head; NV as in score_rows.
template <int64_t NV, int64_t NB, typename CT>
inline void add_weighted_rows(const float* p, const CT* v, int64_t stride, int64_t count, int64_t D, float* acc,
                              int64_t n) {
  constexpr int64_t W = Vec::size();
  if constexpr (NV > 0) {
    // Every head's sums in registers at once (NB * NV <= 16): per key, NB * NV independent FMAs on
    // one load of the row; one head at a time, its NV sums each waited on the FMA's latency.
    Vec a[NB][NV];
    for (int64_t b = 0; b < NB; ++b) {
      for (int64_t d = 0; d < NV; ++d) a[b][d] = Vec::loadu(acc + b * D + d * W);
    }
    for (int64_t i = 0; i < count; ++i, v += stride) {
      Vec vv[NV];
      for (int64_t d = 0; d < NV; ++d) vv[d] = load_vec(v + d * W);
      for (int64_t b = 0; b < NB; ++b) {
        const Vec w(p[b * n + i]);
        for (int64_t d = 0; d < NV; ++d) a[b][d] = at::vec::fmadd(w, vv[d], a[b][d]);
      }
    }
    for (int64_t b = 0; b < NB; ++b) {
      for (int64_t d = 0; d < NV; ++d) a[b][d].store(acc + b * D + d * W);
    }
  } else {
    const int64_t Dv = D - D % W;
    for (int64_t i = 0; i < count; ++i, v += stride) {
      for (int64_t b = 0; b < NB; ++b) {
        const float w = p[b * n + i];
        float* a = acc + b * D;
        for (int64_t d = 0; d < Dv; d += W) at::vec::fmadd(Vec(w), load_vec(v + d), Vec::loadu(a + d)).store(a + d);
        for (int64_t d = Dv; d < D; ++d) a[d] += w * to_float(v[d]);
      }
    }
  }
}

// The G query heads of one KV head in blocks of at most kMaxBlock(NV) (compile-time, so their
// sums fit the registers): f(block's first head, the block's size as a template argument).
constexpr int64_t kMaxBlock(int64_t NV) { return NV == 0 ? 4 : std::clamp<int64_t>(16 / NV, 1, 4); }

template <int64_t NV, typename F>
inline void for_head_blocks(int64_t G, F&& f) {
  constexpr int64_t B = kMaxBlock(NV);
  for (int64_t g0 = 0; g0 < G; g0 += B) {
    switch (std::min<int64_t>(B, G - g0)) {
      case 1: f(g0, std::integral_constant<int64_t, 1>{}); break;
      case 2: if constexpr (B >= 2) f(g0, std::integral_constant<int64_t, 2>{}); break;
      case 3: if constexpr (B >= 3) f(g0, std::integral_constant<int64_t, 3>{}); break;
      default: f(g0, std::integral_constant<int64_t, B>{}); break;
    }
  }
}

// s[0..n) <- softmax(s[0..n)), in place.
inline void softmax_inplace(float* s, int64_t n) {
  const int64_t W = Vec::size(), nv = n - n % W;
  float mx = -std::numeric_limits<float>::max();
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  const Vec vmx(mx);
  Vec vsum(0.f);
  for (int64_t t = 0; t < nv; t += W) {
    const Vec e = (Vec::loadu(s + t) - vmx).exp_u20();  // the exp of torch's CPU flash attention
    e.store(s + t);
    vsum = vsum + e;
  }
  float sum = vsum.reduce_add();
  for (int64_t t = nv; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  const Vec inv(1.f / sum);
  for (int64_t t = 0; t < nv; t += W) (Vec::loadu(s + t) * inv).store(s + t);
  for (int64_t t = nv; t < n; ++t) s[t] *= 1.f / sum;
}

// Query rows [0, nrows) of one request (rows `q_stride` / `out_stride` apart; row j sees the
// request's first n_keys - (nrows - 1 - j) keys, causal), KV heads [h0, h1): their query heads
// attend over the keys. The keys, then the values, are read page by page, each page's rows once
// for all those heads and rows (a verify step's k + 1 rows or a short chunk share one pass), the
// next page prefetched while this one is used. A row's keys past its own count get weight 0 after
// its softmax (they are this request's keys, written before the call: finite), so each row's
// numbers are bit for bit those it gets alone.
// Scratch: scores (h1 - h0) * nrows * G * n_keys floats; acc and qf (h1 - h0) * nrows * G * D
// floats each; qb as many QT (the rows' query heads gathered, head-major then row then group).
template <int64_t NV, typename QT, typename CT>
void attend_rows(const QT* q0, int64_t q_stride, QT* out0, int64_t out_stride, int64_t nrows, const CT* cache,
                 const Meta& m, int64_t request, int64_t h0, int64_t h1, int64_t n_keys, float scale, float* scores,
                 float* acc, float* qf, QT* qb) {
  const int64_t G = m.group, D = m.head_dim, bs = m.block_size, rs = m.row_stride;
  const int64_t per_head = nrows * G, heads = (h1 - h0) * per_head, n = n_keys;
  const int64_t span = bs * rs * static_cast<int64_t>(sizeof(CT));  // one page's K or V half, bytes
  // bf16 queries and keys at a width of whole 512-bit vectors: the dot products in bf16 pairs.
  constexpr bool kBf16Dots = std::is_same_v<QT, c10::BFloat16> && std::is_same_v<CT, c10::BFloat16> && NV > 0 &&
                             NV % 2 == 0 && Vec::size() == 16;
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t j = 0; j < nrows; ++j) {
      const QT* src = q0 + j * q_stride + h * G * D;
      const int64_t at = ((h - h0) * nrows + j) * G * D;
      if constexpr (kBf16Dots) {
        std::copy(src, src + G * D, qb + at);
      } else {
        for (int64_t e = 0; e < G * D; ++e) qf[at + e] = to_float(src[e]) * scale;
      }
    }
  const int32_t* pages = m.kv_indices + m.kv_indptr[request];
  const int64_t num_pages = (n + bs - 1) / bs;
  for (int64_t p = 0; p < num_pages; ++p) {
    const CT* rows = page_rows(cache, pages, m, p, 0);
    if (p + 1 < num_pages) prefetch_span(page_rows(cache, pages, m, p + 1, 0), span);
    if (p + 2 < num_pages) prefetch_span<_MM_HINT_T1>(page_rows(cache, pages, m, p + 2, 0), span);
    prefetch_span<_MM_HINT_T1>(page_rows(cache, pages, m, p, 1), span);  // this page's values, for the second pass
    const int64_t t0 = p * bs, count = std::min(n, t0 + bs) - t0;
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t first = (h - h0) * per_head;
      for_head_blocks<NV>(per_head, [&](int64_t g0, auto nb) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
        if constexpr (kBf16Dots) {
          score_rows_bf16<NV / 2, decltype(nb)::value>(qb + (first + g0) * D, rows + h * D, rs, count, D, scale,
                                                       scores + (first + g0) * n + t0, n);
          return;
        }
#endif
        score_rows<NV, decltype(nb)::value>(qf + (first + g0) * D, rows + h * D, rs, count, D,
                                            scores + (first + g0) * n + t0, n);
      });
    }
  }
  for (int64_t b = 0; b < heads; ++b) {
    const int64_t seen = n - (nrows - 1 - (b / G) % nrows);  // row (b / G) % nrows
    softmax_inplace(scores + b * n, seen);
    std::fill(scores + b * n + seen, scores + (b + 1) * n, 0.f);
  }
  std::fill(acc, acc + heads * D, 0.f);
  for (int64_t p = 0; p < num_pages; ++p) {
    const CT* rows = page_rows(cache, pages, m, p, 1);
    if (p + 1 < num_pages) prefetch_span(page_rows(cache, pages, m, p + 1, 1), span);
    const int64_t t0 = p * bs, count = std::min(n, t0 + bs) - t0;
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t first = (h - h0) * per_head;
      for_head_blocks<NV>(per_head, [&](int64_t g0, auto nb) {
        add_weighted_rows<NV, decltype(nb)::value>(scores + (first + g0) * n + t0, rows + h * D, rs, count, D,
                                                   acc + (first + g0) * D, n);
      });
    }
  }
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t j = 0; j < nrows; ++j) {
      const float* a = acc + ((h - h0) * nrows + j) * G * D;
      QT* dst = out0 + j * out_stride + h * G * D;
      for (int64_t e = 0; e < G * D; ++e) dst[e] = from_float<QT>(a[e]);
    }
}

// Query rows of one request that share a pass over its keys (attend_rows): at most this many.
constexpr int64_t kMaxRowsPerPass = 16;

template <typename QT, typename CT>
void run_attention(const at::Tensor& q, at::Tensor& out, const at::Tensor& kv_cache, const Meta& m, float scale) {
  const QT* qp = q.data_ptr<QT>();
  QT* op = out.data_ptr<QT>();
  const CT* cache = kv_cache.data_ptr<CT>();
  const int64_t q_row_stride = q.stride(0), out_row_stride = out.stride(0);
  // Passes: a request's query rows, up to kMaxRowsPerPass at a time, with the keys its last row
  // sees (its earlier rows see one fewer each).
  struct Pass {
    int64_t request, first_row, num_rows, keys;
  };
  std::vector<Pass> passes;
  int64_t total_keys = 0, max_keys = 0, max_rows = 1;
  for (int64_t i = 0; i < m.num_requests; ++i) {
    const int64_t q0 = m.qo_indptr[i], q1 = m.qo_indptr[i + 1];
    const int64_t num_pages = m.kv_indptr[i + 1] - m.kv_indptr[i];
    const int64_t seq_len = num_pages == 0 ? 0 : (num_pages - 1) * m.block_size + m.kv_last_page_len[i];
    TORCH_CHECK(q1 == q0 || seq_len - (q1 - q0) + 1 >= 1, "paged_attention: request ", i,
                " has fewer keys than query rows");
    for (int64_t r = q0; r < q1; r += kMaxRowsPerPass) {
      const int64_t rows = std::min(kMaxRowsPerPass, q1 - r), keys = seq_len - (q1 - (r + rows));
      passes.push_back({i, r, rows, keys});
      total_keys += rows * keys;
      max_keys = std::max(max_keys, keys);
      max_rows = std::max(max_rows, rows);
    }
  }
  const int64_t macs = total_keys * m.num_kv_heads * m.group * m.head_dim * 2;
  const bool serial = macs < kSerialMacs;
  const int64_t num_passes = static_cast<int64_t>(passes.size());
  // A work item is a pass with all its KV heads (a page's rows are read once for all of them);
  // with fewer passes than a few per thread, a pass's KV heads are split over the threads instead.
  const int64_t splits = !serial && num_passes < 4 * at::get_num_threads() ? m.num_kv_heads : 1;
  const int64_t heads_per_item = m.num_kv_heads / splits, items = num_passes * splits;
  constexpr int64_t W = Vec::size();
  const int64_t nv = m.head_dim % W == 0 ? m.head_dim / W : 0;
  auto work = [&](int64_t begin, int64_t end) {
    const int64_t width = heads_per_item * m.group * max_rows;
    std::vector<float> scores(width * max_keys), acc(width * m.head_dim), qf(width * m.head_dim);
    std::vector<QT> qb(width * m.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const Pass& pass = passes[item / splits];
      const int64_t h0 = (item % splits) * heads_per_item, h1 = h0 + heads_per_item;
      const int64_t next = (item + 1) / splits;
      if (item + 1 < end && next != item / splits) {  // the next pass's first pages into L2 while this one is computed
        const int32_t* pages = m.kv_indices + m.kv_indptr[passes[next].request];
        const int64_t span = m.block_size * m.row_stride * static_cast<int64_t>(sizeof(CT));
        const int64_t ahead = std::min((passes[next].keys + m.block_size - 1) / m.block_size,
                                       std::max<int64_t>(1, kPrefetchBytes / (2 * span)));
        for (int64_t p = 0; p < ahead; ++p) {
          prefetch_span<_MM_HINT_T1>(page_rows(cache, pages, m, p, 0), span);
          prefetch_span<_MM_HINT_T1>(page_rows(cache, pages, m, p, 1), span);
        }
      }
      const QT* qr = qp + pass.first_row * q_row_stride;
      QT* orow = op + pass.first_row * out_row_stride;
      auto run = [&](auto nv_const) {
        attend_rows<decltype(nv_const)::value, QT, CT>(qr, q_row_stride, orow, out_row_stride, pass.num_rows, cache, m,
                                                       pass.request, h0, h1, pass.keys, scale, scores.data(),
                                                       acc.data(), qf.data(), qb.data());
      };
      switch (nv) {  // head_dim 64, 128, 256 at AVX512's width (32, 64, 128 at AVX2's)
        case 2: run(std::integral_constant<int64_t, 2>{}); break;
        case 4: run(std::integral_constant<int64_t, 4>{}); break;
        case 8: run(std::integral_constant<int64_t, 8>{}); break;
        case 16: run(std::integral_constant<int64_t, 16>{}); break;
        default: run(std::integral_constant<int64_t, 0>{}); break;
      }
    }
  };
  if (serial) {
    work(0, items);
  } else {
    at::parallel_for(0, items, 1, work);
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& qo_indptr,
                           const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                           const at::Tensor& kv_last_page_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention: q [T, Hq, D] with rows of contiguous heads");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "paged_attention: a contiguous kv_cache [num_pages, 2, block_size, Hkv, D]");
  for (const at::Tensor* t : {&qo_indptr, &kv_indptr, &kv_indices, &kv_last_page_len}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "paged_attention: int32 contiguous metadata");
  }
  const int64_t num_kv_heads = kv_cache.size(3), head_dim = kv_cache.size(4);
  TORCH_CHECK(q.size(2) == head_dim && q.size(1) % num_kv_heads == 0, "paged_attention: q heads/head_dim do not match the cache");
  TORCH_CHECK(qo_indptr.numel() == kv_indptr.numel() && kv_last_page_len.numel() == qo_indptr.numel() - 1,
              "paged_attention: one qo/kv range and last-page length per request");
  Meta m{qo_indptr.data_ptr<int32_t>(), kv_indptr.data_ptr<int32_t>(), kv_indices.data_ptr<int32_t>(),
         kv_last_page_len.data_ptr<int32_t>(), qo_indptr.numel() - 1, kv_cache.size(2), num_kv_heads,
         q.size(1) / num_kv_heads, head_dim, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2)};
  TORCH_CHECK(m.qo_indptr[m.num_requests] == q.size(0), "paged_attention: qo_indptr does not cover q's rows");
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  const float s = static_cast<float>(scale);
#define FP4SERVE_CACHE_CASE(QT, CT)                                           \
  if (q.scalar_type() == c10::CppTypeToScalarType<QT>::value &&               \
      kv_cache.scalar_type() == c10::CppTypeToScalarType<CT>::value) {        \
    run_attention<QT, CT>(q, out, kv_cache, m, s);                            \
    return out;                                                               \
  }
  FP4SERVE_CACHE_CASE(c10::BFloat16, c10::BFloat16)
  FP4SERVE_CACHE_CASE(float, float)
  FP4SERVE_CACHE_CASE(float, c10::BFloat16)
  FP4SERVE_CACHE_CASE(c10::BFloat16, float)
  FP4SERVE_CACHE_CASE(c10::Half, c10::Half)
  FP4SERVE_CACHE_CASE(float, c10::Half)
#undef FP4SERVE_CACHE_CASE
  TORCH_CHECK(false, "paged_attention: q ", q.scalar_type(), " with a ", kv_cache.scalar_type(), " cache is not built");
}

template <typename ST, typename CT>
void write_rows(const at::Tensor& src, at::Tensor& kv_cache, int64_t half, const int64_t* slots) {
  const int64_t T = src.size(0), row = src.size(1) * src.size(2), bs = kv_cache.size(2);
  const ST* s = src.data_ptr<ST>();
  CT* c = kv_cache.data_ptr<CT>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    CT* dst = c + (slot / bs) * kv_cache.stride(0) + half * kv_cache.stride(1) + (slot % bs) * kv_cache.stride(2);
    const ST* from = s + t * src.stride(0);
#pragma omp simd
    for (int64_t e = 0; e < row; ++e) dst[e] = from_float<CT>(to_float(from[e]));
  }
}

// k/v [T, Hkv, D] (rows of contiguous heads) into the cache at slot_mapping [T] int64
// (page * block_size + offset), cast to the cache's dtype. Always on the calling thread: a step
// writes at most a few hundred KB here.
void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "reshape_and_cache: a contiguous kv_cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "reshape_and_cache: int64 slot_mapping");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t half = 0; half < 2; ++half) {
    const at::Tensor& src = half == 0 ? k : v;
    TORCH_CHECK(src.dim() == 3 && src.stride(2) == 1 && src.stride(1) == src.size(2) && src.size(0) == slot_mapping.numel() &&
                    src.size(1) == kv_cache.size(3) && src.size(2) == kv_cache.size(4),
                "reshape_and_cache: k/v [T, Hkv, D] with rows of contiguous heads, one slot per row");
#define FP4SERVE_WRITE_CASE(ST, CT)                                                                   \
  if (src.scalar_type() == c10::CppTypeToScalarType<ST>::value &&                                     \
      kv_cache.scalar_type() == c10::CppTypeToScalarType<CT>::value) {                                \
    write_rows<ST, CT>(src, kv_cache, half, slots);                                                   \
    continue;                                                                                         \
  }
    FP4SERVE_WRITE_CASE(c10::BFloat16, c10::BFloat16)
    FP4SERVE_WRITE_CASE(float, float)
    FP4SERVE_WRITE_CASE(float, c10::BFloat16)
    FP4SERVE_WRITE_CASE(c10::BFloat16, float)
    FP4SERVE_WRITE_CASE(c10::Half, c10::Half)
    FP4SERVE_WRITE_CASE(float, c10::Half)
#undef FP4SERVE_WRITE_CASE
    TORCH_CHECK(false, "reshape_and_cache: ", src.scalar_type(), " into a ", kv_cache.scalar_type(), " cache is not built");
  }
}

}  // namespace

TORCH_LIBRARY(fp4serve_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, "
        "Tensor kv_last_page_len, float scale) -> Tensor");
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(fp4serve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("reshape_and_cache", &reshape_and_cache);
}
