// A dense decoder layer (Llama/SmolLM2: no q/k norms, no biases) with int4 linears, for a few rows,
// as one op: the same ops the Python layer runs (fp4serve_cpu::rms_norm, the int4 kernel: ours,
// fp4serve_cpu::int4_gemv, or torch's as the linears hold their codes,
// fp4serve_cpu::rope_cache_attention, add_rms_norm, silu_and_mul, the residual add), called from
// C++ through torch's dispatcher, so the results are the Python layer's bit for bit.
//
// Why: at one row a layer's kernels take ~0.3 ms, and Python spent tens of microseconds a layer
// around them (~10 module calls and ~25 ops, each paying Python's call and dispatch; docs/PERF.md
// "The 1-stream step"). engine/models/decoder.py takes this path only where it applies
// (use_fused_layers, DecoderLayer.forward); tests/test_cpu_decode_layer.py checks it bit for bit.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/add.h>
#include <torch/library.h>

#include <tuple>

namespace {

using at::Tensor;

c10::OperatorHandle op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// x [T, H] -> the layer's output [T, H]. Each linear: (packed codes, scales and zeros) as
// engine/weights/formats/int4_linear.py holds them (no padding rows or columns).
Tensor decode_layer_int4(const Tensor& x, const Tensor& input_norm, const Tensor& post_norm, double eps,
                         const Tensor& qkv, const Tensor& qkv_sz, const Tensor& o, const Tensor& o_sz,
                         const Tensor& gate_up, const Tensor& gate_up_sz, const Tensor& down, const Tensor& down_sz,
                         int64_t group_size, const Tensor& cos, const Tensor& signed_sin, Tensor kv_cache,
                         const Tensor& slot_mapping, const Tensor& qo_indptr, const Tensor& kv_indptr,
                         const Tensor& kv_indices, const Tensor& kv_last_page_len, int64_t num_heads, double scale,
                         bool own_kernel) {
  static const auto rms_norm = op_handle("fp4serve_cpu::rms_norm").typed<Tensor(const Tensor&, const Tensor&, double)>();
  static const auto add_rms_norm =
      op_handle("fp4serve_cpu::add_rms_norm").typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>();
  static const auto silu_and_mul = op_handle("fp4serve_cpu::silu_and_mul").typed<Tensor(const Tensor&)>();
  static const auto attend =
      op_handle("fp4serve_cpu::rope_cache_attention")
          .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, const Tensor&, int64_t, double)>();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layer_int4: x [T, hidden], contiguous");
  static const auto int4_gemv = op_handle("fp4serve_cpu::int4_gemv").typed<Tensor(const Tensor&, const Tensor&, const Tensor&)>();
  auto linear = [group_size, own_kernel](const Tensor& in, const Tensor& packed, const Tensor& sz) {
    return own_kernel ? int4_gemv.call(in, packed, sz) : at::_weight_int4pack_mm_for_cpu(in, packed, group_size, sz);
  };
  const Tensor h = rms_norm.call(x, input_norm, eps);
  const Tensor attn = attend.call(linear(h, qkv, qkv_sz), cos, signed_sin, kv_cache, slot_mapping, qo_indptr, kv_indptr,
                                  kv_indices, kv_last_page_len, num_heads, scale);
  const auto [residual, h2] = add_rms_norm.call(linear(attn, o, o_sz), x, post_norm, eps);
  const Tensor mlp = linear(silu_and_mul.call(linear(h2, gate_up, gate_up_sz)), down, down_sz);
  return at::add(residual, mlp);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp4serve_cpu, m) {
  m.def("decode_layer_int4(Tensor x, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv, Tensor qkv_sz, "
        "Tensor o, Tensor o_sz, Tensor gate_up, Tensor gate_up_sz, Tensor down, Tensor down_sz, int group_size, "
        "Tensor cos, Tensor signed_sin, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor qo_indptr, "
        "Tensor kv_indptr, Tensor kv_indices, Tensor kv_last_page_len, int num_heads, float scale, "
        "bool own_kernel) -> Tensor");
}

TORCH_LIBRARY_IMPL(fp4serve_cpu, CPU, m) {
  m.impl("decode_layer_int4", &decode_layer_int4);
}
