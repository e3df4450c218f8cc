// Paged decode attention on CPU: each (sequence, kv head) walks its block table and reads K and
// V straight from the cache rows (no gather into a padded copy), for all G query heads that
// share the kv head at once. The semantics are kernels/paged_attention_reference.py's.
//
// S sequences, Hq query heads, Hk kv heads (G = Hq / Hk), Dk key width, Dv value width,
// MB blocks per table. A cache row (slot = block * block_size + offset) holds the key of kv head
// h at [h * key_head_stride, + Dk) and its value at [value_offset + h * value_head_stride, + Dv):
//   GQA: key_head_stride = D, value_offset = Hk D, value_head_stride = D
//   MLA: one kv head, key = the whole row (latent + rope), value = the latent (offset 0)
// Math in fp32 whatever the storage type; one pass over the context with an online softmax.
// Built with plain flags (no torch headers) by kernels/_cpu_build.py and called
// through ctypes; no Python object is touched, so the caller can release the GIL.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/bf16.h"
#include "common/vec8.h"

namespace {

inline float dot(const float* a, const float* b, int n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float* y, float w, const float* x, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += w * x[i];
}

// e^x for x <= 0 (scores minus their maximum): x = n ln2 + r with n = x / ln2 rounded to the
// nearest integer (by adding and taking away 1.5 * 2^23) and |r| <= ln2 / 2; e^r by its Taylor
// series to r^7 (relative error < 2e-8, under fp32 rounding); 2^n from the exponent bits. The
// eight-lane version below does the same operations lane by lane, so both give the same floats.
constexpr float kShifter = 12582912.f;  // 1.5 * 2^23
constexpr float kTaylor[8] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = (x * 1.44269504089f + kShifter) - kShifter;
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;  // ln2 in two parts
  float p = kTaylor[0];
  for (int i = 1; i < 8; ++i) p = p * r + kTaylor[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Fixed head widths (DK, DV multiples of 8): eight lanes at a time (common/vec8.h).
inline void vstore(float* p, v8 v) { *reinterpret_cast<v8u*>(p) = v; }

typedef int32_t v8i __attribute__((vector_size(32)));

inline v8 exp_nonpositive(v8 x) {
  const v8 lowest = v8{} - 87.f;
  x = x < lowest ? lowest : x;
  const v8 n = (x * 1.44269504089f + kShifter) - kShifter;
  const v8 r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  v8 p = v8{} + kTaylor[0];
  for (int i = 1; i < 8; ++i) p = p * r + kTaylor[i];
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  return p * (v8)bits;  // (a cast between vector types of one size keeps the bits)
}

// sc[i] = e^(sc[i] - m) for c scores -> their sum (in lane order, then the tail in order)
inline float exponentiate(float* sc, int c, float m) {
  int i = 0;
  v8 total8 = v8{};
  for (; i + 8 <= c; i += 8) {
    const v8 e = exp_nonpositive(load(sc + i) - m);
    vstore(sc + i, e);
    total8 += e;
  }
  float total = hsum(total8);
  for (; i < c; ++i) total += (sc[i] = exp_nonpositive(sc[i] - m));
  return total;
}

// sc[i] = q . k[i] for c keys, eight (then four) at a time: one key's dot product is a chain of
// D / 8 dependent additions, so several keys in flight keep the FMA units busy where one would
// wait on each addition's latency.
template <int D, int N>
inline void scores_n(const float* q, const float* const* k, float* sc) {
  v8 acc[N];
  for (int n = 0; n < N; ++n) acc[n] = v8{};
  for (int d = 0; d < D; d += 8) {
    const v8 qv = load(q + d);
    for (int n = 0; n < N; ++n) acc[n] += qv * load(k[n] + d);
  }
  for (int n = 0; n < N; ++n) sc[n] = hsum(acc[n]);
}

template <int D>
inline void scores(const float* q, const float* const* k, int c, float* sc) {
  int i = 0;
  for (; i + 8 <= c; i += 8) scores_n<D, 8>(q, k + i, sc + i);
  for (; i + 4 <= c; i += 4) scores_n<D, 4>(q, k + i, sc + i);
  for (; i < c; ++i) scores_n<D, 1>(q, k + i, sc + i);
}

// o = o * alpha + sum over i of p[i] v[i], 64 lanes of o at a time held in registers across the
// block's keys (an update through memory per key would wait on the store of the one before; eight
// independent chains cover the FMA latency).
template <int D>
inline void add_values(float* o, float alpha, const float* const* v, const float* p, int c) {
  constexpr int kLanes = D < 64 ? D : 64;
  for (int d0 = 0; d0 < D; d0 += kLanes) {
    v8 acc[kLanes / 8];
    for (int r = 0; r < kLanes / 8; ++r) acc[r] = alpha != 1.f ? load(o + d0 + 8 * r) * alpha : load(o + d0 + 8 * r);
    for (int i = 0; i < c; ++i) {
      const v8 pi = v8{} + p[i];
      for (int r = 0; r < kLanes / 8; ++r) acc[r] += pi * load(v[i] + d0 + 8 * r);
    }
    for (int r = 0; r < kLanes / 8; ++r) vstore(o + d0 + 8 * r, acc[r]);
  }
}

// Loads n values at src as fp32: a pointer into the cache itself for fp32, else a converted copy.
inline const float* as_float(const float* src, float* /*buf*/, int /*n*/) { return src; }
inline const float* as_float(const uint16_t* src, float* buf, int n) {
  for (int i = 0; i < n; ++i) buf[i] = to_float(src[i]);
  return buf;
}

struct Args {
  const void* q; int64_t q_stride_s, q_stride_h;
  const void* cache; int64_t row_stride, num_slots;
  const int32_t* block_tables; int64_t table_stride, table_width;
  const int32_t* context_lens;
  void* out; int64_t out_stride_s, out_stride_h;
  int32_t num_seqs, num_q_heads, num_kv_heads, dk, dv;
  int32_t key_head_stride, value_offset, value_head_stride;
  int32_t block_size, window;
  float scale;
};

// Query heads [h0, h1) of sequence s (whole kv-head groups). One cache block at a time, as
// flash attention does with its tiles: scores of the block's positions, an online-softmax update
// of each head's running maximum / sum / accumulator, then the block's values, read while the
// block's rows (consecutive slots) are still in L1. Every row is fetched from memory once.
// DK, DV > 0: head widths known at compile time (32 / 64 / 128), eight lanes at a time in
// registers (scores, exponentials, value sums); 0: read from a, plain loops.
template <typename T, int DK, int DV>
void attend(const Args& a, int s, int h0, int h1, std::vector<float>& scratch, std::vector<const float*>& rowp) {
  const int g = a.num_q_heads / a.num_kv_heads, bs = a.block_size, nh = h1 - h0;
  const int dk = DK > 0 ? DK : a.dk, dv = DV > 0 ? DV : a.dv;
  const int len = a.context_lens[s];
  const int start = (a.window > 0 && len > a.window) ? len - a.window : 0;
  // [nh, Dk] scaled queries | [nh, Dv] accumulators | [nh] maxima | [nh] sums | [bs] scores |
  // [bs, max(Dk, Dv)] rows converted to fp32 (bfloat16 storage only)
  const int dmax = dk > dv ? dk : dv;
  scratch.resize(static_cast<size_t>(nh) * (dk + dv + 2) + bs + static_cast<size_t>(bs) * dmax);
  float* qf = scratch.data();
  float* acc = qf + nh * dk;
  float* mx = acc + nh * dv;
  float* sum = mx + nh;
  float* sc = sum + nh;
  float* buf = sc + bs;
  const T* q = static_cast<const T*>(a.q);
  const T* cache = static_cast<const T*>(a.cache);
  const int32_t* table = a.block_tables + s * a.table_stride;
  for (int j = 0; j < nh; ++j) {
    const T* qh = q + s * a.q_stride_s + (h0 + j) * a.q_stride_h;
    for (int i = 0; i < dk; ++i) qf[j * dk + i] = to_float(qh[i]) * a.scale;
    mx[j] = -INFINITY;
    sum[j] = 0.f;
  }
  std::memset(acc, 0, sizeof(float) * nh * dv);
  constexpr bool kVector = DK > 0 && DK % 8 == 0 && DV > 0 && DV % 8 == 0;
  rowp.resize(bs);  // the block's key or value rows, as fp32
  for (int b = start / bs; b * bs < len; ++b) {
    const int p0 = b * bs > start ? b * bs : start, p1 = (b + 1) * bs < len ? (b + 1) * bs : len, c = p1 - p0;
    const T* rows = cache + (static_cast<int64_t>(table[b]) * bs + p0 % bs) * a.row_stride;
    // The next block's rows are fetched into L2 while this one computes (blocks lie anywhere in
    // the cache, where no hardware prefetcher follows), a share of them per head so that the
    // requests do not all queue at once.
    const char* next = (b + 1) * bs < len
        ? reinterpret_cast<const char*>(cache + static_cast<int64_t>(table[b + 1]) * bs * a.row_stride) : nullptr;
    const int64_t next_lines = static_cast<int64_t>(bs) * a.row_stride * sizeof(T) / 64;
    for (int j = 0; j < nh; ++j) {
      if (next)
        for (int64_t l = next_lines * j / nh; l < next_lines * (j + 1) / nh; ++l) __builtin_prefetch(next + 64 * l, 0, 2);
      const int kh = (h0 + j) / g;
      const T* krow = rows + kh * a.key_head_stride;
      if constexpr (kVector) {
        for (int i = 0; i < c; ++i, krow += a.row_stride) rowp[i] = as_float(krow, buf + i * dmax, dk);
        scores<DK>(qf + j * dk, rowp.data(), c, sc);
      } else {
        for (int i = 0; i < c; ++i, krow += a.row_stride)
          sc[i] = dot(qf + j * dk, as_float(krow, buf + i * dmax, dk), dk);
      }
      float m = mx[j];
      for (int i = 0; i < c; ++i) m = sc[i] > m ? sc[i] : m;
      const float alpha = exp_nonpositive(mx[j] - m);  // 0 on the first block (-inf - m)
      float total = 0.f;
      if constexpr (kVector) {
        total = exponentiate(sc, c, m);
      } else {
#pragma omp simd reduction(+ : total)
        for (int i = 0; i < c; ++i) {
          sc[i] = exp_nonpositive(sc[i] - m);
          total += sc[i];
        }
      }
      mx[j] = m;
      sum[j] = sum[j] * alpha + total;
      float* o = acc + j * dv;
      const T* vrow = rows + a.value_offset + kh * a.value_head_stride;
      if constexpr (kVector) {
        for (int i = 0; i < c; ++i, vrow += a.row_stride) rowp[i] = as_float(vrow, buf + i * dmax, dv);
        add_values<DV>(o, alpha, rowp.data(), sc, c);
        continue;
      }
      if (alpha != 1.f) {
#pragma omp simd
        for (int i = 0; i < dv; ++i) o[i] *= alpha;
      }
      for (int i = 0; i < c; ++i, vrow += a.row_stride) axpy(o, sc[i], as_float(vrow, buf + i * dmax, dv), dv);
    }
  }
  T* out = static_cast<T*>(a.out);
  for (int j = 0; j < nh; ++j) {
    T* oh = out + s * a.out_stride_s + (h0 + j) * a.out_stride_h;
    const float inv = 1.f / sum[j];
    for (int i = 0; i < dv; ++i) store(oh + i, acc[j * dv + i] * inv);
  }
}

// -> 0, or 1 + the first sequence whose context or block ids fall outside the table or cache
// (nothing is read for any sequence then).
int32_t check(const Args& a) {
  const int64_t num_blocks = a.num_slots / a.block_size;
  for (int s = 0; s < a.num_seqs; ++s) {
    const int64_t len = a.context_lens[s];
    if (len < 1 || len > a.table_width * a.block_size) return s + 1;
    const int32_t* table = a.block_tables + s * a.table_stride;
    for (int64_t b = 0; b < (len + a.block_size - 1) / a.block_size; ++b)
      if (table[b] < 0 || table[b] >= num_blocks) return s + 1;
  }
  return 0;
}

template <typename T, int DK, int DV>
int32_t run(const Args& a, int32_t num_threads) {
  if (int32_t bad = check(a)) return bad;
  // one item per sequence; split by kv head only when there are too few sequences for the threads
  const int split = a.num_seqs < 2 * num_threads ? a.num_kv_heads : 1;
  const int per_item = a.num_q_heads / split;
  const int64_t items = static_cast<int64_t>(a.num_seqs) * split;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && items > 1)
  {
    std::vector<float> scratch;
    std::vector<const float*> rows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int h0 = static_cast<int>(it % split) * per_item;
      attend<T, DK, DV>(a, static_cast<int>(it / split), h0, h0 + per_item, scratch, rows);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16. -> 0, or 1 + the first bad sequence (see check).
int32_t batchgen_paged_decode(int32_t dtype, const void* q, int64_t q_stride_s, int64_t q_stride_h,
                              const void* cache, int64_t row_stride, int64_t num_slots,
                              const int32_t* block_tables, int64_t table_stride, int64_t table_width,
                              const int32_t* context_lens, void* out, int64_t out_stride_s, int64_t out_stride_h,
                              int32_t num_seqs, int32_t num_q_heads, int32_t num_kv_heads, int32_t dk, int32_t dv,
                              int32_t key_head_stride, int32_t value_offset, int32_t value_head_stride,
                              int32_t block_size, int32_t window, float scale, int32_t num_threads) {
  const Args a{q, q_stride_s, q_stride_h, cache, row_stride, num_slots, block_tables, table_stride, table_width,
               context_lens, out, out_stride_s, out_stride_h, num_seqs, num_q_heads, num_kv_heads, dk, dv,
               key_head_stride, value_offset, value_head_stride, block_size, window, scale};
  const int same = dk == dv ? dk : 0;
  if (dtype == 0) {
    if (same == 32) return run<float, 32, 32>(a, num_threads);
    if (same == 64) return run<float, 64, 64>(a, num_threads);
    if (same == 128) return run<float, 128, 128>(a, num_threads);
    return run<float, 0, 0>(a, num_threads);
  }
  if (same == 64) return run<uint16_t, 64, 64>(a, num_threads);
  if (same == 128) return run<uint16_t, 128, 128>(a, num_threads);
  return run<uint16_t, 0, 0>(a, num_threads);
}

int32_t batchgen_abi_version() { return 1; }
}
