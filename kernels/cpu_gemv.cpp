// A weight-only int8 linear for a few rows: y[T, N] = x[T, K] (codes[N, K] * scales[N])^T, the
// int8 codes widened to float32 in registers, the products summed in float32, each output rounded
// once to x's dtype (the numbers of torch's `_weight_int8pack_mm`, up to summation order).
//
// Why by hand: torch's `_weight_int8pack_mm` read SmolLM2's 27 MiB int8 lm_head at ~5.5 GB/s in one
// thread, a fifth of a 1-row decode step (docs/PERF.md, "The 1-stream step"). This loop keeps 4
// weight rows x up to 4 input rows of accumulators in registers, so each weight byte is read once
// per 4 input rows, prefetches the weights ahead, and splits the weight rows over torch's threads
// when there is enough work.
//
// NOTE: an AVX512-VNNI form that quantized x to Q8_0 (llama.cpp's way) read the head 4x faster
// from cache but made the built-in model answer "What is the capital of France?" wrongly, as
// llama.cpp does (tests/test_default_model.py); so x stays float.
// Reference: kernels/cpu_gemv.py, compared with it in tests/test_cpu_gemv.py.

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

using fp4serve_cpu::load_row;
using fp4serve_cpu::store_row;
using fp4serve_cpu::Vec;

constexpr int64_t kWeightRows = 4;  // weight rows per tile
constexpr int64_t kInputRows = 4;   // input rows per tile
// Multiply-adds below which the op runs on the calling thread (waking OpenMP's workers costs more).
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the tile the weights are prefetched
constexpr int64_t kSerialWork = 1 << 20;

// Vec::size() int8 codes as floats.
inline Vec load_codes(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  float tmp[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
#endif
}

// out[t * ldo + n] = sum_k x[t][k] * w[n][k] for R weight rows from `w` and I input rows of `x`.
template <int64_t R, int64_t I>
inline void tile(const int8_t* w, int64_t ldw, const float* x, int64_t ldx, int64_t k, float* out, int64_t ldo) {
  const int64_t W = Vec::size(), kv = k - k % W;
  Vec acc[R][I];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; ++i) acc[r][i] = Vec(0.f);
  for (int64_t c = 0; c < kv; c += W) {
    if (c % 64 == 0) {
      // NOTE: without this the loop read weights from memory at a fifth of the pace a plain sum
      // reaches (the rows interleave in short streams the hardware prefetcher does not follow).
      for (int64_t r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * ldw + c + kPrefetchBytes), _MM_HINT_T0);
    }
    Vec xs[I];
    for (int64_t i = 0; i < I; ++i) xs[i] = Vec::loadu(x + i * ldx + c);
    for (int64_t r = 0; r < R; ++r) {
      const Vec wv = load_codes(w + r * ldw + c);
      for (int64_t i = 0; i < I; ++i) acc[r][i] = at::vec::fmadd(wv, xs[i], acc[r][i]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      float sum = acc[r][i].reduce_add();
      for (int64_t c = kv; c < k; ++c) sum += static_cast<float>(w[r * ldw + c]) * x[i * ldx + c];
      out[i * ldo + r] = sum;
    }
  }
}


template <int64_t I>
void rows_of_tiles(const int8_t* w, int64_t k, const float* x, float* out, int64_t n_out, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + kWeightRows <= end; n += kWeightRows) tile<kWeightRows, I>(w + n * k, k, x, k, k, out + n, n_out);
  for (; n < end; ++n) tile<1, I>(w + n * k, k, x, k, k, out + n, n_out);
}

template <typename T>
void int8_gemv_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, at::Tensor& y) {
  const int64_t rows = x.size(0), k = x.size(1), n_out = codes.size(0);
  std::vector<float> xf(rows * k), acc(rows * n_out), sc(n_out);
  const T* xp = x.data_ptr<T>();
  for (int64_t t = 0; t < rows; ++t) load_row(xp + t * x.stride(0), xf.data() + t * k, k);
  load_row(scales.data_ptr<T>(), sc.data(), n_out);
  const int8_t* w = codes.data_ptr<int8_t>();
  auto work = [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < rows; t0 += kInputRows) {
      const float* xt = xf.data() + t0 * k;
      float* ot = acc.data() + t0 * n_out;
      switch (std::min(kInputRows, rows - t0)) {
        case 1: rows_of_tiles<1>(w, k, xt, ot, n_out, begin, end); break;
        case 2: rows_of_tiles<2>(w, k, xt, ot, n_out, begin, end); break;
        case 3: rows_of_tiles<3>(w, k, xt, ot, n_out, begin, end); break;
        default: rows_of_tiles<4>(w, k, xt, ot, n_out, begin, end); break;
      }
    }
    for (int64_t t = 0; t < rows; ++t) {
      float* a = acc.data() + t * n_out;
      for (int64_t n = begin; n < end; ++n) a[n] *= sc[n];
      store_row(a + begin, y.data_ptr<T>() + t * n_out + begin, end - begin);
    }
  };
  if (rows * n_out * k < kSerialWork) {
    work(0, n_out);
  } else {
    // Whole tiles per thread; the grain keeps a thread's share to at least ~kSerialWork / 4.
    const int64_t grain = std::max<int64_t>(kWeightRows, kSerialWork / 4 / std::max<int64_t>(1, rows * k));
    at::parallel_for(0, n_out / kWeightRows + 1, std::max<int64_t>(1, grain / kWeightRows),
                     [&](int64_t b, int64_t e) { work(std::min(b * kWeightRows, n_out), std::min(e * kWeightRows, n_out)); });
  }
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "int8_gemv: x [T, K] with contiguous rows");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kChar && codes.size(1) == x.size(1),
              "int8_gemv: contiguous int8 codes [N, K] with x's K");
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.size(0) == codes.size(0) &&
                  scales.scalar_type() == x.scalar_type(), "int8_gemv: contiguous scales [N] in x's dtype");
  at::Tensor y = at::empty({x.size(0), codes.size(0)}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    int8_gemv_impl<c10::BFloat16>(x, codes, scales, y);
  } else if (x.scalar_type() == at::kHalf) {
    int8_gemv_impl<c10::Half>(x, codes, scales, y);
  } else if (x.scalar_type() == at::kFloat) {
    int8_gemv_impl<float>(x, codes, scales, y);
  } else {
    TORCH_CHECK(false, "int8_gemv: bfloat16, float16 or float32, got ", x.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp4serve_cpu, m) {
  m.def("int8_gemv(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(fp4serve_cpu, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
}
