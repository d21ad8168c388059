// A weight-only int4 linear for a few rows: y[T, N] = x[T, K] W^T with W = (code - 8) * scale + zero
// per group of 32 input columns (GGUF Q4_1's grid; engine/weights/formats/int4_linear.py), x and y
// bf16, the sums in float32.
//
// Why by hand: torch's `_weight_int4pack_mm_for_cpu` read SmolLM2's int4 layers at ~10 GB/s per
// core where a plain bf16 sum over the same bytes reaches ~23 (docs/PERF.md, "The int4 kernel, the
// int8 head's prefetch and huge pages").
// With AVX512-BF16 a superblock of 8 groups (128 bytes of codes) becomes 8 x 32 bf16 values in
// registers with shifts, masks and an OR only (no shuffles: OR-ing a code q into bf16 128.0's bits
// gives 128 + q). The codes are laid out so that each 32-bit lane of those vectors belongs to one
// group (lane l: group l % 8), so 8 VDPBF16PS chain per input row and the 8 groups' scales apply
// once, lane by lane, per superblock: two instructions per 32 weights and row became 1 + 1/8, which
// is what makes several input rows (a speculative verify step's k + 1) cheap. The zero point and
// the 128 fold into a per-group sum X_g of x:
//   sum_k W[n,k] x[k] = sum_g scale[n,g] * ((128 + codes) . x)_g + sum_g (zero[n,g] - 136 scale[n,g]) X_g.
// Without AVX512-BF16 the same layout runs a plain float loop (correct, not fast): the engine then
// keeps torch's kernel (`int4_gemv_native`).
//
// Layout (pack_int4_codes in kernels/cpu_int4.py): codes [N, Kp / 2] uint8, Kp = K rounded up to
// 64; per row, superblocks of 8 groups in 128 bytes (two halves q = 0, 1 of 32 little-endian
// 16-bit words: nibble m (bits 4m..4m+3) of word e of half q holds group (e / 2) % 8, column
// 16 ((e / 2) / 8) + 2 (4q + m) + e % 2), then the remaining groups (Kp / 32 mod 8: 0, 2, 4 or 6)
// as pairs in 32 bytes each (16 words: word j holds columns j and j + 16 of the first group, then
// the same of the second). scales_zeros [N, Kp / 32, 2] bf16 (scale, zero); a padding group has
// scale and zero 0. Reference: kernels/cpu_int4.py (int4_gemv_ref), compared in tests/test_cpu_int4.py.

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
constexpr int64_t kSuperGroups = 8;  // groups per superblock (128 bytes of codes)
// Code bytes below which the op runs on the calling thread (waking OpenMP's workers costs more).
constexpr int64_t kSerialBytes = 48 * 1024;
constexpr int64_t kInputRows = 8;  // input rows per pass over the weights (a verify step's k + 1)

#if defined(FP4SERVE_INT4_NATIVE)

constexpr int64_t kWeightRows = 4;  // weight rows per thread's unit of work
constexpr int64_t kPrefetchBytes = 2048;

// Per input row, laid out for the loop below: xb, the row's bf16 values, zero past K (to Kp),
// within each superblock in the order its decoded codes come: vector c (the VDPBF16PS that
// multiplies decoded vector c), lane l holds columns 32 g + 16 h + 2c and the next, g = l % 8,
// h = l / 8 (the codes' layout above), so the 32-bit pairs move whole, by one gather per vector;
// xz, per group g the pair (-136 X_g, X_g) as floats, X_g the group's sum, zero past the groups.
struct Prepared {
  std::vector<uint16_t> xb;
  std::vector<float> xz;
  int64_t kp, ldz;
};

Prepared prepare(const at::Tensor& x, int64_t kp) {
  const int64_t rows = x.size(0), k = x.size(1), groups = kp / kGroup;
  const int64_t super_cols = groups / kSuperGroups * kSuperGroups * kGroup;
  Prepared p{std::vector<uint16_t>(rows * kp, 0), std::vector<float>(rows * (groups * 2 + 16), 0.f), kp, groups * 2 + 16};
  std::vector<uint16_t> row(kp, 0);  // one input row, zero past K
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  // 32-bit pair u = 16 g + 8 h + c of a superblock for lane l = 8 h + g of vector c (c added below).
  const __m512i base = _mm512_set_epi32(120, 104, 88, 72, 56, 40, 24, 8, 112, 96, 80, 64, 48, 32, 16, 0);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t t = 0; t < rows; ++t) {
    const uint16_t* src = xp + t * x.stride(0);
    std::copy(src, src + k, row.data());
    uint16_t* dst = p.xb.data() + t * kp;
    for (int64_t s = 0; s < super_cols; s += kSuperGroups * kGroup)
      for (int c = 0; c < 8; ++c)
        _mm512_storeu_si512(dst + s + c * 32, _mm512_i32gather_epi32(_mm512_add_epi32(base, _mm512_set1_epi32(c)),
                                                                     row.data() + s, 4));
    std::copy(row.data() + super_cols, row.data() + kp, dst + super_cols);
    float* xz = p.xz.data() + t * p.ldz;
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i v = _mm512_loadu_si512(row.data() + g * kGroup);  // 32 bf16: even and odd halves of 16 pairs
      const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), _mm512_castsi512_ps(_mm512_and_si512(v, high)));
      xz[g * 2 + 1] = _mm512_reduce_add_ps(sum);
      xz[g * 2] = -136.f * xz[g * 2 + 1];
    }
  }
  return p;
}

// The scales of a superblock's 8 groups as floats, lane l holding group l % 8's: the bf16 scale
// (the low half of each (scale, zero) pair at `p`) moved into the high half of lane l.
inline __m512 superblock_scales(const c10::BFloat16* p) {
  const __m512i idx = _mm512_set_epi16(14, 0, 12, 0, 10, 0, 8, 0, 6, 0, 4, 0, 2, 0, 0, 0,
                                       14, 0, 12, 0, 10, 0, 8, 0, 6, 0, 4, 0, 2, 0, 0, 0);
  const __m512i pairs = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, pairs));
}

// out[i * ldo + r] = row r of the tile times input row i, for R weight rows and I input rows.
// Each superblock of codes is loaded and decoded once for all I input rows; the inputs are read
// from L1 where they are used, and the zero-point terms and the last pairs of groups run after the
// main loop, so R * I accumulators and the decoded superblock stay in the 32 registers.
// Each (r, i) runs the same instructions in the same order whatever R and I are: a row's result
// does not depend on how many rows share the call (speculation keeps greedy output unchanged).
template <int64_t R, int64_t I>
inline void tile(const uint8_t* codes, int64_t ldc, const c10::BFloat16* sz, int64_t ldsz, const Prepared& p,
                 int64_t t0, float* out, int64_t ldo) {
  const int64_t groups = p.kp / kGroup, supers = groups / kSuperGroups;
  __m512 acc[R][I];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; ++i) acc[r][i] = _mm512_setzero_ps();
  const uint16_t* xb = p.xb.data() + t0 * p.kp;
  const float* xz = p.xz.data() + t0 * p.ldz;
  for (int64_t b = 0; b < supers; ++b) {
    for (int64_t r = 0; r < R; ++r) {
      const uint8_t* c = codes + r * ldc + b * 128;
      _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchBytes + 64), _MM_HINT_T0);
      __m512bh v[8];
      fp4serve_cpu::nibbles_to_bf16(_mm512_loadu_si512(c), v);
      fp4serve_cpu::nibbles_to_bf16(_mm512_loadu_si512(c + 64), v + 4);
      const __m512 scale = superblock_scales(sz + r * ldsz + b * 2 * kSuperGroups);
      for (int64_t i = 0; i < I; ++i) {
        const uint16_t* x = xb + i * p.kp + b * kSuperGroups * kGroup;
        auto xv = [x](int64_t step) { return (__m512bh)_mm512_loadu_si512(x + step * 32); };
        __m512 even = _mm512_dpbf16_ps(_mm512_setzero_ps(), v[0], xv(0));
        __m512 odd = _mm512_dpbf16_ps(_mm512_setzero_ps(), v[1], xv(1));
        even = _mm512_dpbf16_ps(even, v[2], xv(2)), odd = _mm512_dpbf16_ps(odd, v[3], xv(3));
        even = _mm512_dpbf16_ps(even, v[4], xv(4)), odd = _mm512_dpbf16_ps(odd, v[5], xv(5));
        even = _mm512_dpbf16_ps(even, v[6], xv(6)), odd = _mm512_dpbf16_ps(odd, v[7], xv(7));
        acc[r][i] = _mm512_fmadd_ps(scale, _mm512_add_ps(even, odd), acc[r][i]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const c10::BFloat16* srow = sz + r * ldsz;
    const uint8_t* crow = codes + r * ldc;
    for (int64_t i = 0; i < I; ++i) {
      // The zero-point terms, 4 groups' (scale, zero) pairs against (-136 X_g, X_g) at a time.
      __m256 zacc = _mm256_setzero_ps();
      for (int64_t g = 0; g + 4 <= groups; g += 4) {
        const __m256 szf = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(srow + g * 2))), 16));
        zacc = _mm256_fmadd_ps(szf, _mm256_loadu_ps(xz + i * p.ldz + g * 2), zacc);
      }
      if (groups % 4) {  // the last two groups' zero terms
        const int64_t g = groups / 4 * 4;
        const __m128 szf = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(srow + g * 2))), 16));
        zacc = _mm256_add_ps(zacc, _mm256_zextps128_ps256(_mm_mul_ps(szf, _mm_loadu_ps(xz + i * p.ldz + g * 2))));
      }
      for (int64_t g = supers * kSuperGroups; g < groups; g += 2) {  // the pairs after the superblocks
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(crow + supers * 128 + (g - supers * kSuperGroups) / 2 * kPairBytes));
        __m256bh v[4];
        fp4serve_cpu::nibbles_to_bf16(w, v);
        const c10::BFloat16* s = srow + g * 2;
        const uint16_t* x = xb + i * p.kp + g * kGroup;
        auto xv = [x](int64_t at) { return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + at)); };
        const __m256 da = _mm256_dpbf16_ps(_mm256_dpbf16_ps(_mm256_setzero_ps(), v[0], xv(0)), v[1], xv(16));
        const __m256 db = _mm256_dpbf16_ps(_mm256_dpbf16_ps(_mm256_setzero_ps(), v[2], xv(32)), v[3], xv(48));
        const __m256 sa = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi32(*reinterpret_cast<const int32_t*>(s)), 16));
        const __m256 sb = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi32(*reinterpret_cast<const int32_t*>(s + 2)), 16));
        zacc = _mm256_add_ps(zacc, _mm256_fmadd_ps(sb, db, _mm256_mul_ps(sa, da)));
      }
      out[i * ldo + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][i], _mm512_zextps256_ps512(zacc)));
    }
  }
}

template <int64_t I>
void rows_of_tiles(const uint8_t* codes, int64_t ldc, const c10::BFloat16* sz, int64_t ldsz, const Prepared& p,
                   int64_t t0, float* out, int64_t ldo, int64_t begin, int64_t end) {
  constexpr int64_t R = I <= 2 ? 4 : I <= 4 ? 2 : 1;  // R * I accumulators beside the 8 decoded vectors
  int64_t n = begin;
  for (; n + R <= end; n += R) tile<R, I>(codes + n * ldc, ldc, sz + n * ldsz, ldsz, p, t0, out + n, ldo);
  for (; n < end; ++n) tile<1, I>(codes + n * ldc, ldc, sz + n * ldsz, ldsz, p, t0, out + n, ldo);
}

#endif  // FP4SERVE_INT4_NATIVE

// The code of column j of group g in one row's codes (the layout above; the plain loop's reader).
inline int code_at(const uint8_t* row, int64_t groups, int64_t g, int64_t j) {
  const int64_t supers = groups / kSuperGroups;
  const uint8_t* w;
  int shift;
  if (g < supers * kSuperGroups) {
    const int64_t h = j / 16, step = (j % 16) / 2, e = 2 * (8 * h + g % kSuperGroups) + j % 2;
    w = row + (g / kSuperGroups) * 128 + (step / 4) * 64 + e * 2;
    shift = 4 * static_cast<int>(step % 4);
  } else {
    const int64_t pair = (g - supers * kSuperGroups) / 2;
    w = row + supers * 128 + pair * kPairBytes + (j % 16) * 2;
    shift = 8 * static_cast<int>((g - supers * kSuperGroups) % 2) + 4 * static_cast<int>(j / 16);
  }
  return ((w[0] | (w[1] << 8)) >> shift) & 0x0f;
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
        case 4: rows_of_tiles<4>(cp, ldc, szp, ldsz, p, t0, out, n_out, begin, end); break;
        case 5: rows_of_tiles<5>(cp, ldc, szp, ldsz, p, t0, out, n_out, begin, end); break;
        case 6: rows_of_tiles<6>(cp, ldc, szp, ldsz, p, t0, out, n_out, begin, end); break;
        case 7: rows_of_tiles<7>(cp, ldc, szp, ldsz, p, t0, out, n_out, begin, end); break;
        default: rows_of_tiles<8>(cp, ldc, szp, ldsz, p, t0, out, n_out, begin, end); break;
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
