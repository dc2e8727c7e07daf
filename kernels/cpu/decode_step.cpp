// Every decoder layer of a decode-only step (one new token per sequence) in one native call.
//
// Why: at batch 1 the GEMMs stream the weights in ~19 ms and everything else is ~11 ops per layer whose cost was
// almost all Python and dispatch (25.5 -> ~20 ms per token with this loop). It is the CPU counterpart of replaying
// a captured CUDA graph: the ops the Python model calls (ops.h, and the coded / panel kernel / oneDNN / MKL for the
// GEMMs, with each projection's weight forms and row thresholds handed in from its layer, model/layers/cpu_forms.py),
// chained without returning to Python. The layer math is model/llama.py's; tests check both paths give the same
// tokens and logprobs.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

struct Gemms {
  // rows below coded_m: the coded kernel (where the weight has codes); else below onednn_m: the panel kernel; from
  // onednn_m: oneDNN; from large_m: MKL (model/layers/cpu_forms.py's `cpu_gemm`, in the same order)
  int64_t coded_m, onednn_m, large_m;
  int64_t w8a8_m;  // int8 weights: weight-only below, W8A8 from here (int8_ops.cpp)
  int64_t a8_m;    // 4-bit codes: coded_a8_linear from here (quantization="gguf_a8"), coded_linear below
};

// One projection's weight, in the forms its dispatch reads (an absent form is one no row count reaches).
struct Forms {
  int64_t out_features;
  const c10::optional<at::Tensor>& plain;
  const c10::optional<at::Tensor>& panels;
  const c10::optional<at::Tensor>& coded;
  const c10::optional<at::Tensor>& onednn;
  const c10::optional<at::Tensor>& int8_codes;  // int8 weights (model/layers/cpu_int8.py): codes [out, in] ...
  const c10::optional<at::Tensor>& int8_scales;  // ... and per-channel scales; no other form then
};

// `bf16_out`: a bf16 weight's product stays bf16 (the MLP's gate/up into the bf16 SiLU-and-mul); every other product
// is float32. x may be bf16 (the SiLU-and-mul's output): the float32 kernels get it widened.
at::Tensor project(const Gemms& g, const at::Tensor& x, const Forms& w, const c10::optional<at::Tensor>& bias,
                   bool bf16_out = false) {
  const int64_t rows = x.size(0);
  if (w.int8_codes.has_value()) {
    const at::Tensor x32 = x.to(at::kFloat);
    at::Tensor out = at::empty({rows, w.out_features}, x32.options());
    pagoda::int8_linear(out, x32, *w.int8_codes, *w.int8_scales, bias, g.w8a8_m);
    return out;
  }
  // each row count takes the first form of codes, panels, oneDNN it reaches that the weight has
  if (rows >= g.a8_m && w.coded.has_value() && pagoda::coded_a8_reads(*w.coded)) {
    const at::Tensor x32 = x.to(at::kFloat);
    at::Tensor out = at::empty({rows, w.out_features}, x32.options());
    pagoda::coded_a8_linear(out, x32, *w.coded, bias);
    return out;
  }
  if (rows < g.coded_m && w.coded.has_value()) {
    const at::Tensor x32 = x.to(at::kFloat);
    at::Tensor out = at::empty({rows, w.out_features}, x32.options());
    pagoda::coded_linear(out, x32, *w.coded, bias);
    return out;
  }
  if (rows < g.onednn_m && w.panels.has_value() && w.panels->scalar_type() == at::kBFloat16) {
    // bf16 pair panels (model/layers/cpu_bfloat16.py): the product in bf16 where `bf16_out`, else fp32
    at::Tensor xb = x.to(at::kBFloat16);
    if (xb.stride(1) != 1) xb = xb.contiguous();
    at::Tensor out = at::empty({rows, w.out_features}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
    pagoda::bf16_linear(out, xb, *w.panels, bias);
    return out;
  }
  if (rows < g.onednn_m && w.panels.has_value()) {
    const at::Tensor x32 = x.to(at::kFloat);
    at::Tensor out = at::empty({rows, w.out_features}, x32.options());
    pagoda::panel_linear(out, x32, *w.panels, bias);
    return out;
  }
  if (rows >= g.large_m) {
    TORCH_CHECK(w.plain.has_value(), "decode_layers: no plain weight for ", rows, " rows");
    return at::linear(x.to(at::kFloat), *w.plain, bias);
  }
  TORCH_CHECK(w.onednn.has_value(), "decode_layers: no oneDNN weight for ", rows, " rows");
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  // bf16 weights (model/layers/cpu_bfloat16.py): bf16 in, fp32 accumulation, the product in bf16, widened to fp32
  // unless `bf16_out`
  const auto wt = w.onednn->scalar_type();
  torch::jit::Stack stack{x.to(wt), *w.onednn, bias.has_value() ? c10::IValue(*bias) : c10::IValue(), "none",
                          c10::List<c10::optional<at::Scalar>>(), c10::IValue()};
  op.callBoxed(&stack);
  at::Tensor y = stack.back().toTensor();
  return bf16_out ? y : y.to(at::kFloat);
}

}  // namespace

namespace pagoda {

// h: the step's embeddings [B, hidden]; cos/sin: [B, head_dim] rows for each token's position. Per layer l:
// norms[2l], norms[2l+1] (input, post-attention RMSNorm weights); projections 4l..4l+3 (qkv, o, gate_up, down):
// out_features, and each form its dispatch reads or none: `plain` [out, in], `panels` by panel_pack, `coded` by
// coded_pack, `onednn` as oneDNN tensors; qkv_biases: empty or one per layer. Returns (h, residual) before the final
// norm, as the Python loop.
std::tuple<at::Tensor, at::Tensor> decode_layers(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                                                 at::TensorList kv_caches, const at::Tensor& slot_mapping,
                                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                 at::TensorList norms, at::IntArrayRef out_features,
                                                 const c10::List<c10::optional<at::Tensor>>& plain,
                                                 const c10::List<c10::optional<at::Tensor>>& panels,
                                                 const c10::List<c10::optional<at::Tensor>>& coded,
                                                 const c10::List<c10::optional<at::Tensor>>& onednn,
                                                 const c10::List<c10::optional<at::Tensor>>& int8_codes,
                                                 const c10::List<c10::optional<at::Tensor>>& int8_scales,
                                                 at::TensorList qkv_biases, int64_t num_heads,
                                                 int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                                                 int64_t coded_m, int64_t onednn_m, int64_t large_m,
                                                 int64_t w8a8_m, int64_t a8_m) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  const size_t P = static_cast<size_t>(4 * L);
  TORCH_CHECK(norms.size() == static_cast<size_t>(2 * L) && out_features.size() == P && plain.size() == P &&
                  panels.size() == P && coded.size() == P && onednn.size() == P &&
                  int8_codes.size() == P && int8_scales.size() == P &&
                  (qkv_biases.empty() || qkv_biases.size() == static_cast<size_t>(L)),
              "decode_layers: expected 2 norms and 4 weights per layer (and 0 or 1 qkv bias)");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "decode_layers: h must be a contiguous [tokens, hidden]");
  const int64_t B = h.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const auto opts = h.options();
  const Gemms gemms{coded_m, onednn_m, large_m, w8a8_m, a8_m};
  // NOTE: the List elements are read into locals once: `Forms` holds references to them.
  std::vector<c10::optional<at::Tensor>> plain_v(plain.begin(), plain.end()), panels_v(panels.begin(), panels.end());
  std::vector<c10::optional<at::Tensor>> coded_v(coded.begin(), coded.end()), onednn_v(onednn.begin(), onednn.end());
  std::vector<c10::optional<at::Tensor>> int8_v(int8_codes.begin(), int8_codes.end());
  std::vector<c10::optional<at::Tensor>> int8_s(int8_scales.begin(), int8_scales.end());
  auto forms = [&](int64_t p) {
    return Forms{out_features[p], plain_v[p], panels_v[p], coded_v[p], onednn_v[p], int8_v[p], int8_s[p]};
  };
  // int8 weight-only at every projection: the layers in one parallel region each (decode_int8.cpp)
  if (B > 0 && B < w8a8_m) {
    std::vector<at::Tensor> codes_v, scales_v;
    int64_t max_k = 0;
    for (size_t p = 0; p < P && int8_v[p].has_value() && int8_s[p].has_value(); ++p) {
      codes_v.push_back(*int8_v[p]);
      scales_v.push_back(*int8_s[p]);
      max_k = std::max(max_k, int8_v[p]->size(-1));
    }
    if (codes_v.size() == P && decode_layers_int8_supported(max_k)) {
      return decode_layers_int8(h, cos, sin, kv_caches, slot_mapping, block_tables, seq_lens, norms, codes_v,
                                scales_v, qkv_biases, num_heads, num_kv_heads, head_dim, eps, scale);
    }
  }
  // NOTE: with bf16 weights (bf16 panels below onednn_m, oneDNN from there; codes below coded_m), the norms write
  // the next GEMM's bf16 input and read o/down's bf16 products, and the rotary reads qkv's, in place of a cast on
  // each side (fused_ops.cpp, rms_norm_to and rotary_embedding_to).
  const bool bf16_panels = panels_v[0].has_value() && panels_v[0]->scalar_type() == at::kBFloat16;
  const bool bf16 = B >= coded_m && B < large_m &&
                    ((bf16_panels && B < onednn_m) ||
                     (onednn_v[0].has_value() && onednn_v[0]->scalar_type() == at::kBFloat16 && B >= onednn_m));
  const auto norm_opts = bf16 ? opts.dtype(at::kBFloat16) : opts;
  at::Tensor residual;
  for (int64_t l = 0; l < L; ++l) {
    at::Tensor x;
    if (l == 0) {
      residual = h;
      x = at::empty_like(h, norm_opts);
      rms_norm_to(x, h, c10::nullopt, norms[0], eps);
    } else if (bf16) {
      x = at::empty({B, h.size(1)}, norm_opts);
      rms_norm_to(x, h, residual, norms[2 * l], eps);  // residual += h; x = norm(residual)
    } else {
      add_rms_norm(h, residual, norms[2 * l], eps);  // residual += h; h = norm(residual)
      x = h;
    }
    at::Tensor qkv =
        project(gemms, x, forms(4 * l), qkv_biases.empty() ? c10::optional<at::Tensor>() : qkv_biases[l], bf16);
    if (qkv.scalar_type() == at::kBFloat16) {
      at::Tensor qkv32 = at::empty(qkv.sizes(), opts);
      rotary_embedding_to(qkv32, qkv, cos, sin, num_heads + num_kv_heads, head_dim);
      qkv = qkv32;
    } else {
      rotary_embedding(qkv, cos, sin, num_heads + num_kv_heads, head_dim);
    }
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({B, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({B, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({B, num_kv_heads, head_dim});
    store_kv(kv_caches[l], k, v, slot_mapping);
    at::Tensor attn = at::empty({B, num_heads, head_dim}, opts);
    paged_decode_attention(attn, q, kv_caches[l], block_tables, seq_lens, scale);
    h = project(gemms, attn.view({B, q_size}), forms(4 * l + 1), c10::nullopt, bf16);
    if (bf16) {
      x = at::empty({B, h.size(1)}, norm_opts);
      rms_norm_to(x, h, residual, norms[2 * l + 1], eps);
    } else {
      add_rms_norm(h, residual, norms[2 * l + 1], eps);
      x = h;
    }
    at::Tensor gate_up = project(gemms, x, forms(4 * l + 2), c10::nullopt, /*bf16_out=*/true);
    at::Tensor act = at::empty({B, gate_up.size(1) / 2}, gate_up.options());  // bf16 from a bf16 GEMM
    silu_and_mul(act, gate_up);
    h = project(gemms, act, forms(4 * l + 3), c10::nullopt, bf16);
  }
  // h: the last down projection's product, bf16 with `bf16` (the final norm reads either)
  return {h, residual};
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def(
      "decode_layers(Tensor h, Tensor cos, Tensor sin, Tensor(a!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_lens, Tensor[] norms, int[] out_features, Tensor?[] plain, Tensor?[] panels, Tensor?[] coded, "
      "Tensor?[] onednn, Tensor?[] int8_codes, Tensor?[] int8_scales, "
      "Tensor[] qkv_biases, int num_heads, int num_kv_heads, int head_dim, float eps, float scale, int coded_m, "
      "int onednn_m, int large_m, int w8a8_m, int a8_m) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("decode_layers", &pagoda::decode_layers); }

// The oneDNN packed weights are oneDNN tensors, which make the dispatcher pick this key for the call.
TORCH_LIBRARY_IMPL(pagoda_cpu, MkldnnCPU, m) { m.impl("decode_layers", &pagoda::decode_layers); }
