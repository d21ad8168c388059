// The elementwise work of a decoder layer on CPU, each as one op over bf16/fp16/float32 rows,
// computed in float32 and rounded once: RMSNorm, the residual add fused with the next RMSNorm,
// SwiGLU's silu(gate) * up, and the rotation of q and k heads by RoPE.
//
// Why by hand: at decode sizes a layer's elementwise work is a few microseconds, and eager torch
// spends it as ~15 separate ops (transformers' bf16 RMSNorm alone is 7), each paying dispatch and
// an allocation (docs/PERF.md, "Where a step goes"). torch has no fused CPU op for these (Inductor
// generates them only inside a compiled graph); vLLM's CPU backend hand-writes the same ones.
// References: kernels/cpu_elementwise.py, compared with them in tests/test_cpu_elementwise.py.

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using fp4serve_cpu::load_row;
using fp4serve_cpu::load_vec;
using fp4serve_cpu::store_row;
using fp4serve_cpu::Vec;

// Elements below which an op runs on the calling thread (waking OpenMP's workers costs more).
constexpr int64_t kSerialElements = 1 << 16;

template <typename F>
void for_rows(int64_t rows, int64_t row_elements, const F& f) {
  if (rows * row_elements < kSerialElements) {
    f(0, rows);
  } else {
    at::parallel_for(0, rows, 1, f);
  }
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, what, ": rows contiguous in their last dimension");
}

// buf[0..n) *= rsqrt(mean(buf^2) + eps) * weight.
inline void normalize(float* buf, const float* weight, int64_t n, float eps) {
  const int64_t W = Vec::size(), nv = n - n % W;
  Vec acc(0.f);
  for (int64_t i = 0; i < nv; i += W) {
    const Vec v = Vec::loadu(buf + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sum = acc.reduce_add();
  for (int64_t i = nv; i < n; ++i) sum += buf[i] * buf[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  const Vec vinv(inv);
  for (int64_t i = 0; i < nv; i += W) (Vec::loadu(buf + i) * vinv * Vec::loadu(weight + i)).store(buf + i);
  for (int64_t i = nv; i < n; ++i) buf[i] = buf[i] * inv * weight[i];
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor* residual, at::Tensor* sum_out, at::Tensor& out,
                   const at::Tensor& weight, float eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const at::Tensor x2 = x.reshape({rows, n});
  std::vector<float> w(n);
  load_row(weight.data_ptr<T>(), w.data(), n);
  const T* xp = x2.data_ptr<T>();
  const int64_t xs = x2.stride(0);
  const at::Tensor r2 = residual != nullptr ? residual->reshape({rows, n}) : at::Tensor();  // kept alive below
  const T* rp = residual != nullptr ? r2.data_ptr<T>() : nullptr;
  const int64_t rs = residual != nullptr ? r2.stride(0) : 0;
  T* sp = sum_out != nullptr ? sum_out->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n), other(n);
    for (int64_t r = begin; r < end; ++r) {
      load_row(xp + r * xs, buf.data(), n);
      if (rp != nullptr) {
        load_row(rp + r * rs, other.data(), n);
        for (int64_t i = 0; i < n; ++i) buf[i] += other[i];
        // The sum is rounded to T first, as `residual + x` in T would be, and normalized from there.
        store_row(buf.data(), sp + r * n, n);
        load_row(sp + r * n, buf.data(), n);
      }
      normalize(buf.data(), w.data(), n, eps);
      store_row(buf.data(), op + r * n, n);
    }
  });
}

#define FP4SERVE_FLOAT_TYPES(x, what, CALL)                                      \
  if (x.scalar_type() == at::kBFloat16) {                                        \
    using T = c10::BFloat16;                                                     \
    CALL;                                                                        \
  } else if (x.scalar_type() == at::kHalf) {                                     \
    using T = c10::Half;                                                         \
    CALL;                                                                        \
  } else if (x.scalar_type() == at::kFloat) {                                    \
    using T = float;                                                             \
    CALL;                                                                        \
  } else {                                                                       \
    TORCH_CHECK(false, what, ": bfloat16, float16 or float32, got ", x.scalar_type()); \
  }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(), "rms_norm: a contiguous weight [hidden] in x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  FP4SERVE_FLOAT_TYPES(x, "rms_norm", (rms_norm_rows<T>(x, nullptr, nullptr, out, weight, static_cast<float>(eps))))
  return out;
}

// (residual + x, rms_norm(residual + x)): the residual add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm: x and residual of one shape and dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(), "add_rms_norm: a contiguous weight [hidden] in x's dtype");
  at::Tensor sum = at::empty(x.sizes(), x.options());
  at::Tensor out = at::empty(x.sizes(), x.options());
  FP4SERVE_FLOAT_TYPES(x, "add_rms_norm",
                       (rms_norm_rows<T>(x, &residual, &sum, out, weight, static_cast<float>(eps))))
  return {sum, out};
}

template <typename T>
void silu_and_mul_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t n = out.size(-1), rows = out.numel() / n;
  const at::Tensor x2 = x.reshape({rows, 2 * n});
  const T* xp = x2.data_ptr<T>();
  const int64_t xs = x2.stride(0);
  T* op = out.data_ptr<T>();
  for_rows(rows, 2 * n, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(n), up(n);
    const int64_t W = Vec::size(), nv = n - n % W;
    const Vec one(1.f);
    for (int64_t r = begin; r < end; ++r) {
      load_row(xp + r * xs, gate.data(), n);
      load_row(xp + r * xs + n, up.data(), n);
      for (int64_t i = 0; i < nv; i += W) {
        const Vec g = Vec::loadu(gate.data() + i);
        (g / (one + g.neg().exp_u20()) * Vec::loadu(up.data() + i)).store(gate.data() + i);
      }
      for (int64_t i = nv; i < n; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
      store_row(gate.data(), op + r * n, n);
    }
  });
}

// [..., 2I] (gate, then up) -> [..., I]: silu(gate) * up.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(-1) % 2 == 0, "silu_and_mul: an even last dimension (gate, then up)");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() /= 2;
  at::Tensor out = at::empty(shape, x.options());
  FP4SERVE_FLOAT_TYPES(x, "silu_and_mul", (silu_and_mul_rows<T>(x, out)))
  return out;
}

template <typename T>
void rotary_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin, at::Tensor& out) {
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = signed_sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  for_rows(T_, H * D, [&](int64_t begin, int64_t end) {
    std::vector<float> c(D), s(D), v(D), o(D);
    for (int64_t t = begin; t < end; ++t) {
      load_row(cp + t * D, c.data(), D);
      load_row(sp + t * D, s.data(), D);
      for (int64_t h = 0; h < H; ++h) {
        load_row(xp + t * xs0 + h * xs1, v.data(), D);
        // Two loops, not one with (d + half) % D: the modulo kept gcc from vectorizing it.
        for (int64_t d = 0; d < half; ++d) o[d] = v[d] * c[d] + v[d + half] * s[d];
        for (int64_t d = half; d < D; ++d) o[d] = v[d] * c[d] + v[d - half] * s[d];
        store_row(o.data(), op + (t * H + h) * D, D);
      }
    }
  });
}

// x [T, H, D] (heads of contiguous rows) -> x * cos + roll(x, D/2) * signed_sin, with cos and
// signed_sin [T, D] (sin with its first half negated: engine/models/layers.py's PositionedRotary).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x [T, H, D] with contiguous head rows");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary: an even head_dim");
  for (const at::Tensor* t : {&cos, &signed_sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == x.size(0) && t->size(1) == x.size(2) && t->is_contiguous() &&
                    t->scalar_type() == x.scalar_type(), "rotary: contiguous cos/signed_sin [T, D] in x's dtype");
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  FP4SERVE_FLOAT_TYPES(x, "rotary", (rotary_rows<T>(x, cos, signed_sin, out)))
  return out;
}

// The index of each row's largest value (the first of equal ones; the first NaN where a row has
// one, as torch.argmax), int64 [B], for float32 rows [B, V]. Why by hand: torch's argmax over the
// last dimension does not vectorize (a tenth of its time here, docs/PERF.md "The 32-row step");
// this is a vector max, then a vector scan for its first position.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0 && x.scalar_type() == at::kFloat,
              "argmax_rows: float32 [B, V] with contiguous rows, V > 0");
  const int64_t rows = x.size(0), n = x.size(1), W = Vec::size(), nv = n - n % W;
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * x.stride(0);
      Vec vmax(-std::numeric_limits<float>::infinity());
      for (int64_t i = 0; i < nv; i += W) vmax = at::vec::maximum(vmax, Vec::loadu(row + i));  // NaN wins
      float lanes[Vec::size()];
      vmax.store(lanes);
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < W + n - nv; ++i) {
        const float v = i < W ? lanes[i] : row[nv + i - W];
        best = std::isnan(v) || std::isnan(best) ? std::numeric_limits<float>::quiet_NaN() : std::max(best, v);
      }
      int64_t at_ = 0;
      if (std::isnan(best)) {
        while (!std::isnan(row[at_])) ++at_;
      } else {
        const Vec vbest(best);  // skip whole vectors with no lane equal to the max
        const int all = (1 << W) - 1;
        while (at_ < nv && (Vec::loadu(row + at_) == vbest).zero_mask() == all) at_ += W;
        while (row[at_] != best) ++at_;
      }
      op[r] = at_;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp4serve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(fp4serve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
  m.impl("argmax_rows", &argmax_rows);
}
