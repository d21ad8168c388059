// A decode layer's attention glue as one op: the fused q/k/v projection's rows in, q and k rotated
// by RoPE, k and v written to the paged cache, paged attention over it, the heads' outputs out as
// rows for o_proj. It calls the ops of cpu_elementwise.cpp (rotary) and cpu_attention.cpp
// (reshape_and_cache, paged_attention) through torch's dispatcher.
//
// Why: called from Python the same work was 8 ops a layer (slices and views of q, k and v, the
// rotation, the cache write, the attention, the output's reshape), each paying Python's call and
// dispatch (~2-4 us each on the 2-core EPYC, docs/PERF.md "The 1-stream step") around a few
// microseconds of work at one row. Reference: kernels/cpu_attention.py, rope_cache_attention_ref,
// compared with it in tests/test_cpu_fused_attention.py.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

at::Tensor rope_cache_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                                at::Tensor kv_cache, const at::Tensor& slot_mapping, const at::Tensor& qo_indptr,
                                const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                                const at::Tensor& kv_last_page_len, int64_t num_heads, double scale) {
  TORCH_CHECK(kv_cache.dim() == 5, "rope_cache_attention: kv_cache [num_pages, 2, block_size, Hkv, D]");
  const int64_t rows = qkv.size(0), kv_heads = kv_cache.size(3), d = kv_cache.size(4);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * kv_heads) * d,
              "rope_cache_attention: qkv [T, (Hq + 2 Hkv) * D] with contiguous rows");
  static const auto rotary = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("fp4serve_cpu::rotary", "")
                                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  static const auto write = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("fp4serve_cpu::reshape_and_cache", "")
                                .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&)>();
  static const auto attend =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fp4serve_cpu::paged_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, double)>();
  // q and k are adjacent columns: one rotation of both heads' sets together, as the Python path does.
  const at::Tensor qk = rotary.call(qkv.narrow(1, 0, (num_heads + kv_heads) * d).view({rows, num_heads + kv_heads, d}),
                                    cos, signed_sin);  // [T, Hq + Hkv, D]
  const at::Tensor v = qkv.narrow(1, (num_heads + kv_heads) * d, kv_heads * d).view({rows, kv_heads, d});
  write.call(qk.narrow(1, num_heads, kv_heads), v, kv_cache, slot_mapping);  // new K/V first, as the backend does
  const at::Tensor out = attend.call(qk.narrow(1, 0, num_heads), kv_cache, qo_indptr, kv_indptr, kv_indices,
                                     kv_last_page_len, scale);  // [T, Hq, D] contiguous
  return out.view({rows, num_heads * d});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp4serve_cpu, m) {
  m.def("rope_cache_attention(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, Tensor kv_last_page_len, int num_heads, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(fp4serve_cpu, CPU, m) {
  m.impl("rope_cache_attention", &rope_cache_attention);
}
