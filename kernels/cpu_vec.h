// Shared by the CPU ops (cpu_attention.cpp, cpu_elementwise.cpp): ATen's vector types at the
// machine's width, and float conversions of the element types the ops take.
#pragma once

// ATen's vector types (at::vec::Vectorized) pick their width from these macros, as ATen's own
// per-capability kernels do; the library is compiled for the machine it runs on (-march=native).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace fp4serve_cpu {

using Vec = at::vec::Vectorized<float>;

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

template <typename T>
inline T from_float(float v) {
  return static_cast<T>(v);  // c10::BFloat16 / c10::Half round to nearest even
}

// Vec::size() elements of `p` as floats.
template <typename T>
inline Vec load_vec(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// dst[0..n) <- src[0..n) as floats.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  const int64_t W = Vec::size(), nv = n - n % W;
  for (int64_t i = 0; i < nv; i += W) load_vec(src + i).store(dst + i);
  for (int64_t i = nv; i < n; ++i) dst[i] = to_float(src[i]);
}

// dst[0..n) <- src[0..n), rounded to T (nearest even).
template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The four nibbles of each 16-bit word of `w` as bf16 128 + nibble (nibble m in v[m]): shifts, masks
// and an OR into 128.0's bits (0x4300), no shuffles; VPTERNLOGD 0xea is a & b | c. The int4 and int8
// loops (cpu_int4.cpp, cpu_gemv.cpp) take their codes through it and fold the 128 out.
inline void nibbles_to_bf16(__m512i w, __m512bh v[4]) {
  const __m512i nib = _mm512_set1_epi16(0x000f), one28 = _mm512_set1_epi16(0x4300);
  v[0] = (__m512bh)_mm512_ternarylogic_epi32(w, nib, one28, 0xea);
  v[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), nib, one28, 0xea);
  v[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), nib, one28, 0xea);
  v[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 12), one28);
}

// The same for 16 words (a 256-bit vector).
inline void nibbles_to_bf16(__m256i w, __m256bh v[4]) {
  const __m256i nib = _mm256_set1_epi16(0x000f), one28 = _mm256_set1_epi16(0x4300);
  v[0] = (__m256bh)_mm256_ternarylogic_epi32(w, nib, one28, 0xea);
  v[1] = (__m256bh)_mm256_ternarylogic_epi32(_mm256_srli_epi16(w, 4), nib, one28, 0xea);
  v[2] = (__m256bh)_mm256_ternarylogic_epi32(_mm256_srli_epi16(w, 8), nib, one28, 0xea);
  v[3] = (__m256bh)_mm256_or_si256(_mm256_srli_epi16(w, 12), one28);
}
#endif

}  // namespace fp4serve_cpu
