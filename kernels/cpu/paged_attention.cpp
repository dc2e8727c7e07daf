// The paged KV cache on CPUs: decode attention (one query token per sequence, K/V read straight from the cache)
// and the write of a step's new K/V into their slots.
//
// Why a native kernel: gather + SDPA moves every K/V byte three times (gather read, gather write, SDPA read) and
// SDPA's flash kernel is overhead-bound at one query row (~13 GFLOP/s here). This kernel reads each K/V row once:
// a work item (a sequence and a range of its KV heads) walks the sequence's K rows in chunks of up to 16 tokens,
// scoring every query head of the range against each chunk while it is in L1, then a softmax, then the same walk
// over V. Built at first use by kernels/cpu/__init__.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <omp.h>
#include <vector>

// NOTE: glibc declares the vector variants of expf (libmvec) only under -ffast-math, which would also let the
// compiler assume no infinities. Declaring the SIMD variant ourselves keeps IEEE semantics and a vectorised exp.
extern "C" __attribute__((__simd__("notinbranch"))) float expf(float) noexcept;

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 16;  // K/V rows scored or accumulated per step of the walk (one AVX-512 register of scores)

// Loads every cache line of `n` rows (`floats` floats each, `row` floats apart) once, discarding the data.
// NOTE: why: decode attention is bound by the K/V reads, and a dense run of independent loads keeps many more
// misses in flight than the FMA chains of the scoring loop, whose loads wait behind their arithmetic. Measured
// (64 sequences x ~440 tokens, SmolLM2 heads, 2 threads, blocks in allocation order, K/V from DRAM): 3.50 -> 1.95
// ms per layer. Software prefetch of the next chunk instead was slower; a larger block size gained nothing in the
// engine.
// NOTE: the loads feed two OR chains of vector registers, not one chain of scalar float adds: the adds' latency
// (3 cycles each, 7 per row) had the touch take ~12 % of the kernel where the rows were already in L2 (perf, 8 rows
// x ~250 tokens, bf16 cache), and the chain held the loads' retirement in order.
template <typename T>
inline void touch_rows(const T* p, int64_t n, int64_t row, int64_t elems) {
  constexpr int64_t kLine = 64 / sizeof(T);
#if defined(__AVX512F__)
  if (elems >= kLine) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0;
    for (int64_t t = 0; t < n; ++t) {
      const T* r = p + t * row;
      int64_t i = 0;
      for (; i + 2 * kLine <= elems; i += 2 * kLine) {
        a0 = _mm512_or_si512(a0, _mm512_loadu_si512(r + i));
        a1 = _mm512_or_si512(a1, _mm512_loadu_si512(r + i + kLine));
      }
      // the rest of the row (under two lines): 64-byte loads, the last ending at the row's end (never past it)
      if (i < elems) a0 = _mm512_or_si512(a0, _mm512_loadu_si512(r + std::min(i, elems - kLine)));
      if (i + kLine < elems) a1 = _mm512_or_si512(a1, _mm512_loadu_si512(r + elems - kLine));
    }
    asm volatile("" : : "v"(a0), "v"(a1));
    return;
  }
#endif
  float sink = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    const T* r = p + t * row;
    for (int64_t i = 0; i < elems; i += kLine) sink += static_cast<float>(r[i]);
    sink += static_cast<float>(r[elems - 1]);
  }
  asm volatile("" : : "x"(sink));
}

#if defined(__AVX512F__)
// 16 K/V elements as fp32: a float32 cache's load, or a bf16 cache's widened exactly (bf16 is fp32's top half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// Lane j of the result = the sum of the 16 lanes of a[j] (a transpose-and-add tree: 15 adds for 16 sums).
// NOTE: always inlined: GCC kept it a call, storing the 16 accumulators to the stack and reloading them.
__attribute__((always_inline)) inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// scores[t] = scale * q . k_t for 16 K rows `row` floats apart; NC = head_dim / 16.
template <int NC, typename T>
inline void score16(const float* q, const T* k, int64_t row, float scale, float* scores) {
  __m512 qv[NC], acc[16];
  for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    acc[t] = _mm512_mul_ps(qv[0], load16(k + t * row));
#pragma GCC unroll 8
    for (int c = 1; c < NC; ++c) acc[t] = _mm512_fmadd_ps(qv[c], load16(k + t * row + 16 * c), acc[t]);
  }
  _mm512_storeu_ps(scores, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
}

// o_g += sum_t p_g[t] * v_t for GG query heads sharing n V rows: GG x NC accumulators stay in registers, each V
// row is loaded once for the whole group (independent FMA chains, not one chain per output register).
template <int NC, int GG, typename T>
inline void accumulate_group(const float* const* p, const T* v, int64_t n, int64_t row, float* const* o) {
  __m512 acc[GG][NC];
  for (int g = 0; g < GG; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_loadu_ps(o[g] + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    __m512 vv[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) vv[c] = load16(v + t * row + 16 * c);
#pragma GCC unroll 4
    for (int g = 0; g < GG; ++g) {
      const __m512 pt = _mm512_set1_ps(p[g][t]);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(pt, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GG; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o[g] + 16 * c, acc[g][c]);
}

// accumulate_group for head_dim 64 (NC = 4), the same FMAs in the same order with named accumulators.
// NOTE: GCC kept one of the array's accumulators on the stack in the (4 x 3) bf16 case, a store and a reload on every
// V row (~14 % of the kernel's samples in perf); named variables stay in registers (as in panel_linear.cpp).
#define ACC4_ROW(g)                                                                     \
  if constexpr (GG > g) {                                                               \
    const __m512 pt = _mm512_set1_ps(p##g[t]);                                          \
    a##g##0 = _mm512_fmadd_ps(pt, v0, a##g##0);                                         \
    a##g##1 = _mm512_fmadd_ps(pt, v1, a##g##1);                                         \
    a##g##2 = _mm512_fmadd_ps(pt, v2, a##g##2);                                         \
    a##g##3 = _mm512_fmadd_ps(pt, v3, a##g##3);                                         \
  }
#define ACC4_LOAD(g)                                                                                          \
  if constexpr (GG > g) {                                                                                     \
    a##g##0 = _mm512_loadu_ps(o##g), a##g##1 = _mm512_loadu_ps(o##g + 16), a##g##2 = _mm512_loadu_ps(o##g + 32), \
    a##g##3 = _mm512_loadu_ps(o##g + 48);                                                                     \
  }
#define ACC4_STORE(g)                                                                                       \
  if constexpr (GG > g) {                                                                                   \
    _mm512_storeu_ps(o##g, a##g##0), _mm512_storeu_ps(o##g + 16, a##g##1), _mm512_storeu_ps(o##g + 32, a##g##2); \
    _mm512_storeu_ps(o##g + 48, a##g##3);                                                                   \
  }
template <int GG, typename T>
inline void accumulate_group4(const float* const* p, const T* v, int64_t n, int64_t row, float* const* o) {
  const float *p0 = p[0], *p1 = GG > 1 ? p[1] : nullptr, *p2 = GG > 2 ? p[2] : nullptr, *p3 = GG > 3 ? p[3] : nullptr;
  float *o0 = o[0], *o1 = GG > 1 ? o[1] : nullptr, *o2 = GG > 2 ? o[2] : nullptr, *o3 = GG > 3 ? o[3] : nullptr;
  __m512 a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33;
  ACC4_LOAD(0) ACC4_LOAD(1) ACC4_LOAD(2) ACC4_LOAD(3)
  for (int64_t t = 0; t < n; ++t) {
    const T* vt = v + t * row;
    const __m512 v0 = load16(vt), v1 = load16(vt + 16), v2 = load16(vt + 32), v3 = load16(vt + 48);
    ACC4_ROW(0) ACC4_ROW(1) ACC4_ROW(2) ACC4_ROW(3)
  }
  ACC4_STORE(0) ACC4_STORE(1) ACC4_STORE(2) ACC4_STORE(3)
}
#undef ACC4_ROW
#undef ACC4_LOAD
#undef ACC4_STORE

template <int NC, int MaxGG, typename T>
inline void accumulate_heads(const float* const* p, int64_t G, const T* v, int64_t n, int64_t row, float* const* o) {
  for (int64_t g = 0; g < G; g += MaxGG) {
    if constexpr (NC == 4) {
      switch (std::min<int64_t>(MaxGG, G - g)) {
        case 1: accumulate_group4<1, T>(p + g, v, n, row, o + g); break;
        case 2: accumulate_group4<2, T>(p + g, v, n, row, o + g); break;
        case 3: accumulate_group4<3, T>(p + g, v, n, row, o + g); break;
        default: accumulate_group4<4, T>(p + g, v, n, row, o + g); break;
      }
      continue;
    }
    switch (std::min<int64_t>(MaxGG, G - g)) {
      case 1: accumulate_group<NC, 1, T>(p + g, v, n, row, o + g); break;
      case 2: accumulate_group<NC, 2, T>(p + g, v, n, row, o + g); break;
      case 3: if constexpr (MaxGG >= 3) accumulate_group<NC, 3, T>(p + g, v, n, row, o + g); break;
      default: if constexpr (MaxGG >= 4) accumulate_group<NC, 4, T>(p + g, v, n, row, o + g); break;
    }
  }
}
#endif

// scores[t] = scale * q . k_t for n K rows `row` floats apart.
template <typename T>
inline void score_rows(const float* q, const T* k, int64_t n, int64_t row, int64_t D, float scale, float* scores) {
#if defined(__AVX512F__)
  if (n == 16 && D == 64) return score16<4>(q, k, row, scale, scores);
  if (n == 16 && D == 128) return score16<8>(q, k, row, scale, scores);
#endif
  for (int64_t t = 0; t < n; ++t) scores[t] = pagoda::dot(q, k + t * row, D) * scale;  // ops.h, per type
}

// o[g] += sum_t p[g][t] * v_t for the G query heads of one KV head over n V rows `row` floats apart.
template <typename T>
inline void accumulate_rows(const float* const* p, int64_t G, const T* v, int64_t n, int64_t row, int64_t D,
                            float* const* o) {
#if defined(__AVX512F__)
  if (D == 64) return accumulate_heads<4, 4>(p, G, v, n, row, o);
  if (D == 128) return accumulate_heads<8, 2>(p, G, v, n, row, o);
#endif
  for (int64_t g = 0; g < G; ++g) {
    float* og = o[g];
    for (int64_t t = 0; t < n; ++t) {
      const T* vt = v + t * row;
      const float pt = p[g][t];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[d] += pt * static_cast<float>(vt[d]);
    }
  }
}

// The largest of x[0, n) (-inf for n = 0). NOTE: GCC left `omp simd reduction(max)` over std::max scalar (~9 % of
// the kernel in the perf profile above); the maximum does not depend on the order, so the bits are the same.
inline float max_of(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t l = 0;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(m);
  for (; l + 16 <= n; l += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + l));
  m = _mm512_reduce_max_ps(mv);
#endif
  for (; l < n; ++l) m = std::max(m, x[l]);
  return m;
}

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

// Per work item: the scores of its query heads (one row of `stride` >= seq_len floats each) and pointer lists.
struct Scratch {
  std::vector<float> scores;
  std::vector<float> inv_sum;
  std::vector<const float*> p;
  std::vector<float*> o;
};

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
  const int32_t* table = a.tables + b * a.max_blocks;
  const bool whole_rows = (h1 - h0) * D == row;
  // The walk: chunks of up to kChunk rows that never cross a block; `base` + the chunk's first row.
  auto walk = [&](const T* base, auto&& visit) {
    for (int64_t l0 = 0; l0 < L;) {
      const int64_t block = table[l0 / BS];
      TORCH_CHECK(block >= 0 && block < a.num_blocks, "paged_decode_attention: block id out of range");
      const int64_t n = std::min({kChunk, L - l0, BS - l0 % BS});
      const T* rows = base + (block * BS + l0 % BS) * row + h0 * D;
      if (whole_rows) touch_rows(rows, n, row, row);
      visit(l0, n, rows);
      l0 += n;
    }
  };
  // Pass 1: scores[j][l] = scale * q_j . k_l for every query head j of the item.
  walk(a.kp, [&](int64_t l0, int64_t n, const T* rows) {
    for (int64_t j = 0; j < heads; ++j)
      score_rows(qg + j * D, rows + (j / G) * D, n, row, D, a.fscale, s.scores.data() + j * stride + l0);
  });
  for (int64_t j = 0; j < heads; ++j) s.inv_sum[j] = softmax_row(s.scores.data() + j * stride, L);
  // Pass 2: out_j = sum_l p[j][l] * v_l, each KV head's V rows shared by its G query heads.
  walk(a.vp, [&](int64_t l0, int64_t n, const T* rows) {
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

#if defined(__AVX512F__)
// o[g][16 c0, 16 c1) += sum_t p[g][t] * v_t[16 c0, 16 c1) for the G query heads of one KV head: accumulate_rows over
// a slice of head_dim (o and v point at the slice), the same FMA per element in the same order over t.
template <typename T>
inline void accumulate_slice(const float* const* p, int64_t G, const T* v, int64_t n, int64_t row, int64_t vectors,
                             float* const* o, std::vector<float*>& shifted) {
  switch (vectors) {
    case 1: return accumulate_heads<1, 4>(p, G, v, n, row, o);
    case 2: return accumulate_heads<2, 4>(p, G, v, n, row, o);
    case 4: return accumulate_heads<4, 4>(p, G, v, n, row, o);
    default:
      for (int64_t c = 0; c < vectors; ++c) {
        for (int64_t g = 0; g < G; ++g) shifted[g] = o[g] + 16 * c;
        accumulate_heads<1, 4>(p, G, v + 16 * c, n, row, shifted.data());
      }
  }
}

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
           for (int64_t j = 0; j < H; ++j)
             score_rows(qg + j * D, rows + (j / G) * D, n, row, D, a.fscale, scores.data() + j * stride + l0);
         });
#pragma omp barrier
    for (int64_t j = w; j < H; j += nw) inv_sum[j] = softmax_row(scores.data() + j * stride, L);
#pragma omp barrier
    const int64_t c0 = w * vectors / nw, c1 = (w + 1) * vectors / nw;
    if (c1 > c0) {
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

// kv_cache[0|1] rows <- k|v for tokens [t0, t1), each at its slot; slots < 0 (padding) are skipped.
template <typename T>
void store_rows(T* kc, T* vc, const float* kp, const float* vp, int64_t ks, int64_t vs, const int64_t* slots,
                int64_t row, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    // NOTE: to bf16 by round-to-nearest-even (c10::BFloat16's conversion, as torch's .to(bfloat16))
    std::copy(kp + t * ks, kp + t * ks + row, kc + slot * row);
    std::copy(vp + t * vs, vp + t * vs + row, vc + slot * row);
  }
}

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
#if defined(__AVX512F__)
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

void store_kv(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "store_kv: k and v must be float32");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "store_kv: the KV cache must be float32 or bfloat16");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "store_kv: int64 slots");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(), "store_kv: bad cache");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2), HKV = kv_cache.size(3), D = kv_cache.size(4);
  const int64_t T = slot_mapping.numel(), row = HKV * D;
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(0) >= T && x->size(1) == HKV && x->size(2) == D && x->stride(2) == 1 &&
                    x->stride(1) == D,
                "store_kv: k/v must be [tokens, kv_heads, head_dim] with packed heads");
  }
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "store_kv: slot out of range");
  }
  const bool bf16 = kv_cache.scalar_type() == at::kBFloat16;
  // NOTE: parallel: the first write to a slot's page of the lazily-mapped cache (engine_core/host_memory.py) is a
  // page fault, which dominates this copy in a prefill chunk (measured: ~10 ms per layer for 2,048 fresh tokens on
  // one thread); faults on both cores overlap. Small steps (decode rows) stay on the calling thread.
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    if (bf16) {
      at::BFloat16* kc = kv_cache.data_ptr<at::BFloat16>();
      store_rows(kc, kc + num_slots * row, kp, vp, ks, vs, slots, row, t0, t1);
    } else {
      float* kc = kv_cache.data_ptr<float>();
      store_rows(kc, kc + num_slots * row, kp, vp, ks, vs, slots, row, t0, t1);
    }
  });
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
