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
//
// `decode_int8_head` runs the final norm and the LM head in the last layer's region too (the down projection's
// prefetches run on into the head's codes), and for an all-greedy step with nothing else reading the logits, picks
// each row's token there: every thread keeps its share's largest logit and first index per row, one thread reduces
// the shares in channel order. Why: the head's 28 MB (SmolLM2's tied 49,152 x 576 int8 table) was its own call, its
// stream starting cold, and its code stream evicted the 196 KB of logits it wrote, which the sampler then read back
// from DRAM for the argmax (~110 us a token).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
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

// The LM head after the last layer: the final norm's weight, the head's codes, and where its outputs go: the logits
// [B, V], or with `greedy` each row's largest logit and its first index (per thread, then reduced).
struct Head {
  Product p;
  const at::Tensor* final_norm;
  float* logits;  // nullptr with greedy
  float* best;  // [threads, stride]: each thread's running maximum per row ...
  int64_t* index;  // ... its first index ...
  uint8_t* nan;  // ... and whether a NaN was seen
  int64_t stride;  // per thread, >= B, a cache line apart
};

// Every thread: its share of the LM head (the logits, or the per-row maximum); then a barrier; with greedy one
// thread reduces the shares into row_max / tokens [B] (ties: the lowest index, as a share's lower channels come
// first; a NaN anywhere makes the row's maximum NaN; a row whose maximum is not finite gets token -1).
void run_head(const Head& head, const A16Rows& q, int64_t B, float* row_max, int64_t* tokens) {
  const int t = omp_get_thread_num(), T = omp_get_num_threads();
  const Product& p = head.p;
  const auto [begin, end] = share(p.N, t, T);
  if (head.logits != nullptr) {
    a16_run(head.logits, q.hi, q.lo, q.s, q.hi_sum, B, p.codes, p.scale, p.bias, p.N, p.K, begin, end,
            share_start(p, t, T));
#pragma omp barrier
    return;
  }
  float* best = head.best + t * head.stride;
  int64_t* index = head.index + t * head.stride;
  uint8_t* nan = head.nan + t * head.stride;
  std::fill(best, best + B, -std::numeric_limits<float>::infinity());
  std::fill(index, index + B, int64_t{-1});
  std::fill(nan, nan + B, uint8_t{0});
  a16_max(q.hi, q.lo, q.s, q.hi_sum, B, p.codes, p.scale, p.bias, p.N, p.K, begin, end, share_start(p, t, T), best,
          index, nan);
#pragma omp barrier
#pragma omp single
  for (int64_t r = 0; r < B; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    int64_t at = -1;
    bool any_nan = false;
    for (int u = 0; u < T; ++u) {
      const int64_t i = u * head.stride + r;
      any_nan = any_nan || head.nan[i] != 0;
      if (head.index[i] >= 0 && (at < 0 || head.best[i] > m)) m = head.best[i], at = head.index[i];
    }
    row_max[r] = any_nan ? std::numeric_limits<float>::quiet_NaN() : m;
    // NOTE: the sampler's FAILED_TOKEN (-1) where the maximum is not finite (its fail_unsampleable), here rather
    // than in torch ops: the code stream has evicted the interpreter's and torch's state from the caches, and each
    // op after the step ran ~20x its warm time (~150 us for that check, measured in the engine)
    tokens[r] = std::isfinite(row_max[r]) ? at : -1;
  }
}

Product checked_product(const at::Tensor& c, const at::Tensor& sc, int64_t N, int64_t K, const float* bias,
                        int64_t p) {
  TORCH_CHECK(c.scalar_type() == at::kChar && c.is_contiguous() && c.dim() == 2 && c.size(0) == N && c.size(1) == K,
              "decode_layers: int8 codes of projection ", p, " must be a contiguous [", N, ", ", K, "]");
  TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.is_contiguous() && sc.numel() == N,
              "decode_layers: int8 scales of projection ", p, " must be a contiguous float32 [", N, "]");
  return Product{c.data_ptr<int8_t>(), sc.data_ptr<float>(), bias, N, K};
}

// The layers (decode_layers_int8), then with `head` the final norm and the LM head in the last region. Returns the
// last down projection's product and the residual (without a head), as decode_step.cpp's loop.
std::tuple<at::Tensor, at::Tensor> run_layers(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                                              at::TensorList kv_caches, const at::Tensor& slot_mapping,
                                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                              at::TensorList norms, const std::vector<at::Tensor>& codes,
                                              const std::vector<at::Tensor>& scales, at::TensorList qkv_biases,
                                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                                              double scale, Head* head, float* row_max, int64_t* tokens) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  const int64_t B = h.size(0), hidden = h.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim, qkv_n = q_size + 2 * kv_size;
  TORCH_CHECK(codes.size() >= static_cast<size_t>(4 * L) && scales.size() == codes.size() && codes[2].dim() == 2,
              "decode_layers: expected int8 codes and scales for 4 projections per layer");
  const int64_t inter = codes[2].size(0) / 2;
  // NOTE: every shape is checked here, before the regions: an exception inside an OpenMP region ends the process.
  const int64_t in_features[4] = {hidden, q_size, hidden, inter}, out_n[4] = {qkv_n, hidden, 2 * inter, hidden};
  std::vector<Product> products(static_cast<size_t>(4 * L));
  int64_t max_k = 0;
  for (int64_t p = 0; p < 4 * L; ++p) {
    const int64_t N = out_n[p % 4], K = in_features[p % 4];
    const float* bias = p % 4 == 0 && !qkv_biases.empty() ? bias_data(qkv_biases[p / 4], N, "decode_layers") : nullptr;
    products[p] = checked_product(codes[p], scales[p], N, K, bias, p);
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
    // the product after this layer's down: the next layer's qkv, past the last the LM head, or none (its own)
    const Product& after_down = !last ? w[4] : head != nullptr ? head->p : w[3];
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
      } else if (head != nullptr) {
#pragma omp single
        {
          add_rms_norm(out, residual, *head->final_norm, eps);  // the model's final norm, as NativeDecodeStep's
          quantize(out, hidden);
        }
        run_head(*head, q, B, row_max, tokens);
      }
    }
  }
  return {out, residual};
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
  return run_layers(h, cos, sin, kv_caches, slot_mapping, block_tables, seq_lens, norms, codes, scales, qkv_biases,
                    num_heads, num_kv_heads, head_dim, eps, scale, nullptr, nullptr, nullptr);
}

// table[index[r]] for each r, as a new contiguous float32 [len(index), columns] (an index outside it names `what`):
// a float32 table's rows, or with `row_scale` an int8 table's, row i widened as codes[i][c] * row_scale[i]: one
// float32 product per value, as layers/int8_embedding.py's, so both give the same bits.
static at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& index, const char* what,
                              const c10::optional<at::Tensor>& row_scale = c10::nullopt) {
  const bool int8 = row_scale.has_value();
  TORCH_CHECK(table.scalar_type() == (int8 ? at::kChar : at::kFloat) && table.dim() == 2 && table.is_contiguous(),
              "decode_int8_head: a contiguous ", int8 ? "int8" : "float32", " table for ", what);
  TORCH_CHECK(!int8 || (row_scale->scalar_type() == at::kFloat && row_scale->is_contiguous() &&
                        row_scale->dim() == 1 && row_scale->size(0) == table.size(0)),
              "decode_int8_head: contiguous float32 scales, one per row of the int8 table for ", what);
  const at::Tensor rows = index.to(at::kLong).contiguous();
  TORCH_CHECK(rows.dim() == 1, "decode_int8_head: ", what, " must be a vector");
  const int64_t n = rows.size(0), width = table.size(1), limit = table.size(0);
  at::Tensor out = at::empty({n, width}, table.options().dtype(at::kFloat));
  const int64_t* at_row = rows.data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(at_row[r] >= 0 && at_row[r] < limit, "decode_int8_head: ", what, " ", at_row[r], " is outside [0, ",
                limit, ")");
    if (int8) {
      const int8_t* codes = table.data_ptr<int8_t>() + at_row[r] * width;
      const float s = row_scale->data_ptr<float>()[at_row[r]];
      for (int64_t c = 0; c < width; ++c) dst[r * width + c] = static_cast<float>(codes[c]) * s;
    } else {
      std::copy_n(table.data_ptr<float>() + at_row[r] * width, width, dst + r * width);
    }
  }
  return out;
}

// The layers as decode_layers_int8 over the embedding rows of `input_ids` (a float32 table, or int8 codes with
// `embedding_scale`: a tied table read from the LM head's codes) and the rotary rows of `positions`, then the
// final norm and the LM head (codes / scales: the layers' 4 per layer, then the head's). Returns (logits [B, V], an
// empty int64 tensor), or with `greedy` (each row's largest logit [B], NaN where a logit is NaN; its first index [B]
// int64, -1 where that maximum is not finite).
std::tuple<at::Tensor, at::Tensor> decode_int8_head(const at::Tensor& input_ids, const at::Tensor& positions,
                                                    const at::Tensor& embedding,
                                                    const c10::optional<at::Tensor>& embedding_scale,
                                                    const at::Tensor& cos_table, const at::Tensor& sin_table,
                                                    at::TensorList kv_caches,
                                                    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                                    const at::Tensor& seq_lens, at::TensorList norms,
                                                    at::TensorList codes, at::TensorList scales,
                                                    at::TensorList qkv_biases, const at::Tensor& final_norm,
                                                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                                    double eps, double scale, bool greedy) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(codes.size() == static_cast<size_t>(4 * L + 1) && scales.size() == codes.size(),
              "decode_int8_head: expected int8 codes and scales for 4 projections per layer and the LM head");
  TORCH_CHECK(embedding.dim() == 2 && codes.back().dim() == 2,
              "decode_int8_head: an embedding table [vocab, hidden] and head codes [V, hidden]");
  const int64_t hidden = embedding.size(1), V = codes.back().size(0);
  // NOTE: the embedding rows and the rotary's cos / sin rows copied here, not by torch ops before the call: each op
  // there ran from cold caches after the previous step's code stream (~0.07 ms a token each, measured in the engine)
  const at::Tensor h = gather_rows(embedding, input_ids, "input_ids", embedding_scale);
  const int64_t B = h.size(0);
  TORCH_CHECK(cos_table.sizes() == sin_table.sizes() && cos_table.dim() == 2 && cos_table.size(1) == head_dim,
              "decode_int8_head: cos / sin tables [positions, head_dim]");
  const at::Tensor cos = gather_rows(cos_table, positions, "positions"), sin = gather_rows(sin_table, positions,
                                                                                           "positions");
  TORCH_CHECK(cos.size(0) == B, "decode_int8_head: one position per input id");
  TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.is_contiguous() && final_norm.numel() == hidden,
              "decode_int8_head: the final norm's weight must be a contiguous float32 vector of the hidden size");
  const int threads = at::get_num_threads();
  const int64_t stride = (B + 63) / 64 * 64;
  at::Tensor first = greedy ? at::empty({B}, h.options()) : at::empty({B, V}, h.options());
  at::Tensor tokens = at::empty({greedy ? B : 0}, h.options().dtype(at::kLong));
  at::Tensor best = at::empty({greedy ? threads * stride : 0}, h.options());
  at::Tensor index = at::empty({greedy ? threads * stride : 0}, h.options().dtype(at::kLong));
  at::Tensor nan = at::empty({greedy ? threads * stride : 0}, h.options().dtype(at::kByte));
  Head head{checked_product(codes.back(), scales.back(), V, hidden, nullptr, 4 * L),
            &final_norm,
            greedy ? nullptr : first.data_ptr<float>(),
            best.data_ptr<float>(),
            index.data_ptr<int64_t>(),
            nan.data_ptr<uint8_t>(),
            stride};
  run_layers(h, cos, sin, kv_caches, slot_mapping, block_tables, seq_lens, norms, codes.vec(), scales.vec(),
             qkv_biases, num_heads, num_kv_heads, head_dim, eps, scale, &head,
             greedy ? first.data_ptr<float>() : nullptr, greedy ? tokens.data_ptr<int64_t>() : nullptr);
  return {first, tokens};
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

std::tuple<at::Tensor, at::Tensor> decode_int8_head(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const c10::optional<at::Tensor>&, const at::Tensor&,
                                                    const at::Tensor&, at::TensorList,
                                                    const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                                                    const at::Tensor&, int64_t, int64_t, int64_t, double, double,
                                                    bool) {
  TORCH_CHECK(false, "decode_int8_head: needs an AVX-512 VNNI build");
}
#endif

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def(
      "decode_int8_head(Tensor input_ids, Tensor positions, Tensor embedding, Tensor? embedding_scale, "
      "Tensor cos_table, Tensor sin_table, "
      "Tensor(a!)[] kv_caches, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor[] norms, Tensor[] codes, Tensor[] scales, Tensor[] qkv_biases, "
      "Tensor final_norm, int num_heads, int num_kv_heads, int head_dim, float eps, float scale, bool greedy) "
      "-> (Tensor, Tensor)");
  m.def("decode_int8_supported(int max_k) -> bool", &pagoda::decode_layers_int8_supported);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("decode_int8_head", &pagoda::decode_int8_head); }
