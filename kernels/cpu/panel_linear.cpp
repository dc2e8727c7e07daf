// y = x @ W^T (+ b) for decode-sized row counts (~5-256 rows), with W packed once at load into column panels.
//
// Why: below prefill sizes (oneDNN / MKL) oneDNN's packed
// path reaches only ~60 GFLOP/s at 5-16 rows and ~130 at 64 on this 2-core EPYC. Here W [N, K] is re-laid once as
// panels [ceil(N/16)][K][16] (zero-padded columns), so one panel is a contiguous stream that a register-blocked
// micro-kernel walks with aligned loads, broadcasting one x value per row and k:
// - AVX-512 (this EPYC is a Zen 4: lscpu lists avx512f, and -march=native enables it): two adjacent panels at once,
//   up to 12 rows x 32 columns in 24 zmm accumulators (+2 for the panels, +1 for the broadcast); 32 registers let
//   one pass over W take 12 rows, where AVX2's 16 take 6 (measured, 30 layers at 8 rows: 31.5 ms AVX2 6x16,
//   20.6 ms AVX-512 12x16, 21.7 ms 12x32 - which then wins from 24 rows up: 32.5 against 41.9 ms).
// - AVX2: up to 6 rows x 16 columns in 12 ymm accumulators (+2 for the panel, +1 for the broadcast).
// - otherwise a portable loop with the same order.
// The panels are split over the cores; inside a panel the row blocks reuse it from L1/L2, so up to one row block
// W streams from DRAM exactly once, and above that x is what gets re-read (from L2), not W.
//
// Determinism: every output is one sequential FMA chain over k = 0..K-1 (then + bias), computed by a single thread;
// the row blocking depends on M alone, so the result is the same whatever the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "ops.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kNr = 16;  // panel width (columns of W per panel)

#if defined(__AVX512F__)
constexpr int64_t kMr = 12;  // most rows per micro-kernel call (one zmm accumulator per row, of 32 registers)

#define PANEL_ROW(r)                                          \
  if constexpr (MR > r) {                                     \
    c##r = _mm512_fmadd_ps(_mm512_set1_ps(a##r[k]), b, c##r); \
  }
#define PANEL_STORE(r)                                                \
  if constexpr (MR > r) {                                             \
    _mm512_storeu_ps(c + r * ldc, _mm512_add_ps(c##r, bias_v));       \
  }

template <int MR>
inline void micro(const float* a, int64_t lda, const float* panel, int64_t K, const float* bias, float* c,
                  int64_t ldc) {
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0,
         c10 = c0, c11 = c0;
  const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda, *a4 = a + 4 * lda, *a5 = a + 5 * lda;
  const float *a6 = a + 6 * lda, *a7 = a + 7 * lda, *a8 = a + 8 * lda, *a9 = a + 9 * lda, *a10 = a + 10 * lda,
              *a11 = a + 11 * lda;
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b = _mm512_load_ps(panel + k * kNr);
    PANEL_ROW(0)
    PANEL_ROW(1)
    PANEL_ROW(2)
    PANEL_ROW(3)
    PANEL_ROW(4)
    PANEL_ROW(5)
    PANEL_ROW(6)
    PANEL_ROW(7)
    PANEL_ROW(8)
    PANEL_ROW(9)
    PANEL_ROW(10)
    PANEL_ROW(11)
  }
  const __m512 bias_v = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  PANEL_STORE(0)
  PANEL_STORE(1)
  PANEL_STORE(2)
  PANEL_STORE(3)
  PANEL_STORE(4)
  PANEL_STORE(5)
  PANEL_STORE(6)
  PANEL_STORE(7)
  PANEL_STORE(8)
  PANEL_STORE(9)
  PANEL_STORE(10)
  PANEL_STORE(11)
}
#undef PANEL_ROW
#undef PANEL_STORE

// The same for two adjacent panels (32 columns): one broadcast of x feeds two FMAs, halving the loads per FMA.
#define PANEL_ROW(r)                               \
  if constexpr (MR > r) {                          \
    const __m512 av = _mm512_set1_ps(a##r[k]);     \
    c##r = _mm512_fmadd_ps(av, b, c##r);           \
    d##r = _mm512_fmadd_ps(av, e, d##r);           \
  }
#define PANEL_STORE(r)                                                   \
  if constexpr (MR > r) {                                                \
    _mm512_storeu_ps(c + r * ldc, _mm512_add_ps(c##r, bias_v));          \
    _mm512_storeu_ps(c + r * ldc + kNr, _mm512_add_ps(d##r, bias_w));    \
  }

template <int MR>
inline void micro2(const float* a, int64_t lda, const float* panel, int64_t K, const float* bias, float* c,
                   int64_t ldc) {
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0,
         c10 = c0, c11 = c0;
  __m512 d0 = c0, d1 = c0, d2 = c0, d3 = c0, d4 = c0, d5 = c0, d6 = c0, d7 = c0, d8 = c0, d9 = c0, d10 = c0,
         d11 = c0;
  const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda, *a4 = a + 4 * lda, *a5 = a + 5 * lda;
  const float *a6 = a + 6 * lda, *a7 = a + 7 * lda, *a8 = a + 8 * lda, *a9 = a + 9 * lda, *a10 = a + 10 * lda,
              *a11 = a + 11 * lda;
  const float* next = panel + K * kNr;
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b = _mm512_load_ps(panel + k * kNr);
    const __m512 e = _mm512_load_ps(next + k * kNr);
    PANEL_ROW(0)
    PANEL_ROW(1)
    PANEL_ROW(2)
    PANEL_ROW(3)
    PANEL_ROW(4)
    PANEL_ROW(5)
    PANEL_ROW(6)
    PANEL_ROW(7)
    PANEL_ROW(8)
    PANEL_ROW(9)
    PANEL_ROW(10)
    PANEL_ROW(11)
  }
  const __m512 bias_v = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 bias_w = bias != nullptr ? _mm512_loadu_ps(bias + kNr) : _mm512_setzero_ps();
  PANEL_STORE(0)
  PANEL_STORE(1)
  PANEL_STORE(2)
  PANEL_STORE(3)
  PANEL_STORE(4)
  PANEL_STORE(5)
  PANEL_STORE(6)
  PANEL_STORE(7)
  PANEL_STORE(8)
  PANEL_STORE(9)
  PANEL_STORE(10)
  PANEL_STORE(11)
}
#undef PANEL_ROW
#undef PANEL_STORE
#define PANEL_PAIRS 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kMr = 6;  // most rows per micro-kernel call (12 accumulators at 16 columns)

// NOTE: named accumulators, not an array: GCC keeps an `__m256 acc[MR][2]` in memory and stores all 12 of them
// on every k (measured: 80 GFLOP/s at 256 rows against ~190 with registers).
#define PANEL_ROW(r)                                                   \
  if constexpr (MR > r) {                                              \
    const __m256 av = _mm256_broadcast_ss(a##r + k);                   \
    c##r##0 = _mm256_fmadd_ps(av, b0, c##r##0);                        \
    c##r##1 = _mm256_fmadd_ps(av, b1, c##r##1);                        \
  }
#define PANEL_STORE(r)                                                 \
  if constexpr (MR > r) {                                              \
    _mm256_storeu_ps(c + r * ldc, _mm256_add_ps(c##r##0, bias0));      \
    _mm256_storeu_ps(c + r * ldc + 8, _mm256_add_ps(c##r##1, bias1));  \
  }

// c[r][0..15] = sum_k a[r][k] * panel[k][0..15] (+ bias) for MR rows; `ldc` the row stride of c.
template <int MR>
inline void micro(const float* a, int64_t lda, const float* panel, int64_t K, const float* bias, float* c,
                  int64_t ldc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda, *a4 = a + 4 * lda, *a5 = a + 5 * lda;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_load_ps(panel + k * kNr);
    const __m256 b1 = _mm256_load_ps(panel + k * kNr + 8);
    PANEL_ROW(0)
    PANEL_ROW(1)
    PANEL_ROW(2)
    PANEL_ROW(3)
    PANEL_ROW(4)
    PANEL_ROW(5)
  }
  // + 0.0f where there is no bias: x + 0 == x for every float but -0 (which becomes +0; harmless).
  const __m256 bias0 = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 bias1 = bias != nullptr ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  PANEL_STORE(0)
  PANEL_STORE(1)
  PANEL_STORE(2)
  PANEL_STORE(3)
  PANEL_STORE(4)
  PANEL_STORE(5)
}
#undef PANEL_ROW
#undef PANEL_STORE
#else
constexpr int64_t kMr = 6;
// The portable kernel: the same per-output order (one chain over k, then + bias), without explicit FMAs.
template <int MR>
inline void micro(const float* a, int64_t lda, const float* panel, int64_t K, const float* bias, float* c,
                  int64_t ldc) {
  float acc[MR][kNr] = {};
  for (int64_t k = 0; k < K; ++k) {
    for (int r = 0; r < MR; ++r) {
      const float av = a[r * lda + k];
      for (int64_t j = 0; j < kNr; ++j) acc[r][j] += av * panel[k * kNr + j];
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < kNr; ++j) c[r * ldc + j] = acc[r][j] + (bias != nullptr ? bias[j] : 0.0f);
  }
}
#endif

using Micro = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t);
#if defined(__AVX512F__)
constexpr Micro kMicro[kMr + 1] = {nullptr,  micro<1>, micro<2>, micro<3>,  micro<4>,  micro<5>, micro<6>,
                                   micro<7>, micro<8>, micro<9>, micro<10>, micro<11>, micro<12>};
constexpr Micro kMicro2[kMr + 1] = {nullptr,   micro2<1>, micro2<2>, micro2<3>,  micro2<4>,  micro2<5>, micro2<6>,
                                    micro2<7>, micro2<8>, micro2<9>, micro2<10>, micro2<11>, micro2<12>};
#else
constexpr Micro kMicro[kMr + 1] = {nullptr, micro<1>, micro<2>, micro<3>, micro<4>, micro<5>, micro<6>};
#endif

// One panel (16 columns starting at n0; with `pair`, two full ones) for the rows of x: full panels write `out` directly; the last, partial
// panel goes through a small buffer (its padded columns are computed and dropped).
void panel_rows(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* out,
                int64_t N, int64_t n0, int64_t rows, int64_t blocks, bool pair) {
  const int64_t cols = std::min(kNr, N - n0);
  float bias_tail[kNr];
  const float* b = bias != nullptr ? bias + n0 : nullptr;
  if (b != nullptr && cols < kNr) {
    std::fill(bias_tail, bias_tail + kNr, 0.0f);
    std::copy(b, b + cols, bias_tail);
    b = bias_tail;
  }
  // Row blocks as even as possible (8 rows: 4 + 4, not 6 + 2): a short block pays the panel's loads for few FMAs.
  const int64_t base = rows / blocks, extra = rows % blocks;
  int64_t r = 0;
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t mr = base + (i < extra ? 1 : 0);
    const float* a = x + r * ldx;
    if (pair) {
#ifdef PANEL_PAIRS
      kMicro2[mr](a, ldx, panel, K, b, out + r * N + n0, N);
#endif
    } else if (cols == kNr) {
      kMicro[mr](a, ldx, panel, K, b, out + r * N + n0, N);
    } else {
      float tmp[kMr * kNr];
      kMicro[mr](a, ldx, panel, K, b, tmp, kNr);
      for (int64_t q = 0; q < mr; ++q) std::copy(tmp + q * kNr, tmp + q * kNr + cols, out + (r + q) * N + n0);
    }
    r += mr;
  }
}

}  // namespace

namespace pagoda {

void panel_gemm(const float* x, int64_t ldx, const float* panels, int64_t count, int64_t K, const float* bias,
                float* out, int64_t N, int64_t n0, int64_t M) {
  const int64_t blocks = (M + kMr - 1) / kMr;
#ifdef PANEL_PAIRS
  if (count == 2 && n0 + 2 * kNr <= N) {
    panel_rows(x, ldx, panels, K, bias, out, N, n0, M, blocks, true);
    return;
  }
#endif
  for (int64_t i = 0; i < count && n0 + i * kNr < N; ++i) {
    panel_rows(x, ldx, panels + i * K * kNr, K, bias, out, N, n0 + i * kNr, M, blocks, false);
  }
}

// W [N, K] -> panels [ceil(N/16), K, 16], zero-padded past column N.
at::Tensor panel_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "panel_pack: weight must be float32 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kNr - 1) / kNr;
  const at::Tensor w = weight.contiguous();
  // The 64-byte alignment of the result follows from torch's allocator.
  at::Tensor packed = at::empty({P, K, kNr}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  // NOTE: one pass, panels split over the cores: a zero-padded copy and a transposing copy (torch ops) took 0.56 s
  // of the default model's load. Each panel reads its 16 rows k-block by k-block, so they stay in L1.
  constexpr int64_t kBlockK = 64;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      float* out = dst + p * K * kNr;
      const int64_t rows = std::min(kNr, N - p * kNr);
      for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
        const int64_t k1 = std::min(K, k0 + kBlockK);
        for (int64_t c = 0; c < rows; ++c) {
          const float* row = src + (p * kNr + c) * K;
          for (int64_t k = k0; k < k1; ++k) out[k * kNr + c] = row[k];
        }
        for (int64_t c = rows; c < kNr; ++c) {
          for (int64_t k = k0; k < k1; ++k) out[k * kNr + c] = 0.0f;
        }
      }
    }
  });
  return packed;
}

void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "panel_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.is_contiguous(),
              "panel_linear: x [M, K] with contiguous rows, out [M, N] contiguous");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kNr && packed.is_contiguous(),
              "panel_linear: packed must be panel_pack's [ceil(N/16), K, 16]");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && out.size(0) == M && (N + kNr - 1) / kNr == P,
              "panel_linear: shapes do not match");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr<float>()) % 32 == 0, "panel_linear: packed not aligned");
  const float* b = bias_data(bias, N, "panel_linear");
  if (M == 0 || N == 0) return;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // NOTE: no cache blocking over rows or K: x of 256 rows x 1536 (1.5 MB) re-read per panel pair from L2/L3 ran as
  // fast as chunks of 128/384 KB (which re-read W instead) - the FMAs, not the loads, are the limit there.
  const int64_t blocks = (M + kMr - 1) / kMr;
  // ~2 panels per task at least; at::parallel_for hands each thread one contiguous range of panels.
  at::parallel_for(0, P, 2, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end;) {
#ifdef PANEL_PAIRS
      const bool pair = p + 1 < end && (p + 2) * kNr <= N;  // two full panels
#else
      const bool pair = false;
#endif
      // NOTE: a pair or a single panel gives the same bits: both keep one FMA chain over k per output.
      panel_rows(xp, ldx, wp + p * K * kNr, K, b, op, N, p * kNr, M, blocks, pair);
      p += pair ? 2 : 1;
    }
  });
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("panel_pack(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("panel_pack", &pagoda::panel_pack);
  m.impl("panel_linear", &pagoda::panel_linear);
}
