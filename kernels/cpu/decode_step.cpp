// Every decoder layer of a decode-only step (one new token per sequence) in one native call.
//
// Why: at batch 1 the GEMMs stream the weights in ~19 ms and everything else is ~11 ops per layer whose cost was
// almost all Python and dispatch (25.5 -> ~20 ms per token with this loop). It is the CPU counterpart of replaying
// a captured CUDA graph: the ops the Python model calls (ops.h, and the panel kernel / MKL for the GEMMs, with the
// same row threshold as models/cpu_linear.py, passed in), chained without returning to Python. The layer math is
// models/llama.py's; tests check both paths give the same tokens and logprobs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "ops.h"

namespace {

struct Gemms {
  int64_t large_m;  // rows at or above: MKL; below: the panel kernel (weights packed at load)
};

// NOTE: measured (benchmarks/cpu_bench.py gemm, 30 layers): the panel kernel beat both oneDNN and the streaming
// kernel at every row count from 1 to 256 (1 row: 16.7 ms vs 23.5 / 21.6; 8: 19.6 vs 27.8; 64: 70.8 vs 86.5; 256:
// 285.6 vs 294.1), so below large_m it is the only path here.
at::Tensor project(const Gemms& g, const at::Tensor& x, const at::Tensor& w, const at::Tensor& panels,
                   const c10::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0);
  if (rows >= g.large_m) return at::linear(x, w, bias);
  at::Tensor out = at::empty({rows, w.size(0)}, x.options());
  pagoda::panel_linear(out, x, panels, bias);
  return out;
}

}  // namespace

namespace pagoda {

// h: the step's embeddings [B, hidden]; cos/sin: [B, head_dim] rows for each token's position. Per layer l:
// norms[2l], norms[2l+1] (input, post-attention RMSNorm weights); weights[4l..4l+3] (qkv, o, gate_up, down, each
// [out, in]) and `panels` the same packed by panel_pack; qkv_biases: empty or one per layer. Returns (h, residual)
// before the final norm, as the Python loop.
std::tuple<at::Tensor, at::Tensor> decode_layers(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                                                 at::TensorList kv_caches, const at::Tensor& slot_mapping,
                                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                 at::TensorList norms, at::TensorList weights, at::TensorList panels,
                                                 at::TensorList qkv_biases, int64_t num_heads, int64_t num_kv_heads,
                                                 int64_t head_dim, double eps, double scale, int64_t large_m) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(norms.size() == static_cast<size_t>(2 * L) && weights.size() == static_cast<size_t>(4 * L) &&
                  panels.size() == weights.size() &&
                  (qkv_biases.empty() || qkv_biases.size() == static_cast<size_t>(L)),
              "decode_layers: expected 2 norms and 4 weights per layer (and 0 or 1 qkv bias)");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "decode_layers: h must be a contiguous [tokens, hidden]");
  const int64_t B = h.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const auto opts = h.options();
  const Gemms gemms{large_m};
  at::Tensor residual;
  for (int64_t l = 0; l < L; ++l) {
    at::Tensor x;
    if (l == 0) {
      residual = h;
      x = h.clone();
      add_rms_norm(x, c10::nullopt, norms[0], eps);
    } else {
      add_rms_norm(h, residual, norms[2 * l], eps);  // residual += h; h = norm(residual)
      x = h;
    }
    at::Tensor qkv = project(gemms, x, weights[4 * l], panels[4 * l],
                             qkv_biases.empty() ? c10::optional<at::Tensor>() : qkv_biases[l]);
    rotary_embedding(qkv, cos, sin, num_heads + num_kv_heads, head_dim);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({B, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({B, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({B, num_kv_heads, head_dim});
    store_kv(kv_caches[l], k, v, slot_mapping);
    at::Tensor attn = at::empty({B, num_heads, head_dim}, opts);
    paged_decode_attention(attn, q, kv_caches[l], block_tables, seq_lens, scale);
    h = project(gemms, attn.view({B, q_size}), weights[4 * l + 1], panels[4 * l + 1], c10::nullopt);
    add_rms_norm(h, residual, norms[2 * l + 1], eps);
    at::Tensor gate_up = project(gemms, h, weights[4 * l + 2], panels[4 * l + 2], c10::nullopt);
    at::Tensor act = at::empty({B, gate_up.size(1) / 2}, opts);
    silu_and_mul(act, gate_up);
    h = project(gemms, act, weights[4 * l + 3], panels[4 * l + 3], c10::nullopt);
  }
  return {h, residual};
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def(
      "decode_layers(Tensor h, Tensor cos, Tensor sin, Tensor(a!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_lens, Tensor[] norms, Tensor[] weights, Tensor[] panels, Tensor[] qkv_biases, int num_heads, "
      "int num_kv_heads, int head_dim, float eps, float scale, int large_m) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("decode_layers", &pagoda::decode_layers); }
