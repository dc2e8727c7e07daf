// y ~= x @ W^T (+ b) with W's 4-bit GGUF codes (coded_linear.cpp's 4-bit records: Q4_0, Q4_1, Q4_K) multiplied by x
// quantized to 8 bits per 32-k block, in integer dot products: `quantization="gguf_a8"` (model/layers/gguf_a8.py).
//
// Why: on a CPU without int8 or bf16 dot-product instructions (AVX2 + FMA: Zen 1-3, Haswell-Skylake client) a
// float32 GEMM is bound by its FMA ports (8 fp32 FMAs a cycle on Zen 1, ~80 % of which the panel kernel and oneDNN
// reach). `vpmaddubsw` multiplies 32 unsigned by signed bytes per instruction and adds adjacent pairs into 16-bit
// lanes, and a 4-bit code (0..15) times an 8-bit activation (|a| <= 127) summed over 16 products stays below 2^15,
// so each lane accumulates a whole 32-k block in 16 bits: one multiply instruction per 32 products where float32
// spends four (docs/benchmarks.md, "gguf_a8 on AVX2"). This is what llama.cpp's CPU kernels and vLLM's CUDA GGUF
// kernels (`ggml_mul_mat_a8`) compute: activations in 8 bits per block, so the output is not float32's (the quality
// table in docs/benchmarks.md); the exact float32 path (`coded_linear`) stays the default.
//
// The arithmetic, per row of x and 32-k block b: d_a = max|x| / 127, q_a = round-half-even(x / d_a) (x * (1 / d_a)),
// s_a = the block's float32 sum of x; per column, with the record's d and m (w = d * q + m):
//   acc = fma(float(sum_k q_a q), d * d_a, acc); acc = fma(m, s_a, acc)   over b in order, then + bias.
// Integer sums are exact and the float32 steps run in that order, so the result does not depend on the thread count
// or the row tiling (tests/kernels/test_coded_a8_linear.py checks it against a float64 replay of the same steps).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGODA_A8 1
#else
#define PAGODA_A8 0
#endif

namespace {

constexpr int64_t kCols = 16;                   // columns per record (coded_linear.cpp's panel)
constexpr int64_t kBlock = 32;                  // k per record
constexpr int64_t kScaleBytes = 2 * kCols * 4;  // d[16], m[16] float32
constexpr int64_t kRecord = kScaleBytes + kBlock * kCols / 2;  // 384: 4-bit codes, low nibble k, high nibble k + 1
static_assert(kRecord == pagoda::kCodedRecord4Bytes, "coded_linear.cpp's 4-bit records");
constexpr int kTileRows = 4;        // rows per micro-kernel call: 8 16-bit accumulators
constexpr int64_t kChunkRows = 64;  // rows per work item
// panels per work item at most: their records (8 x K/32 x 384 bytes, 147 KB at K = 1536) stay in L2 across the rows
constexpr int64_t kGroupPanels = 8;

#if PAGODA_A8

// lane 0 takes the pair (a[4g], a[4g+1]) in every 16-bit slot, lane 1 the pair (a[4g+2], a[4g+3])
const __m256i kPairs = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                                        3, 2, 3, 2, 3);

// Quantizes row `x` [K] into d [K/32], s [K/32] and the codes as the micro-kernel reads them: per 4 k, 32 bytes
// holding (a[k], a[k+1]) eight times then (a[k+2], a[k+3]) eight times (q [K/4, 32]).
// NOTE: laid out once per row here rather than broadcast and shuffled for every panel in the micro-kernel
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m256 sum = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
    alignas(32) float lanes[8], sums[8];
    _mm256_store_ps(lanes, amax);
    _mm256_store_ps(sums, sum);
    float m = 0.0f, total = 0.0f;
    for (int i = 0; i < 8; ++i) {
      m = std::max(m, lanes[i]);
      total += sums[i];
    }
    const float scale = m / 127.0f;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    d[b] = scale;
    s[b] = total;
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i r[4];  // NOTE: _mm256_cvtps_epi32 rounds half to even (the default MXCSR), as torch.round does
    for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    alignas(32) int32_t fours[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(fours), _mm256_permutevar8x32_epi32(w, order));
    for (int g = 0; g < 8; ++g) {
      const __m256i pairs = _mm256_shuffle_epi8(_mm256_set1_epi32(fours[g]), kPairs);
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + (b * 8 + g) * 32), pairs);
    }
  }
}

// out[r, 0:cols] = the record row's 16 columns for `R` rows of quantized x (q, d, s with row strides), over nb
// blocks of one panel's records.
template <int R>
void tile(const uint8_t* records, int64_t nb, const int8_t* q, int64_t ldq, const float* d, const float* s,
          int64_t lds, const float* bias, float* out, int64_t ldo, int64_t cols) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = records + b * kRecord;
    __m256i lo[R], hi[R];  // 16-bit sums: columns 0-7 / 8-15; lane 0 k = 0, 1 mod 4, lane 1 k = 2, 3 mod 4
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    // NOTE: unrolled: 8-11 % faster on a Zen 1 core (the loop's own instructions share the ports with the products)
#pragma GCC unroll 8
    for (int g = 0; g < kBlock / 4; ++g) {
      // 32 bytes: k-pair 2g then 2g + 1, one byte per column each
      const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(rec + kScaleBytes + 32 * g));
      const __m256i even = _mm256_and_si256(v, low), odd = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      // per column c of 0-7 (8-15): its codes for (k, k + 1) side by side, lane 0 k = 4g, lane 1 k = 4g + 2
      const __m256i w0 = _mm256_unpacklo_epi8(even, odd), w1 = _mm256_unpackhi_epi8(even, odd);
      for (int r = 0; r < R; ++r) {
        const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + r * ldq + (b * 8 + g) * 32));
        lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(w0, a));
        hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(w1, a));
        // NOTE: keeps GCC from reassociating the integer sums across g (it hoisted every product and spilled them)
        asm("" : "+x"(lo[r]), "+x"(hi[r]));
      }
    }
    const float* dw = reinterpret_cast<const float*>(rec);
    const __m256 d0 = _mm256_load_ps(dw), d1 = _mm256_load_ps(dw + 8);
    const __m256 m0 = _mm256_load_ps(dw + 16), m1 = _mm256_load_ps(dw + 24);
    for (int r = 0; r < R; ++r) {
      const __m256i s0 = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo[r])),
                                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo[r], 1)));
      const __m256i s1 = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi[r])),
                                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi[r], 1)));
      const __m256 da = _mm256_set1_ps(d[r * lds + b]), sa = _mm256_set1_ps(s[r * lds + b]);
      acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, da), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, da), acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(m0, sa, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(m1, sa, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float row[kCols];
    _mm256_store_ps(row, acc[r][0]);
    _mm256_store_ps(row + 8, acc[r][1]);
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = bias == nullptr ? row[c] : row[c] + bias[c];
  }
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const float*, const float*, int64_t,
                        const float*, float*, int64_t, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>};

#endif  // PAGODA_A8

}  // namespace

namespace pagoda {

bool coded_a8_supported() { return PAGODA_A8 != 0; }

void coded_a8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& records,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(coded_a8_supported(), "coded_a8_linear: this build has no AVX2 + FMA");
  TORCH_CHECK(records.dim() == 3 && records.size(2) == kRecord && records.scalar_type() == at::kByte &&
                  records.is_contiguous(),
              "coded_a8_linear: records must be coded_linear's 4-bit records, uint8 [P, K/32, ", kRecord, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                  out.dim() == 2 && out.is_contiguous(),
              "coded_a8_linear: float32 x [M, K] with contiguous rows, out [M, N] contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = records.size(0), nb = records.size(1);
  TORCH_CHECK(nb * kBlock == K && P == (N + kCols - 1) / kCols && out.size(0) == M,
              "coded_a8_linear: records must be [ceil(N/16), K/32, R] for x [M, K], out [M, N]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(records.data_ptr<uint8_t>()) % 32 == 0,
              "coded_a8_linear: records not aligned");
  const float* b = bias_data(bias, N, "coded_a8_linear");
  if (M == 0 || N == 0) return;
#if PAGODA_A8
  at::Tensor q = at::empty({M, 8 * K}, x.options().dtype(at::kChar));  // 64-byte aligned rows
  at::Tensor ds = at::empty({2, M, nb}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = ds.data_ptr<float>();
  float* sp = dp + M * nb;
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * ldx, K, qp + r * 8 * K, dp + r * nb, sp + r * nb);
  });
  // Work items: (row chunk, group of panels). Small M (decode) splits the panels finer so every thread has work.
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  const int64_t want = 4 * at::get_num_threads();
  int64_t per_group = std::min(kGroupPanels, P);
  if (chunks * ((P + per_group - 1) / per_group) < want) per_group = std::max<int64_t>(1, P * chunks / want);
  const int64_t groups = (P + per_group - 1) / per_group;
  const uint8_t* rp = records.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, chunks * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r0 = (item / groups) * kChunkRows, r1 = std::min(M, r0 + kChunkRows);
      const int64_t p0 = (item % groups) * per_group, p1 = std::min(P, p0 + per_group);
      for (int64_t r = r0; r < r1; r += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, r1 - r));
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t n0 = p * kCols;
          kTiles[rows](rp + p * nb * kRecord, nb, qp + r * 8 * K, 8 * K, dp + r * nb, sp + r * nb, nb,
                       b == nullptr ? nullptr : b + n0, op + r * N + n0, N, std::min(kCols, N - n0));
        }
      }
    }
  });
#endif
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("coded_a8_linear(Tensor(a!) out, Tensor x, Tensor records, Tensor? bias) -> ()");
  m.def("coded_a8_supported() -> bool", &pagoda::coded_a8_supported);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("coded_a8_linear", &pagoda::coded_a8_linear); }
