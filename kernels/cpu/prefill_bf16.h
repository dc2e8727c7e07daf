// Prefill attention's micro-kernels over a bf16 KV cache with AVX-512 BF16 dot products (`vdpbf16ps`: two bf16
// products per fp32 lane, fp32 accumulation), used by prefill_attention.cpp where the compiler targets them.
//
// Why: prefill attention is compute-bound, and over a bf16 cache the float32 kernel widened every K/V tile and ran
// fp32 FMAs (~105 GFLOP/s on 2 Zen 4 cores); vdpbf16ps does twice the multiply-adds per instruction and reads K
// straight from the cache. The operands are pairs along the reduction:
//   S^T[j][r] = sum_i qt2[i][r] . k_j[2i : 2i + 2]   q rounded to bf16 once per item, packed as (d, d + 1) pairs
//                                                    per row (rows are the lanes); k_j's pair broadcast from the cache
//   O[r][c] += sum_i p2[i][r] . vt2[i][c]            V packed per tile as (key 2i, key 2i + 1) pairs per column
//                                                    (columns are the lanes); p rounded to bf16, paired the same way
// What is rounded beyond the cache's own bf16: q (once) and the softmax weights p (each, the row sums adding the
// rounded values, so the weights still sum to one); max, exp (a polynomial to ~2 ulps), the sums and O stay fp32.
#pragma once

#if defined(__AVX512BF16__)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace pagoda::prefill_bf16 {

constexpr int kW = 16;   // fp32 lanes per vector
constexpr int kJr = 8;   // keys per S micro-kernel call: 2 x 8 accumulators
constexpr int kMr = 4;   // rows per PV micro-kernel call: 4 x 4 accumulators
constexpr int kNc = 4;   // vectors of columns per PV micro-kernel call

// x rounded to bf16 (nearest even, as torch's .to(bfloat16)), as its 16 bits.
inline uint32_t bf16_bits(float x) { return at::BFloat16(x).x; }

// 16 lanes of fp32 rounded to bf16 (nearest even; no NaNs reach here), kept as fp32 with the low half zero.
inline __m512i round16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

inline __m512bh broadcast_pair(const at::BFloat16* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return as_bh(_mm512_set1_epi32(pair));
}

// s[j * ldS + r] = sum_i qt2[i * ldQ + r] . k_j[2i : 2i + 2] for rows r in [0, 2 * kW) and kJr keys, i < D2.
inline void s_micro(const at::BFloat16* const* k, const uint32_t* qt2, int64_t ldQ, int64_t D2, float* s,
                    int64_t ldS) {
  __m512 a[kJr], b[kJr];
#pragma GCC unroll 8
  for (int j = 0; j < kJr; ++j) a[j] = _mm512_setzero_ps(), b[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D2; ++i) {
    const __m512bh q0 = as_bh(_mm512_loadu_si512(qt2 + i * ldQ));
    const __m512bh q1 = as_bh(_mm512_loadu_si512(qt2 + i * ldQ + kW));
#pragma GCC unroll 8
    for (int j = 0; j < kJr; ++j) {
      const __m512bh kj = broadcast_pair(k[j] + 2 * i);
      a[j] = _mm512_dpbf16_ps(a[j], q0, kj);
      b[j] = _mm512_dpbf16_ps(b[j], q1, kj);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < kJr; ++j) {
    _mm512_storeu_ps(s + j * ldS, a[j]);
    _mm512_storeu_ps(s + j * ldS + kW, b[j]);
  }
}

// o[r][c] = alpha[r] * o[r][c] + sum_i p2[i * ldP + r] . vt2[i * ldV + c] for kMr rows and NC vectors of columns.
template <int NC>
inline void pv_micro(const uint32_t* vt2, int64_t ldV, int64_t col, int64_t n2, const uint32_t* p2, int64_t ldP,
                     const float* alpha, float* o, int64_t ldO) {
  __m512 c[kMr][NC];
#pragma GCC unroll 4
  for (int r = 0; r < kMr; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
    for (int x = 0; x < NC; ++x) c[r][x] = _mm512_mul_ps(_mm512_loadu_ps(o + r * ldO + x * kW), al);
  }
  for (int64_t i = 0; i < n2; ++i) {
    __m512bh v[NC];
#pragma GCC unroll 4
    for (int x = 0; x < NC; ++x) v[x] = as_bh(_mm512_loadu_si512(vt2 + i * ldV + col + x * kW));
#pragma GCC unroll 4
    for (int r = 0; r < kMr; ++r) {
      const __m512bh pr = as_bh(_mm512_set1_epi32(static_cast<int32_t>(p2[i * ldP + r])));
#pragma GCC unroll 4
      for (int x = 0; x < NC; ++x) c[r][x] = _mm512_dpbf16_ps(c[r][x], v[x], pr);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kMr; ++r) {
#pragma GCC unroll 4
    for (int x = 0; x < NC; ++x) _mm512_storeu_ps(o + r * ldO + x * kW, c[r][x]);
  }
}

using PvMicro = void (*)(const uint32_t*, int64_t, int64_t, int64_t, const uint32_t*, int64_t, const float*, float*,
                         int64_t);
constexpr PvMicro kPv[kNc + 1] = {nullptr, pv_micro<1>, pv_micro<2>, pv_micro<3>, pv_micro<4>};

inline float lo_bf16(uint32_t pair) { return c10::bit_cast<float>(pair << 16); }
inline float hi_bf16(uint32_t pair) { return c10::bit_cast<float>(pair & 0xffff0000u); }

// The same for the last `ncol` < kW columns (scalar; the pair's two products summed before the accumulation).
inline void pv_tail(const uint32_t* vt2, int64_t ldV, int64_t col, int64_t ncol, int64_t n2, const uint32_t* p2,
                    int64_t ldP, const float* alpha, float* o, int64_t ldO) {
  for (int64_t r = 0; r < kMr; ++r) {
    for (int64_t x = 0; x < ncol; ++x) {
      float acc = o[r * ldO + x] * alpha[r];
      for (int64_t i = 0; i < n2; ++i) {
        const uint32_t p = p2[i * ldP + r], v = vt2[i * ldV + col + x];
        acc += lo_bf16(p) * lo_bf16(v) + hi_bf16(p) * hi_bf16(v);
      }
      o[r * ldO + x] = acc;
    }
  }
}

// dst[x] = scale * src[x] rounded to bf16, for n elements (16 to a vector, the tail one by one).
inline void narrow_scaled(const float* src, float scale, int64_t n, uint16_t* dst) {
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t x = 0;
  for (; x + kW <= n; x += kW) {
    const __m512i r = _mm512_srli_epi32(round16(_mm512_mul_ps(_mm512_loadu_ps(src + x), sc)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + x), _mm512_cvtepi32_epi16(r));
  }
  for (; x < n; ++x) dst[x] = static_cast<uint16_t>(bf16_bits(src[x] * scale));
}

// O = alpha * O + P V for the tile, in blocks of kMr rows x kNc vectors of columns; `visible(r0, kMr)` is how many
// of the tile's keys rows [r0, r0 + kMr) see (a pair's second key past it has p = 0).
template <typename Visible>
inline void pv_tile(const uint32_t* vt2, int64_t D, const uint32_t* p2, int64_t R, const float* alpha, float* o,
                    Visible&& visible) {
  for (int64_t r0 = 0; r0 < R; r0 += kMr) {
    const int64_t n2 = (visible(r0, kMr) + 1) / 2;
    for (int64_t c0 = 0; c0 < D;) {
      const int64_t nc = std::min<int64_t>(kNc, (D - c0) / kW);
      if (nc == 0) {  // fewer than kW columns left
        pv_tail(vt2, D, c0, D - c0, n2, p2 + r0, R, alpha + r0, o + r0 * D + c0, D);
        break;
      }
      kPv[nc](vt2, D, c0, n2, p2 + r0, R, alpha + r0, o + r0 * D + c0, D);
      c0 += nc * kW;
    }
  }
}

// qt2[i * R + r] = words[r * D2 + i]: the item's `rows` bf16 rows of q (D2 pairs each) transposed to pairs x rows;
// padded rows up to R are zero.
inline void pack_q(const uint32_t* words, int64_t rows, int64_t R, int64_t D2, uint32_t* qt2) {
  std::memset(qt2, 0, sizeof(uint32_t) * D2 * R);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < D2; ++i) qt2[i * R + r] = words[r * D2 + i];
  }
}

// vt2[i * D + c] = (v_{2i}[c], v_{2i+1}[c]) for n2 pairs of the tile's V rows (bf16 cache rows, bits as they are).
inline void pack_v(const at::BFloat16* const* v, int64_t n2, int64_t D, uint32_t* vt2) {
  for (int64_t i = 0; i < n2; ++i) {
    const at::BFloat16 *v0 = v[2 * i], *v1 = v[2 * i + 1];
    uint32_t* dst = vt2 + i * D;
#pragma omp simd
    for (int64_t c = 0; c < D; ++c) dst[c] = static_cast<uint32_t>(v0[c].x) | (static_cast<uint32_t>(v1[c].x) << 16);
  }
}

// exp(x) for x <= 0 (finite), to ~2 fp32 ulps: Cephes' expf polynomial on x - n ln2, scaled by 2^n (scalef
// underflows to 0 below ~-104).
// NOTE: inline, not libmvec's: the weights are rounded to bf16 (2^-9) right after, so the last ulp is moot, and
// the call with its spills was ~17 % of the kernel's time.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// The tile's softmax weights from its scores s[j][r] (kW-aligned R; masked scores are -inf) and the rows' running
// max m, rounded to bf16 and paired along the keys: p2[i * R + r] = (p[2i][r], p[2i+1][r]); l[r] += the rounded
// weights. Masked scores give p = 0 by a select. nk is even.
inline void softmax_pairs(const float* s, int64_t nk, int64_t R, const float* m, uint32_t* p2, float* l) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < R; r += kW) {
    const __m512 mr = _mm512_loadu_ps(m + r);
    __m512 sum = _mm512_loadu_ps(l + r);
    for (int64_t i = 0; i < nk / 2; ++i) {
      __m512i e[2];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512 x = _mm512_loadu_ps(s + (2 * i + h) * R + r);
        const __mmask16 live = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);
        e[h] = round16(_mm512_maskz_mov_ps(live, exp16(_mm512_maskz_sub_ps(live, x, mr))));
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(e[h]));
      }
      _mm512_storeu_si512(p2 + i * R + r, _mm512_or_si512(_mm512_srli_epi32(e[0], 16), e[1]));
    }
    _mm512_storeu_ps(l + r, sum);
  }
}

}  // namespace pagoda::prefill_bf16
#endif
