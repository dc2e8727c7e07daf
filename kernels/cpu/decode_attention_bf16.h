// Decode attention's arithmetic over a bf16 KV cache with AVX-512 BF16 dot products (`vdpbf16ps`: two bf16
// products per fp32 lane, fp32 accumulation), used by paged_attention.cpp where the compiler targets them and
// head_dim is a multiple of 32 up to 128.
//
// Why: over a bf16 cache the fp32 helpers (decode_attention_simd.h) widen every K element once per query head of
// its group (3x for SmolLM2's 9 / 3 heads) and every V element once, then run one FMA per 16 multiply-adds; with the
// rows in L1 after the touch, that compute was about half of a quiet 64-row step's attention (benchmarks.md, "CPU
// decode attention"). vdpbf16ps does 32 multiply-adds per instruction on the cache's bits as they are:
//   score_t = sum_i (hi2[i] . k_t[2i : 2i + 2]     q scaled and split once per work item into two bf16 halves,
//                    + lo2[i] . k_t[2i : 2i + 2])  hi = bf16(q) and lo = bf16(q - hi) (~16 of q's 24 bits); a K
//                                                  row is 64 bytes of pairs per vector, used by both halves; 16
//                                                  rows per register of scores (reduce16); per lane hi's pair,
//                                                  then lo's, vector after vector
//   o[d] += (p_t, p_t+1) . (v_t[d], v_t+1[d])      two consecutive V rows interleaved in registers (unpacklo/hi of
//                                                  16-bit elements), the weights rounded to bf16 and broadcast as a
//                                                  pair; a chunk's odd last row is paired with a zero row and weight 0
// What is rounded beyond the cache's own bf16: q to ~16 bits (relative ~2^-17; NOTE: q rounded to bf16 alone, as
// prefill's dot products do, moved the scores by up to 2^-9 of |q . k|, and greedy decoding over the equality
// prompts matched float32's on 12 of 17 against the widened kernel's 16, benchmarks.md), and the softmax weights p
// (each, relative 2^-9; the sum that normalises the output adds the rounded weights); the max, the exp
// (prefill_bf16.h's polynomial), the sums and the outputs stay fp32. Every output element's arithmetic depends only
// on its rows and the chunk they are in, never on the work split, so the bits do not depend on the thread count.
#pragma once

#if defined(__AVX512BF16__)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "decode_attention_simd.h"
#include "prefill_bf16.h"

namespace pagoda::decode_bf16 {

using prefill_bf16::as_bh;

constexpr int64_t kSlice = 32;  // elements of a row per vector of bf16 pairs (one 64-byte load)

// Whether this head_dim runs the dot products (whole 64-byte vectors of pairs, up to 4 of them in registers).
inline bool head_dim_fits(int64_t D) { return D % kSlice == 0 && D <= 4 * kSlice; }

// hi[x] = bf16(scale * src[x]), lo[x] = bf16(scale * src[x] - hi[x]) (nearest even), as bits, for n elements.
inline void split_scaled(const float* src, float scale, int64_t n, uint16_t* hi, uint16_t* lo) {
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t x = 0;
  for (; x + 16 <= n; x += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(src + x), sc);
    const __m512i h = prefill_bf16::round16(v);
    const __m512i l = prefill_bf16::round16(_mm512_sub_ps(v, _mm512_castsi512_ps(h)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + x), _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + x), _mm512_cvtepi32_epi16(_mm512_srli_epi32(l, 16)));
  }
  for (; x < n; ++x) {
    const float v = src[x] * scale;
    hi[x] = static_cast<uint16_t>(prefill_bf16::bf16_bits(v));
    lo[x] = static_cast<uint16_t>(prefill_bf16::bf16_bits(v - c10::bit_cast<float>(uint32_t{hi[x]} << 16)));
  }
}

// scores[t] = q . k_t for n <= 16 K rows `row` elements apart; q is its hi and lo halves, NV vectors of bf16 pairs
// each. NOTE: lanes past n repeat the last row and are not stored, so a row's score does not depend on how full its
// chunk is.
template <int NV>
inline void score16(const uint16_t* hi, const uint16_t* lo, const at::BFloat16* k, int64_t n, int64_t row,
                    float* scores) {
  __m512bh qh[NV], ql[NV];
  for (int c = 0; c < NV; ++c) {
    qh[c] = as_bh(_mm512_loadu_si512(hi + kSlice * c));
    ql[c] = as_bh(_mm512_loadu_si512(lo + kSlice * c));
  }
  __m512 acc[16];
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const at::BFloat16* kt = k + std::min<int64_t>(t, n - 1) * row;
    acc[t] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      const __m512bh kc = as_bh(_mm512_loadu_si512(kt + kSlice * c));
      acc[t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[t], qh[c], kc), ql[c], kc);
    }
  }
  _mm512_mask_storeu_ps(scores, static_cast<__mmask16>((1u << n) - 1), decode_simd::reduce16(acc));
}

inline void score_rows(const uint16_t* hi, const uint16_t* lo, const at::BFloat16* k, int64_t n, int64_t row,
                       int64_t D, float* scores) {
  switch (D / kSlice) {
    case 1: return score16<1>(hi, lo, k, n, row, scores);
    case 2: return score16<2>(hi, lo, k, n, row, scores);
    case 3: return score16<3>(hi, lo, k, n, row, scores);
    default: return score16<4>(hi, lo, k, n, row, scores);
  }
}

// exp(x - max) over x[0, L), each weight rounded to bf16 (nearest even) into p[0, L) as its bits; returns 1 / the
// sum of the rounded weights, so the weights the V pass multiplies sum to one.
inline float softmax_row(const float* x, int64_t L, uint16_t* p) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t l = 0; l < L; l += 16) {
    const __mmask16 live = static_cast<__mmask16>(L - l >= 16 ? 0xffff : (1u << (L - l)) - 1);
    mv = _mm512_mask_max_ps(mv, live, mv, _mm512_maskz_loadu_ps(live, x + l));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t l = 0; l < L; l += 16) {
    const __mmask16 live = static_cast<__mmask16>(L - l >= 16 ? 0xffff : (1u << (L - l)) - 1);
    const __m512i e = prefill_bf16::round16(prefill_bf16::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, x + l), m)));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, _mm512_castsi512_ps(e)));
    _mm256_mask_storeu_epi16(p + l, live, _mm512_cvtepi32_epi16(_mm512_srli_epi32(e, 16)));
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// o[g][0, 32) += sum_t p[g][t] * v_t[0, 32) for GG query heads sharing n V rows `row` elements apart (32-element
// slices at v and o[g]); p[g] holds the rows' bf16 weights. The output is kept as the interleave leaves it
// (`natural_index` maps back): lanes 0-15 hold elements 8L + i, lanes 16-31 elements 8L + 4 + i (L = lane / 4,
// i = lane % 4).
template <int GG>
inline void accumulate_slice(const uint16_t* const* p, const at::BFloat16* v, int64_t n, int64_t row,
                             float* const* o) {
  __m512 lo[GG], hi[GG];
  for (int g = 0; g < GG; ++g) lo[g] = _mm512_loadu_ps(o[g]), hi[g] = _mm512_loadu_ps(o[g] + 16);
  int64_t t = 0;
  for (; t + 2 <= n; t += 2) {
    const __m512i r0 = _mm512_loadu_si512(v + t * row), r1 = _mm512_loadu_si512(v + (t + 1) * row);
    const __m512bh x0 = as_bh(_mm512_unpacklo_epi16(r0, r1)), x1 = as_bh(_mm512_unpackhi_epi16(r0, r1));
#pragma GCC unroll 4
    for (int g = 0; g < GG; ++g) {
      int32_t pair;
      std::memcpy(&pair, p[g] + t, sizeof pair);
      const __m512bh pg = as_bh(_mm512_set1_epi32(pair));
      lo[g] = _mm512_dpbf16_ps(lo[g], x0, pg);
      hi[g] = _mm512_dpbf16_ps(hi[g], x1, pg);
    }
  }
  if (t < n) {
    const __m512i r0 = _mm512_loadu_si512(v + t * row), zero = _mm512_setzero_si512();
    const __m512bh x0 = as_bh(_mm512_unpacklo_epi16(r0, zero)), x1 = as_bh(_mm512_unpackhi_epi16(r0, zero));
    for (int g = 0; g < GG; ++g) {
      const __m512bh pg = as_bh(_mm512_set1_epi32(p[g][t]));
      lo[g] = _mm512_dpbf16_ps(lo[g], x0, pg);
      hi[g] = _mm512_dpbf16_ps(hi[g], x1, pg);
    }
  }
  for (int g = 0; g < GG; ++g) _mm512_storeu_ps(o[g], lo[g]), _mm512_storeu_ps(o[g] + 16, hi[g]);
}

// accumulate_slice for the G query heads of one KV head, up to 4 heads per walk over the rows.
inline void accumulate_heads(const uint16_t* const* p, int64_t G, const at::BFloat16* v, int64_t n, int64_t row,
                             float* const* o) {
  for (int64_t g = 0; g < G; g += 4) {
    switch (std::min<int64_t>(4, G - g)) {
      case 1: accumulate_slice<1>(p + g, v, n, row, o + g); break;
      case 2: accumulate_slice<2>(p + g, v, n, row, o + g); break;
      case 3: accumulate_slice<3>(p + g, v, n, row, o + g); break;
      default: accumulate_slice<4>(p + g, v, n, row, o + g); break;
    }
  }
}

// The element of a 32-element slice that accumulate_slice keeps in lane `a` (0-31).
inline int64_t natural_index(int64_t a) { return 8 * ((a % 16) / 4) + 4 * (a / 16) + a % 4; }

// out[d] = acc[lane of d] * inv for one head's D outputs kept by accumulate_slice, slice by slice in [s0, s1).
inline void finish_head(const float* acc, int64_t s0, int64_t s1, float inv, float* out) {
  for (int64_t s = s0; s < s1; ++s) {
    for (int64_t a = 0; a < kSlice; ++a) out[kSlice * s + natural_index(a)] = acc[kSlice * s + a] * inv;
  }
}

}  // namespace pagoda::decode_bf16
#endif
