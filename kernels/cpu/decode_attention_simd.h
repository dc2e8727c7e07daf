// The SIMD helpers of CPU decode attention (paged_attention.cpp) whose arithmetic is fp32 FMAs on K/V widened to
// fp32: the dense touch of a chunk's rows, scoring K rows against one query head (16 to a register of scores), and
// accumulating V rows for a KV head's query group in registers, with their portable fallbacks. Every output
// element's arithmetic is fixed by these helpers, so a caller that hands them the same rows in the same chunks gets
// the same bits whatever the work split.
#pragma once

#include <ATen/ATen.h>

#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace pagoda::decode_simd {

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PAGODA_DECODE_AVX2 1
#endif

// Loads every cache line of `n` rows (`floats` floats each, `row` floats apart) once, discarding the data.
// NOTE: why: decode attention is bound by the K/V reads, and a dense run of independent loads keeps many more
// misses in flight than the FMA chains of the scoring loop, whose loads wait behind their arithmetic. Measured
// (64 sequences x ~440 tokens, SmolLM2 heads, 2 threads, blocks in allocation order, K/V from DRAM): 3.50 -> 1.95
// ms per layer. Software prefetch of the next chunk instead of the touch was slower; beside it, a prefetch of the next
// block into L2 gains (prefetch_l2); a larger block size gained nothing in the engine.
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
#elif defined(PAGODA_DECODE_AVX2)
  constexpr int64_t kHalf = kLine / 2;  // one 32-byte load per 64-byte line
  if (elems >= kHalf) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    for (int64_t t = 0; t < n; ++t) {
      const T* r = p + t * row;
      int64_t i = 0;
      for (; i + 2 * kLine <= elems; i += 2 * kLine) {
        a0 = _mm256_or_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i)));
        a1 = _mm256_or_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i + kLine)));
      }
      for (; i < elems; i += kLine)  // the rest of the row: 32-byte loads, never past its end
        a0 = _mm256_or_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + std::min(i, elems - kHalf))));
      a1 = _mm256_or_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + elems - kHalf)));
    }
    asm volatile("" : : "x"(a0), "x"(a1));
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

// Prefetches `elems` contiguous elements into L2 (`prefetcht1`), one request per 64-byte line.
// NOTE: decode attention walks each sequence's blocks (6 KiB of K or V per block over a bf16 cache for SmolLM2's 3 KV
// heads) in block-table order, scattered through the cache, so the hardware prefetchers start cold at every block
// and the touch's misses are all the kernel has in flight. The walk asks for the next block (kPrefetchBlocks ahead)
// while it scores or accumulates the current one. Measured (benchmarks/decode_attention.py's step, 1 thread, CPU time
// on the shared machine, alternated with the previous build): bf16 cache 84.5-95.1 -> 66.1-72.0 ms for the 30
// layers, float32 133.7-144.6 -> 119.8-135.9 ms (docs/benchmarks.md, "CPU decode attention"). Into L1
// (`prefetcht0`) it was slower than none (92-96 ms: the L1 prefetches hold the miss buffers the demand loads wait
// for, as in int8_a16.h), `prefetcht2` 68-84 ms, 2-3 blocks ahead 70-74 ms.
constexpr int64_t kPrefetchBlocks = 1;
template <typename T>
inline void prefetch_l2(const T* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = elems * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
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
#endif

#if defined(PAGODA_DECODE_AVX2)
// 8 K/V elements as fp32 (a bf16 cache's widened exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// q . k_t for R rows (R <= 4), each one chain of FMAs over head_dim in 8-lane steps, then the 8 lanes summed as
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (two hadds and the halves' add): the same tree for every row
// count R, so a score's bits do not depend on how rows are grouped.
template <int R, typename T>
inline void score_group(const float* q, const T* k, int64_t row, int64_t D, float scale, float* scores) {
  __m256 acc[4];
#pragma GCC unroll 4
  for (int t = 0; t < R; ++t) acc[t] = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k + t * row));
  for (int64_t d = 8; d < D; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) acc[t] = _mm256_fmadd_ps(qd, load8(k + t * row + d), acc[t]);
  }
#pragma GCC unroll 4
  for (int t = R; t < 4; ++t) acc[t] = _mm256_setzero_ps();
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  float out[4];
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  _mm_storeu_ps(out, _mm_mul_ps(sums, _mm_set1_ps(scale)));
  for (int t = 0; t < R; ++t) scores[t] = out[t];
}

// o[g][0, 16) += sum_t p[g][t] * v_t[0, 16) for GG query heads (GG <= 4): one FMA chain per element over t, as the
// portable loop; 2 x GG accumulators in registers, each V row's 16 elements loaded once for the group.
template <int GG, typename T>
inline void accumulate16(const float* const* p, const T* v, int64_t n, int64_t row, int64_t d, float* const* o) {
  __m256 a[4][2];
#pragma GCC unroll 4
  for (int g = 0; g < GG; ++g) a[g][0] = _mm256_loadu_ps(o[g] + d), a[g][1] = _mm256_loadu_ps(o[g] + d + 8);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 v0 = load8(v + t * row + d), v1 = load8(v + t * row + d + 8);
#pragma GCC unroll 4
    for (int g = 0; g < GG; ++g) {
      const __m256 pt = _mm256_broadcast_ss(p[g] + t);
      a[g][0] = _mm256_fmadd_ps(pt, v0, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(pt, v1, a[g][1]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GG; ++g) _mm256_storeu_ps(o[g] + d, a[g][0]), _mm256_storeu_ps(o[g] + d + 8, a[g][1]);
}

// o[g][d0, d1) += sum_t p[g][t] * v_t[d0, d1) for the G query heads of one KV head (d0, d1 multiples of 16): the
// 16-column slices in turn, up to 4 heads at a time.
template <typename T>
inline void accumulate_cols(const float* const* p, int64_t G, const T* v, int64_t n, int64_t row, int64_t d0,
                            int64_t d1, float* const* o) {
  for (int64_t g = 0; g < G; g += 4) {
    for (int64_t d = d0; d < d1; d += 16) {
      switch (std::min<int64_t>(4, G - g)) {
        case 1: accumulate16<1>(p + g, v, n, row, d, o + g); break;
        case 2: accumulate16<2>(p + g, v, n, row, d, o + g); break;
        case 3: accumulate16<3>(p + g, v, n, row, d, o + g); break;
        default: accumulate16<4>(p + g, v, n, row, d, o + g); break;
      }
    }
  }
}

// accumulate_slice's AVX2 form (o and v point at the slice): each element's FMA chain as accumulate_rows runs it.
template <typename T>
inline void accumulate_slice(const float* const* p, int64_t G, const T* v, int64_t n, int64_t row, int64_t vectors,
                             float* const* o, std::vector<float*>& /*shifted*/) {
  accumulate_cols(p, G, v, n, row, 0, 16 * vectors, o);
}
#endif

// scores[t] = scale * q . k_t for n K rows `row` floats apart.
template <typename T>
inline void score_rows(const float* q, const T* k, int64_t n, int64_t row, int64_t D, float scale, float* scores) {
#if defined(__AVX512F__)
  if (n == 16 && D == 64) return score16<4>(q, k, row, scale, scores);
  if (n == 16 && D == 128) return score16<8>(q, k, row, scale, scores);
#elif defined(PAGODA_DECODE_AVX2)
  if (D % 8 == 0) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) score_group<4>(q, k + t * row, row, D, scale, scores + t);
    for (; t < n; ++t) score_group<1>(q, k + t * row, row, D, scale, scores + t);
    return;
  }
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
#elif defined(PAGODA_DECODE_AVX2)
  if (D % 16 == 0) return accumulate_cols(p, G, v, n, row, 0, D, o);
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
// the kernel in perf); the maximum does not depend on the order, so the bits are the same.
inline float max_of(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t l = 0;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(m);
  for (; l + 16 <= n; l += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + l));
  m = _mm512_reduce_max_ps(mv);
#elif defined(PAGODA_DECODE_AVX2)
  if (n >= 8) {
    __m256 mv = _mm256_set1_ps(m);
    for (; l + 8 <= n; l += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + l));
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    const __m128 h2 = _mm_max_ps(h, _mm_movehl_ps(h, h));
    m = _mm_cvtss_f32(_mm_max_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
  }
#endif
  for (; l < n; ++l) m = std::max(m, x[l]);
  return m;
}

#if defined(__AVX512F__) || defined(PAGODA_DECODE_AVX2)
#define PAGODA_DECODE_SLICES 1  // accumulate_slice exists: paged_attention.cpp's attend_lone splits V by slices
#endif
#undef PAGODA_DECODE_AVX2

}  // namespace pagoda::decode_simd
