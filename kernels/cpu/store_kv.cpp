// The write of a step's new K/V into their slots of the paged KV cache on CPUs (float32 or bf16, rounded to nearest
// even as torch's .to(bfloat16)); decode attention (paged_attention.cpp) and prefill attention read them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>

namespace {

// kv_cache[0|1] rows <- k|v for tokens [t0, t1), each at its slot; slots < 0 (padding) are skipped.
template <typename T>
void store_rows(T* kc, T* vc, const float* kp, const float* vp, int64_t ks, int64_t vs, const int64_t* slots,
                int64_t row, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    // NOTE: to bf16 by round-to-nearest-even (c10::BFloat16's conversion, as torch's .to(bfloat16))
    std::copy(kp + t * ks, kp + t * ks + row, kc + slot * row);
    std::copy(vp + t * vs, vp + t * vs + row, vc + slot * row);
  }
}

}  // namespace

namespace pagoda {

void store_kv(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "store_kv: k and v must be float32");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "store_kv: the KV cache must be float32 or bfloat16");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "store_kv: int64 slots");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(), "store_kv: bad cache");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2), HKV = kv_cache.size(3), D = kv_cache.size(4);
  const int64_t T = slot_mapping.numel(), row = HKV * D;
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(0) >= T && x->size(1) == HKV && x->size(2) == D && x->stride(2) == 1 &&
                    x->stride(1) == D,
                "store_kv: k/v must be [tokens, kv_heads, head_dim] with packed heads");
  }
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "store_kv: slot out of range");
  }
  const bool bf16 = kv_cache.scalar_type() == at::kBFloat16;
  // NOTE: parallel: the first write to a slot's page of the lazily-mapped cache (engine_core/host_memory.py) is a
  // page fault, which dominates this copy in a prefill chunk (measured: ~10 ms per layer for 2,048 fresh tokens on
  // one thread); faults on both cores overlap. Small steps (decode rows) stay on the calling thread.
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    if (bf16) {
      at::BFloat16* kc = kv_cache.data_ptr<at::BFloat16>();
      store_rows(kc, kc + num_slots * row, kp, vp, ks, vs, slots, row, t0, t1);
    } else {
      float* kc = kv_cache.data_ptr<float>();
      store_rows(kc, kc + num_slots * row, kp, vp, ks, vs, slots, row, t0, t1);
    }
  });
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("store_kv(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("store_kv", &pagoda::store_kv); }
