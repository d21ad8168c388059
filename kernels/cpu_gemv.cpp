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
// With bf16 inputs on AVX512-BF16 the codes go through VDPBF16PS instead (tile_bf16 below): twice the
// float loop's pace from cache; from memory both read at the same pace (docs/PERF.md "The int4 kernel, ...").
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
// Input rows per pass over the weights on the VDPBF16PS path: a verify step's k + 1 <= 8 rows read
// the head once.
constexpr int64_t kInputRowsBf16 = 8;
// Multiply-adds below which the op runs on the calling thread (waking OpenMP's workers costs more).
// How far ahead of the tile the weights are prefetched, into L2 (_MM_HINT_T2): into L1 at 4 KiB the
// VDPBF16PS loop read the head from memory well below a plain sum's pace, into L2 at 8 KiB at
// about that pace, the float loop faster too (docs/PERF.md "The int4 kernel, ...").
constexpr int64_t kPrefetchL2Bytes = 8192;
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
      for (int64_t r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * ldw + c + kPrefetchL2Bytes), _MM_HINT_T2);
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


#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define FP4SERVE_INT8_BF16 1
// bf16 inputs on AVX512-BF16: a code v = 16 h + l with l = v & 15 and h + 8 = (v ^ 0x80) >> 4, both
// 0..15, become bf16 128 + l and 128 + h + 8 with shifts and masks (OR-ing a nibble into 128.0's bits,
// as kernels/cpu_int4.cpp does), and VDPBF16PS multiplies them by x and 16 x (exact in bf16), so
//   sum_k v_k x_k = sum_k (128 + h_k + 8) 16 x_k + sum_k (128 + l_k) x_k - 2304 sum_k x_k.
// A 64-byte load is 32 words of two codes: word j holds codes 2j and 2j + 1, so the nibble vectors
// pair with x's even and odd columns (prepared once per call). No per-code conversions: ~12 vector
// ops per 64 codes where the float loop above takes ~12 per 16.
struct Bf16Input {
  std::vector<uint16_t> even, odd, even16, odd16;  // per input row, K / 2 each, blocks of 64 codes
  std::vector<float> sums;                           // sum of x over the blocks' columns, per input row
  int64_t half;
};

Bf16Input prepare_bf16(const c10::BFloat16* x, int64_t rows, int64_t ldx, int64_t kb) {
  Bf16Input p{std::vector<uint16_t>(rows * kb / 2), std::vector<uint16_t>(rows * kb / 2), std::vector<uint16_t>(rows * kb / 2),
              std::vector<uint16_t>(rows * kb / 2), std::vector<float>(rows, 0.f), kb / 2};
  for (int64_t t = 0; t < rows; ++t) {
    const c10::BFloat16* src = x + t * ldx;
    for (int64_t m = 0; m < kb / 2; ++m) {
      const c10::BFloat16 e = src[2 * m], o = src[2 * m + 1];
      p.even[t * p.half + m] = e.x;
      p.odd[t * p.half + m] = o.x;
      p.even16[t * p.half + m] = c10::BFloat16(static_cast<float>(e) * 16.f).x;  // a power of two: exact
      p.odd16[t * p.half + m] = c10::BFloat16(static_cast<float>(o) * 16.f).x;
      p.sums[t] += static_cast<float>(e) + static_cast<float>(o);
    }
  }
  return p;
}

// out[t * ldo + r] = the first kb columns of R weight rows times I input rows (kb a multiple of 64).
// Up to 4 input rows, their 4 vectors per block are loaded first and each weight row is decoded where
// it is used; for more (a speculative verify step's k + 1), the R <= 2 weight rows are decoded first
// and each input row's vectors are loaded from L1 where they are used, so the R * I accumulators,
// the decoded vectors and the inputs fit in the 32 registers. Either way each (r, i) runs the same
// instructions in the same order: a row's result does not depend on how many rows share the call.
template <int64_t R, int64_t I>
inline void tile_bf16(const int8_t* w, int64_t ldw, const Bf16Input& p, int64_t t0, int64_t kb, float* out, int64_t ldo) {
  constexpr bool kInputsFirst = I <= 4;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R][I];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; ++i) acc[r][i] = _mm512_setzero_ps();
  auto load_inputs = [&](int64_t i, int64_t c, __m512bh x[4]) {
    const int64_t at = (t0 + i) * p.half + c / 2;
    x[0] = (__m512bh)_mm512_loadu_si512(p.even.data() + at);
    x[1] = (__m512bh)_mm512_loadu_si512(p.even16.data() + at);
    x[2] = (__m512bh)_mm512_loadu_si512(p.odd.data() + at);
    x[3] = (__m512bh)_mm512_loadu_si512(p.odd16.data() + at);
  };
  // l and h + 8 of the even codes (the words' low bytes), then of the odd ones; v + 128 as unsigned bytes
  auto decode = [&](int64_t r, int64_t c, __m512bh v[4]) {
    const int8_t* row = w + r * ldw + c;
    _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchL2Bytes), _MM_HINT_T2);
    fp4serve_cpu::nibbles_to_bf16(_mm512_xor_si512(_mm512_loadu_si512(row), flip), v);
  };
  auto accumulate = [&](int64_t r, int64_t i, const __m512bh v[4], const __m512bh x[4]) {
    __m512 a = _mm512_dpbf16_ps(acc[r][i], v[0], x[0]);
    a = _mm512_dpbf16_ps(a, v[1], x[1]);
    a = _mm512_dpbf16_ps(a, v[2], x[2]);
    acc[r][i] = _mm512_dpbf16_ps(a, v[3], x[3]);
  };
  for (int64_t c = 0; c < kb; c += 64) {
    if constexpr (kInputsFirst) {
      __m512bh xs[I][4];
      for (int64_t i = 0; i < I; ++i) load_inputs(i, c, xs[i]);
      for (int64_t r = 0; r < R; ++r) {
        __m512bh v[4];
        decode(r, c, v);
        for (int64_t i = 0; i < I; ++i) accumulate(r, i, v, xs[i]);
      }
    } else {
      __m512bh v[R][4];
      for (int64_t r = 0; r < R; ++r) decode(r, c, v[r]);
      for (int64_t i = 0; i < I; ++i) {
        __m512bh x[4];
        load_inputs(i, c, x);
        for (int64_t r = 0; r < R; ++r) accumulate(r, i, v[r], x);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; ++i) out[i * ldo + r] = _mm512_reduce_add_ps(acc[r][i]) - 2304.f * p.sums[t0 + i];
}

template <int64_t I>
void rows_of_tiles_bf16(const int8_t* w, int64_t k, const Bf16Input& p, int64_t t0, int64_t kb, float* out, int64_t n_out,
                        int64_t begin, int64_t end) {
  constexpr int64_t R = I <= 4 ? kWeightRows : 2;  // weight rows per tile, as registers allow
  int64_t n = begin;
  for (; n + R <= end; n += R) tile_bf16<R, I>(w + n * k, k, p, t0, kb, out + n, n_out);
  for (; n < end; ++n) tile_bf16<1, I>(w + n * k, k, p, t0, kb, out + n, n_out);
}
#endif

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
#if defined(FP4SERVE_INT8_BF16)
  // bf16 inputs: whole blocks of 64 columns on the VDPBF16PS path, the rest (k % 64) in floats below.
  const int64_t kb = std::is_same_v<T, c10::BFloat16> ? k - k % 64 : 0;
  Bf16Input p;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (kb) p = prepare_bf16(xp, rows, x.stride(0), kb);
  }
#else
  constexpr int64_t kb = 0;
#endif
  auto work = [&](int64_t begin, int64_t end) {
    const int64_t pass_rows = kb ? kInputRowsBf16 : kInputRows;
    for (int64_t t0 = 0; t0 < rows; t0 += pass_rows) {
      const float* xt = xf.data() + t0 * k;
      float* ot = acc.data() + t0 * n_out;
#if defined(FP4SERVE_INT8_BF16)
      if (kb) {
        switch (std::min(kInputRowsBf16, rows - t0)) {
          case 1: rows_of_tiles_bf16<1>(w, k, p, t0, kb, ot, n_out, begin, end); break;
          case 2: rows_of_tiles_bf16<2>(w, k, p, t0, kb, ot, n_out, begin, end); break;
          case 3: rows_of_tiles_bf16<3>(w, k, p, t0, kb, ot, n_out, begin, end); break;
          case 4: rows_of_tiles_bf16<4>(w, k, p, t0, kb, ot, n_out, begin, end); break;
          case 5: rows_of_tiles_bf16<5>(w, k, p, t0, kb, ot, n_out, begin, end); break;
          case 6: rows_of_tiles_bf16<6>(w, k, p, t0, kb, ot, n_out, begin, end); break;
          case 7: rows_of_tiles_bf16<7>(w, k, p, t0, kb, ot, n_out, begin, end); break;
          default: rows_of_tiles_bf16<8>(w, k, p, t0, kb, ot, n_out, begin, end); break;
        }
        if (kb < k) {  // the columns past the last whole block, as floats
          for (int64_t t = t0; t < std::min(rows, t0 + kInputRowsBf16); ++t)
            for (int64_t n = begin; n < end; ++n) {
              float sum = 0.f;
              for (int64_t c = kb; c < k; ++c) sum += static_cast<float>(w[n * k + c]) * xf[t * k + c];
              acc[t * n_out + n] += sum;
            }
        }
        continue;
      }
#endif
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
