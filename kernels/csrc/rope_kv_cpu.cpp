// Rotary embedding of q and k plus the KV cache write, in one pass over the qkv projection:
// the CPU replacement of rotate(q), rotate(k), cat(k, v), cache.index_copy_(slots, kv).
//
// T tokens, Hq query heads, Hk kv heads, D head dim, R rotated channels per head (R <= D, even).
// qkv: [T, (Hq + 2 Hk) D] (q heads, k heads, v heads); cos, sin: [T, R/2] fp32 (attention factor
// folded in); slots: [T]. Writes q_out [T, Hq, D], kv_out [T, 2 Hk D] (rotated k, then v) and
// the cache row of each token's slot. Bit-identical to batchgen's RotaryEmbedding.apply: fp32
// products rounded one at a time, so this file is built with -ffp-contract=off (no FMA).
#include <cstdint>
#include <cstring>

#include "common/bf16.h"

namespace {

// One head: out[:R] rotated (half-split or interleaved pairs), out[R:] copied.
template <typename T>
inline void rotate(const T* x, T* out, const float* cos, const float* sin, int d, int r, bool interleaved) {
  const int half = r / 2;
  if (interleaved) {
    for (int i = 0; i < half; ++i) {
      const float x1 = to_float(x[2 * i]), x2 = to_float(x[2 * i + 1]);
      store(out + 2 * i, x1 * cos[i] - x2 * sin[i]);
      store(out + 2 * i + 1, x1 * sin[i] + x2 * cos[i]);
    }
  } else {
    for (int i = 0; i < half; ++i) {
      const float x1 = to_float(x[i]), x2 = to_float(x[half + i]);
      store(out + i, x1 * cos[i] - x2 * sin[i]);
      store(out + half + i, x2 * cos[i] + x1 * sin[i]);
    }
  }
  if (d > r) std::memcpy(out + r, x + r, sizeof(T) * (d - r));
}

template <typename T>
int64_t run(const void* qkv_, int64_t qkv_stride, const float* cos, const float* sin, const int64_t* slots,
            void* q_out_, void* kv_out_, void* cache_, int64_t cache_stride, int64_t num_slots, int32_t num_tokens,
            int32_t hq, int32_t hk, int32_t d, int32_t r, int32_t interleaved, int32_t num_threads) {
  for (int t = 0; t < num_tokens; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return t + 1;
  const T* qkv = static_cast<const T*>(qkv_);
  T* q_out = static_cast<T*>(q_out_);
  T* kv_out = static_cast<T*>(kv_out_);
  T* cache = static_cast<T*>(cache_);
  const int half = r / 2, w = 2 * hk * d;
  // tokens are independent (each writes its own q, kv and cache rows): a prompt step's
  // thousands split over the threads; a decode step's few stay on one (no fork to pay)
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && num_tokens >= 64)
  for (int t = 0; t < num_tokens; ++t) {
    const T* row = qkv + t * qkv_stride;
    const float* c = cos + static_cast<int64_t>(t) * half;
    const float* s = sin + static_cast<int64_t>(t) * half;
    for (int h = 0; h < hq; ++h) rotate(row + h * d, q_out + (static_cast<int64_t>(t) * hq + h) * d, c, s, d, r, interleaved);
    T* kv = kv_out + static_cast<int64_t>(t) * w;
    for (int h = 0; h < hk; ++h) rotate(row + (hq + h) * d, kv + h * d, c, s, d, r, interleaved);
    std::memcpy(kv + hk * d, row + (hq + hk) * d, sizeof(T) * hk * d);
    std::memcpy(cache + slots[t] * cache_stride, kv, sizeof(T) * w);
  }
  return 0;
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16 (qkv, outputs and cache alike); num_threads: at most this many
// (torch's intra-op count). -> 0, or 1 + the first token whose slot is outside the cache
// (nothing written then).
int64_t batchgen_rope_kv_write(int32_t dtype, const void* qkv, int64_t qkv_stride, const float* cos,
                               const float* sin, const int64_t* slots, void* q_out, void* kv_out, void* cache,
                               int64_t cache_stride, int64_t num_slots, int32_t num_tokens, int32_t hq, int32_t hk,
                               int32_t d, int32_t r, int32_t interleaved, int32_t num_threads) {
  return dtype == 0 ? run<float>(qkv, qkv_stride, cos, sin, slots, q_out, kv_out, cache, cache_stride, num_slots,
                                 num_tokens, hq, hk, d, r, interleaved, num_threads)
                    : run<uint16_t>(qkv, qkv_stride, cos, sin, slots, q_out, kv_out, cache, cache_stride, num_slots,
                                    num_tokens, hq, hk, d, r, interleaved, num_threads);
}

int32_t batchgen_abi_version() { return 1; }
}
