// The decode step's layers for int8 weight-only products (decode_step.cpp's loop, `quantization="int8"` below
// `w8a8_m` rows) in one OpenMP parallel region per layer: the threads stay in the region from one layer's o
// projection to the next layer's qkv projection, each product's channel tiles split in one fixed share per thread,
// barriers between the ops; attention, the rotary and the K/V store run between the regions as in the loop.
//
// Why: at batch 1 the step is the weights' bytes. decode_step.cpp's loop opens a region per product and the threads
// spin down and up around each; the DRAM stream stops at every product's end and restarts cold on the next. Here a
// thread's prefetches run on past the end of its share into its share of the next product (int8w::a16_run's `next`),
// so DRAM streams through the barrier, the norm and the next quantization, and across attention into the o
// projection. The arithmetic is int8_linear's (the same a16 tiles) and fused_ops.cpp's, so the outputs are bitwise
// the loop's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "int8_a16.h"
#include "ops.h"

namespace pagoda {

#if defined(PAGODA_INT8_VNNI)
namespace {

using namespace int8w;  // NOLINT(build/namespaces)

// One int8 projection: codes [N, K] row-major, per-channel scales, optional bias.
struct Product {
  const int8_t* codes;
  const float* scale;
  const float* bias;
  int64_t N, K;
};

// The channel tiles thread t of T computes of an N-channel product: one contiguous run each.
std::pair<int64_t, int64_t> share(int64_t N, int t, int T) {
  const int64_t tiles = (N + kNb - 1) / kNb;
  return {tiles * t / T, tiles * (t + 1) / T};
}

// Where thread t's share of `p` starts in its codes (its prefetch stream's target before the share begins).
const int8_t* share_start(const Product& p, int t, int T) { return p.codes + share(p.N, t, T).first * kNb * p.K; }

// The region's scratch: x quantized (quantize_rows_a16), shared by the threads.
struct A16Rows {
  int8_t* hi;
  uint8_t* lo;
  float* s;
  int32_t* hi_sum;
};

// Every thread: its share of out = x @ p (x as `q` holds it), prefetching on into `next`'s share; then a barrier.
void run_share(const Product& p, const A16Rows& q, int64_t M, float* out, const Product& next) {
  const int t = omp_get_thread_num(), T = omp_get_num_threads();
  const auto [begin, end] = share(p.N, t, T);
  a16_run(out, q.hi, q.lo, q.s, q.hi_sum, M, p.codes, p.scale, p.bias, p.N, p.K, begin, end, share_start(next, t, T));
#pragma omp barrier
}

}  // namespace

bool decode_layers_int8_supported(int64_t max_k) { return max_k < kA16MaxK; }

std::tuple<at::Tensor, at::Tensor> decode_layers_int8(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                                                      at::TensorList kv_caches, const at::Tensor& slot_mapping,
                                                      const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                      at::TensorList norms, const std::vector<at::Tensor>& codes,
                                                      const std::vector<at::Tensor>& scales,
                                                      at::TensorList qkv_biases, int64_t num_heads,
                                                      int64_t num_kv_heads, int64_t head_dim, double eps,
                                                      double scale) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  const int64_t B = h.size(0), hidden = h.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim, qkv_n = q_size + 2 * kv_size;
  const int64_t inter = codes[2].size(0) / 2;
  // NOTE: every shape is checked here, before the regions: an exception inside an OpenMP region ends the process.
  const int64_t in_features[4] = {hidden, q_size, hidden, inter}, out_n[4] = {qkv_n, hidden, 2 * inter, hidden};
  std::vector<Product> products(static_cast<size_t>(4 * L));
  int64_t max_k = 0;
  for (int64_t p = 0; p < 4 * L; ++p) {
    const at::Tensor& c = codes[p];
    const at::Tensor& sc = scales[p];
    const int64_t N = out_n[p % 4], K = in_features[p % 4];
    TORCH_CHECK(c.scalar_type() == at::kChar && c.is_contiguous() && c.dim() == 2 && c.size(0) == N &&
                    c.size(1) == K,
                "decode_layers: int8 codes of projection ", p, " must be a contiguous [", N, ", ", K, "]");
    TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.is_contiguous() && sc.numel() == N,
                "decode_layers: int8 scales of projection ", p, " must be a contiguous float32 [", N, "]");
    const float* bias = p % 4 == 0 && !qkv_biases.empty() ? bias_data(qkv_biases[p / 4], N, "decode_layers") : nullptr;
    products[p] = Product{c.data_ptr<int8_t>(), sc.data_ptr<float>(), bias, N, K};
    max_k = std::max(max_k, K);
  }
  TORCH_CHECK(max_k < kA16MaxK, "decode_layers: int8 in_features too large for the 16-bit activations");
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2 && h.is_contiguous(),
              "decode_layers: int8 layers need float32 embeddings");
  TORCH_CHECK(norms.size() == static_cast<size_t>(2 * L), "decode_layers: expected 2 norms per layer");
  for (const at::Tensor& w : norms) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == hidden,
                "decode_layers: norm weights must be contiguous float32 vectors of the hidden size");
  }
  const auto opts = h.options();
  // The step's buffers, once (the loop allocates each op's output per layer).
  at::Tensor x = at::empty({B, hidden}, opts), qkv = at::empty({B, qkv_n}, opts);
  at::Tensor attn = at::empty({B, num_heads, head_dim}, opts), out = at::empty({B, hidden}, opts);
  at::Tensor gate_up = at::empty({B, 2 * inter}, opts), act = at::empty({B, inter}, opts);
  const int64_t Kp = padded_k(max_k);
  at::Tensor bytes = at::empty({2 * B * Kp}, opts.dtype(at::kByte));
  at::Tensor row_scales = at::empty({B}, opts), hi_sums = at::empty({B}, opts.dtype(at::kInt));
  const A16Rows q{reinterpret_cast<int8_t*>(bytes.data_ptr<uint8_t>()), bytes.data_ptr<uint8_t>() + B * Kp,
                  row_scales.data_ptr<float>(), hi_sums.data_ptr<int32_t>()};
  const auto quantize = [&](const at::Tensor& rows, int64_t K) {
    quantize_rows_a16(rows.data_ptr<float>(), rows.stride(0), B, K, q.hi, q.lo, q.s, q.hi_sum);
  };
  const at::Tensor attn_rows = attn.view({B, q_size});
  const at::Tensor residual = h;  // NOTE: the embeddings' buffer, updated in place (as the loop's)
  const int threads = at::get_num_threads();
  // NOTE: the serial ops of a region (norms, SiLU, quantizing x) run on one thread (`omp single`, whose end is a
  // barrier); inside the region their own parallel_for runs inline.
#pragma omp parallel num_threads(threads)
  {
#pragma omp single
    {
      rms_norm_to(x, h, c10::nullopt, norms[0], eps);
      quantize(x, hidden);
    }
    run_share(products[0], q, B, qkv.data_ptr<float>(), products[1]);
  }
  for (int64_t l = 0; l < L; ++l) {
    rotary_embedding(qkv, cos, sin, num_heads + num_kv_heads, head_dim);
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({B, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({B, num_kv_heads, head_dim});
    store_kv(kv_caches[l], k, v, slot_mapping);
    paged_decode_attention(attn, qkv.narrow(1, 0, q_size).view({B, num_heads, head_dim}), kv_caches[l], block_tables,
                           seq_lens, scale);
    const Product* w = &products[4 * l];
    const bool last = l + 1 == L;
    // the product after this layer's down: the next layer's qkv, or past the last, the down's own (no next)
    const Product& after_down = last ? w[3] : w[4];
#pragma omp parallel num_threads(threads)
    {
#pragma omp single
      quantize(attn_rows, q_size);
      run_share(w[1], q, B, out.data_ptr<float>(), w[2]);
#pragma omp single
      {
        add_rms_norm(out, residual, norms[2 * l + 1], eps);  // residual += h; h = norm(residual)
        quantize(out, hidden);
      }
      run_share(w[2], q, B, gate_up.data_ptr<float>(), w[3]);
#pragma omp single
      {
        silu_and_mul(act, gate_up);
        quantize(act, inter);
      }
      run_share(w[3], q, B, out.data_ptr<float>(), after_down);
      if (!last) {
#pragma omp single
        {
          add_rms_norm(out, residual, norms[2 * l + 2], eps);
          quantize(out, hidden);
        }
        run_share(w[4], q, B, qkv.data_ptr<float>(), w[5]);
      }
    }
  }
  return {out, residual};
}
#else
bool decode_layers_int8_supported(int64_t) { return false; }

std::tuple<at::Tensor, at::Tensor> decode_layers_int8(at::Tensor, const at::Tensor&, const at::Tensor&,
                                                      at::TensorList, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, at::TensorList, const std::vector<at::Tensor>&,
                                                      const std::vector<at::Tensor>&, at::TensorList, int64_t,
                                                      int64_t, int64_t, double, double) {
  TORCH_CHECK(false, "decode_layers_int8: needs an AVX-512 VNNI build");
}
#endif

}  // namespace pagoda
