// Fused elementwise ops for the CPU float32 path (SiLU-and-mul also bf16): one pass over memory and one dispatch each.
//
// Why: in eager torch these are 3-7 ops apiece (RMSNorm: add, pow, mean, add, rsqrt, mul, mul), each a full pass
// over the activations plus ~2-10 us of dispatch. Ten prefill steps of 2048 tokens spent ~4 of their 36 s in them
// (profiled; SiLU on the strided gate half of the fused gate/up output ran at 2.6 GB/s), and a batch-1 decode step
// made hundreds of such calls (272 multiplies alone).
// Numerics follow transformers' float32 modules up to rounding: RMSNorm is x / sqrt(mean(x^2) + eps) * weight (HF
// multiplies by rsqrt), rotary is the rotate-half (NeoX) form, SiLU is x / (1 + exp(-x)).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

extern "C" __attribute__((__simd__("notinbranch"))) float expf(float) noexcept;

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, ": float32 only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": expected a 2-D tensor with contiguous rows");
}

// The norms' shared arguments: a float32 weight of the hidden size, and the optional float32 residual of x's shape
// (its data and row stride; null and 0 without one).
std::pair<float*, int64_t> norm_residual(const c10::optional<at::Tensor>& residual, const at::Tensor& x,
                                         const at::Tensor& weight, const char* name) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1), name,
              ": weight must be a contiguous float32 vector of the hidden size");
  if (!residual.has_value()) return {nullptr, 0};
  check_rows(*residual, name);
  TORCH_CHECK(residual->sizes() == x.sizes(), name, ": residual shape does not match");
  return {residual->data_ptr<float>(), residual->stride(0)};
}

// Rows per parallel task: enough work (~16K floats) per task that the thread hand-off is worth it.
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1)); }

// sum of p[i]^2: one out-of-line copy for every norm, so that each vectorizes it alike (the partial sums' order, and
// with it the bits, would otherwise follow each caller's inlining).
__attribute__((noinline)) float sum_squares(const float* p, int64_t n) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += p[i] * p[i];
  return ss;
}

// NOTE: bf16 <-> fp32 a row at a time in vector registers: element-wise conversions inside the arithmetic loops kept
// GCC from vectorizing them (SiLU-and-mul on bf16 ran ~4x slower than on float32, scalar expf included).
// dst = src widened to fp32 (exact: bf16 is fp32's top half).
inline void widen_row(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// dst = bf16(src), round to nearest even with NaN kept a quiet NaN: c10::BFloat16's conversion (torch's .to), bit
// for bit, denormals included (AVX-512 BF16's VCVTNEPS2BF16 would flush those).
inline void narrow_row(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF), qnan = _mm512_set1_epi32(0x7FC0);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(src + i);
    const __m512i b = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), one), half);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, bias), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);
}

// out[t] = rms_norm(r[t] += x[t], or x[t]) * w for X, O in {float, bf16}; fp32 arithmetic, residual fp32.
template <typename X, typename O>
void norm_rows(const X* xp, float* r, O* op, const float* w, int64_t T, int64_t N, int64_t xs, int64_t rs, int64_t os,
               float eps) {
  at::parallel_for(0, T, grain(N), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(N);
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = nullptr;
      if constexpr (std::is_same_v<X, float>) {
        xr = xp + t * xs;
      } else {
        widen_row(xp + t * xs, buf.data(), N);
        xr = buf.data();
      }
      float* src = buf.data();
      if (r != nullptr) {
        src = r + t * rs;
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) src[i] += xr[i];
      } else if (xr != src) {
        std::copy(xr, xr + N, src);
      }
      const float inv = 1.0f / std::sqrt(sum_squares(src, N) / static_cast<float>(N) + eps);
      float* dst = std::is_same_v<O, float> ? reinterpret_cast<float*>(op + t * os) : buf.data();
#pragma omp simd
      for (int64_t i = 0; i < N; ++i) dst[i] = w[i] * (src[i] * inv);
      if constexpr (!std::is_same_v<O, float>) narrow_row(dst, op + t * os, N);
    }
  });
}

}  // namespace

namespace pagoda {

// out = rms_norm(residual += x, or x) * weight with x float32 or bf16 (a bf16 GEMM's product, widened exactly) and
// out float32 or bf16 (the next bf16 GEMM's input).
// NOTE: with bf16 CPU GEMMs this is the norm, its residual add and both casts around it in one pass: the bits are the
// ones the casts gave (an exact widening before, the same fp32 norm, round to nearest even after).
void rms_norm_to(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                 const at::Tensor& weight, double eps) {
  const auto xt = x.scalar_type(), ot = out.scalar_type();
  TORCH_CHECK((xt == at::kFloat || xt == at::kBFloat16) && (ot == at::kFloat || ot == at::kBFloat16),
              "rms_norm_to: x and out must be float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1 && out.sizes() == x.sizes(),
              "rms_norm_to: expected 2-D tensors of one shape with contiguous rows");
  const int64_t T = x.size(0), N = x.size(1);
  // NOTE: not a structured binding: the lambdas below capture r and rs (C++20 only for bindings)
  const std::pair<float*, int64_t> res = norm_residual(residual, x, weight, "rms_norm_to");
  float* const r = res.first;
  const int64_t rs = res.second;
  const float* w = weight.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  const int64_t xs = x.stride(0), os = out.stride(0);
  auto run = [&](auto* xp) {
    if (ot == at::kBFloat16) {
      norm_rows(xp, r, out.data_ptr<at::BFloat16>(), w, T, N, xs, rs, os, feps);
    } else {
      norm_rows(xp, r, out.data_ptr<float>(), w, T, N, xs, rs, os, feps);
    }
  };
  if (xt == at::kBFloat16) {
    run(x.data_ptr<at::BFloat16>());
  } else {
    run(x.data_ptr<float>());
  }
}

// out[t] = silu(x[t, :I]) * x[t, I:], float32 or bf16 in and out (the same dtype), fp32 arithmetic.
// NOTE: bf16 with bf16 CPU GEMMs: gate/up's bf16 product comes in as is and the output is the down projection's
// bf16 input, rounded here to nearest even as its cast was: the same bits, minus two casts over the largest
// activations of the layer.
template <typename T>
void silu_rows(const T* xp, T* op, int64_t T_, int64_t I, int64_t xs, int64_t os) {
  at::parallel_for(0, T_, grain(I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = xp + t * xs;
      const T* u = g + I;
      T* o = op + t * os;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float gi = static_cast<float>(g[i]);
        o[i] = static_cast<T>(gi / (1.0f + expf(-gi)) * static_cast<float>(u[i]));
      }
    }
  });
}

// The bf16 form: a row widened into fp32, the float32 loop's arithmetic, the product rounded once.
void silu_rows_bf16(const at::BFloat16* xp, at::BFloat16* op, int64_t T_, int64_t I, int64_t xs, int64_t os) {
  at::parallel_for(0, T_, grain(I), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * I);
    float* g = buf.data();
    const float* u = g + I;
    for (int64_t t = begin; t < end; ++t) {
      widen_row(xp + t * xs, g, 2 * I);
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
      narrow_row(g, op + t * os, I);
    }
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "silu_and_mul: float32 or bfloat16 only");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "silu_and_mul: out must have x's dtype");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1,
              "silu_and_mul: expected 2-D tensors with contiguous rows");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(x.size(1) == 2 * I && out.size(0) == T && out.size(1) == I, "silu_and_mul: shapes do not match");
  if (bf16) {
    silu_rows_bf16(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), T, I, x.stride(0), out.stride(0));
  } else {
    silu_rows(x.data_ptr<float>(), out.data_ptr<float>(), T, I, x.stride(0), out.stride(0));
  }
}

// residual (if given) += x, then x = rms_norm(residual or x) * weight; both in place.
void add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  const int64_t T = x.size(0), N = x.size(1);
  // NOTE: not a structured binding: the lambdas below capture r and rs (C++20 only for bindings)
  const std::pair<float*, int64_t> res = norm_residual(residual, x, weight, "add_rms_norm");
  float* const r = res.first;
  const int64_t rs = res.second;
  float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* xr = xp + t * xs;
      const float* src = xr;
      if (r != nullptr) {
        float* rr = r + t * rs;
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) rr[i] += xr[i];
        src = rr;
      }
      const float inv = 1.0f / std::sqrt(sum_squares(src, N) / static_cast<float>(N) + feps);
#pragma omp simd
      for (int64_t i = 0; i < N; ++i) xr[i] = w[i] * (src[i] * inv);
    }
  });
}

// The first `num_heads` heads of one token's row rotated in place (rotate-half form) by that position's cos/sin.
static inline void rotate_heads(float* row, const float* c, const float* s, int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* a = row + h * head_dim;
    float* b = a + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = a[i], x2 = b[i];
      a[i] = x1 * c[i] - x2 * s[i];
      b[i] = x2 * c[i + half] + x1 * s[i + half];
    }
  }
}

// Rotates the first `num_heads` heads of every row of x in place (rotate-half form), with cos/sin the rows for
// each token's position: x[:h] = x[:h] * cos - x[h:] * sin; x[h:] = x[h:] * cos + x[:h] * sin.
void rotary_embedding(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                      int64_t head_dim) {
  check_rows(x, "rotary_embedding");
  check_rows(cos, "rotary_embedding");
  check_rows(sin, "rotary_embedding");
  const int64_t T = x.size(0);
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= x.size(1) && cos.size(0) == T && cos.size(1) == head_dim &&
                  sin.sizes() == cos.sizes(),
              "rotary_embedding: shapes do not match");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t xs = x.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, T, grain(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * cs;
      const float* s = sp + t * ss;
      rotate_heads(xp + t * xs, c, s, num_heads, head_dim);
    }
  });
}

// out = x widened to float32, then its first `num_heads` heads rotated as rotary_embedding does: qkv's bf16 product
// (bf16 CPU GEMMs) into the fp32 q/k/v that attention reads, one pass instead of a cast and a rotation.
void rotary_embedding_to(at::Tensor out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t num_heads, int64_t head_dim) {
  check_rows(out, "rotary_embedding_to");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1 && x.sizes() == out.sizes(),
              "rotary_embedding_to: x must be a bf16 [T, width] with contiguous rows, out's shape");
  check_rows(cos, "rotary_embedding_to");
  check_rows(sin, "rotary_embedding_to");
  const int64_t T = x.size(0), W = x.size(1);
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= W && cos.size(0) == T && cos.size(1) == head_dim &&
                  sin.sizes() == cos.sizes(),
              "rotary_embedding_to: shapes do not match");
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  float* op = out.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, T, grain(W), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const at::BFloat16* xr = xp + t * xs;
      float* o = op + t * os;
      widen_row(xr, o, W);
      const float* c = cp + t * cs;
      const float* s = sp + t * ss;
      rotate_heads(o, c, s, num_heads, head_dim);
    }
  });
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def("rms_norm_to(Tensor(a!) out, Tensor x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_embedding(Tensor(a!) x, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
  m.def(
      "rotary_embedding_to(Tensor(a!) out, Tensor x, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("silu_and_mul", &pagoda::silu_and_mul);
  m.impl("add_rms_norm", &pagoda::add_rms_norm);
  m.impl("rms_norm_to", &pagoda::rms_norm_to);
  m.impl("rotary_embedding", &pagoda::rotary_embedding);
  m.impl("rotary_embedding_to", &pagoda::rotary_embedding_to);
}
