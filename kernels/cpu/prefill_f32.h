// Prefill attention's float32 micro-kernels (prefill_attention.cpp): the S^T = K (scale Q)^T and O = alpha O + P V
// register tiles in a GCC vector type of the widest ISA that -march=native enables (AVX-512, AVX, else 128-bit: SSE
// or NEON), so one source serves every target. A float32 cache runs them on its rows; a bf16 cache on CPUs without
// AVX-512 BF16 (or with an odd head_dim) on its tile widened to fp32.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

namespace pagoda::prefill_f32 {

#if defined(__AVX512F__)
constexpr int kW = 16;  // floats per vector
constexpr int kJr = 8;  // keys per S micro-kernel call: 2 x 8 accumulators
constexpr int kMr = 4;  // rows per PV micro-kernel call: 4 x 4 accumulators
#elif defined(__AVX__)
constexpr int kW = 8;
constexpr int kJr = 6;  // 12 accumulators of 16 ymm registers
constexpr int kMr = 2;  // 8 accumulators + 4 V vectors
#else
constexpr int kW = 4;
constexpr int kJr = 4;
constexpr int kMr = 2;
#endif
constexpr int kNc = 4;                   // vectors of V columns per PV micro-kernel call
typedef float vec __attribute__((vector_size(kW * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
// NOTE: not `vec{} + x`: 0 + x is no identity for x = -0, so GCC keeps a scalar add before every broadcast.
template <size_t... I>
inline vec splat_impl(float x, std::index_sequence<I...>) {
  return vec{(static_cast<void>(I), x)...};
}
inline vec splat(float x) { return splat_impl(x, std::make_index_sequence<kW>{}); }

#if defined(__AVX2__) && !defined(__AVX512F__)
#define PAGODA_PREFILL_VEXP 1
// libmvec's AVX2 expf (glibc's vector-ABI name), the variant GCC's vectorised loops call at this width.
// NOTE: called by hand because GCC leaves a loop with a select around expf scalar on AVX2 ("control flow in loop":
// without mask registers it will not if-convert the call), and tunes Zen 1 to 128-bit vectors elsewhere.
static_assert(kW == 8, "_ZGVdN8v_expf takes 8 floats");
extern "C" vec _ZGVdN8v_expf(vec) noexcept;
inline vec vexp(vec x) { return _ZGVdN8v_expf(x); }
#endif

// s[j * ldS + r] = sum_d k_j[d] * qt[d * ldQ + r] for rows r in [0, 2 * kW) and kJr keys (one FMA chain over d).
#define S_ACC(j)                         \
  {                                      \
    const vec kj = splat(k[j][d]);       \
    a##j += kj * q0;                     \
    b##j += kj * q1;                     \
  }
#define S_STORE(j)                           \
  store(s + (j) * ldS, a##j);                \
  store(s + (j) * ldS + kW, b##j);
inline void s_micro(const float* const* k, const float* qt, int64_t ldQ, int64_t D, float* s, int64_t ldS) {
  static_assert(kJr >= 4 && kJr <= 8, "s_micro is written for 4..8 keys");
  vec a0{}, a1{}, a2{}, a3{}, a4{}, a5{}, a6{}, a7{};
  vec b0{}, b1{}, b2{}, b3{}, b4{}, b5{}, b6{}, b7{};
  for (int64_t d = 0; d < D; ++d) {
    const vec q0 = load(qt + d * ldQ), q1 = load(qt + d * ldQ + kW);
    S_ACC(0) S_ACC(1) S_ACC(2) S_ACC(3)
    if constexpr (kJr > 4) S_ACC(4)
    if constexpr (kJr > 5) S_ACC(5)
    if constexpr (kJr > 6) S_ACC(6)
    if constexpr (kJr > 7) S_ACC(7)
  }
  S_STORE(0) S_STORE(1) S_STORE(2) S_STORE(3)
  if constexpr (kJr > 4) { S_STORE(4) }
  if constexpr (kJr > 5) { S_STORE(5) }
  if constexpr (kJr > 6) { S_STORE(6) }
  if constexpr (kJr > 7) { S_STORE(7) }
}
#undef S_ACC
#undef S_STORE

// o[r][c] = alpha[r] * o[r][c] + sum_j p[j * ldP + r] * v_j[c] for kMr rows and NC vectors of columns.
#define PV_LOAD(r)                                   \
  if constexpr (kMr > r) {                           \
    const vec al = splat(alpha[r]);                  \
    c##r##0 = load(o + r * ldO) * al;                \
    if constexpr (NC > 1) c##r##1 = load(o + r * ldO + kW) * al;     \
    if constexpr (NC > 2) c##r##2 = load(o + r * ldO + 2 * kW) * al; \
    if constexpr (NC > 3) c##r##3 = load(o + r * ldO + 3 * kW) * al; \
  }
#define PV_ACC(r)                                    \
  if constexpr (kMr > r) {                           \
    const vec pr = splat(p[j * ldP + r]);            \
    c##r##0 += pr * v0;                              \
    if constexpr (NC > 1) c##r##1 += pr * v1;        \
    if constexpr (NC > 2) c##r##2 += pr * v2;        \
    if constexpr (NC > 3) c##r##3 += pr * v3;        \
  }
#define PV_STORE(r)                                                   \
  if constexpr (kMr > r) {                                            \
    store(o + r * ldO, c##r##0);                                      \
    if constexpr (NC > 1) store(o + r * ldO + kW, c##r##1);           \
    if constexpr (NC > 2) store(o + r * ldO + 2 * kW, c##r##2);       \
    if constexpr (NC > 3) store(o + r * ldO + 3 * kW, c##r##3);       \
  }
template <int NC>
inline void pv_micro(const float* const* v, int64_t col, int64_t n, const float* p, int64_t ldP, const float* alpha,
                     float* o, int64_t ldO) {
  static_assert(kMr <= 4, "pv_micro is written for up to 4 rows");
  vec c00{}, c01{}, c02{}, c03{}, c10{}, c11{}, c12{}, c13{}, c20{}, c21{}, c22{}, c23{}, c30{}, c31{}, c32{}, c33{};
  PV_LOAD(0) PV_LOAD(1) PV_LOAD(2) PV_LOAD(3)
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v[j] + col;
    const vec v0 = load(vj);
    vec v1{}, v2{}, v3{};
    if constexpr (NC > 1) v1 = load(vj + kW);
    if constexpr (NC > 2) v2 = load(vj + 2 * kW);
    if constexpr (NC > 3) v3 = load(vj + 3 * kW);
    PV_ACC(0) PV_ACC(1) PV_ACC(2) PV_ACC(3)
  }
  PV_STORE(0) PV_STORE(1) PV_STORE(2) PV_STORE(3)
}
#undef PV_LOAD
#undef PV_ACC
#undef PV_STORE

using PvMicro = void (*)(const float* const*, int64_t, int64_t, const float*, int64_t, const float*, float*, int64_t);
constexpr PvMicro kPv[kNc + 1] = {nullptr, pv_micro<1>, pv_micro<2>, pv_micro<3>, pv_micro<4>};

// The same for the last `ncol` < kW columns, in the same order per output (scale by alpha, then one chain over j).
inline void pv_tail(const float* const* v, int64_t col, int64_t ncol, int64_t n, const float* p, int64_t ldP,
             const float* alpha, float* o, int64_t ldO) {
  for (int64_t r = 0; r < kMr; ++r) {
    for (int64_t c = 0; c < ncol; ++c) {
      float acc = o[r * ldO + c] * alpha[r];
      for (int64_t j = 0; j < n; ++j) acc += p[j * ldP + r] * v[j][col + c];
      o[r * ldO + c] = acc;
    }
  }
}

}  // namespace pagoda::prefill_f32
