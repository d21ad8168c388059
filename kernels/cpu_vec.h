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

}  // namespace fp4serve_cpu
