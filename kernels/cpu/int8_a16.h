// The int8 weight-only kernels' shared pieces (int8_ops.cpp's `int8_linear`, and decode_int8.cpp's streamed decode
// step, which runs the same tiles on each thread's share of every product).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGODA_INT8_AVX512 1
#if defined(__AVX512VNNI__)
#define PAGODA_INT8_VNNI 1
#endif
#endif

namespace pagoda::int8w {

constexpr int kNb = 4;  // output channels per tile: each code vector is widened once and used by every row
constexpr int64_t kPrefetchTiles = 2;  // how many channel tiles ahead the weight-only kernels prefetch their codes

#if defined(PAGODA_INT8_VNNI)
// The weight-only kernel on VNNI dot products (`vpdpbusd`: 64 u8 x s8 products an instruction, int32 sums).
//
// Why: widening each code to float32 costs two conversions and an FMA per 16 weights, which ran at ~25 GB/s of codes
// per core from the caches and ~8 GB/s from DRAM (2.4x batch 1's floor); here 64 codes are one load, one xor and two
// dot-product instructions. x is quantized per row to 16 bits (not 8, as W8A8 does): xq = round(x / s),
// s = max|x| / 32767, an error of at most s / 2 per activation (~2^-16 of the row's largest), beside the codes' own
// 2^-8 of each channel's largest weight, so the product keeps float32 activations' accuracy (tests/test_int8.py
// bounds it). xq = 256 * hi + lo with hi = xq >> 8 in [-128, 127] (s8) and lo = xq & 255 (u8); `vpdpbusd` multiplies
// u8 by s8, so the codes are the u8 side of the hi products, offset by 128 (w ^ 0x80 = w + 128):
//   sum_k xq[k] w[k] = 256 * (sum_k (w[k] + 128) hi[k] - 128 * sum_k hi[k]) + sum_k lo[k] w[k],
// where sum_k hi[k] is x's own (taken once per row as it is quantized). Both dot products are exact int32 sums while
// K < 2^16 (255 * 128 * K < 2^31); they meet exactly in a double and are rounded once to float32.
constexpr int64_t kA16MaxK = int64_t{1} << 16;  // K from which an int32 sum could overflow: the float32 kernel then

inline int64_t padded_k(int64_t K) { return (K + 63) / 64 * 64; }

// hi (s8), lo (u8) [M, Kp] (Kp = padded_k(K); the padding is xq = 0), s [M] and hi_sum [M] (sum_k hi) for rows of x.
inline void quantize_rows_a16(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* hi, uint8_t* lo, float* s,
                       int32_t* hi_sum) {
  const int64_t Kp = padded_k(K);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ldx;
    int8_t* h = hi + m * Kp;
    uint8_t* l = lo + m * Kp;
    __m512 mx = _mm512_setzero_ps(), nonfinite = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m512 v = _mm512_loadu_ps(row + k);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
      nonfinite = _mm512_add_ps(nonfinite, _mm512_mul_ps(v, _mm512_setzero_ps()));  // NaN once an inf or NaN passed
    }
    float absmax = _mm512_reduce_max_ps(mx);
    float check = _mm512_reduce_add_ps(nonfinite);
    for (int64_t i = k; i < K; ++i) absmax = std::max(absmax, std::fabs(row[i])), check += row[i] * 0.0f;
    if (!std::isfinite(check)) {
      // NOTE: a row with an inf or NaN gives NaN outputs (float32 x would give inf / NaN there): its codes would be
      // garbage, and max drops NaNs, so the scale is made NaN and the codes zero; the sampler then fails that row alone
      s[m] = std::numeric_limits<float>::quiet_NaN();
      std::fill(h, h + Kp, int8_t{0});
      std::fill(l, l + Kp, uint8_t{0});
      hi_sum[m] = 0;
      continue;
    }
    const float sm = absmax > 0.0f ? absmax / 32767.0f : 1.0f;
    s[m] = sm;
    // NOTE: a divide, as quantize_rows: |x / s| <= 32767 holds exactly, so hi never leaves [-128, 127]
    const __m512 sv = _mm512_set1_ps(sm);
    const __m512i byte = _mm512_set1_epi32(255);
    __m512i hs = _mm512_setzero_si512();
    for (k = 0; k + 16 <= K; k += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(row + k), sv));
      const __m512i qh = _mm512_srai_epi32(q, 8);
      hs = _mm512_add_epi32(hs, qh);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h + k), _mm512_cvtepi32_epi8(qh));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(l + k), _mm512_cvtepi32_epi8(_mm512_and_si512(q, byte)));
    }
    int32_t total = _mm512_reduce_add_epi32(hs);
    for (; k < K; ++k) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(row[k] / sm));
      h[k] = static_cast<int8_t>(q >> 8);
      l[k] = static_cast<uint8_t>(q & 255);
      total += q >> 8;
    }
    for (; k < Kp; ++k) h[k] = 0, l[k] = 0;
    hi_sum[m] = total;
  }
}

// The 16 lanes of a, b, c, d summed: [sum a, sum b, sum c, sum d] (one tree for the four, not four reductions).
inline __m128i reduce4(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}
static_assert(kNb == 4, "reduce4 sums one tile's four channels");

// sums[j] = sum_k xq[k] * codes[j][k], exactly, for one row of x (its hi / lo bytes and hi_sum) and kNb channels
// (rows `w[j]` of the codes, K bytes each; the last K % 64 read masked, so the x padding meets zeros).
// NOTE: one row per call: with two, GCC kept the 16 accumulators on the stack (2.5x the time of one row); the
// other rows of a step re-read the tile's codes (kNb x K bytes) from L1, so DRAM still streams them once.
inline void a16_tile(const int8_t* hi, const uint8_t* lo, int32_t hi_sum, const int8_t* const* w, int64_t K,
                     const int8_t* ahead, double sums[kNb]) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc_hi[kNb], acc_lo[kNb];
  for (int j = 0; j < kNb; ++j) acc_hi[j] = acc_lo[j] = _mm512_setzero_si512();
  // NOTE: one loop with the tail's mask computed in it (a lambda for the step kept the accumulators on the stack)
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 mask = K - k >= 64 ? ~__mmask64{0} : (__mmask64{1} << (K - k)) - 1;
    const __m512i h = _mm512_loadu_si512(hi + k), l = _mm512_loadu_si512(lo + k);
    for (int j = 0; j < kNb; ++j) {
      // NOTE: `ahead`'s kNb * K bytes (a16_run: the codes kPrefetchTiles channel tiles ahead), into L2, not L1:
      // measured from DRAM at 1 row, one thread, the 30 layers and LM head of SmolLM2-135M, T0 prefetches (two
      // tiles or 16 KB ahead) left this kernel at 2.4-2.7x the read bandwidth's floor, none at 3.2x, T1 at 1.0x
      // (the L1 prefetches hold the core's few L1 miss buffers the demand loads then wait for).
      _mm_prefetch(reinterpret_cast<const char*>(ahead + j * K + k), _MM_HINT_T1);
      const __m512i wv = _mm512_maskz_loadu_epi8(mask, w[j] + k);
      const __m512i wu = _mm512_xor_si512(wv, flip);  // w + 128 as u8 (the padding's 128 meets hi = 0)
      acc_hi[j] = _mm512_dpbusd_epi32(acc_hi[j], wu, h);
      acc_lo[j] = _mm512_dpbusd_epi32(acc_lo[j], l, wv);
    }
  }
  alignas(16) int32_t hs[kNb], ls[kNb];
  _mm_store_si128(reinterpret_cast<__m128i*>(hs), reduce4(acc_hi[0], acc_hi[1], acc_hi[2], acc_hi[3]));
  _mm_store_si128(reinterpret_cast<__m128i*>(ls), reduce4(acc_lo[0], acc_lo[1], acc_lo[2], acc_lo[3]));
  const int32_t offset = 128 * hi_sum;
  for (int j = 0; j < kNb; ++j) sums[j] = 256.0 * (hs[j] - offset) + ls[j];
}

// sink(r, n, y) with y = x[r] . codes[n] * scale[n] (+ bias[n]) for n in tiles [begin, end) of kNb channels and the
// M rows of x, as quantize_rows_a16 left them (hi / lo [M, padded_k(K)], s, hi_sum). The prefetches run
// kPrefetchTiles tiles ahead, and past `end` on into `next`: the codes this thread reads after these (the next tiles
// of the same product, or its share of the next product), so DRAM streams on across the boundary.
template <typename Sink>
inline void a16_each(const int8_t* hi, const uint8_t* lo, const float* s, const int32_t* hi_sum, int64_t M,
                     const int8_t* codes, const float* scale, const float* bias, int64_t N, int64_t K, int64_t begin,
                     int64_t end, const int8_t* next, Sink&& sink) {
  const int64_t Kp = padded_k(K);
  double sums[kNb];
  for (int64_t t = begin; t < end; ++t) {
    const int64_t n0 = t * kNb, cols = std::min<int64_t>(kNb, N - n0);
    const int8_t* w[kNb];
    for (int j = 0; j < kNb; ++j) w[j] = codes + (n0 + std::min<int64_t>(j, cols - 1)) * K;  // a short tile repeats
    const int64_t a = t + kPrefetchTiles;
    const int8_t* ahead = a < end ? codes + a * kNb * K : next + (a - end) * kNb * K;
    for (int64_t r = 0; r < M; ++r) {
      a16_tile(hi + r * Kp, lo + r * Kp, hi_sum[r], w, K, ahead, sums);
      for (int64_t j = 0; j < cols; ++j) {
        const float y = static_cast<float>(sums[j]) * s[r] * scale[n0 + j];
        sink(r, n0 + j, bias != nullptr ? y + bias[n0 + j] : y);
      }
    }
  }
}

// out[r, n] = a16_each's y, for out [M, N].
inline void a16_run(float* out, const int8_t* hi, const uint8_t* lo, const float* s, const int32_t* hi_sum, int64_t M,
                    const int8_t* codes, const float* scale, const float* bias, int64_t N, int64_t K, int64_t begin,
                    int64_t end, const int8_t* next) {
  a16_each(hi, lo, s, hi_sum, M, codes, scale, bias, N, K, begin, end, next,
           [out, N](int64_t r, int64_t n, float y) { out[r * N + n] = y; });
}

// Each row's largest y over tiles [begin, end) and its first index, without writing the products (the greedy pick
// fused into the LM head: decode_int8.cpp). best / index / nan [M]: the caller's running maximum per row (start at
// -inf, -1, 0); a strict > keeps the lowest index of a tie (as torch.argmax); a NaN never compares greater, so it is
// flagged in `nan` instead.
inline void a16_max(const int8_t* hi, const uint8_t* lo, const float* s, const int32_t* hi_sum, int64_t M,
                    const int8_t* codes, const float* scale, const float* bias, int64_t N, int64_t K, int64_t begin,
                    int64_t end, const int8_t* next, float* best, int64_t* index, uint8_t* nan) {
  a16_each(hi, lo, s, hi_sum, M, codes, scale, bias, N, K, begin, end, next, [=](int64_t r, int64_t n, float y) {
    if (y > best[r] || (index[r] < 0 && y == best[r])) {
      best[r] = y;
      index[r] = n;
    } else if (y != y) {
      nan[r] = 1;
    }
  });
}
#endif

}  // namespace pagoda::int8w
