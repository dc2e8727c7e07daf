// y = x @ W^T (+ b) at every row count, with W resident only in its block-coded form: 4 or 8 bits per weight
// instead of 32. Up to 16 rows (AVX-512; 4 on AVX2) each record is decoded in registers once per call; above, each
// pair of panels is decoded once into an L2-sized buffer and multiplied by the panel kernel (panel_gemm,
// panel_linear.cpp).
//
// Why: at 1-8 rows a projection is bound by the memory stream of W (30 GB/s here: SmolLM2's 425 MB of float32
// layer weights take ~14 ms per decode step). A GGUF model's float32 weights are exactly its quantization blocks
// decoded (Q4_1: w = d * q + m, q in 0..15; Q8_0: w = d * q, q in -128..127; 32 weights per block, d and m f16
// values), so the same float32 weights can be stored as codes and decoded on the fly, bit for bit: d * q is exact in
// float32 (an 11-bit mantissa times at most 8 bits), so fma(d, q, m) rounds once, as the decoding did.
//
// coded_pack finds the codes from the float32 weights alone (no GGUF reader, no name mapping): Q4_1, Q4_0 (4-bit
// records), Q8_0, Q5_1, Q5_0 (8-bit records), block by block (`encode_block`). It accepts codes only if decoding
// reproduces every weight exactly, and returns no records otherwise (bf16, fp16, trained float32 or K-quant weights
// keep the float32 forms).
//
// Layout (`records`, uint8 [ceil(N/16), K/32, R]): the panel of 16 output columns of panel_linear.cpp, cut into
// blocks of 32 k; each (panel, block) is one record: d[16] float32, m[16] float32, then the codes, one byte per
// column per k (8 bits, R = 640) or per pair of k (4 bits: low nibble k, high nibble k + 1; R = 384); R tells
// the kernel which. Q4_K and Q5_K are these records too (their 32-weight sub-blocks decode as d * q - dmin * m, d
// and dmin * m exact float32 products, so fma(d, q, -dmin * m) with one rounding: model/layers/block_codes.py
// builds them from the file's blocks). Q6_K's sub-blocks are 16 weights (w = d * q): its records are
// [ceil(N/16), K/32, 2, 384], two halves of 16 k, each d[16] and m[16] float32 (m = 0 for Q6_K; fma(d, q, 0) is
// d * q rounded once) then one int8 code per column per k (`kHalves`, told apart by the records' rank); a fused
// projection whose shards mix Q6_K with Q4_K / Q5_K (llama.cpp's Q4_K_M files do) has all its shards in this layout.
//
// Determinism: every output is the same sequential FMA chain over k as panel_linear's (fma(x[k], w[k], acc) from
// 0, then + bias) on the same float32 weights, so the two kernels give identical bits (tests/kernels/test_coded_linear.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>  // std::aligned_alloc
#include <utility>  // std::integer_sequence
#include <vector>

#include "ops.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kCols = 16;   // columns per panel
constexpr int64_t kBlock = 32;  // k per record
constexpr int64_t kScales = 2 * kCols * static_cast<int64_t>(sizeof(float));  // d[16] and m[16]
// Rows per micro-kernel call.
// AVX-512: 16 accumulators + the decoded weights, scales and masks fit its 32 registers.
// NOTE: 16, not 8: a speculative verification step of 9-16 query rows (k = 8..15 drafts) decodes each record once
// instead of twice; the FMAs per row are the same, the decoding (~3.5 ops per 16 weights, on the FMA ports) is what
// a second row block repeats (docs/benchmarks.md, "Speculative decoding").
// AVX2: 4, two ymm accumulators per row. On a Zen 1 EPYC, 3 rows took 19 ms in registers against 22 ms decoded
// once into a buffer (SmolLM2's 30 layers, 2 threads), and at 4 rows the two tied (docs/benchmarks.md, "CPU GEMMs by
// row count").
#if defined(__AVX512F__)
constexpr int kMaxRows = 16;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kMaxRows = 4;
#else
constexpr int kMaxRows = 16;
#endif
// Rows from which a panel is decoded once and multiplied by the panel kernel (below: decoded in registers, once per
// call: docs/benchmarks.md, "CPU GEMMs by row count").
constexpr int64_t kDecodeOnceRows = kMaxRows + 1;

constexpr int kHalves = 6;      // the Q6_K layout's tag: two 16-k halves, each with its d and m, int8 codes
constexpr int64_t kHalfBytes = kScales + (kBlock / 2) * kCols;  // 384

constexpr int64_t record_bytes(int64_t bits) {
  return bits == kHalves ? 2 * kHalfBytes : kScales + kBlock * kCols * bits / 8;
}
static_assert(record_bytes(4) == pagoda::kCodedRecord4Bytes, "ops.h's 4-bit record size");

// Weight (k0 + kk, column j) of a record, decoded as the vector paths decode it.
template <int BITS>
float weight_at(const uint8_t* rec, int64_t kk, int64_t j) {
  if constexpr (BITS == kHalves) {
    const uint8_t* half = rec + (kk / (kBlock / 2)) * kHalfBytes;
    const int q = static_cast<int8_t>(half[kScales + (kk % (kBlock / 2)) * kCols + j]);
    const float* d = reinterpret_cast<const float*>(half);
    return std::fma(d[j], static_cast<float>(q), d[kCols + j]);
  } else {
    const float* d = reinterpret_cast<const float*>(rec);
    const uint8_t* codes = rec + kScales;
    const int q = BITS == 4 ? (codes[(kk / 2) * kCols + j] >> (4 * (kk % 2))) & 0xF
                            : static_cast<int8_t>(codes[kk * kCols + j]);
    return std::fma(d[j], static_cast<float>(q), d[kCols + j]);
  }
}

#if defined(__AVX512F__)
#define CODED_ROW(r, w, kk)                                                  \
  if constexpr (MR > r) {                                                    \
    c##r = _mm512_fmadd_ps(_mm512_set1_ps(at[(kk) * MR + r]), w, c##r);    \
  }
#define CODED_ROWS(w, kk)                                                    \
  CODED_ROW(0, w, kk) CODED_ROW(1, w, kk) CODED_ROW(2, w, kk) CODED_ROW(3, w, kk) CODED_ROW(4, w, kk) \
  CODED_ROW(5, w, kk) CODED_ROW(6, w, kk) CODED_ROW(7, w, kk) CODED_ROW(8, w, kk) CODED_ROW(9, w, kk) \
  CODED_ROW(10, w, kk) CODED_ROW(11, w, kk) CODED_ROW(12, w, kk) CODED_ROW(13, w, kk) CODED_ROW(14, w, kk) \
  CODED_ROW(15, w, kk)
#define CODED_STORE(r)                                                       \
  if constexpr (MR > r) {                                                    \
    _mm512_storeu_ps(c + r * ldc, _mm512_add_ps(c##r, bias_v));              \
  }

// c[r][0..15] = sum_k a[r][k] * W[k][0..15] (+ bias) for MR rows, W decoded from one panel's records. `at`: the MR
// rows k-major ([K][MR], `pack_rows`), so every broadcast is one pointer plus a constant offset.
// NOTE: with one pointer per row, 16 rows' pointers spilled from the 16 general registers (16 rows then ran slower
// than two calls of 8).
template <int MR, int BITS>
void micro(const float* at, const uint8_t* rec, int64_t K, const float* bias, float* c, int64_t ldc) {
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
  __m512 c8 = c0, c9 = c0, c10 = c0, c11 = c0, c12 = c0, c13 = c0, c14 = c0, c15 = c0;
  const __m512i low = _mm512_set1_epi32(0xF);
  for (int64_t k0 = 0; k0 < K; k0 += kBlock, rec += record_bytes(BITS)) {
    if constexpr (BITS == kHalves) {
      for (int64_t h = 0; h < 2; ++h) {
        const uint8_t* half = rec + h * kHalfBytes;
        const __m512 dh = _mm512_load_ps(reinterpret_cast<const float*>(half));
        const __m512 mh = _mm512_load_ps(reinterpret_cast<const float*>(half) + kCols);
        for (int64_t i = 0; i < kBlock / 2; ++i) {
          const __m512i v =
              _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(half + kScales + i * kCols)));
          const __m512 w = _mm512_fmadd_ps(dh, _mm512_cvtepi32_ps(v), mh);
          const int64_t k = k0 + h * (kBlock / 2) + i;
          CODED_ROWS(w, k)
        }
      }
      continue;
    }
    const __m512 d = _mm512_load_ps(reinterpret_cast<const float*>(rec));
    const __m512 m = _mm512_load_ps(reinterpret_cast<const float*>(rec) + kCols);
    const uint8_t* codes = rec + kScales;
    if constexpr (BITS == 4) {
      for (int64_t i = 0; i < kBlock / 2; ++i) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + i * kCols)));
        const __m512 w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(v, low)), m);
        const __m512 w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), m);
        const int64_t k = k0 + 2 * i;
        CODED_ROWS(w0, k)
        CODED_ROWS(w1, k + 1)
      }
    } else {
      for (int64_t i = 0; i < kBlock; ++i) {
        const __m512i v = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + i * kCols)));
        const __m512 w = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(v), m);
        const int64_t k = k0 + i;
        CODED_ROWS(w, k)
      }
    }
  }
  const __m512 bias_v = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  CODED_STORE(0) CODED_STORE(1) CODED_STORE(2) CODED_STORE(3) CODED_STORE(4) CODED_STORE(5) CODED_STORE(6)
  CODED_STORE(7) CODED_STORE(8) CODED_STORE(9) CODED_STORE(10) CODED_STORE(11) CODED_STORE(12) CODED_STORE(13)
  CODED_STORE(14) CODED_STORE(15)
}
#undef CODED_ROW
#undef CODED_ROWS
#undef CODED_STORE
constexpr bool kVectorized = true;
#elif defined(__AVX2__) && defined(__FMA__)
// Eight signed (8-bit records) or unsigned (4-bit) codes -> int32 lanes.
template <bool SIGNED>
inline __m256i widen8(const uint8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return SIGNED ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}
inline __m256 decode8(__m256 d, __m256i q, __m256 m) { return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m); }

#define CODED_ROW(r, w0, w1, kk)                                      \
  if constexpr (MR > r) {                                             \
    const __m256 av = _mm256_broadcast_ss(at + (kk) * MR + r);        \
    c##r##0 = _mm256_fmadd_ps(av, w0, c##r##0);                       \
    c##r##1 = _mm256_fmadd_ps(av, w1, c##r##1);                       \
  }
#define CODED_ROWS(w0, w1, kk) \
  CODED_ROW(0, w0, w1, kk) CODED_ROW(1, w0, w1, kk) CODED_ROW(2, w0, w1, kk) CODED_ROW(3, w0, w1, kk)
#define CODED_STORE(r)                                                \
  if constexpr (MR > r) {                                             \
    _mm256_storeu_ps(c + r * ldc, _mm256_add_ps(c##r##0, bias0));     \
    _mm256_storeu_ps(c + r * ldc + 8, _mm256_add_ps(c##r##1, bias1)); \
  }

// The AVX-512 kernel with its 16 columns as two ymm halves: the same fma(d, q, m) weights and the same FMA chain per
// output, so the same bits. Up to 4 rows: 8 accumulators beside the scales, offsets, weights and the broadcast.
// NOTE: named accumulators, not an array (as in panel_linear's AVX2 kernel: GCC kept an array in memory).
template <int MR, int BITS>
void micro(const float* at, const uint8_t* rec, int64_t K, const float* bias, float* c, int64_t ldc) {
  static_assert(MR <= 4, "four rows of two accumulators");
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
  const __m256i low = _mm256_set1_epi32(0xF);
  for (int64_t k0 = 0; k0 < K; k0 += kBlock, rec += record_bytes(BITS)) {
    if constexpr (BITS == kHalves) {
      for (int64_t h = 0; h < 2; ++h) {
        const uint8_t* half = rec + h * kHalfBytes;
        const float* dm = reinterpret_cast<const float*>(half);
        const __m256 d0 = _mm256_load_ps(dm), d1 = _mm256_load_ps(dm + 8);
        const __m256 m0 = _mm256_load_ps(dm + kCols), m1 = _mm256_load_ps(dm + kCols + 8);
        for (int64_t i = 0; i < kBlock / 2; ++i) {
          const uint8_t* q = half + kScales + i * kCols;
          const __m256 w0 = decode8(d0, widen8<true>(q), m0), w1 = decode8(d1, widen8<true>(q + 8), m1);
          CODED_ROWS(w0, w1, k0 + h * (kBlock / 2) + i)
        }
      }
      continue;
    }
    const float* dm = reinterpret_cast<const float*>(rec);
    const __m256 d0 = _mm256_load_ps(dm), d1 = _mm256_load_ps(dm + 8);
    const __m256 m0 = _mm256_load_ps(dm + kCols), m1 = _mm256_load_ps(dm + kCols + 8);
    const uint8_t* codes = rec + kScales;
    if constexpr (BITS == 4) {
      for (int64_t i = 0; i < kBlock / 2; ++i) {
        const __m256i v0 = widen8<false>(codes + i * kCols), v1 = widen8<false>(codes + i * kCols + 8);
        const __m256 e0 = decode8(d0, _mm256_and_si256(v0, low), m0), e1 = decode8(d1, _mm256_and_si256(v1, low), m1);
        CODED_ROWS(e0, e1, k0 + 2 * i)
        const __m256 o0 = decode8(d0, _mm256_srli_epi32(v0, 4), m0), o1 = decode8(d1, _mm256_srli_epi32(v1, 4), m1);
        CODED_ROWS(o0, o1, k0 + 2 * i + 1)
      }
    } else {
      for (int64_t i = 0; i < kBlock; ++i) {
        const uint8_t* q = codes + i * kCols;
        const __m256 w0 = decode8(d0, widen8<true>(q), m0), w1 = decode8(d1, widen8<true>(q + 8), m1);
        CODED_ROWS(w0, w1, k0 + i)
      }
    }
  }
  const __m256 bias0 = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 bias1 = bias != nullptr ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  CODED_STORE(0) CODED_STORE(1) CODED_STORE(2) CODED_STORE(3)
}
#undef CODED_ROW
#undef CODED_ROWS
#undef CODED_STORE
constexpr bool kVectorized = true;
#else
// The portable kernel: the same per-output order and the same decoded weights, without explicit FMAs (as
// panel_linear's portable kernel).
template <int MR, int BITS>
void micro(const float* at, const uint8_t* rec, int64_t K, const float* bias, float* c, int64_t ldc) {
  float acc[MR][kCols] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kBlock, rec += record_bytes(BITS)) {
    for (int64_t kk = 0; kk < kBlock; ++kk) {
      for (int64_t j = 0; j < kCols; ++j) {
        const float w = weight_at<BITS>(rec, kk, j);
        for (int r = 0; r < MR; ++r) acc[r][j] += at[(k0 + kk) * MR + r] * w;
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < kCols; ++j) c[r * ldc + j] = acc[r][j] + (bias != nullptr ? bias[j] : 0.0f);
  }
}
constexpr bool kVectorized = false;
#endif

// One panel's records (16 columns, K / 32 records) -> its float32 weights in panel_pack's layout [K][16]: the same
// fma(d, q, m) per weight as the micro-kernels, so the panel kernel on them gives coded_linear's bits.
template <int BITS>
void decode_panel(const uint8_t* rec, int64_t K, float* dst) {
  for (int64_t k0 = 0; k0 < K; k0 += kBlock, rec += record_bytes(BITS)) {
#if defined(__AVX512F__)
    if constexpr (BITS == kHalves) {
      for (int64_t h = 0; h < 2; ++h) {
        const uint8_t* half = rec + h * kHalfBytes;
        const __m512 dh = _mm512_load_ps(reinterpret_cast<const float*>(half));
        const __m512 mh = _mm512_load_ps(reinterpret_cast<const float*>(half) + kCols);
        for (int64_t i = 0; i < kBlock / 2; ++i) {
          const __m512i v =
              _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(half + kScales + i * kCols)));
          _mm512_store_ps(dst + (k0 + h * (kBlock / 2) + i) * kCols, _mm512_fmadd_ps(dh, _mm512_cvtepi32_ps(v), mh));
        }
      }
      continue;
    }
    const float* d = reinterpret_cast<const float*>(rec);
    const uint8_t* codes = rec + kScales;
    const __m512 dv = _mm512_load_ps(d), mv = _mm512_load_ps(d + kCols);
    for (int64_t kk = 0; kk < kBlock; ++kk) {
      __m512i v;
      if constexpr (BITS == 4) {
        v = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + (kk / 2) * kCols)));
        v = kk % 2 ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(0xF));
      } else {
        v = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + kk * kCols)));
      }
      _mm512_store_ps(dst + (k0 + kk) * kCols, _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(v), mv));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256i low = _mm256_set1_epi32(0xF);
    for (int64_t j = 0; j < kCols; j += 8) {  // each 8-column half: its scales and offsets, then its 32 k
      for (int64_t h = 0; h < (BITS == kHalves ? 2 : 1); ++h) {
        const uint8_t* part = rec + h * kHalfBytes;  // the Q6_K layout's two halves; other records are one part
        const float* dm = reinterpret_cast<const float*>(part);
        const __m256 d = _mm256_load_ps(dm + j), m = _mm256_load_ps(dm + kCols + j);
        const uint8_t* codes = part + kScales + j;
        float* out = dst + (k0 + h * (kBlock / 2)) * kCols + j;
        if constexpr (BITS == 4) {
          for (int64_t i = 0; i < kBlock / 2; ++i) {
            const __m256i v = widen8<false>(codes + i * kCols);
            _mm256_store_ps(out + 2 * i * kCols, decode8(d, _mm256_and_si256(v, low), m));
            _mm256_store_ps(out + (2 * i + 1) * kCols, decode8(d, _mm256_srli_epi32(v, 4), m));
          }
        } else {
          for (int64_t kk = 0; kk < (BITS == kHalves ? kBlock / 2 : kBlock); ++kk) {
            _mm256_store_ps(out + kk * kCols, decode8(d, widen8<true>(codes + kk * kCols), m));
          }
        }
      }
    }
#else
    for (int64_t kk = 0; kk < kBlock; ++kk) {
      for (int64_t j = 0; j < kCols; ++j) dst[(k0 + kk) * kCols + j] = weight_at<BITS>(rec, kk, j);
    }
#endif
  }
}

using Micro = void (*)(const float*, const uint8_t*, int64_t, const float*, float*, int64_t);

// Rows r0 .. r0 + mr - 1 of x, k-major: dst[k * mr + q] = x[r0 + q][k] (the micro-kernels' `at`).
void pack_rows(const float* x, int64_t ldx, int64_t r0, int64_t mr, int64_t K, float* dst) {
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t q = 0; q < mr; ++q) dst[k * mr + q] = x[(r0 + q) * ldx + k];
  }
}
// kMicro<BITS>[mr]: the micro-kernel for mr rows, 1..kMaxRows (index 0 unused).
template <int BITS, int... R>
constexpr std::array<Micro, sizeof...(R) + 1> micro_table(std::integer_sequence<int, R...>) {
  return {nullptr, micro<R + 1, BITS>...};
}
template <int BITS>
constexpr std::array<Micro, kMaxRows + 1> kMicro = micro_table<BITS>(std::make_integer_sequence<int, kMaxRows>{});

// Whether the block w[0..31] is exactly fma(d, q, m) for integers q in [qmin, qmax] (d * q is exact for the scales
// tried, so this is the kernel's decoding); the codes into q.
bool fits(const float* w, float d, float m, float qmin, float qmax, int* q) {
  for (int64_t i = 0; i < kBlock; ++i) {
    const float c = d != 0.0f ? std::clamp(std::nearbyint((w[i] - m) / d), qmin, qmax) : 0.0f;
    if (d * c + m != w[i]) return false;  // NaN fails here too
    q[i] = static_cast<int>(c);
  }
  return true;
}

// One block of 32 weights of output column j into its record; false where the block is not exactly BITS codes. Each
// GGUF format's scale and offset are found from its decoded values (llama.cpp's quantizers): Q4_1 / Q5_1 map the
// block's minimum to q = 0 and its maximum to q = 15 / 31 (d = f16((max - min) / 15 or 31), m = min); Q4_0 / Q5_0
// map the value of largest magnitude e to q = 0 (x = d * (q - 8 or 16), so d = -e / 8 or 16 exactly, m = e); Q8_0
// maps it to +-127 (d = f16(max |w| / 127), m = 0). 4-bit records hold Q4_1 and Q4_0 blocks, 8-bit ones Q8_0, Q5_1
// and Q5_0 blocks, block by block.
template <int BITS>
bool encode_block(const float* w, uint8_t* rec, int64_t j) {
  float lo = w[0], hi = w[0];
  for (int64_t i = 1; i < kBlock; ++i) {
    lo = std::min(lo, w[i]);
    hi = std::max(hi, w[i]);
  }
  const float extreme = hi >= -lo ? hi : lo;
  const auto f16 = [](float v) { return static_cast<float>(c10::Half(v)); };
  int q[kBlock];
  float d = 0.0f, m = 0.0f;
  bool found = false;
  if constexpr (BITS == 4) {
    const float schemes[2][2] = {{f16((hi - lo) / 15.0f), lo}, {-extreme / 8.0f, extreme}};
    for (const auto& [sd, sm] : schemes) {
      if ((found = fits(w, sd, sm, 0.0f, 15.0f, q))) {
        d = sd, m = sm;
        break;
      }
    }
  } else {
    const float schemes[3][4] = {{f16(std::max(hi, -lo) / 127.0f), 0.0f, -128.0f, 127.0f},
                                 {f16((hi - lo) / 31.0f), lo, 0.0f, 31.0f},
                                 {-extreme / 16.0f, extreme, 0.0f, 31.0f}};
    for (const auto& [sd, sm, qmin, qmax] : schemes) {
      if ((found = fits(w, sd, sm, qmin, qmax, q))) {
        d = sd, m = sm;
        break;
      }
    }
  }
  if (!found) return false;
  uint8_t* codes = rec + kScales;
  for (int64_t i = 0; i < kBlock; ++i) {
    if constexpr (BITS == 4) {
      codes[(i / 2) * kCols + j] |= static_cast<uint8_t>(q[i]) << (4 * (i % 2));
    } else {
      codes[i * kCols + j] = static_cast<uint8_t>(static_cast<int8_t>(q[i]));
    }
  }
  reinterpret_cast<float*>(rec)[j] = d;
  reinterpret_cast<float*>(rec)[kCols + j] = m;
  return true;
}

template <int BITS>
at::Tensor encode(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), P = (N + kCols - 1) / kCols, B = K / kBlock;
  at::Tensor records = at::zeros({P, B, record_bytes(BITS)}, w.options().dtype(at::kByte));  // zero: padded columns
  const float* wp = w.data_ptr<float>();
  uint8_t* rp = records.data_ptr<uint8_t>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end && exact.load(std::memory_order_relaxed); ++p) {
      for (int64_t j = 0; j < kCols && p * kCols + j < N; ++j) {
        for (int64_t b = 0; b < B; ++b) {
          if (!encode_block<BITS>(wp + (p * kCols + j) * K + b * kBlock, rp + (p * B + b) * record_bytes(BITS), j)) {
            exact.store(false, std::memory_order_relaxed);
            return;
          }
        }
      }
    }
  });
  return exact.load() ? records : at::Tensor();
}

}  // namespace

namespace pagoda {

// W [N, K] float32 -> records [ceil(N/16), K/32, R] (4 bits tried first, then 8), or none where W is not exactly
// either.
c10::optional<at::Tensor> coded_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "coded_pack: weight must be float32 [N, K]");
  if (weight.size(1) % kBlock != 0 || weight.size(0) == 0) return c10::nullopt;
  const at::Tensor w = weight.contiguous();
  at::Tensor records = encode<4>(w);
  if (!records.defined()) records = encode<8>(w);
  return records.defined() ? c10::optional<at::Tensor>(records) : c10::nullopt;
}

void coded_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& records,
                  const c10::optional<at::Tensor>& bias) {
  const bool halves = records.dim() == 4 && records.size(2) == 2 && records.size(3) == kHalfBytes;
  TORCH_CHECK(halves || (records.dim() == 3 && (records.size(2) == record_bytes(4) || records.size(2) == record_bytes(8))),
              "coded_linear: records must be [P, K/32, ", record_bytes(4), " or ", record_bytes(8), "] or [P, K/32, 2, ",
              kHalfBytes, "]");
  const int64_t bits = halves ? kHalves : records.size(2) == record_bytes(4) ? 4 : 8;
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && records.scalar_type() == at::kByte,
              "coded_linear: float32 x and out, uint8 records");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.is_contiguous(),
              "coded_linear: x [M, K] with contiguous rows, out [M, N] contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(records.is_contiguous() && records.size(0) == (N + kCols - 1) / kCols && records.size(1) * kBlock == K &&
                  out.size(0) == M,
              "coded_linear: records must be [ceil(N/16), K/32, R] for x [M, K], out [M, N]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(records.data_ptr<uint8_t>()) % 64 == 0, "coded_linear: records not aligned");
  const float* b = bias_data(bias, N, "coded_linear");
  if (M == 0 || N == 0) return;
  const float* xp = x.data_ptr<float>();
  const uint8_t* rp = records.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), P = records.size(0), panel_bytes = (K / kBlock) * record_bytes(bits);
  if (M >= kDecodeOnceRows) {
    // NOTE: from kDecodeOnceRows rows each pair of panels is decoded once into a buffer that stays in L2 (2 x K x 16
    // floats: 196 KB at K = 1536) and multiplied by the panel kernel's tile (12 x 32; 6 x 16 on AVX2), not decoded
    // again for every row block: float32 GEMM speed at prefill sizes with only the codes resident.
    const int64_t panel_floats = K * kCols;
    at::parallel_for(0, P, 2, [&](int64_t begin, int64_t end) {
      float* buf = static_cast<float*>(std::aligned_alloc(64, 2 * panel_floats * sizeof(float)));
      TORCH_CHECK(buf != nullptr, "coded_linear: out of memory for a ", 2 * panel_floats, "-float buffer");
      for (int64_t p = begin; p < end;) {
        const int64_t count = p + 1 < end ? 2 : 1;
        for (int64_t i = 0; i < count; ++i) {
          if (bits == 4) {
            decode_panel<4>(rp + (p + i) * panel_bytes, K, buf + i * panel_floats);
          } else if (bits == 8) {
            decode_panel<8>(rp + (p + i) * panel_bytes, K, buf + i * panel_floats);
          } else {
            decode_panel<kHalves>(rp + (p + i) * panel_bytes, K, buf + i * panel_floats);
          }
        }
        pagoda::panel_gemm(xp, ldx, buf, count, K, b, op, N, p * kCols, M);
        p += count;
      }
      std::free(buf);
    });
    return;
  }
  const Micro* micros = bits == 4 ? kMicro<4>.data() : bits == 8 ? kMicro<8>.data() : kMicro<kHalves>.data();
  // Row blocks as even as possible; every block decodes the panel again, so the caller keeps this kernel to the
  // few rows where decoding is cheaper than streaming float32 weights (model/layers/cpu_gemm_rows.py, CODED_M).
  const int64_t blocks = (M + kMaxRows - 1) / kMaxRows, base = M / blocks, extra = M % blocks;
  // NOTE: one row is its own k-major form (no copy on the one-token decode step); more rows are packed once per call
  // (at most kMaxRows x K floats per block), shared by every thread.
  std::vector<float> packed(M > 1 ? M * K : 0);
  for (int64_t i = 0, r = 0; M > 1 && i < blocks; ++i) {
    const int64_t mr = base + (i < extra ? 1 : 0);
    pack_rows(xp, ldx, r, mr, K, packed.data() + r * K);
    r += mr;
  }
  const float* rows_at = M > 1 ? packed.data() : xp;
  at::parallel_for(0, P, 2, [&](int64_t begin, int64_t end) {
    float tmp[kMaxRows * kCols];
    float bias_tail[kCols];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kCols, cols = std::min(kCols, N - n0);
      const float* pb = b != nullptr ? b + n0 : nullptr;
      if (pb != nullptr && cols < kCols) {
        std::fill(bias_tail, bias_tail + kCols, 0.0f);
        std::copy(pb, pb + cols, bias_tail);
        pb = bias_tail;
      }
      for (int64_t i = 0, r = 0; i < blocks; ++i) {
        const int64_t mr = base + (i < extra ? 1 : 0);
        if (cols == kCols) {
          micros[mr](rows_at + r * K, rp + p * panel_bytes, K, pb, op + r * N + n0, N);
        } else {  // the last, partial panel: computed into a buffer, its padded columns dropped
          micros[mr](rows_at + r * K, rp + p * panel_bytes, K, pb, tmp, kCols);
          for (int64_t q = 0; q < mr; ++q) std::copy(tmp + q * kCols, tmp + q * kCols + cols, op + (r + q) * N + n0);
        }
        r += mr;
      }
    }
  });
}

bool coded_linear_vectorized() { return kVectorized; }

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("coded_linear(Tensor(a!) out, Tensor x, Tensor records, Tensor? bias) -> ()");
  m.def("coded_pack(Tensor weight) -> Tensor?");
  m.def("coded_linear_vectorized() -> bool", &pagoda::coded_linear_vectorized);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("coded_pack", &pagoda::coded_pack);
  m.impl("coded_linear", &pagoda::coded_linear);
}
