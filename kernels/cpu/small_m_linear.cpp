// y = x @ W^T (+ b) for a handful of rows: the batch-1 (and near) decode GEMM, which is a weight-streaming problem.
//
// Why: at 1-4 rows a projection does 1-4 FMAs per weight loaded, so its speed is the speed at which the weight
// streams from DRAM. oneDNN reaches ~24 GB/s on SmolLM2's projections here (17.9 ms for 425 MB), a plain two-core
// read ~33 GB/s, this kernel ~27 GB/s (15.6 ms).
// This kernel walks W once, 4 rows at a time (the rows stay in L1 while every x row is applied to them), split
// over the cores by output rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 4;  // weight rows per inner step

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// out[r] = x . w_r for kRows rows of W (K % 8 == 0).
inline void dot_rows(const float* x, const float* w, int64_t K, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + k), a0);
    a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + K + k), a1);
    a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 2 * K + k), a2);
    a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 3 * K + k), a3);
  }
  out[0] = hsum(a0);
  out[1] = hsum(a1);
  out[2] = hsum(a2);
  out[3] = hsum(a3);
}
constexpr bool kHaveAvx2 = true;
#else
inline void dot_rows(const float*, const float*, int64_t, float*) {}
constexpr bool kHaveAvx2 = false;
#endif

}  // namespace

namespace pagoda {

void small_m_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "small_m_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 2 && weight.is_contiguous() && out.is_contiguous(),
              "small_m_linear: x [M, K] with contiguous rows, weight [N, K] contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && out.size(0) == M && out.size(1) == N, "small_m_linear: shapes do not match");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "small_m_linear: bias must be a contiguous float32 vector of the output size");
    b = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const bool fast = kHaveAvx2 && K % 8 == 0;
  // ~64 KB of weight per task: large enough to amortise the hand-off, small enough to balance two cores.
  const int64_t grain = std::max<int64_t>(kRows, (16384 / std::max<int64_t>(K, 1)) / kRows * kRows);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float acc[kRows];
    int64_t n = begin;
    if (fast) {
      for (; n + kRows <= end; n += kRows) {
        const float* w = wp + n * K;
        for (int64_t m = 0; m < M; ++m) {
          dot_rows(xp + m * xs, w, K, acc);
          for (int64_t r = 0; r < kRows; ++r) op[m * N + n + r] = acc[r] + (b ? b[n + r] : 0.0f);
        }
      }
    }
    for (; n < end; ++n) {
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = dot(xp + m * xs, wp + n * K, K) + (b ? b[n] : 0.0f);
    }
  });
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) { m.def("small_m_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()"); }

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("small_m_linear", &pagoda::small_m_linear); }
