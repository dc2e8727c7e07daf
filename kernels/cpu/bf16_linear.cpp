// y = x @ W^T (+ b) with bf16 x and W, fp32 accumulation, on AVX-512 BF16 dot products (`vdpbf16ps`: two bf16
// products summed into each fp32 lane per instruction), W packed once at load in a pair (VNNI) layout.
//
// Why: oneDNN's bf16 GEMM reaches this 2-core Zen 4's bf16 peak (~420 GFLOP/s) at prefill sizes but only ~60 % of
// it at decode's 32-128 rows (docs/benchmarks.md, "bfloat16 on CPU"). Here W [N, K] is re-laid as panels
// [ceil(N/32)][ceil(K/2)][32][2] (zero-padded columns and k), so a panel is one contiguous stream: per k pair two
// aligned zmm loads (columns 0-15 and 16-31, each lane a (k, k+1) pair) feed up to 12 rows x 2 `vdpbf16ps` into 24
// zmm accumulators, x's pair broadcast as one 32-bit value. The panels are split over the threads (each streams
// only its share of W); the row blocks inside a panel re-read it from L2. The structure is panel_linear.cpp's.
//
// Determinism: every output is summed by one thread in an order that depends on K alone (k pairs in order), so the
// result is the same whatever the thread count or row blocking.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "ops.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kCols = 32;  // output columns per panel
constexpr int64_t kMr = 12;    // most rows per micro-kernel call (2 zmm accumulators per row, of 32 registers)
constexpr int64_t kChunkBlocks = 16;  // row blocks (~192 rows, ~220 KB of x at K = 576) per pass over the panels

#if defined(__AVX512BF16__)
// 32-bit broadcast of x's pair (k, k+1) of row r; the odd-K tail pairs x[K-1] with 0 (the padded weight is 0 too).
#define BF16_ROW(r)                                                                              \
  if constexpr (MR > r) {                                                                        \
    const __m512bh av = (__m512bh)_mm512_set1_epi32(pair_at(x##r, k2));                          \
    c##r = _mm512_dpbf16_ps(c##r, av, b0);                                                       \
    d##r = _mm512_dpbf16_ps(d##r, av, b1);                                                       \
  }
#define BF16_TAIL(r)                                                                             \
  if constexpr (MR > r) {                                                                        \
    const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x##r[K - 1]));          \
    c##r = _mm512_dpbf16_ps(c##r, av, b0);                                                       \
    d##r = _mm512_dpbf16_ps(d##r, av, b1);                                                       \
  }
#define BF16_STORE(r)                                                                            \
  if constexpr (MR > r) {                                                                        \
    store_row(_mm512_add_ps(c##r, bias0), _mm512_add_ps(d##r, bias1), out, r * ldo, lo, hi, bf16_out); \
  }

inline int32_t pair_at(const uint16_t* x, int64_t k2) {
  int32_t v;
  std::memcpy(&v, x + 2 * k2, sizeof(v));
  return v;
}

// One output row's 32 columns (masks lo/hi: the columns that exist), as fp32 or bf16 (round to nearest even).
inline void store_row(__m512 lo_v, __m512 hi_v, void* out, int64_t at, __mmask16 lo, __mmask16 hi, bool bf16_out) {
  if (bf16_out) {
    uint16_t* o = static_cast<uint16_t*>(out) + at;
    _mm256_mask_storeu_epi16(o, lo, (__m256i)_mm512_cvtneps_pbh(lo_v));
    _mm256_mask_storeu_epi16(o + 16, hi, (__m256i)_mm512_cvtneps_pbh(hi_v));
  } else {
    float* o = static_cast<float*>(out) + at;
    _mm512_mask_storeu_ps(o, lo, lo_v);
    _mm512_mask_storeu_ps(o + 16, hi, hi_v);
  }
}

// out[r][0..31] = sum_k x[r][k] * panel[k][0..31] (+ bias) for MR rows of x (row stride ldx, in elements).
template <int MR>
void micro(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, const float* bias, void* out,
           int64_t ldo, __mmask16 lo, __mmask16 hi, bool bf16_out) {
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0,
         c10 = c0, c11 = c0;
  __m512 d0 = c0, d1 = c0, d2 = c0, d3 = c0, d4 = c0, d5 = c0, d6 = c0, d7 = c0, d8 = c0, d9 = c0, d10 = c0,
         d11 = c0;
  const uint16_t *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
  const uint16_t *x6 = x + 6 * ldx, *x7 = x + 7 * ldx, *x8 = x + 8 * ldx, *x9 = x + 9 * ldx, *x10 = x + 10 * ldx,
                 *x11 = x + 11 * ldx;
  const int64_t full = K / 2;
  for (int64_t k2 = 0; k2 < full; ++k2) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512(panel + k2 * 2 * kCols);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(panel + k2 * 2 * kCols + kCols);
    BF16_ROW(0)
    BF16_ROW(1)
    BF16_ROW(2)
    BF16_ROW(3)
    BF16_ROW(4)
    BF16_ROW(5)
    BF16_ROW(6)
    BF16_ROW(7)
    BF16_ROW(8)
    BF16_ROW(9)
    BF16_ROW(10)
    BF16_ROW(11)
  }
  if (K % 2 != 0) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512(panel + full * 2 * kCols);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(panel + full * 2 * kCols + kCols);
    BF16_TAIL(0)
    BF16_TAIL(1)
    BF16_TAIL(2)
    BF16_TAIL(3)
    BF16_TAIL(4)
    BF16_TAIL(5)
    BF16_TAIL(6)
    BF16_TAIL(7)
    BF16_TAIL(8)
    BF16_TAIL(9)
    BF16_TAIL(10)
    BF16_TAIL(11)
  }
  const __m512 bias0 = bias != nullptr ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();
  const __m512 bias1 = bias != nullptr ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps();
  BF16_STORE(0)
  BF16_STORE(1)
  BF16_STORE(2)
  BF16_STORE(3)
  BF16_STORE(4)
  BF16_STORE(5)
  BF16_STORE(6)
  BF16_STORE(7)
  BF16_STORE(8)
  BF16_STORE(9)
  BF16_STORE(10)
  BF16_STORE(11)
}
#undef BF16_ROW
#undef BF16_TAIL
#undef BF16_STORE

using Micro = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, void*, int64_t, __mmask16,
                       __mmask16, bool);
constexpr Micro kMicro[kMr + 1] = {nullptr,  micro<1>, micro<2>, micro<3>,  micro<4>,  micro<5>, micro<6>,
                                   micro<7>, micro<8>, micro<9>, micro<10>, micro<11>, micro<12>};
#endif

}  // namespace

namespace pagoda {

bool bf16_linear_native() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// W [N, K] bf16 -> panels [ceil(N/32), ceil(K/2), 32, 2] bf16, zero-padded past column N and past k = K.
at::Tensor bf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "bf16_pack: weight must be bf16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kCols - 1) / kCols, K2 = (K + 1) / 2;
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::zeros({P, K2, kCols, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint16_t* panel = dst + p * K2 * kCols * 2;
      const int64_t cols = std::min(kCols, N - p * kCols);
      for (int64_t c = 0; c < cols; ++c) {
        const uint16_t* row = src + (p * kCols + c) * K;
        for (int64_t k = 0; k < K; ++k) panel[(k / 2) * kCols * 2 + c * 2 + (k % 2)] = row[k];
      }
    }
  });
  return packed;
}

void bf16_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bf16_linear: x and the packed weight must be bf16");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "bf16_linear: out must be float32 or bf16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.is_contiguous(),
              "bf16_linear: x [M, K] with contiguous rows, out [M, N] contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 && packed.is_contiguous(),
              "bf16_linear: packed must be bf16_pack's [ceil(N/32), ceil(K/2), 32, 2]");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == (K + 1) / 2 && out.size(0) == M && (N + kCols - 1) / kCols == P,
              "bf16_linear: shapes do not match");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0, "bf16_linear: packed not 64-byte aligned");
  const float* b = bias_data(bias, N, "bf16_linear");
  if (M == 0 || N == 0) return;
#if defined(__AVX512BF16__)
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const bool bf16_out = out.scalar_type() == at::kBFloat16;
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t esize = bf16_out ? 2 : 4, ldx = x.stride(0), K2 = packed.size(1);
  // Row blocks as even as possible (64 rows: 4 x 11 + 2 x 10): a short block pays the panel's loads for few FMAs.
  const int64_t blocks = (M + kMr - 1) / kMr, base = M / blocks, extra = M % blocks;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    // NOTE: the row blocks in chunks of kChunkBlocks (x's chunk stays in L2 while this thread's panels pass by):
    // a panel at a time over all of a prefill chunk's rows re-read x from L3 for every panel.
    for (int64_t i0 = 0, r0 = 0; i0 < blocks; i0 += kChunkBlocks) {
      const int64_t i1 = std::min(blocks, i0 + kChunkBlocks);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kCols, cols = std::min(kCols, N - n0);
        const __mmask16 lo = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
        const __mmask16 hi = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
        const uint16_t* panel = wp + p * K2 * kCols * 2;
        const float* bp = b != nullptr ? b + n0 : nullptr;
        int64_t r = r0;
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t mr = base + (i < extra ? 1 : 0);
          kMicro[mr](xp + r * ldx, ldx, panel, K, bp, op + (r * N + n0) * esize, N, lo, hi, bf16_out);
          r += mr;
        }
      }
      for (int64_t i = i0; i < i1; ++i) r0 += base + (i < extra ? 1 : 0);
    }
  });
#else
  TORCH_CHECK(false, "bf16_linear: this build has no AVX-512 BF16 (check bf16_linear_native first)");
#endif
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("bf16_linear_native() -> bool", &pagoda::bf16_linear_native);
  m.def("bf16_pack(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("bf16_pack", &pagoda::bf16_pack);
  m.impl("bf16_linear", &pagoda::bf16_linear);
}
