// The paged KV cache on CPUs: decode attention (one query token per sequence, K/V read straight from the cache)
// and the write of a step's new K/V into their slots.
//
// Why a native kernel: gather + SDPA moves every K/V byte three times (gather read, gather write, SDPA read) and
// SDPA's flash kernel is overhead-bound at one query row (~13 GFLOP/s here). This kernel reads each K/V row once:
// one work item per (sequence, KV head) computes the scores of the KV head's whole query group against each K
// row while it is in L1, then a softmax, then one pass over V. Built at first use by kernels/cpu/__init__.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// NOTE: glibc declares the vector variants of expf (libmvec) only under -ffast-math, which would also let the
// compiler assume no infinities. Declaring the SIMD variant ourselves keeps IEEE semantics and a vectorised exp.
extern "C" __attribute__((__simd__("notinbranch"))) float expf(float) noexcept;

namespace {

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
constexpr bool kHaveAvx2 = true;

// Sum of each of 8 vectors, returned as one vector (lane t = sum of a[t]).
inline __m256 reduce8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // s0123 = [t0 t1 t2 t3 | t0 t1 t2 t3] halves (low lanes, high lanes); same for s4567.
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

// scores[t] = scale * q . k_t for 8 K rows `row` floats apart (D % 8 == 0).
inline void dot8(const float* q, const float* k, int64_t row, int64_t D, float scale, float* scores) {
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + t * row + c), acc[t]);
  }
  _mm256_storeu_ps(scores, _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale)));
}

// o[0:D] += sum_t p[t] * v_t for n V rows `row` floats apart (D % 32 == 0): four accumulators in registers.
inline void axpy_rows(const float* p, const float* v, int64_t n, int64_t row, int64_t D, float* o) {
  for (int64_t c = 0; c < D; c += 32) {
    __m256 a0 = _mm256_loadu_ps(o + c), a1 = _mm256_loadu_ps(o + c + 8);
    __m256 a2 = _mm256_loadu_ps(o + c + 16), a3 = _mm256_loadu_ps(o + c + 24);
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = v + t * row + c;
      const __m256 pt = _mm256_set1_ps(p[t]);
      a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt), a0);
      a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8), a1);
      a2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 16), a2);
      a3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 24), a3);
    }
    _mm256_storeu_ps(o + c, a0);
    _mm256_storeu_ps(o + c + 8, a1);
    _mm256_storeu_ps(o + c + 16, a2);
    _mm256_storeu_ps(o + c + 24, a3);
  }
}
#else
constexpr bool kHaveAvx2 = false;
inline void dot8(const float*, const float*, int64_t, int64_t, float, float*) {}
inline void axpy_rows(const float*, const float*, int64_t, int64_t, int64_t, float*) {}
#endif

struct DecodeArgs {
  const float* qp;
  const float* kp;
  const float* vp;
  const int32_t* tables;
  const int32_t* lens;
  float* op;
  int64_t q_row, H, D, G, BS, num_blocks, max_blocks, row;
  float fscale;
  bool fast;
};

// Attention of sequence b's query heads [h*G, (h+1)*G) over KV head h.
void attend(const DecodeArgs& a, int64_t b, int64_t h, std::vector<float>& scores, std::vector<float>& inv_sum) {
  const int64_t H = a.H, D = a.D, G = a.G, BS = a.BS, row = a.row, num_blocks = a.num_blocks;
  const float *kp = a.kp, *vp = a.vp;
  const float fscale = a.fscale;
  const bool fast = a.fast;
  const int64_t L = a.lens[b];
  const float* qg = a.qp + b * a.q_row + h * G * D;
  float* og = a.op + (b * H + h * G) * D;
  std::fill(og, og + G * D, 0.0f);
  if (L <= 0) return;
  TORCH_CHECK((L + BS - 1) / BS <= a.max_blocks, "paged_decode_attention: seq_len exceeds the block table");
  scores.resize(G * L);
  const int32_t* table = a.tables + b * a.max_blocks;
  // Pass 1: scores[g][l] = scale * q_g . k_l, every K row read once for the whole query group.
  for (int64_t l0 = 0; l0 < L; l0 += BS) {
    const int64_t block = table[l0 / BS];
    TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block id out of range");
    const float* kb = kp + block * BS * row + h * D;
    const int64_t n = std::min(BS, L - l0);
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores.data() + g * L + l0;
      int64_t t = 0;
      if (fast) {
        for (; t + 8 <= n; t += 8) dot8(qg + g * D, kb + t * row, row, D, fscale, sg + t);
      }
      for (; t < n; ++t) sg[t] = pagoda::dot(qg + g * D, kb + t * row, D) * fscale;
    }
  }
  // Softmax per query head (vectorised exp through libmvec).
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * L;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t l = 0; l < L; ++l) m = std::max(m, s[l]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t l = 0; l < L; ++l) {
      s[l] = expf(s[l] - m);
      sum += s[l];
    }
    inv_sum[g] = 1.0f / sum;
  }
  // Pass 2: out_g = sum_l p[g][l] * v_l, every V row read once.
  for (int64_t l0 = 0; l0 < L; l0 += BS) {
    const float* vb = vp + static_cast<int64_t>(table[l0 / BS]) * BS * row + h * D;
    const int64_t n = std::min(BS, L - l0);
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = scores.data() + g * L + l0;
      float* o = og + g * D;
      if (fast) {
        axpy_rows(pg, vb, n, row, D, o);
        continue;
      }
      for (int64_t t = 0; t < n; ++t) {
        const float* v = vb + t * row;
        const float p = pg[t];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += p * v[d];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* o = og + g * D;
    const float inv = inv_sum[g];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

}  // namespace

namespace pagoda {

void paged_decode_attention(
    at::Tensor out,                 // [B, H, D] float32, written
    const at::Tensor& q,            // [B, H, D] float32
    const at::Tensor& kv_cache,     // [2, num_blocks, block_size, H_kv, D] float32
    const at::Tensor& block_tables, // [B, max_blocks] int32
    const at::Tensor& seq_lens,     // [B] int32
    double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 only");
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
  const int64_t row = HKV * D;  // floats between consecutive tokens of one block
  const float* qp = q.data_ptr<float>();
  const float* kp = kv_cache.data_ptr<float>();
  const float* vp = kp + num_blocks * BS * row;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const bool fast = kHaveAvx2 && D % 32 == 0;

  // NOTE: sequences are dealt out round-robin, not in static halves: decode rows arrive sorted longest-first, so
  // halves would give one core most of the context (measured: 64 rows of 100-700 tokens, 4.2 -> 3.6 ms). A unit is
  // a whole sequence (its KV heads in turn) unless there are too few sequences to keep every core busy.
  const DecodeArgs args{qp, kp, vp, tables, lens, op, q.stride(0), H, D, G, BS, num_blocks, max_blocks, row, fscale, fast};
  const int64_t nthreads = at::get_num_threads();
  const int64_t heads_per_unit = B >= 2 * nthreads ? HKV : 1;
  const int64_t num_units = B * HKV / heads_per_unit;
  const int64_t workers = std::min(nthreads, num_units);
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores, inv_sum(G);
    for (int64_t w = w0; w < w1; ++w) {
      for (int64_t unit = w; unit < num_units; unit += workers) {
        for (int64_t item = unit * heads_per_unit; item < (unit + 1) * heads_per_unit; ++item) {
          attend(args, item / HKV, item % HKV, scores, inv_sum);
        }
      }
    }
  });
}

// kv_cache[0|1] at slot s = block * block_size + offset <- k|v of token t; slots < 0 (padding) are skipped.
void store_kv(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "store_kv: float32 only");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "store_kv: int64 slots");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(), "store_kv: bad cache");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2), HKV = kv_cache.size(3), D = kv_cache.size(4);
  const int64_t T = slot_mapping.numel(), row = HKV * D;
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(0) >= T && x->size(1) == HKV && x->size(2) == D && x->stride(2) == 1 &&
                    x->stride(1) == D,
                "store_kv: k/v must be [tokens, kv_heads, head_dim] with packed heads");
  }
  float* kc = kv_cache.data_ptr<float>();
  float* vc = kc + num_slots * row;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "store_kv: slot out of range");
    std::copy(kp + t * ks, kp + t * ks + row, kc + slot * row);
    std::copy(vp + t * vs, vp + t * vs + row, vc + slot * row);
  }
}

}  // namespace pagoda

TORCH_LIBRARY(pagoda_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale) -> ()");
  m.def("store_kv(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("paged_decode_attention", &pagoda::paged_decode_attention);
  m.impl("store_kv", &pagoda::store_kv);
}
