// Decode attention over the paged KV cache on CPUs: one query token per sequence, K/V read straight from the cache
// (store_kv.cpp writes them; the SIMD helpers are in decode_attention_simd.h).
//
// Why a native kernel: gather + SDPA moves every K/V byte three times (gather read, gather write, SDPA read) and
// SDPA's flash kernel is overhead-bound at one query row (~13 GFLOP/s here). This kernel reads each K/V row once:
// a work item (a sequence and a range of its KV heads) walks the sequence's K rows in chunks of up to 16 tokens,
// scoring every query head of the range against each chunk while it is in L1, then a softmax, then the same walk
// over V, asking for the next block's rows into L2 while it works on the current one (prefetch_l2). Built at first use
// by kernels/cpu/__init__.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "decode_attention_bf16.h"
#include "decode_attention_simd.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <omp.h>
#include <type_traits>
#include <vector>

// NOTE: glibc declares the vector variants of expf (libmvec) only under -ffast-math, which would also let the
// compiler assume no infinities. Declaring the SIMD variant ourselves keeps IEEE semantics and a vectorised exp.
extern "C" __attribute__((__simd__("notinbranch"))) float expf(float) noexcept;

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace pagoda::decode_simd;

constexpr int64_t kChunk = 16;  // K/V rows scored or accumulated per step of the walk (one AVX-512 register of scores)

// exp(x - max) in place over x[0, L) (vectorised exp through libmvec); returns 1 / their sum. NOTE: not inlined, so
// that both work splits below run the same instructions (the same lanes summed in the same order).
__attribute__((noinline)) float softmax_row(float* x, int64_t L) {
  const float m = max_of(x, L);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t l = 0; l < L; ++l) {
    x[l] = expf(x[l] - m);
    sum += x[l];
  }
  return 1.0f / sum;
}

template <typename T>
struct DecodeArgs {
  const float* qp;
  const T* kp;
  const T* vp;
  const int32_t* tables;
  const int32_t* lens;
  float* op;
  int64_t q_row, H, D, G, BS, num_blocks, max_blocks, row;
  float fscale;
};

// Per work item: the scores of its query heads (one row of `stride` >= seq_len floats each) and pointer lists; for
// the bf16 dot products also q and the weights as bf16 bits and the outputs in accumulate_slice's lane order.
struct Scratch {
  std::vector<float> scores;
  std::vector<float> inv_sum;
  std::vector<const float*> p;
  std::vector<float*> o;
  std::vector<uint16_t> q16, p16;
  std::vector<const uint16_t*> p2;
  std::vector<float> acc;
};

// Whether a cache of T at head_dim D takes the bf16 dot products (decode_attention_bf16.h): a bf16 cache, where
// the compiler targets AVX-512 BF16.
template <typename T>
inline bool uses_dot_products([[maybe_unused]] int64_t D) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) return pagoda::decode_bf16::head_dim_fits(D);
#endif
  return false;
}

#if defined(__AVX512BF16__)
namespace dp = pagoda::decode_bf16;
#endif

#if defined(__AVX512BF16__)
// `attend`'s passes with the bf16 dot products: q (scaled) split into two bf16 halves, the weights rounded to bf16,
// the outputs accumulated in accumulate_slice's lane order and put back in place by the normalisation.
template <typename Walk>
void attend_dp(const DecodeArgs<at::BFloat16>& a, int64_t L, const float* qg, float* og, int64_t heads,
               int64_t stride, const Walk& walk, Scratch& s) {
  const int64_t D = a.D, G = a.G, row = a.row, slices = D / dp::kSlice;
  s.q16.resize(2 * heads * D);  // q's hi halves, then its lo halves
  s.p16.resize(heads * stride);
  s.p2.resize(G);
  s.acc.assign(heads * D, 0.0f);
  const uint16_t *hi = s.q16.data(), *lo = hi + heads * D;
  dp::split_scaled(qg, a.fscale, heads * D, s.q16.data(), s.q16.data() + heads * D);
  walk(a.kp, a.vp, [&](int64_t l0, int64_t n, const at::BFloat16* rows) {
    for (int64_t h = 0, j = 0; j < heads; ++h) {
      for (int64_t g = 0; g < G; ++g, ++j)
        dp::score_rows(hi + j * D, lo + j * D, rows + h * D, n, row, D, s.scores.data() + j * stride + l0);
    }
  });
  for (int64_t j = 0; j < heads; ++j)
    s.inv_sum[j] = dp::softmax_row(s.scores.data() + j * stride, L, s.p16.data() + j * stride);
  walk(a.vp, nullptr, [&](int64_t l0, int64_t n, const at::BFloat16* rows) {
    for (int64_t h = 0; h * G < heads; ++h) {
      for (int64_t c = 0; c < slices; ++c) {
        for (int64_t g = 0; g < G; ++g) {
          s.p2[g] = s.p16.data() + (h * G + g) * stride + l0;
          s.o[g] = s.acc.data() + (h * G + g) * D + dp::kSlice * c;
        }
        dp::accumulate_heads(s.p2.data(), G, rows + h * D + dp::kSlice * c, n, row, s.o.data());
      }
    }
  });
  for (int64_t j = 0; j < heads; ++j) dp::finish_head(s.acc.data() + j * D, 0, slices, s.inv_sum[j], og + j * D);
}
#endif

// Attention of sequence b's query heads [h0*G, h1*G) over KV heads [h0, h1).
template <typename T>
void attend(const DecodeArgs<T>& a, int64_t b, int64_t h0, int64_t h1, Scratch& s) {
  const int64_t D = a.D, G = a.G, BS = a.BS, row = a.row, heads = (h1 - h0) * G;
  const int64_t L = a.lens[b];
  const float* qg = a.qp + b * a.q_row + h0 * G * D;
  float* og = a.op + (b * a.H + h0 * G) * D;
  std::fill(og, og + heads * D, 0.0f);
  if (L <= 0) return;
  TORCH_CHECK((L + BS - 1) / BS <= a.max_blocks, "paged_decode_attention: seq_len exceeds the block table");
  const int64_t stride = (L + kChunk - 1) / kChunk * kChunk;
  s.scores.resize(heads * stride);
  s.inv_sum.resize(heads);
  s.p.resize(G);
  s.o.resize(G);
  const bool dots = uses_dot_products<T>(D);
  const int32_t* table = a.tables + b * a.max_blocks;
  const bool whole_rows = (h1 - h0) * D == row;
  const int64_t blocks = (L + BS - 1) / BS;
  // The walk: chunks of up to kChunk rows that never cross a block; `base` + the chunk's first row. `next`: the
  // cache whose walk follows this one (the K walk's: V), whose first blocks are prefetched as this one ends.
  auto walk = [&](const T* base, const T* next, auto&& visit) {
    for (int64_t l0 = 0; l0 < L;) {
      const int64_t block = table[l0 / BS];
      TORCH_CHECK(block >= 0 && block < a.num_blocks, "paged_decode_attention: block id out of range");
      const int64_t n = std::min({kChunk, L - l0, BS - l0 % BS});
      const T* rows = base + (block * BS + l0 % BS) * row + h0 * D;
      if (whole_rows) {
        // the block kPrefetchBlocks ahead in this walk, or past its end the first blocks of the walk that follows
        const int64_t ahead = l0 / BS + kPrefetchBlocks, pb = ahead < blocks ? ahead : ahead - blocks;
        const T* pbase = ahead < blocks ? base : next;
        if (l0 % BS == 0 && pbase != nullptr && pb < blocks && table[pb] >= 0 && table[pb] < a.num_blocks)
          prefetch_l2(pbase + table[pb] * BS * row, std::min(BS, L - pb * BS) * row);
        touch_rows(rows, n, row, row);
      }
      visit(l0, n, rows);
      l0 += n;
    }
  };
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (dots) return attend_dp(a, L, qg, og, heads, stride, walk, s);
  }
#endif
  // Pass 1: scores[j][l] = scale * q_j . k_l for every query head j of the item.
  walk(a.kp, a.vp, [&](int64_t l0, int64_t n, const T* rows) {
    for (int64_t j = 0; j < heads; ++j)
      score_rows(qg + j * D, rows + (j / G) * D, n, row, D, a.fscale, s.scores.data() + j * stride + l0);
  });
  for (int64_t j = 0; j < heads; ++j) s.inv_sum[j] = softmax_row(s.scores.data() + j * stride, L);
  // Pass 2: out_j = sum_l p[j][l] * v_l, each KV head's V rows shared by its G query heads.
  walk(a.vp, nullptr, [&](int64_t l0, int64_t n, const T* rows) {
    for (int64_t h = 0; h < h1 - h0; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        s.p[g] = s.scores.data() + (h * G + g) * stride + l0;
        s.o[g] = og + (h * G + g) * D;
      }
      accumulate_rows(s.p.data(), G, rows + h * D, n, row, D, s.o.data());
    }
  });
  for (int64_t j = 0; j < heads; ++j) {
    float* o = og + j * D;
    const float inv = s.inv_sum[j];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

#if defined(PAGODA_DECODE_SLICES)
// One sequence's attention on every thread (batch 1): split by KV head, 3 KV heads gave one core two strided walks
// and the other one. Here the threads share the whole-row walks, with the same arithmetic for each output as
// `attend` (so the bits do not depend on the thread count): the K walk split by token ranges that start where the
// walk's chunks do (each score is its own dot product), the softmax by query head, the V walk by slices of
// head_dim (each output element's sum keeps its order over the tokens). False: not for this shape (attend it).
template <typename T>
bool attend_lone(const DecodeArgs<T>& a, int64_t b, int64_t nthreads) {
  const int64_t D = a.D, G = a.G, BS = a.BS, row = a.row, H = a.H, HKV = row / D, L = a.lens[b];
  if ((D != 64 && D != 128) || nthreads < 2 || L <= 0) return false;
  const int64_t num_blocks = (L + BS - 1) / BS;
  TORCH_CHECK(num_blocks <= a.max_blocks, "paged_decode_attention: seq_len exceeds the block table");
  const int32_t* table = a.tables + b * a.max_blocks;
  // NOTE: checked here: an exception must not leave the OpenMP region below
  for (int64_t i = 0; i < num_blocks; ++i) {
    TORCH_CHECK(table[i] >= 0 && table[i] < a.num_blocks, "paged_decode_attention: block id out of range");
  }
  const int64_t stride = (L + kChunk - 1) / kChunk * kChunk, span = std::lcm(BS, kChunk);
  const int64_t spans = (L + span - 1) / span, vectors = D / 16;
  std::vector<float> scores(H * stride), inv_sum(H);
  const float* qg = a.qp + b * a.q_row;
  float* og = a.op + b * H * D;
  // the bf16 dot products: q and the weights as bf16 bits, the outputs in accumulate_slice's lane order, the V walk
  // split by its 32-element slices
  const bool dots = uses_dot_products<T>(D);
  std::vector<uint16_t> q16(dots ? 2 * H * D : 0), p16(dots ? H * stride : 0);  // q's hi halves, then its lo halves
  std::vector<float> acc(dots ? H * D : 0);
#if defined(__AVX512BF16__)
  if (dots) dp::split_scaled(qg, a.fscale, H * D, q16.data(), q16.data() + H * D);
#endif
  // chunks of up to kChunk rows that never cross a block, over rows [l_begin, l_end), as attend's walk
  auto walk = [&](const T* base, int64_t l_begin, int64_t l_end, auto&& visit) {
    for (int64_t l0 = l_begin; l0 < l_end;) {
      const int64_t n = std::min({kChunk, l_end - l0, BS - l0 % BS});
      visit(l0, n, base + (table[l0 / BS] * BS + l0 % BS) * row);
      l0 += n;
    }
  };
#pragma omp parallel num_threads(nthreads)
  {
    const int64_t w = omp_get_thread_num(), nw = omp_get_num_threads();
    walk(a.kp, std::min(L, w * spans / nw * span), std::min(L, (w + 1) * spans / nw * span),
         [&](int64_t l0, int64_t n, const T* rows) {
           touch_rows(rows, n, row, row);
#if defined(__AVX512BF16__)
           if constexpr (std::is_same_v<T, at::BFloat16>) {
             if (dots) {
               for (int64_t j = 0; j < H; ++j)
                 dp::score_rows(q16.data() + j * D, q16.data() + (H + j) * D, rows + (j / G) * D, n, row, D,
                                scores.data() + j * stride + l0);
               return;
             }
           }
#endif
           for (int64_t j = 0; j < H; ++j)
             score_rows(qg + j * D, rows + (j / G) * D, n, row, D, a.fscale, scores.data() + j * stride + l0);
         });
#pragma omp barrier
    for (int64_t j = w; j < H; j += nw) {
#if defined(__AVX512BF16__)
      if (dots) {
        inv_sum[j] = dp::softmax_row(scores.data() + j * stride, L, p16.data() + j * stride);
        continue;
      }
#endif
      inv_sum[j] = softmax_row(scores.data() + j * stride, L);
    }
#pragma omp barrier
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (dots) {
        const int64_t slices = D / dp::kSlice, s0 = w * slices / nw, s1 = (w + 1) * slices / nw;
        std::vector<const uint16_t*> p(G);
        std::vector<float*> o(G);
        walk(a.vp, 0, s1 > s0 ? L : 0, [&](int64_t l0, int64_t n, const T* rows) {
          for (int64_t h = 0; h < HKV; ++h) {
            for (int64_t c = s0; c < s1; ++c) {
              for (int64_t g = 0; g < G; ++g) {
                p[g] = p16.data() + (h * G + g) * stride + l0;
                o[g] = acc.data() + (h * G + g) * D + dp::kSlice * c;
              }
              dp::accumulate_heads(p.data(), G, rows + h * D + dp::kSlice * c, n, row, o.data());
            }
          }
        });
        for (int64_t j = 0; j < H; ++j) dp::finish_head(acc.data() + j * D, s0, s1, inv_sum[j], og + j * D);
      }
    }
#endif
    const int64_t c0 = w * vectors / nw, c1 = (w + 1) * vectors / nw;
    if (c1 > c0 && !dots) {
      std::vector<const float*> p(G);
      std::vector<float*> o(G), shifted(G);
      for (int64_t j = 0; j < H; ++j) std::fill(og + j * D + 16 * c0, og + j * D + 16 * c1, 0.0f);
      walk(a.vp, 0, L, [&](int64_t l0, int64_t n, const T* rows) {
        for (int64_t h = 0; h < HKV; ++h) {
          for (int64_t g = 0; g < G; ++g) {
            p[g] = scores.data() + (h * G + g) * stride + l0;
            o[g] = og + (h * G + g) * D + 16 * c0;
          }
          accumulate_slice(p.data(), G, rows + h * D + 16 * c0, n, row, c1 - c0, o.data(), shifted);
        }
      });
      for (int64_t j = 0; j < H; ++j) {
        float* oj = og + j * D;
        for (int64_t d = 16 * c0; d < 16 * c1; ++d) oj[d] *= inv_sum[j];
      }
    }
  }
  return true;
}
#endif

// The work split over threads, for one K/V element type (float32 or bf16).
template <typename T>
void decode_all(const DecodeArgs<T>& args, int64_t B, int64_t HKV) {
  // NOTE: a unit is a whole sequence (all its KV heads, so each K/V row is read as one contiguous run) unless there
  // are too few sequences to keep every core busy; then a unit is one KV head. Units are dealt out round-robin, not
  // in static halves: decode rows arrive sorted longest-first, so halves would give one core most of the context
  // (measured: 64 rows of 100-700 tokens, 4.2 -> 3.6 ms). Either way each head's arithmetic is the same, so the
  // output does not depend on the thread count.
  // NOTE: one thread always takes whole sequences: split by KV head, a lone sequence's walk reads each head's slice
  // of the rows (strided, untouched); whole rows are contiguous and touched first. Measured at batch 1 (SmolLM2,
  // ~190 tokens of context, 1 thread, thread CPU time): the 30 layers' attention 1.21-1.51 -> 0.87 ms per token.
  const int64_t nthreads = at::get_num_threads();
#if defined(PAGODA_DECODE_SLICES)
  if (B == 1 && !at::in_parallel_region() && attend_lone(args, 0, nthreads)) return;
#endif
  const int64_t heads_per_unit = B >= 2 * nthreads || nthreads == 1 ? HKV : 1;
  const int64_t num_units = B * HKV / heads_per_unit;
  const int64_t workers = std::min(nthreads, num_units);
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    Scratch scratch;
    for (int64_t w = w0; w < w1; ++w) {
      for (int64_t unit = w; unit < num_units; unit += workers) {
        const int64_t item = unit * heads_per_unit;
        attend(args, item / HKV, item % HKV, item % HKV + heads_per_unit, scratch);
      }
    }
  });
}

}  // namespace

namespace pagoda {

void paged_decode_attention(
    at::Tensor out,                 // [B, H, D] float32, written
    const at::Tensor& q,            // [B, H, D] float32
    const at::Tensor& kv_cache,     // [2, num_blocks, block_size, H_kv, D] float32 or bfloat16
    const at::Tensor& block_tables, // [B, max_blocks] int32
    const at::Tensor& seq_lens,     // [B] int32
    double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_decode_attention: q and out must be float32");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "paged_decode_attention: the KV cache must be float32 or bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and seq_lens must be int32");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "paged_decode_attention: bad shapes");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  // q may be a row-strided view into the fused qkv projection output; heads within a row must be packed.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && kv_cache.is_contiguous() && out.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention: inputs must be contiguous (q: heads packed within each row)");
  const int64_t num_blocks = kv_cache.size(1), BS = kv_cache.size(2), HKV = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % HKV == 0, "paged_decode_attention: head shapes do not match the cache");
  TORCH_CHECK(block_tables.size(0) >= B && seq_lens.size(0) >= B && out.sizes() == q.sizes(),
              "paged_decode_attention: batch sizes do not match");
  const int64_t G = H / HKV, max_blocks = block_tables.size(1);
  const int64_t row = HKV * D;  // elements between consecutive tokens of one block
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  // NOTE: a bf16 cache halves the bytes this DRAM-bound kernel reads; each element is widened to fp32 exactly on
  // load and every product and sum stays fp32, so only the stored K/V are rounded (by store_kv).
  if (kv_cache.scalar_type() == at::kBFloat16) {
    const at::BFloat16* kp = kv_cache.data_ptr<at::BFloat16>();
    decode_all(DecodeArgs<at::BFloat16>{q.data_ptr<float>(), kp, kp + num_blocks * BS * row, tables, lens,
                                        out.data_ptr<float>(), q.stride(0), H, D, G, BS, num_blocks, max_blocks, row,
                                        fscale},
               B, HKV);
  } else {
    const float* kp = kv_cache.data_ptr<float>();
    decode_all(DecodeArgs<float>{q.data_ptr<float>(), kp, kp + num_blocks * BS * row, tables, lens,
                                 out.data_ptr<float>(), q.stride(0), H, D, G, BS, num_blocks, max_blocks, row, fscale},
               B, HKV);
  }
}

}  // namespace pagoda

TORCH_LIBRARY(pagoda_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale) -> ()");
  m.def("decode_bf16_dot_products(int head_dim) -> bool",
        [](int64_t head_dim) { return uses_dot_products<at::BFloat16>(head_dim); });
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("paged_decode_attention", &pagoda::paged_decode_attention);
}
