// A weight-only int4 linear for a few rows: y[T, N] = x[T, K] W^T with W = (code - 8) * scale + zero
// per group of 32 input columns (GGUF Q4_1's grid; engine/weights/formats/int4_linear.py), x and y
// bf16, the sums in float32.
//
// Why by hand: torch's `_weight_int4pack_mm_for_cpu` read SmolLM2's int4 layers at ~10 GB/s per
// core where a plain bf16 sum over the same bytes reaches ~23 (docs/PERF.md, "The int4 kernel, the
// int8 head's prefetch and huge pages").
// With AVX512-BF16 a block of 4 groups (64 bytes of codes) becomes 4 x 32 bf16 values in registers
// with shifts, masks and an OR only (no shuffles: OR-ing a code q into bf16 128.0's bits gives
// 128 + q), then one VDPBF16PS per group against x; each group's partial sums take its scale once,
// and the zero point and the 128 fold into a per-group sum X_g of x:
//   sum_k W[n,k] x[k] = sum_g scale[n,g] * ((128 + codes) . x)_g + sum_g (zero[n,g] - 136 scale[n,g]) X_g.
// Without AVX512-BF16 the same layout runs a plain float loop (correct, not fast): the engine then
// keeps torch's kernel (`int4_gemv_native`).
//
// Layout (pack_int4_codes in kernels/cpu_int4.py): codes [N, Kp / 2] uint8, Kp = K rounded up to
// 64; per row, blocks of 4 groups in 64 bytes (32 little-endian 16-bit words: word j holds column
// j of the block's 4 groups, group m in bits 4m..4m+3), and when Kp / 32 is 2 mod 4 a last pair of
// groups in 32 bytes (16 words: word j holds columns j and j + 16 of the first group, then the
// same of the second). scales_zeros [N, Kp / 32, 2] bf16 (scale, zero); a padding group has scale
// and zero 0. Reference: kernels/cpu_int4.py (int4_gemv_ref), compared in tests/test_cpu_int4.py.

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FP4SERVE_INT4_NATIVE 1
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kPairBytes = 32;  // codes of two groups
// Code bytes below which the op runs on the calling thread (waking OpenMP's workers costs more).
constexpr int64_t kSerialBytes = 48 * 1024;
constexpr int64_t kInputRows = 4;  // input rows per pass over the weights

#if defined(FP4SERVE_INT4_NATIVE)

constexpr int64_t kWeightRows = 4;  // weight rows per tile
constexpr int64_t kPrefetchBytes = 2048;

// Per input row, laid out for the loop below: xb, the row's bf16 values, zero past K (to Kp);
// xz, per group g the pair (-136 X_g, X_g) as floats, X_g the group's sum, zero past the groups.
struct Prepared {
  std::vector<uint16_t> xb;
  std::vector<float> xz;
  int64_t kp, ldz;
};

Prepared prepare(const at::Tensor& x, int64_t kp) {
  const int64_t rows = x.size(0), k = x.size(1), groups = kp / kGroup;
  Prepared p{std::vector<uint16_t>(rows * kp, 0), std::vector<float>(rows * (groups * 2 + 16), 0.f), kp, groups * 2 + 16};
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  for (int64_t t = 0; t < rows; ++t) {
    const uint16_t* src = xp + t * x.stride(0);
    std::copy(src, src + k, p.xb.data() + t * kp);
    float* xz = p.xz.data() + t * p.ldz;
    for (int64_t c = 0; c < k; ++c) xz[(c / kGroup) * 2 + 1] += c10::BFloat16(src[c], c10::BFloat16::from_bits());
    for (int64_t g = 0; g < groups; ++g) xz[g * 2] = -136.f * xz[g * 2 + 1];
  }
  return p;
}

// The (scale, zero) pair at `p` -> the scale in every lane (a 32-bit broadcast from memory: the
// scale is the pair's low half).
inline __m512 broadcast_scale(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p)), 16));
}

// out[i * ldo + r] = row r of the tile times input row i, for R weight rows and I input rows.
// Codes: per block of 4 groups, 64 bytes = 32 words, word j = the 4 groups' codes of column j,
// one nibble each (group 4b + m in bits 4m..4m+3); a last pair of groups (Kp / 32 = 2 mod 4) in
// 32 bytes = 16 words, word j = (group a: column j, column j + 16, group b: the same).
template <int64_t R, int64_t I>
inline void tile(const uint8_t* codes, int64_t ldc, const c10::BFloat16* sz, int64_t ldsz, const Prepared& p,
                 int64_t t0, float* out, int64_t ldo) {
  const int64_t groups = p.kp / kGroup, blocks = groups / 4;
  __m512 acc[R][I];
  __m256 zacc[R][I];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; ++i) acc[r][i] = _mm512_setzero_ps(), zacc[r][i] = _mm256_setzero_ps();
  const uint16_t* xb = p.xb.data() + t0 * p.kp;
  const float* xz = p.xz.data() + t0 * p.ldz;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512bh xs[I][4];
    for (int64_t i = 0; i < I; ++i)
      for (int64_t m = 0; m < 4; ++m) xs[i][m] = (__m512bh)_mm512_loadu_si512(xb + i * p.kp + b * 128 + m * 32);
    for (int64_t r = 0; r < R; ++r) {
      const uint8_t* c = codes + r * ldc + b * 64;
      _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchBytes), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(c);
      __m512bh v[4];
      fp4serve_cpu::nibbles_to_bf16(w, v);
      const c10::BFloat16* s = sz + r * ldsz + b * 8;
      const __m256 szf = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))), 16));
      for (int64_t m = 0; m < 4; ++m) {
        const __m512 scale = broadcast_scale(s + 2 * m);
        for (int64_t i = 0; i < I; ++i)
          acc[r][i] = _mm512_fmadd_ps(scale, _mm512_dpbf16_ps(_mm512_setzero_ps(), v[m], xs[i][m]), acc[r][i]);
      }
      for (int64_t i = 0; i < I; ++i) zacc[r][i] = _mm256_fmadd_ps(szf, _mm256_loadu_ps(xz + i * p.ldz + b * 8), zacc[r][i]);
    }
  }
  if (groups % 4) {  // the last pair of groups
    const int64_t g = blocks * 4;
    for (int64_t r = 0; r < R; ++r) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + r * ldc + blocks * 64));
      __m256bh v[4];
      fp4serve_cpu::nibbles_to_bf16(w, v);
      const c10::BFloat16* s = sz + r * ldsz + g * 2;
      const __m128 szf = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))), 16));
      for (int64_t i = 0; i < I; ++i) {
        const uint16_t* x = xb + i * p.kp + g * kGroup;
        auto xv = [x](int64_t at) { return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + at)); };
        const __m256 da = _mm256_dpbf16_ps(_mm256_dpbf16_ps(_mm256_setzero_ps(), v[0], xv(0)), v[1], xv(16));
        const __m256 db = _mm256_dpbf16_ps(_mm256_dpbf16_ps(_mm256_setzero_ps(), v[2], xv(32)), v[3], xv(48));
        const __m256 sa = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi32(*reinterpret_cast<const int32_t*>(s)), 16));
        const __m256 sb = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi32(*reinterpret_cast<const int32_t*>(s + 2)), 16));
        const __m128 zt = _mm_mul_ps(szf, _mm_loadu_ps(xz + i * p.ldz + g * 2));  // the two zero terms
        zacc[r][i] = _mm256_add_ps(zacc[r][i], _mm256_fmadd_ps(sb, db, _mm256_mul_ps(sa, da)));
        zacc[r][i] = _mm256_add_ps(zacc[r][i], _mm256_zextps128_ps256(zt));
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; ++i)
      out[i * ldo + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][i], _mm512_zextps256_ps512(zacc[r][i])));
}

template <int64_t I>
void rows_of_tiles(const uint8_t* codes, int64_t ldc, const c10::BFloat16* sz, int64_t ldsz, const Prepared& p,
                   int64_t t0, float* out, int64_t ldo, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + kWeightRows <= end; n += kWeightRows)
    tile<kWeightRows, I>(codes + n * ldc, ldc, sz + n * ldsz, ldsz, p, t0, out + n, ldo);
  for (; n < end; ++n) tile<1, I>(codes + n * ldc, ldc, sz + n * ldsz, ldsz, p, t0, out + n, ldo);
}

#endif  // FP4SERVE_INT4_NATIVE

// The code of column j of group g in one row's codes (the layout above; the plain loop's reader).
inline int code_at(const uint8_t* row, int64_t groups, int64_t g, int64_t j) {
  const int64_t blocks = groups / 4;
  uint16_t word;
  int shift;
  if (g < blocks * 4) {
    const uint8_t* w = row + (g / 4) * 64 + j * 2;
    word = static_cast<uint16_t>(w[0] | (w[1] << 8));
    shift = 4 * static_cast<int>(g % 4);
  } else {
    const uint8_t* w = row + blocks * 64 + (j % 16) * 2;
    word = static_cast<uint16_t>(w[0] | (w[1] << 8));
    shift = 8 * static_cast<int>(g - blocks * 4) + 4 * static_cast<int>(j / 16);
  }
  return (word >> shift) & 0x0f;
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_zeros) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "int4_gemv: bf16 x [T, K] with contiguous rows");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.size(1) % kPairBytes == 0,
              "int4_gemv: contiguous uint8 codes [N, Kp / 2], Kp a multiple of 64");
  const int64_t n_out = codes.size(0), kp = codes.size(1) * 2, groups = kp / kGroup, rows = x.size(0);
  TORCH_CHECK(x.size(1) <= kp && x.size(1) > kp - 2 * kGroup, "int4_gemv: x has ", x.size(1), " columns for ", kp, " columns of codes");
  TORCH_CHECK(scales_zeros.dim() == 3 && scales_zeros.is_contiguous() && scales_zeros.scalar_type() == at::kBFloat16 &&
                  scales_zeros.size(0) == n_out && scales_zeros.size(1) == groups && scales_zeros.size(2) == 2,
              "int4_gemv: contiguous bf16 scales_zeros [N, Kp / 32, 2]");
  at::Tensor y = at::empty({rows, n_out}, x.options());
  std::vector<float> acc(rows * n_out);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const c10::BFloat16* szp = scales_zeros.data_ptr<c10::BFloat16>();
  const int64_t ldc = kp / 2, ldsz = groups * 2;
#if defined(FP4SERVE_INT4_NATIVE)
  const Prepared p = prepare(x, kp);
  auto work = [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < rows; t0 += kInputRows) {
      float* out = acc.data() + t0 * n_out;
      switch (std::min(kInputRows, rows - t0)) {
        case 1: rows_of_tiles<1>(cp, ldc, szp, ldsz, p, t0, out, n_out, begin, end); break;
        case 2: rows_of_tiles<2>(cp, ldc, szp, ldsz, p, t0, out, n_out, begin, end); break;
        case 3: rows_of_tiles<3>(cp, ldc, szp, ldsz, p, t0, out, n_out, begin, end); break;
        default: rows_of_tiles<4>(cp, ldc, szp, ldsz, p, t0, out, n_out, begin, end); break;
      }
    }
    for (int64_t t = 0; t < rows; ++t)
      fp4serve_cpu::store_row(acc.data() + t * n_out + begin, y.data_ptr<c10::BFloat16>() + t * n_out + begin, end - begin);
  };
  const int64_t tiles = (n_out + kWeightRows - 1) / kWeightRows;
#else
  // Plain float loops over the same layout (no AVX512-BF16 here).
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  auto work = [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* c = cp + n * ldc;
      for (int64_t t = 0; t < rows; ++t) {
        const c10::BFloat16* xt = xp + t * x.stride(0);
        float sum = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const float scale = szp[n * ldsz + 2 * g], zero = szp[n * ldsz + 2 * g + 1];
          float dot = 0.f, xs = 0.f;
          for (int64_t j = 0; j < kGroup; ++j) {
            const int64_t col = g * kGroup + j;
            if (col >= x.size(1)) break;
            const float xv = xt[col];
            dot += static_cast<float>(code_at(c, groups, g, j)) * xv;
            xs += xv;
          }
          sum += scale * dot + (zero - 8.f * scale) * xs;
        }
        acc[t * n_out + n] = sum;
      }
    }
    for (int64_t t = 0; t < rows; ++t)
      fp4serve_cpu::store_row(acc.data() + t * n_out + begin, y.data_ptr<c10::BFloat16>() + t * n_out + begin, end - begin);
  };
  constexpr int64_t kWeightRows = 1;
  const int64_t tiles = n_out;
#endif
  if (codes.numel() < kSerialBytes || tiles < 2) {
    work(0, n_out);
  } else {
    // Whole tiles per thread, each thread's share at least kSerialBytes / 2 of codes.
    const int64_t grain = std::max<int64_t>(1, kSerialBytes / 2 / std::max<int64_t>(1, ldc * kWeightRows));
    at::parallel_for(0, tiles, grain, [&](int64_t b, int64_t e) {
      work(std::min(b * kWeightRows, n_out), std::min(e * kWeightRows, n_out));
    });
  }
  return y;
}

bool int4_gemv_native() {
#if defined(FP4SERVE_INT4_NATIVE)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp4serve_cpu, m) {
  m.def("int4_gemv(Tensor x, Tensor codes, Tensor scales_zeros) -> Tensor");
  m.def("int4_gemv_native() -> bool");
}

TORCH_LIBRARY_IMPL(fp4serve_cpu, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
}

TORCH_LIBRARY_IMPL(fp4serve_cpu, CompositeExplicitAutograd, m) {
  m.impl("int4_gemv_native", &int4_gemv_native);
}
