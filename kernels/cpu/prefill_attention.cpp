// Paged prefill attention on CPUs: many query tokens per chunk, K/V read straight from the paged cache.
//
// Why: gather + SDPA copies every K/V block into a workspace first, and SDPA's CPU flash kernel runs at ~50 GFLOP/s
// on causal ~400-token chunks here (2-core Zen 4) while the GEMMs reach ~175. One work item is (chunk, KV head, block of query tokens); the
// KV head's whole query group is folded into the item's rows (row r = token r / G, head r % G), so every K/V tile
// is loaded once for all G heads. Per key tile (flash-attention style, online softmax):
//   S^T[j][r] = k_j . (scale * q_r)    rows are the SIMD lanes: Q^T is packed once per item, K is broadcast
//                                       element by element straight from the cache (no K packing, any block size)
//   running max / sum per row          vectorised over rows; exp through libmvec (IEEE semantics kept)
//   O[r][:] = alpha[r] * O[r][:] + sum_j p[j][r] * v_j    V rows streamed from the cache, p broadcast
// Both micro-kernels keep their accumulators in registers (prefill_f32.h: a GCC vector type of the widest ISA
// that -march=native enables). Over a bf16 cache on CPUs with AVX-512 BF16 the tiles are bf16 dot products instead
// (prefill_bf16.h: q and the softmax weights rounded to bf16, fp32 accumulation).
//
// Determinism: an item's outputs depend on its own rows and keys only, in a fixed order, whichever thread runs it
// (the same bits for any thread count).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "prefill_bf16.h"
#include "prefill_f32.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

// NOTE: as in paged_attention.cpp: the SIMD variant of expf declared by hand keeps IEEE semantics (no -ffast-math).
extern "C" __attribute__((__simd__("notinbranch"))) float expf(float) noexcept;

namespace {

using namespace pagoda::prefill_f32;  // kW, vec, the micro-kernels

constexpr int64_t kRowAlign = 32;        // item rows are padded to a multiple of this (>= 2 vectors on every ISA)
constexpr int64_t kTargetRows = 96;      // query rows (tokens x group) per work item
constexpr int64_t kBk = 8 * kJr;         // keys per tile (64 with AVX-512)
#if defined(__AVX512BF16__)
namespace dp = pagoda::prefill_bf16;
constexpr bool kDp = true;  // a bf16 cache runs prefill_bf16.h's dot-product micro-kernels
static_assert(dp::kJr == kJr && dp::kMr == kMr && dp::kW == kW, "the tiles are shared with the float32 kernels");
#else
constexpr bool kDp = false;
#endif

struct PrefillArgs {
  const float* qp;
  const float* kp;  // a float32 cache's K and V halves, or
  const float* vp;
  const at::BFloat16* kb;  // a bf16 cache's (the other pair null)
  const at::BFloat16* vb;
  const int32_t* tables;
  const int32_t* seq_lens;
  const int32_t* starts;
  float* op;
  int64_t q_row, o_row, H, D, G, BS, num_blocks, max_blocks, kv_row;
  float scale;
};

struct Item {
  int64_t chunk, head, t0, nq;
};

// Per-thread buffers, 64-byte aligned.
struct Scratch {
  std::vector<float> mem;
  float *qt, *s, *o, *m, *l, *alpha, *kbuf, *vbuf, *p2;
  std::vector<const float*> kptr, vptr;
  std::vector<const at::BFloat16*> kbp, vbp;  // a bf16 cache's rows, for the dot-product kernels
  Scratch(int64_t R, int64_t D)
      : mem(R * D * 2 + kBk * R * 3 / 2 + 3 * R + 2 * kBk * D + 9 * 16), kptr(kBk), vptr(kBk), kbp(kBk), vbp(kBk) {
    float* p = mem.data();
    auto take = [&p](int64_t n) {
      p = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
      float* r = p;
      p += n;
      return r;
    };
    qt = take(D * R), s = take(kBk * R), o = take(R * D), m = take(R), l = take(R), alpha = take(R);
    kbuf = take(kBk * D), vbuf = take(kBk * D), p2 = take(kBk * R / 2);
  }
};

// Queries [t0, t0 + nq) of one chunk, query heads [h*G, (h+1)*G), over KV head h.
void attend(const PrefillArgs& a, const Item& it, int64_t R, Scratch& w) {
  const int64_t D = a.D, G = a.G, BS = a.BS, h = it.head, nq = it.nq;
  const int64_t L = a.seq_lens[it.chunk], qlen = a.starts[it.chunk + 1] - a.starts[it.chunk];
  const int64_t p0 = L - qlen + it.t0;  // absolute position of the item's first query
  const int64_t rows = nq * G;
  const int32_t* table = a.tables + it.chunk * a.max_blocks;
  // NOTE: the pairs need an even head_dim; the float32 kernels over the widened tile serve any other.
  const bool bf16_dp = kDp && a.kb != nullptr && D % 2 == 0;
  // The dot-product kernels' packed Q^T and V pairs live in the float32 kernels' qt / vbuf (half their size).
  [[maybe_unused]] uint32_t *qt2 = reinterpret_cast<uint32_t*>(w.qt), *vt2 = reinterpret_cast<uint32_t*>(w.vbuf);
  [[maybe_unused]] uint32_t* p2 = reinterpret_cast<uint32_t*>(w.p2);
  // Q^T [D][R], scaled, zero-padded rows (their scores are finite garbage that is never stored).
  // NOTE: in two steps, through the O buffer: a token's G heads are one contiguous run of q, copied as a stream;
  // the transpose then scatters within L1. Scattering straight from q (cold: written by the projection) stalled on
  // its cache misses (perf: ~5% of the kernel's time).
  for (int64_t i = 0; i < nq; ++i) {
    const float* qi = a.qp + (a.starts[it.chunk] + it.t0 + i) * a.q_row + h * G * D;
#if defined(__AVX512BF16__)
    if (bf16_dp) {  // rounded to bf16 rows (D / 2 pairs each)
      dp::narrow_scaled(qi, a.scale, G * D, reinterpret_cast<uint16_t*>(w.o) + i * G * D);
      continue;
    }
#endif
    float* dst = w.o + i * G * D;
#pragma omp simd
    for (int64_t x = 0; x < G * D; ++x) dst[x] = qi[x] * a.scale;
  }
  if (bf16_dp) {
#if defined(__AVX512BF16__)
    dp::pack_q(reinterpret_cast<const uint32_t*>(w.o), rows, R, D / 2, qt2);
#endif
  } else {
    std::fill(w.qt, w.qt + D * R, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t d = 0; d < D; ++d) w.qt[d * R + r] = w.o[r * D + d];
    }
  }
  std::fill(w.o, w.o + R * D, 0.0f);
  std::fill(w.m, w.m + R, -std::numeric_limits<float>::infinity());
  std::fill(w.l, w.l + R, 0.0f);
  const int64_t kend = p0 + nq;  // keys [0, kend) are visible to some query of the item
  for (int64_t k0 = 0; k0 < kend; k0 += kBk) {
    const int64_t n = std::min(kBk, kend - k0);
    // Row pointers of the tile's keys, walking the block table (no division per key: BS is a runtime value).
    for (int64_t j = 0, b = k0 / BS, off = k0 % BS; j < n; ++j) {
      const int64_t block = table[b];
      TORCH_CHECK(block >= 0 && block < a.num_blocks, "paged_prefill_attention: block id out of range");
      const int64_t slot = (block * BS + off) * a.kv_row + h * D;
      if (bf16_dp) {
        w.kbp[j] = a.kb + slot;
        w.vbp[j] = a.vb + slot;
      } else if (a.kb != nullptr) {
        // NOTE: a bf16 cache's tile is widened into fp32 rows once per tile (D x 64 keys, ~1 % of the tile's FMAs),
        // so the micro-kernels are the float32 ones: prefill is compute-bound, the halved bytes matter in decode.
        float *kd = w.kbuf + j * D, *vd = w.vbuf + j * D;
        const at::BFloat16 *ks = a.kb + slot, *vs = a.vb + slot;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) kd[d] = static_cast<float>(ks[d]), vd[d] = static_cast<float>(vs[d]);
        w.kptr[j] = kd;
        w.vptr[j] = vd;
      } else {
        w.kptr[j] = a.kp + slot;
        w.vptr[j] = a.vp + slot;
      }
      if (++off == BS) off = 0, ++b;
    }
    // Keys past `n` repeat the tile's first key (a valid slot) and are masked below: whole micro-kernel calls.
    std::fill(w.kptr.begin() + n, w.kptr.end(), w.kptr[0]);
    std::fill(w.vptr.begin() + n, w.vptr.end(), w.vptr[0]);
    std::fill(w.kbp.begin() + n, w.kbp.end(), w.kbp[0]);
    std::fill(w.vbp.begin() + n, w.vbp.end(), w.vbp[0]);
    const int64_t nk = (n + kJr - 1) / kJr * kJr;  // keys computed (whole micro-kernel calls)
#if defined(__AVX512BF16__)
    if (bf16_dp) dp::pack_v(w.vbp.data(), nk / 2, D, vt2);
#endif
    // Keys of this tile that the last query of rows [r0, r0 + nr) sees (padded rows count as the last query): on
    // the diagonal, a row group skips the keys past it (the mask below covers what it leaves unwritten).
    auto visible = [&](int64_t r0, int64_t nr) {
      return std::clamp<int64_t>(p0 + std::min(nq - 1, (r0 + nr - 1) / G) + 1 - k0, 0, n);
    };
    for (int64_t r0 = 0; r0 < R; r0 += 2 * kW) {
      const int64_t nv = visible(r0, 2 * kW);
      for (int64_t j0 = 0; j0 < nv; j0 += kJr) {
#if defined(__AVX512BF16__)
        if (bf16_dp) {
          dp::s_micro(w.kbp.data() + j0, qt2 + r0, R, D / 2, w.s + j0 * R + r0, R);
          continue;
        }
#endif
        s_micro(w.kptr.data() + j0, w.qt + r0, R, D, w.s + j0 * R + r0, R);
      }
    }
    // Causal mask: row r (query position p0 + r / G) sees key k0 + j iff k0 + j <= p0 + r / G. Rows below
    // `(k0 + j - p0) * G` are masked; keys >= n sit past every query.
    if (k0 + nk - 1 > p0) {
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t masked = j < n ? std::clamp<int64_t>((k0 + j - p0) * G, 0, R) : R;
        std::fill(w.s + j * R, w.s + j * R + masked, -std::numeric_limits<float>::infinity());
      }
    }
    // Online softmax. Every row sees key 0 in the first tile, so its running max is finite from there on.
    float *s = w.s, *m = w.m, *l = w.l, *alpha = w.alpha;
    // NOTE: the tile's row maxima a vector of rows at a time, its running max in a register across the keys (a loop
    // over keys outermost loaded and stored alpha per key: ~15 % of the bf16 kernel's time). Max is exact: the same
    // bits either way.
    for (int64_t r0 = 0; r0 < R; r0 += kW) {
      vec mx = load(s + r0);
      for (int64_t j = 1; j < nk; ++j) {
        const vec x = load(s + j * R + r0);
        mx = mx < x ? x : mx;  // std::max's order
      }
      store(alpha + r0, mx);
    }
#pragma omp simd
    for (int64_t r = 0; r < R; ++r) {
      const float mn = std::max(m[r], alpha[r]);
      alpha[r] = expf(m[r] - mn);  // exp(-inf) = 0 on the first tile
      m[r] = mn;
      l[r] *= alpha[r];
    }
    // NOTE: masked scores give p = 0 by a select, not through expf(-inf): libmvec hands every lane outside its fast
    // range to the scalar expf (1 thread, 5 chunks of ~410 tokens: 15.6 -> 15.0 ms). Other lanes are exact.
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#if defined(__AVX512BF16__)
    if (bf16_dp) {
      dp::softmax_pairs(s, nk, R, m, p2, l);
      dp::pv_tile(vt2, D, p2, R, alpha, w.o, visible);
      continue;
    }
#endif
#if defined(PAGODA_PREFILL_VEXP)
    // The same arithmetic a vector of rows at a time (R is a multiple of kW): each lane's sum in the same key order.
    for (int64_t r0 = 0; r0 < R; r0 += kW) {
      const vec mr = load(m + r0), zero{};
      vec sum = load(l + r0);
      for (int64_t j = 0; j < nk; ++j) {
        const vec x = load(s + j * R + r0);
        const auto live = x != splat(kNegInf);
        const vec p = live ? vexp(live ? x - mr : zero) : zero;
        store(s + j * R + r0, p);
        sum += p;
      }
      store(l + r0, sum);
    }
#else
    for (int64_t j = 0; j < nk; ++j) {
      float* sj = s + j * R;
#pragma omp simd
      for (int64_t r = 0; r < R; ++r) {
        const bool masked = sj[r] == kNegInf;
        const float e = expf(masked ? 0.0f : sj[r] - m[r]);
        sj[r] = masked ? 0.0f : e;
        l[r] += sj[r];
      }
    }
#endif
    // O = alpha * O + P V, in blocks of kMr rows x kNc vectors of columns.
    // Keys past `visible` have p = 0 exactly: skipping them changes nothing.
    for (int64_t r0 = 0; r0 < R; r0 += kMr) {
      const int64_t nv = visible(r0, kMr);
      for (int64_t c0 = 0; c0 < D;) {
        const int64_t nc = std::min<int64_t>(kNc, (D - c0) / kW);
        if (nc == 0) {  // fewer than kW columns left (head_dim not a multiple of the vector width)
          pv_tail(w.vptr.data(), c0, D - c0, nv, s + r0, R, alpha + r0, w.o + r0 * D + c0, D);
          break;
        }
        kPv[nc](w.vptr.data(), c0, nv, s + r0, R, alpha + r0, w.o + r0 * D + c0, D);
        c0 += nc * kW;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = a.op + (a.starts[it.chunk] + it.t0 + r / G) * a.o_row + (h * G + r % G) * D;
    const float inv = 1.0f / w.l[r];
    const float* o = w.o + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] = o[d] * inv;
  }
}

}  // namespace

namespace pagoda {

void paged_prefill_attention(
    at::Tensor out,                    // [T, H, D] float32, written (heads packed within each row)
    const at::Tensor& q,               // [T, H, D] float32, rows may be strided (heads packed)
    const at::Tensor& kv_cache,        // [2, num_blocks, block_size, H_kv, D] float32 or bfloat16
    const at::Tensor& block_tables,    // [C, max_blocks] int32
    const at::Tensor& seq_lens,        // [C] int32, context length after each chunk
    const at::Tensor& query_start_loc, // [C + 1] int32, chunk c's queries are rows [start[c], start[c + 1])
    double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_prefill_attention: q and out must be float32");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "paged_prefill_attention: the KV cache must be float32 or bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "paged_prefill_attention: block_tables, seq_lens and query_start_loc must be int32");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  block_tables.dim() == 2,
              "paged_prefill_attention: bad shapes");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && out.stride(2) == 1 && out.stride(1) == D &&
                  kv_cache.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous(),
              "paged_prefill_attention: inputs must be contiguous (q, out: heads packed within each row)");
  const int64_t num_blocks = kv_cache.size(1), BS = kv_cache.size(2), HKV = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % HKV == 0, "paged_prefill_attention: head shapes do not match the cache");
  const int64_t C = seq_lens.size(0);
  TORCH_CHECK(out.sizes() == q.sizes() && query_start_loc.size(0) == C + 1 && block_tables.size(0) >= C,
              "paged_prefill_attention: batch sizes do not match");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t G = H / HKV, max_blocks = block_tables.size(1);
  const int64_t bq = std::max<int64_t>(1, kTargetRows / G);  // query tokens per work item
  std::vector<int64_t> order(C);  // chunks, most work first
  std::vector<double> work(C);
  for (int64_t c = 0; c < C; ++c) {
    const int64_t qlen = starts[c + 1] - starts[c], L = lens[c];
    TORCH_CHECK(qlen >= 0 && starts[c] >= 0 && starts[c + 1] <= T && qlen <= L,
                "paged_prefill_attention: query_start_loc / seq_lens out of range");
    TORCH_CHECK((L + BS - 1) / BS <= max_blocks, "paged_prefill_attention: seq_len exceeds the block table");
    order[c] = c;
    work[c] = static_cast<double>(qlen) * (L - qlen / 2.0);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return work[x] > work[y]; });
  // NOTE: items are handed out one at a time (an atomic counter): causal items differ in cost by their context
  // length, so static halves would leave a core idle. Within a (chunk, KV head) the query blocks go last-first: a
  // thread's next item then reads a prefix of the keys its previous one left in its L2 (5 chunks of ~410 tokens,
  // 1 thread: 13.5 ms against 14.2 with all items sorted by cost alone), and the cheapest items come last.
  std::vector<Item> items;
  for (const int64_t c : order) {
    const int64_t qlen = starts[c + 1] - starts[c];
    for (int64_t h = 0; h < HKV; ++h) {
      for (int64_t t0 = (qlen - 1) / bq * bq; t0 >= 0; t0 -= bq) items.push_back({c, h, t0, std::min(bq, qlen - t0)});
    }
  }
  if (items.empty()) return;
  const int64_t R = (bq * G + kRowAlign - 1) / kRowAlign * kRowAlign;
  const bool bf16 = kv_cache.scalar_type() == at::kBFloat16;
  const int64_t half = num_blocks * BS * HKV * D;  // elements of K before V
  const float* kp = bf16 ? nullptr : kv_cache.data_ptr<float>();
  const at::BFloat16* kb = bf16 ? kv_cache.data_ptr<at::BFloat16>() : nullptr;
  const PrefillArgs args{q.data_ptr<float>(), kp, bf16 ? nullptr : kp + half, kb, bf16 ? kb + half : nullptr,
                         block_tables.data_ptr<int32_t>(), lens, starts, out.data_ptr<float>(), q.stride(0),
                         out.stride(0), H, D, G, BS, num_blocks, max_blocks, HKV * D, static_cast<float>(scale)};
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch w(R, D);
    for (int64_t i = next++; i < n_items; i = next++) {
      const Item& it = items[i];
      attend(args, it, (it.nq * G + kRowAlign - 1) / kRowAlign * kRowAlign, w);
    }
  });
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, float scale) -> ()");
  // Whether a bf16 cache (even head_dim) runs the AVX-512 BF16 dot-product kernels (prefill_bf16.h).
  m.def("prefill_bf16_dot_products() -> bool", []() { return kDp; });
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("paged_prefill_attention", &pagoda::paged_prefill_attention); }
