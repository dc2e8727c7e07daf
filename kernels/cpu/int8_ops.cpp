// y = x @ (codes * scale)^T (+ b) for int8 weights per output channel (`quantization="int8"`): codes int8 [N, K]
// row-major (the layout `torch._int_mm` reads as codes^T), scale float32 [N], x float32. By row count:
// - below `w8a8_m` rows, weight-only: one byte per weight streamed (batch 1 and small steps are bound by W's bytes),
//   the channel's scale applied once per output (it factors out of its dot product). With AVX-512 VNNI, x is
//   quantized per row to 16 bits and multiplied by the codes in VNNI integer dot products (`weight_only_a16`: as
//   good as float32 activations for the output, exact integer sums); without it, each code is widened to float32 in
//   registers and multiplied by x in float32 (fp32 accumulation).
// - from `w8a8_m` rows, W8A8: one native pass quantizes each row of x to int8 with its own scale (absmax / 127),
//   `at::_int_mm` (oneDNN's AVX-512 VNNI GEMM) writes the int32 product into the output's own buffer, and one
//   native pass turns it into float32 in place, times the row's scale and the channel's, plus the bias.
//
// Why native: the same W8A8 in torch ops was an inf-norm, a divide, a round and a cast over x, and the product cast
// and scaled twice (four passes over the output, each a dispatch), which ate most of _int_mm's 1.8x over bf16; and
// `torch._weight_int8pack_mm` wants bf16 x and pays ~0.1 ms per call at batch 1 (docs/benchmarks.md, "int8 on CPU").
// Both paths are one op here, which decode_step.cpp calls too, so the native whole-step decode runs int8 weights.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "int8_a16.h"
#include "ops.h"

namespace {

using namespace pagoda::int8w;  // NOLINT(build/namespaces): the tiles' constants and the VNNI pieces

constexpr int kMr = 4;  // rows per tile (kNb x kMr accumulators + kNb codes + 1 x vector fit 32 zmm registers)

#if defined(PAGODA_INT8_AVX512)
// sums[r][j] = x[r] . codes[j] over K for kMr >= MR rows and kNb channels (rows `w[j]`).
template <int MR>
void dot_tile(const float* x, int64_t ldx, const int8_t* const* w, int64_t K, float sums[kMr][kNb]) {
  __m512 acc[MR][kNb];
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < kNb; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[kNb];
    for (int j = 0; j < kNb; ++j) {
      // NOTE: the codes of the tile kPrefetchTiles ahead (rows are contiguous, so the same offset kNb * K on), one
      // line per 64 k: the hardware prefetcher alone left batch 1 at ~40 % of the read bandwidth. A prefetch past
      // the end of the codes is a no-op.
      if (k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w[j] + k + kPrefetchTiles * kNb * K), _MM_HINT_T0);
      wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[j] + k))));
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
      for (int j = 0; j < kNb; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  if (k < K) {  // the last K % 16: masked loads read zeros past the row
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[kNb];
    for (int j = 0; j < kNb; ++j) {
      wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w[j] + k)));
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * ldx + k);
      for (int j = 0; j < kNb; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < kNb; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
  }
}
constexpr bool kVectorized = true;
#else
template <int MR>
void dot_tile(const float* x, int64_t ldx, const int8_t* const* w, int64_t K, float sums[kMr][kNb]) {
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < kNb; ++j) {
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += x[r * ldx + k] * static_cast<float>(w[j][k]);
      sums[r][j] = acc;
    }
  }
}
constexpr bool kVectorized = false;
#endif

using Tile = void (*)(const float*, int64_t, const int8_t* const*, int64_t, float[kMr][kNb]);
constexpr Tile kTiles[kMr + 1] = {nullptr, dot_tile<1>, dot_tile<2>, dot_tile<3>, dot_tile<4>};

void weight_only(float* out, const float* x, int64_t ldx, int64_t M, const int8_t* codes, const float* scale,
                 const float* bias, int64_t N, int64_t K) {
  const int64_t tiles = (N + kNb - 1) / kNb;
  // NOTE: the row blocks run inside each channel tile, so a tile's codes (kNb x K bytes) stream from DRAM once and
  // stay in L1 for the other row blocks; the tiles are split over the threads in contiguous runs (one stream each).
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    float sums[kMr][kNb];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kNb, cols = std::min<int64_t>(kNb, N - n0);
      const int8_t* w[kNb];
      for (int j = 0; j < kNb; ++j) w[j] = codes + (n0 + std::min<int64_t>(j, cols - 1)) * K;  // a short tile repeats
      for (int64_t r = 0; r < M; r += kMr) {
        const int64_t mr = std::min<int64_t>(kMr, M - r);
        kTiles[mr](x + r * ldx, ldx, w, K, sums);
        for (int64_t i = 0; i < mr; ++i) {
          for (int64_t j = 0; j < cols; ++j) {
            const float y = sums[i][j] * scale[n0 + j];
            out[(r + i) * N + n0 + j] = bias != nullptr ? y + bias[n0 + j] : y;
          }
        }
      }
    }
  });
}

#if defined(PAGODA_INT8_VNNI)
void weight_only_a16(float* out, const float* x, int64_t ldx, int64_t M, const int8_t* codes, const float* scale,
                     const float* bias, int64_t N, int64_t K) {
  const int64_t Kp = padded_k(K);
  // NOTE: one buffer per calling thread, reused: the native decode step calls this ~120 times a token
  thread_local std::vector<uint8_t> bytes;
  thread_local std::vector<float> scales;
  thread_local std::vector<int32_t> hi_sums;
  bytes.resize(static_cast<size_t>(2 * M * Kp));
  scales.resize(static_cast<size_t>(M));
  hi_sums.resize(static_cast<size_t>(M));
  const int8_t* hi = reinterpret_cast<const int8_t*>(bytes.data());
  const uint8_t* lo = bytes.data() + M * Kp;
  const float* s = scales.data();
  const int32_t* hs = hi_sums.data();
  quantize_rows_a16(x, ldx, M, K, reinterpret_cast<int8_t*>(bytes.data()), bytes.data() + M * Kp, scales.data(),
                    hi_sums.data());
  const int64_t tiles = (N + kNb - 1) / kNb;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    a16_run(out, hi, lo, s, hs, M, codes, scale, bias, N, K, begin, end, codes + end * kNb * K);
  });
}
#endif

// Rows per parallel task of the passes over x and the product: ~16K elements each, as fused_ops.cpp's.
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1)); }

// xq[m] = round(x[m] / s[m]) with s[m] = max |x[m]| / 127 (1 for a row of zeros): symmetric int8 per row, in one
// pass over x from memory (the row's second read, for the codes, hits L1).
void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* xq, float* s) {
  at::parallel_for(0, M, grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * ldx;
      int8_t* q = xq + m * K;
      float absmax = 0.0f;
      int64_t k = 0;
#if defined(PAGODA_INT8_AVX512)
      __m512 mx = _mm512_setzero_ps();
      for (; k + 16 <= K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
      absmax = _mm512_reduce_max_ps(mx);
#endif
      for (int64_t i = k; i < K; ++i) absmax = std::max(absmax, std::fabs(row[i]));
      const float sm = absmax > 0.0f ? absmax / 127.0f : 1.0f;
      s[m] = sm;
      k = 0;
#if defined(PAGODA_INT8_AVX512)
      // NOTE: a divide, not a multiply by 1 / s: the same codes as round(x / s) in torch (ties to even), so
      // |x / s| <= 127 holds exactly and the saturating pack never clips.
      const __m512 sv = _mm512_set1_ps(sm);
      for (; k + 16 <= K; k += 16) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(row + k), sv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(v));
      }
#endif
      for (int64_t i = k; i < K; ++i) q[i] = static_cast<int8_t>(std::nearbyint(row[i] / sm));
    }
  });
}

// In place over the int32 product `acc` [M, N]: y = float(acc) * s[m] * scale[n] (+ bias[n]), written as float32.
void scale_back(int32_t* acc, int64_t M, int64_t N, const float* s, const float* scale, const float* bias) {
  at::parallel_for(0, M, grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int32_t* row = acc + m * N;
      float* y = reinterpret_cast<float*>(row);
      const float sm = s[m];
      int64_t n = 0;
#if defined(PAGODA_INT8_AVX512)
      const __m512 sv = _mm512_set1_ps(sm);
      for (; n + 16 <= N; n += 16) {
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(row + n)), sv),
                                 _mm512_loadu_ps(scale + n));
        if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
        _mm512_storeu_ps(y + n, v);
      }
#endif
      for (int64_t i = n; i < N; ++i) {
        const float v = static_cast<float>(row[i]) * sm * scale[i];
        y[i] = bias != nullptr ? v + bias[i] : v;
      }
    }
  });
}

}  // namespace

namespace pagoda {

void int8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                 const c10::optional<at::Tensor>& bias, int64_t w8a8_m) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "int8_linear: float32 x and out");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(),
              "int8_linear: codes must be a contiguous int8 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && codes.size(1) == K, "int8_linear: x [M, K] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == M && out.size(1) == N,
              "int8_linear: out must be a contiguous [M, N]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "int8_linear: scale must be a contiguous float32 [N]");
  const float* b = bias_data(bias, N, "int8_linear");
  if (M == 0 || N == 0) return;
  if (M < w8a8_m || K == 0) {
#if defined(PAGODA_INT8_VNNI)
    if (K > 0 && K < kA16MaxK) {
      weight_only_a16(out.data_ptr<float>(), x.data_ptr<float>(), x.stride(0), M, codes.data_ptr<int8_t>(),
                      scale.data_ptr<float>(), b, N, K);
      return;
    }
#endif
    weight_only(out.data_ptr<float>(), x.data_ptr<float>(), x.stride(0), M, codes.data_ptr<int8_t>(),
                scale.data_ptr<float>(), b, N, K);
    return;
  }
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({M}, x.options());
  quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, xq.data_ptr<int8_t>(), s.data_ptr<float>());
  at::Tensor acc = out.view(at::kInt);  // NOTE: the product lands in out's buffer and is scaled back in place
  at::_int_mm_out(acc, xq, codes.t());
  scale_back(acc.data_ptr<int32_t>(), M, N, s.data_ptr<float>(), scale.data_ptr<float>(), b);
}

bool int8_linear_vectorized() { return kVectorized; }

bool int8_weight_only_vnni() {
#if defined(PAGODA_INT8_VNNI)
  return true;
#else
  return false;
#endif
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("int8_linear(Tensor(a!) out, Tensor x, Tensor codes, Tensor scale, Tensor? bias, int w8a8_m) -> ()");
  m.def("int8_linear_vectorized() -> bool", &pagoda::int8_linear_vectorized);
  m.def("int8_weight_only_vnni() -> bool", &pagoda::int8_weight_only_vnni);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("int8_linear", &pagoda::int8_linear); }
