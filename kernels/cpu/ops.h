// The native CPU ops, callable from each other's translation units (decode_step.cpp chains them).
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace pagoda {

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale);
void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, double scale);
void store_kv(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
void add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight, double eps);
void rms_norm_to(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                 const at::Tensor& weight, double eps);
void rotary_embedding(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                      int64_t head_dim);
void rotary_embedding_to(at::Tensor out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t num_heads, int64_t head_dim);
at::Tensor panel_pack(const at::Tensor& weight);
void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
// out[:, n0 : n0 + 16 * count] (within N) = x @ W^T (+ bias) for M rows of x, W's columns as `count` (1 or 2)
// adjacent `panel_pack` panels [K][16] at `panels` (64-byte aligned); panel_linear's bits for those columns.
void panel_gemm(const float* x, int64_t ldx, const float* panels, int64_t count, int64_t K, const float* bias,
                float* out, int64_t N, int64_t n0, int64_t M);
// out (float32 or bf16) = x @ W^T (+ bias) for bf16 x and W as `bf16_pack` pair panels, fp32 accumulation
// (bf16_linear.cpp; AVX-512 BF16 builds only).
void bf16_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
void coded_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& records,
                  const c10::optional<at::Tensor>& bias);
// out ~= x @ W^T (+ bias) for W as 4-bit coded_linear records (coded_a8_reads), x quantized to 8 bits per 32-k
// block (coded_a8_linear.cpp: quantization="gguf_a8"); AVX2 + FMA builds only (coded_a8_supported).
bool coded_a8_supported();
constexpr int64_t kCodedRecord4Bytes = 384;  // a 4-bit coded_linear record: d[16], m[16] float32, 256 bytes of codes
inline bool coded_a8_reads(const at::Tensor& records) {
  return records.dim() == 3 && records.size(2) == kCodedRecord4Bytes;
}
void coded_a8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& records,
                     const c10::optional<at::Tensor>& bias);
// out = x @ (codes * scale[:, None])^T (+ bias): int8 weights per output channel, weight-only below w8a8_m rows,
// W8A8 from there (int8_ops.cpp).
void int8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                 const c10::optional<at::Tensor>& bias, int64_t w8a8_m);
// decode_step.cpp's layers when every projection is int8 weight-only at these rows (decode_int8.cpp): codes and
// scales per projection in decode_layers' order; supported where the build has AVX-512 VNNI and every in_features
// is below `max_k`'s limit.
bool decode_layers_int8_supported(int64_t max_k);
std::tuple<at::Tensor, at::Tensor> decode_layers_int8(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                                                      at::TensorList kv_caches, const at::Tensor& slot_mapping,
                                                      const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                      at::TensorList norms, const std::vector<at::Tensor>& codes,
                                                      const std::vector<at::Tensor>& scales,
                                                      at::TensorList qkv_biases, int64_t num_heads,
                                                      int64_t num_kv_heads, int64_t head_dim, double eps,
                                                      double scale);

// A projection's optional bias of n outputs, checked, as a pointer (nullptr for none); `op` names the caller.
inline const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, op,
              ": bias must be a contiguous float32 vector of the output size");
  return bias->data_ptr<float>();
}

// a . b over n floats (the portable path; vectorised by `omp simd` without reassociating anything else).
inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// a . b with b a bf16 row (a bf16 KV cache), widened exactly to fp32.
inline float dot(const float* a, const at::BFloat16* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * static_cast<float>(b[i]);
  return acc;
}

}  // namespace pagoda
