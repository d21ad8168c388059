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
#include <vector>

namespace {

using fp4serve_cpu::from_float;
using fp4serve_cpu::load_vec;
using fp4serve_cpu::to_float;
using fp4serve_cpu::Vec;

// Work (multiply-adds) below which a call runs on the calling thread: waking OpenMP's workers
// costs more than a small decode batch's attention (engine/cpu_threads.py has the measurements).
constexpr int64_t kSerialMacs = 1 << 20;
// Query heads per KV head held in registers while a key row is read once for all of them.
constexpr int64_t kMaxGroup = 8;

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

// The rows of one KV head's keys (half 0) or values (half 1) for keys t0..t1-1 of a request, page by
// page: f(t, row). One division per call, none per key (at 64 dims a division per key cost as much as
// the key's multiply-adds).
template <typename CT, typename F>
inline void for_each_row(const CT* cache, const int32_t* pages, const Meta& m, int64_t kv_head, int64_t half, int64_t t0,
                         int64_t t1, F&& f) {
  for (int64_t t = t0, p = t0 / m.block_size; t < t1; ++p) {
    const CT* row = cache + pages[p] * m.page_stride + half * m.half_stride + kv_head * m.head_dim +
                    (t % m.block_size) * m.row_stride;
    for (const int64_t end = std::min(t1, (p + 1) * m.block_size); t < end; ++t, row += m.row_stride) f(t, row);
  }
}

// scores[g * n + t] = qf[g] . k_t for the G query heads of one KV head (qf: G x D floats, scaled).
template <typename CT>
void key_scores(const float* qf, const CT* cache, const int32_t* pages, const Meta& m, int64_t kv_head, int64_t n,
                float* scores) {
  const int64_t G = m.group, D = m.head_dim, W = Vec::size();
  const int64_t Dv = D - D % W;
  for_each_row(cache, pages, m, kv_head, 0, 0, n, [&](int64_t t, const CT* k) {
    if (G <= kMaxGroup) {
      Vec acc[kMaxGroup];
      for (int64_t g = 0; g < G; ++g) acc[g] = Vec(0.f);
      for (int64_t d = 0; d < Dv; d += W) {
        const Vec kd = load_vec(k + d);
        for (int64_t g = 0; g < G; ++g) acc[g] = at::vec::fmadd(Vec::loadu(qf + g * D + d), kd, acc[g]);
      }
      for (int64_t g = 0; g < G; ++g) {
        float dot = acc[g].reduce_add();
        for (int64_t d = Dv; d < D; ++d) dot += qf[g * D + d] * to_float(k[d]);
        scores[g * n + t] = dot;
      }
    } else {
      for (int64_t g = 0; g < G; ++g) {
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * to_float(k[d]);
        scores[g * n + t] = dot;
      }
    }
  });
}

// acc[g * D ..] = sum_t p[g * n + t] v_t for the G query heads, NV vectors wide (D = NV * W): per
// chunk of keys (its values stay in L1 across the heads) each head's sums stay in registers (a load
// and store of the sums per key and vector cost more than the FMAs).
template <int64_t NV, typename CT>
void weighted_values(const float* p, const CT* cache, const int32_t* pages, const Meta& m, int64_t kv_head, int64_t n,
                     float* acc) {
  constexpr int64_t W = Vec::size(), kChunk = 64;
  std::fill(acc, acc + m.group * NV * W, 0.f);
  for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
    const int64_t t1 = std::min(n, t0 + kChunk);
    for (int64_t g = 0; g < m.group; ++g) {
      Vec a[NV];
      for (int64_t d = 0; d < NV; ++d) a[d] = Vec::loadu(acc + g * NV * W + d * W);
      for_each_row(cache, pages, m, kv_head, 1, t0, t1, [&](int64_t t, const CT* v) {
        const Vec w(p[g * n + t]);
        for (int64_t d = 0; d < NV; ++d) a[d] = at::vec::fmadd(w, load_vec(v + d * W), a[d]);
      });
      for (int64_t d = 0; d < NV; ++d) a[d].store(acc + g * NV * W + d * W);
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

// One (query row, KV head): the G query heads of that KV head attend over the row's visible keys.
// scores: scratch of at least G * n_keys floats; acc and qf: G * D floats each.
template <typename QT, typename CT>
void attend_row(const QT* q_row, QT* out_row, const CT* cache, const Meta& m, int64_t request, int64_t kv_head,
                int64_t n_keys, float scale, float* scores, float* acc, float* qf) {
  const int64_t G = m.group, D = m.head_dim, W = Vec::size();
  const int64_t Dv = D - D % W;
  for (int64_t g = 0; g < G; ++g) {
    const QT* src = q_row + (kv_head * G + g) * D;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(src[d]) * scale;
  }
  const int32_t* pages = m.kv_indices + m.kv_indptr[request];
  key_scores<CT>(qf, cache, pages, m, kv_head, n_keys, scores);
  for (int64_t g = 0; g < G; ++g) softmax_inplace(scores + g * n_keys, n_keys);
  if (D == 4 * W) {
    weighted_values<4>(scores, cache, pages, m, kv_head, n_keys, acc);
  } else if (D == 8 * W) {
    weighted_values<8>(scores, cache, pages, m, kv_head, n_keys, acc);
  } else {
    std::fill(acc, acc + G * D, 0.f);
    for_each_row(cache, pages, m, kv_head, 1, 0, n_keys, [&](int64_t t, const CT* v) {
      for (int64_t d = 0; d < Dv; d += W) {
        const Vec vd = load_vec(v + d);
        for (int64_t g = 0; g < G; ++g) {
          float* a = acc + g * D + d;
          at::vec::fmadd(Vec(scores[g * n_keys + t]), vd, Vec::loadu(a)).store(a);
        }
      }
      for (int64_t d = Dv; d < D; ++d) {
        for (int64_t g = 0; g < G; ++g) acc[g * D + d] += scores[g * n_keys + t] * to_float(v[d]);
      }
    });
  }
  for (int64_t g = 0; g < G; ++g) {
    QT* dst = out_row + (kv_head * G + g) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = from_float<QT>(acc[g * D + d]);
  }
}

template <typename QT, typename CT>
void run_attention(const at::Tensor& q, at::Tensor& out, const at::Tensor& kv_cache, const Meta& m, float scale) {
  const int64_t num_rows = q.size(0);
  const QT* qp = q.data_ptr<QT>();
  QT* op = out.data_ptr<QT>();
  const CT* cache = kv_cache.data_ptr<CT>();
  const int64_t q_row_stride = q.stride(0), out_row_stride = out.stride(0);
  // Which request each query row belongs to, and how many keys it sees.
  std::vector<int64_t> row_request(num_rows), row_keys(num_rows);
  int64_t total_keys = 0, max_keys = 0;
  for (int64_t i = 0; i < m.num_requests; ++i) {
    const int64_t q0 = m.qo_indptr[i], q1 = m.qo_indptr[i + 1];
    const int64_t num_pages = m.kv_indptr[i + 1] - m.kv_indptr[i];
    const int64_t seq_len = num_pages == 0 ? 0 : (num_pages - 1) * m.block_size + m.kv_last_page_len[i];
    for (int64_t r = q0; r < q1; ++r) {
      row_request[r] = i;
      row_keys[r] = seq_len - (q1 - r) + 1;
      TORCH_CHECK(row_keys[r] >= 1, "paged_attention: request ", i, " has fewer keys than query rows");
      total_keys += row_keys[r];
      max_keys = std::max(max_keys, row_keys[r]);
    }
  }
  const int64_t items = num_rows * m.num_kv_heads;
  const int64_t macs = total_keys * m.num_kv_heads * m.group * m.head_dim * 2;
  auto work = [&](int64_t begin, int64_t end) {
    std::vector<float> scores(m.group * max_keys), acc(m.group * m.head_dim), qf(m.group * m.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / m.num_kv_heads, h = item % m.num_kv_heads;
      attend_row<QT, CT>(qp + r * q_row_stride, op + r * out_row_stride, cache, m, row_request[r], h, row_keys[r],
                         scale, scores.data(), acc.data(), qf.data());
    }
  };
  if (macs < kSerialMacs) {
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
