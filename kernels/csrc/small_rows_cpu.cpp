// Products with few rows on CPU: the decode tail's expert layers and dense projections.
//
// With 1-32 rows a GEMM is a matrix-vector product in disguise, bound by reading the weights
// once. Measured on 2 AVX2 cores, sgemm streamed them at 3-10 GB/s on one thread and gained
// nothing from the second, against 13.5 / 26.7 GB/s of plain reads on one / two threads. Here
// every thread streams its own weight rows once, prefetching the rows it reads next, so the
// weights stream in while it computes. Up to kPanelRows rows, each dot product reads a weight
// row from memory, then the other rows of x from cache (row_dots). With more rows the products
// are bound by the multiply-adds: x is packed into panels of eight rows, transposed, and each
// weight element is broadcast against eight rows at once (panel_dots), a tile that needs about
// half the cache traffic per multiply-add: 140-170 GFLOP/s on two AVX2 cores, 70-89 on one, past
// sgemm's rate on these shapes (which packs the weights again on every call) up to hundreds of
// rows. How many rows the callers send is theirs to decide (cpu_small_rows.py).
//
// batchgen_moe_small_rows: E experts, K hidden, N expert width, R routed rows sorted by expert
// (starts[e]..starts[e+1]). x: [R, K]; w13: [E, 2N, K] (gate rows, then up rows); w2: [E, K, N];
// y: [R, K]. h = silu(x w_gate^T) * (x w_up^T), y = h w2^T, for the experts flagged in `take`;
// all experts' rows are split over the threads at once.
//
// batchgen_moe_routed_small_rows: the whole routed layer in one call, for the decode tail, where
// the ~25 torch operators around the kernel (sort the slots by expert, gather, weight, scatter,
// sum over the choices) cost more than the kernel itself at a few rows. x: [T, K]; ids, weights:
// [T, A] (int64 expert per choice, outside [0, E): unrouted; fp32 weight); out: [T, K] =
// sum over a of weights[t, a] * expert(ids[t, a]) applied to x[t]. The slots are ordered by
// expert and, within one, by slot (a stable sort, as the grouped path's argsort); each slot's
// output is rounded times its weight, then the choices are summed in order from zero, as that
// path's slot sum: the same floats as the kernel called through it.
//
// batchgen_moe_routed_tiled: batchgen_moe_routed_small_rows on experts stored in tiles of L lanes
// (every row count, no limit): w13t [E, 2N / L, K, L] and w2t [E, K / L, N, L], each weight
// matrix's rows taken L at a time and interleaved (tile[k * L + lane] = w[L p + lane][k]); N and K
// multiples of L. L is 8, or 16 in a build with AVX-512 (batchgen_tile_lanes). One tile reads them
// (tiled_dots): an x element broadcast against L weight rows' lanes, rows of x never padded.
// Measured against the plain layout's kernel (8 experts of 1024 x 1024 read from memory, 2 AVX2
// threads, equal rows per expert, L = 8): 1.13-1.15x at 1-8 rows, 1.09-1.33x at 9-17, level at 24,
// 1.04-1.14x at 32-512. Every output is one chain of fused multiply-adds over k, summed in the same
// order whatever rows surround it and whatever L: a row's result never depends on its batch.
//
// batchgen_linear_small_rows: x: [M, K] (row stride ldx), w: [Nout, K], bias: [Nout] or null;
// y: [M, Nout] = x w^T + bias.
//
// batchgen_linear_tiled: the same product with w in tiles of L lanes ([Nout / L, K, L], as the
// experts'), at every row count: the experts' tile, blocks of three tiles over the threads, each
// prefetching the next block's weights as it computes. One chain of multiply-adds over k per
// output, as for the experts: a row's result never depends on its batch.
//
// Each output element is one dot product summed in a fixed order that does not depend on the
// other rows' values: a row's result is the same whatever it is batched with, as long as the
// product has rows on the same side of kPanelRows (the two tiles sum in different orders: eight
// partial sums over k then a fixed tree, against one chain over k).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

// Short weight rows (a dot product of at most kPrefetchLen) are fetched kPrefetch floats ahead
// in software: a row of 1-2 KiB ends before the hardware prefetcher has followed it. Measured
// with 2 experts' rows streamed from memory (2 threads): 1.4-1.85x at width 256 and 1.1-1.2x at
// 512 for 1-8 rows; none at 1024; a 5% loss at 4096, so longer rows are prefetched one group of
// rows ahead instead (dots_rows).
constexpr int kPrefetch = 1024;
constexpr int kPrefetchLen = 512;

inline v8 load(const float* p) { return *reinterpret_cast<const v8u*>(p); }

// Scratch kept between calls by the thread that asks for it, up to kKeptFloats a buffer. At prompt
// sizes the routed layer's scratch is tens of MiB, and a fresh allocation that size is a fresh
// mapping whose pages fault in, zeroed, on every call: measured 10% of a layer at 512 rows an
// expert (8 experts of 1024 x 1024).
struct Scratch {
  std::unique_ptr<float[]> kept;
  int64_t size = 0;
};
constexpr int64_t kKeptFloats = int64_t{16} << 20;  // 64 MiB

// -> room for `floats` floats: `scratch`'s buffer (grown as needed) up to kKeptFloats, past it a
// buffer of the call's own in `spill`, freed with it.
inline float* room(Scratch& scratch, int64_t floats, std::unique_ptr<float[]>& spill) {
  if (floats > kKeptFloats) {
    spill.reset(new float[floats]);
    return spill.get();
  }
  if (floats > scratch.size) {
    scratch.kept.reset(new float[floats]);
    scratch.size = floats;
  }
  return scratch.kept.get();
}

inline float hsum(v8 v) {
  const float a = (v[0] + v[4]) + (v[2] + v[6]);
  const float b = (v[1] + v[5]) + (v[3] + v[7]);
  return a + b;
}

// out[i * ldo + j] = dot(x row i, w[j]) for M rows of x (stride ldx) and NW weight rows of K.
template <int M, int NW>
inline void dots(const float* x, int64_t ldx, const float* const* w, int k_len, float* out, int64_t ldo,
                 int64_t ahead) {
  v8 acc[M][NW];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NW; ++j) acc[i][j] = v8{};
  const bool short_rows = k_len <= kPrefetchLen;
  int k = 0;
  for (; k + 8 <= k_len; k += 8) {
    // (a prefetch past the weights' end is harmless: it never faults)
    if (short_rows)
      for (int j = 0; j < NW; ++j) __builtin_prefetch(w[j] + k + kPrefetch);
    else if (ahead && (k & 15) == 0)  // one prefetch per 64-byte line
      for (int j = 0; j < NW; ++j) __builtin_prefetch(w[j] + k + ahead);
    v8 wv[NW];
    for (int j = 0; j < NW; ++j) wv[j] = load(w[j] + k);
    for (int i = 0; i < M; ++i) {
      const v8 xv = load(x + i * ldx + k);
      for (int j = 0; j < NW; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NW; ++j) {
      float s = hsum(acc[i][j]);
      for (int t = k; t < k_len; ++t) s += x[i * ldx + t] * w[j][t];
      out[i * ldo + j] = s;
    }
}

// All m rows (any m) against NW weight rows, four rows of x at a time: the weight rows are read
// from memory by the first group and from cache by the others.
template <int NW>
inline void dots_rows(const float* x, int64_t ldx, int m, const float* const* w, int k_len, float* out,
                      int64_t ldo) {
  // Long weight rows: the first group of x rows reads the weight rows from memory; it also
  // prefetches the same offsets NW rows on (the next group's rows, contiguous), so those stream
  // in while the other groups compute from cache. (Each long row starts a new page, where the
  // hardware prefetcher stops.) Short rows keep the fixed distance in every group (dots).
  const int64_t ahead = static_cast<int64_t>(NW) * k_len;
  int i = 0;
  for (; i + 4 <= m; i += 4) dots<4, NW>(x + i * ldx, ldx, w, k_len, out + i * ldo, ldo, i == 0 ? ahead : 0);
  const int64_t last = i == 0 ? ahead : 0;
  switch (m - i) {
    case 3: dots<3, NW>(x + i * ldx, ldx, w, k_len, out + i * ldo, ldo, last); break;
    case 2: dots<2, NW>(x + i * ldx, ldx, w, k_len, out + i * ldo, ldo, last); break;
    case 1: dots<1, NW>(x + i * ldx, ldx, w, k_len, out + i * ldo, ldo, last); break;
    default: break;
  }
}

// All M rows of x against the n weight rows at w (K apart), NW weight rows at a time: one pass
// over the weights, each read from memory while all rows use it.
template <int M, int NW>
inline void one_pass(const float* x, int64_t ldx, const float* w, int k_len, int n, float* out, int64_t ldo) {
  int c = 0;
  for (; c + NW <= n; c += NW) {
    const float* wr[NW];
    for (int j = 0; j < NW; ++j) wr[j] = w + static_cast<int64_t>(c + j) * k_len;
    dots<M, NW>(x, ldx, wr, k_len, out + c, ldo, static_cast<int64_t>(NW) * k_len);
  }
  for (; c < n; ++c) {
    const float* wr[1] = {w + static_cast<int64_t>(c) * k_len};
    dots<M, 1>(x, ldx, wr, k_len, out + c, ldo, k_len);
  }
}

// out[i * ldo + c] = dot(x row i, w row c) for the n consecutive weight rows at w (K apart), x in
// rows (at most kPanelRows of them). Up to four rows and at eight, three weight rows at a time:
// 4 x 3 accumulators, the weight and x registers fill AVX2's sixteen (eight rows in two passes,
// the second from cache). Five to seven rows take one pass, 5-6 x 2 and 7 x 1 accumulators: the
// two passes spent the second's multiply-adds after the first's reads, and one pass took
// 1.11-1.21x less time at 5-6 rows and 1.00-1.08x at 7 (8 experts of 1024 x 1024 read from
// memory, 2 threads); at eight rows 8 x 1 (nine loads for eight multiply-adds) was 0.92x the two
// passes. Every output is the same sum in either (eight partial sums over k, then a fixed tree).
inline void row_dots(const float* x, int64_t ldx, int m, const float* w, int k_len, int n, float* out,
                       int64_t ldo) {
  switch (m) {
    case 5: return one_pass<5, 2>(x, ldx, w, k_len, n, out, ldo);
    case 6: return one_pass<6, 2>(x, ldx, w, k_len, n, out, ldo);
    case 7: return one_pass<7, 1>(x, ldx, w, k_len, n, out, ldo);
    default: break;
  }
  int c = 0;
  for (; c + 3 <= n; c += 3) {
    const float* wr[3] = {w + static_cast<int64_t>(c) * k_len, w + static_cast<int64_t>(c + 1) * k_len,
                          w + static_cast<int64_t>(c + 2) * k_len};
    dots_rows<3>(x, ldx, m, wr, k_len, out + c, ldo);
  }
  if (n - c == 2) {
    const float* wr[2] = {w + static_cast<int64_t>(c) * k_len, w + static_cast<int64_t>(c + 1) * k_len};
    dots_rows<2>(x, ldx, m, wr, k_len, out + c, ldo);
  } else if (n - c == 1) {
    const float* wr[1] = {w + static_cast<int64_t>(c) * k_len};
    dots_rows<1>(x, ldx, m, wr, k_len, out + c, ldo);
  }
}

// Rows of x are packed into panels of kLanes rows, transposed and zero-padded: panel[k * kLanes
// + lane] = x[lane][k]. A tile multiplies NR weight rows (each element broadcast) by NV panels:
// NR x NV vectors of accumulators, one chain of fused multiply-adds over k per output, so every
// result is the same sum in the same order whichever lanes, panels or rows surround it.
constexpr int kLanes = 8;

inline int64_t padded(int64_t m) { return (m + kLanes - 1) / kLanes * kLanes; }

// Panel p of x's m rows (row stride ldx): kLanes rows, those past m zero.
void pack_panel(const float* x, int64_t ldx, int m, int k_len, int p, float* panels) {
  float* dst = panels + static_cast<int64_t>(p) * k_len * kLanes;
  const int rows = m - p * kLanes < kLanes ? m - p * kLanes : kLanes;
  const float* src[kLanes];
  for (int l = 0; l < rows; ++l) src[l] = x + (static_cast<int64_t>(p) * kLanes + l) * ldx;
  int k = 0;
#if defined(__AVX__)
  if (rows == kLanes)  // eight by eight blocks through registers
    for (; k + 8 <= k_len; k += 8) {
      __m256 r[8], t[8];
      for (int l = 0; l < 8; ++l) r[l] = _mm256_loadu_ps(src[l] + k);
      for (int l = 0; l < 8; l += 2) {
        t[l] = _mm256_unpacklo_ps(r[l], r[l + 1]);
        t[l + 1] = _mm256_unpackhi_ps(r[l], r[l + 1]);
      }
      for (int l = 0; l < 8; l += 4)
        for (int h = 0; h < 2; ++h) {
          r[l + 2 * h] = _mm256_shuffle_ps(t[l + h], t[l + h + 2], _MM_SHUFFLE(1, 0, 1, 0));
          r[l + 2 * h + 1] = _mm256_shuffle_ps(t[l + h], t[l + h + 2], _MM_SHUFFLE(3, 2, 3, 2));
        }
      // r[c], r[c + 4]: columns c and c + 4 of rows 0-3 and of rows 4-7, in their two halves
      for (int c = 0; c < 4; ++c) {
        float* d = dst + static_cast<int64_t>(k) * kLanes;
        _mm256_storeu_ps(d + kLanes * c, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
        _mm256_storeu_ps(d + kLanes * (c + 4), _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
      }
    }
#endif
  for (; k < k_len; ++k)
    for (int l = 0; l < kLanes; ++l) dst[static_cast<int64_t>(k) * kLanes + l] = l < rows ? src[l][k] : 0.f;
}

// out[(8 v + lane) * ldo + j] = sum over k of w[j][k] * panel v's lane, for the lanes below rows
// (counted from panel 0). `ahead`: prefetch the weights that far on into L2 (0: none).
template <int NR, int NV>
inline void tile(const float* panel, int64_t panel_stride, const float* const* w, int k_len, float* out, int64_t ldo,
                 int rows, int64_t ahead) {
  v8 acc[NR][NV];
  for (int j = 0; j < NR; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = v8{};
  for (int k = 0; k < k_len; ++k) {
    if (ahead && (k & 15) == 0)
      for (int j = 0; j < NR; ++j) __builtin_prefetch(w[j] + k + ahead, 0, 1);
    v8 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(panel + v * panel_stride + static_cast<int64_t>(k) * kLanes);
    for (int j = 0; j < NR; ++j) {
      const float s = w[j][k];
      const v8 a = {s, s, s, s, s, s, s, s};
      for (int v = 0; v < NV; ++v) acc[j][v] += a * b[v];
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int l = 0; l < kLanes && v * kLanes + l < rows; ++l)
      for (int j = 0; j < NR; ++j) out[(v * kLanes + l) * ldo + j] = acc[j][v][l];
}

// NR weight rows at w (K apart) against the panels from p0 on, NV at a time (the m rows' panels
// split into groups: `groups` of NV panels); the first group reads the weight rows from memory
// and prefetches the next NR rows at the same offsets.
template <int NR, int NV>
inline void tile_groups(const float* panels, int m, int p0, int groups, const float* w, int k_len, float* out,
                        int64_t ldo) {
  const float* wr[NR];
  for (int j = 0; j < NR; ++j) wr[j] = w + static_cast<int64_t>(j) * k_len;
  const int64_t stride = static_cast<int64_t>(k_len) * kLanes;
  for (int g = 0; g < groups; ++g) {
    const int p = p0 + g * NV;
    tile<NR, NV>(panels + p * stride, stride, wr, k_len, out + static_cast<int64_t>(p) * kLanes * ldo, ldo,
                 m - p * kLanes, g == 0 ? static_cast<int64_t>(NR) * k_len : 0);
  }
}

// n weight rows, NR at a time, then the rest in one narrower tile.
template <int NR, int NV>
inline void rows_in_tiles(const float* panels, int m, int p0, int groups, const float* w, int k_len, int n,
                          float* out, int64_t ldo) {
  int c = 0;
  for (; c + NR <= n; c += NR)
    tile_groups<NR, NV>(panels, m, p0, groups, w + static_cast<int64_t>(c) * k_len, k_len, out + c, ldo);
  if constexpr (NR > 1)
    if (c < n)
      rows_in_tiles<NR - 1, NV>(panels, m, p0, groups, w + static_cast<int64_t>(c) * k_len, k_len, n - c, out + c,
                                ldo);
}

// out[i * ldo + c] = dot(x row i, w row c) for the n consecutive weight rows at w (K apart), x
// given as panels of its m rows (more than kPanelRows). Tiles of 12 accumulators where they fill
// up (with the operands, 15 of AVX2's 16 registers): 6 weight rows x 2 panels, and for an odd
// number of panels 4 x 3 on the last three (m > kPanelRows makes at least two panels).
inline void panel_dots(const float* panels, int m, const float* w, int k_len, int n, float* out, int64_t ldo) {
  const int p = static_cast<int>((m + kLanes - 1) / kLanes);
  const int pairs = p % 2 ? (p - 3) / 2 : p / 2;
  if (pairs) rows_in_tiles<6, 2>(panels, m, 0, pairs, w, k_len, n, out, ldo);
  if (p % 2) rows_in_tiles<4, 3>(panels, m, 2 * pairs, 1, w, k_len, n, out, ldo);
}

// Memory the caller wants in L2 by the time it is needed (the next work item's weights): `lines`
// cache lines from `at`, prefetched a few at a time between a tile's multiply-adds.
struct Ahead {
  const char* at = nullptr;
  int64_t lines = 0;
};

// The Ahead of `rows` weight rows of `len` elements from w.
template <typename T>
inline Ahead weights_ahead(const T* w, int rows, int len) {
  return {reinterpret_cast<const char*>(w), (static_cast<int64_t>(rows) * len * static_cast<int64_t>(sizeof(T)) + 63) / 64};
}

// A tiled kernel's registers, by its tiles' lanes (weight rows a tile interleaves): eight on AVX2
// (ymm: RM x NV = 4 x 3 accumulators, the weight and x registers fill its sixteen), sixteen where
// AVX-512 is built in (zmm: 8 x 3 accumulators of its 32 registers). The sixteen-lane tiles
// measured 1.04-1.14x the eight-lane ones at 5-64 rows an expert, 1.02x at 512 (8 experts of
// 1024 x 1024 from memory, 2 threads, Zen 4, builds alternated), 1.05x on a benchmark job's decode
// calls replayed: about the same multiply-add rate (Zen 4 runs a zmm multiply-add as two ymm
// halves), from half the instructions and loads. 12 x 2 was 0.86-0.89x, 5 x 4 and 7 x 3 level or
// worse. The outputs are the same floats either way: one chain of multiply-adds over k for each.
template <int L>
struct TileShape;
template <>
struct TileShape<8> {
  typedef float vec __attribute__((vector_size(32)));
  typedef float vec_u __attribute__((vector_size(32), aligned(4), may_alias));
  static constexpr int rows = 4, tiles = 3;
};
#if defined(__AVX512F__)
constexpr int kWidestLanes = 16;
template <>
struct TileShape<16> {
  typedef float vec __attribute__((vector_size(64)));
  typedef float vec_u __attribute__((vector_size(64), aligned(4), may_alias));
  static constexpr int rows = 8, tiles = 3;
};
#else
constexpr int kWidestLanes = 8;
#endif

// out[r * ldo + c] = dot(x row r, weight row c) for RM rows of x (row stride ldx) and the n <= L NV
// weight rows of NV tiles (each k_len x L, consecutive): each x element broadcast against a tile's
// L rows. ahead's lines are spread evenly over the k loop.
template <int L, int RM, int NV>
inline void tiled_tile(const float* x, int64_t ldx, const float* w, int k_len, float* out, int64_t ldo, int n,
                       Ahead ahead = {}) {
  typedef typename TileShape<L>::vec vec;
  typedef typename TileShape<L>::vec_u vec_u;
  const char* next = ahead.at;
  int64_t due = 0;  // ahead.lines per k_len steps, as whole lines (Bresenham)
  vec acc[RM][NV];
  for (int r = 0; r < RM; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vec{};
  const int64_t stride = static_cast<int64_t>(k_len) * L;
  for (int k = 0; k < k_len; ++k) {
    vec b[NV];
    for (int v = 0; v < NV; ++v) b[v] = *reinterpret_cast<const vec_u*>(w + v * stride + static_cast<int64_t>(k) * L);
    for (int r = 0; r < RM; ++r) {
      const vec a = x[r * ldx + k] - vec{};  // (the element in every lane)
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
    if (ahead.lines) {
      for (due += ahead.lines; due >= k_len; due -= k_len, next += 64) __builtin_prefetch(next, 0, 2);
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int v = 0; v < NV; ++v)
      if ((v + 1) * L <= n) *reinterpret_cast<vec_u*>(out + r * ldo + v * L) = acc[r][v];
      else
        for (int l = 0; l < L && v * L + l < n; ++l) out[r * ldo + v * L + l] = acc[r][v][l];
}

// The last m < RM rows of a tiled_rows call, in one tile of m rows.
template <int L, int NV, int RM>
inline void tiled_last_rows(const float* x, int64_t ldx, int m, const float* w, int k_len, float* out, int64_t ldo,
                            int n, Ahead ahead) {
  if constexpr (RM > 1) {
    if (m < RM) return tiled_last_rows<L, NV, RM - 1>(x, ldx, m, w, k_len, out, ldo, n, ahead);
  }
  tiled_tile<L, RM, NV>(x, ldx, w, k_len, out, ldo, n, ahead);
}

// All m rows of x, TileShape<L>::rows at a time, against the NV tiles at w; ahead's lines shared
// out over the passes.
template <int L, int NV>
inline void tiled_rows(const float* x, int64_t ldx, int m, const float* w, int k_len, float* out, int64_t ldo,
                       int n, Ahead ahead) {
  constexpr int RM = TileShape<L>::rows;
  const int passes = (m + RM - 1) / RM;
  int pass = 0;
  auto share = [&]() {  // this pass's part of ahead
    const int64_t from = ahead.lines * pass / passes, to = ahead.lines * (pass + 1) / passes;
    ++pass;
    return ahead.at ? Ahead{ahead.at + 64 * from, to - from} : Ahead{};
  };
  int i = 0;
  for (; i + RM <= m; i += RM) tiled_tile<L, RM, NV>(x + i * ldx, ldx, w, k_len, out + i * ldo, ldo, n, share());
  if (i < m) tiled_last_rows<L, NV, RM - 1>(x + i * ldx, ldx, m - i, w, k_len, out + i * ldo, ldo, n, share());
}

// out[i * ldo + c] = dot(x row i, w row c) for the n (a multiple of L, at most 3 L) weight rows
// whose tiles start at w; ahead prefetched meanwhile.
template <int L>
inline void tiled_dots(const float* x, int64_t ldx, int m, const float* w, int k_len, int n, float* out,
                       int64_t ldo, Ahead ahead = {}) {
  static_assert(TileShape<L>::tiles == 3, "a block is three tiles");
  switch ((n + L - 1) / L) {
    case 3: return tiled_rows<L, 3>(x, ldx, m, w, k_len, out, ldo, n, ahead);
    case 2: return tiled_rows<L, 2>(x, ldx, m, w, k_len, out, ldo, n, ahead);
    default: return tiled_rows<L, 1>(x, ldx, m, w, k_len, out, ldo, n, ahead);
  }
}

constexpr int kBlock = 24;  // weight rows per work item (tiled: three tiles, 3 L)
// From this many rows an expert, a tiled work item prefetches the next item's weights into L2 as
// it computes (tiled_tile's Ahead): at a few rows an expert the hardware prefetcher only follows
// the block being read, so reading the weights and the multiply-adds otherwise take turns.
// Measured (8 experts of 1024 x 1024 from memory, 2 threads, Zen 4): 1.13-1.34x at 6-24 rows an
// expert, 1.03-1.12x at 32-64, level at 512; at 1-2 rows, where reading is all there is, 0.97x.
constexpr int kAheadRows = 3;
// Up to this many rows, x is read as rows (row_dots): the products are bound by reading the
// weights, which a weight vector per eight multiply-adds streams best. Above it, as panels
// (panel_dots): bound by the multiply-adds, which the broadcast tiles feed with fewer bytes of
// cache traffic each. Measured on 2 AVX2 cores, 8 experts of 1024 x 1024 and of 256 x 512: level
// at 8-12 rows; below, the panels read the weights at 15-19 GB/s against 23-27 GB/s.
constexpr int kPanelRows = 8;

// x: m rows, as rows (row stride ldx) when m <= kPanelRows, else as panels.
inline void any_dots(const float* x, int64_t ldx, int m, const float* w, int k_len, int n, float* out, int64_t ldo) {
  if (m <= kPanelRows) row_dots(x, ldx, m, w, k_len, n, out, ldo);
  else panel_dots(x, m, w, k_len, n, out, ldo);
}

// A phase's work items (an expert's block of weight rows each) split into `parts` contiguous
// ranges of about equal cost. An item costs its expert's computed rows (padded to whole panels)
// plus kBlockReadRows, rows whose multiply-adds take about as long as reading the block's
// weights from memory. Split by count, one thread could take the experts with the most rows and
// the others wait for it at the phase's end: replaying the expert layers of a decode run (8
// experts of 1024 x 1024, 2 threads), that took 1.07-1.08x longer in its steps of 17-96 rows.
// -> parts + 1 bounds, in items; item = expert's place in item_cost * blocks + block.
constexpr int64_t kBlockReadRows = 8;

std::vector<int64_t> balanced_bounds(const std::vector<int64_t>& item_cost, int64_t blocks, int parts) {
  double total = 0;
  for (int64_t c : item_cost) total += static_cast<double>(c) * blocks;
  const int64_t items = static_cast<int64_t>(item_cost.size()) * blocks;
  std::vector<int64_t> bounds(parts + 1, items);
  bounds[0] = 0;
  double sum = 0;
  int part = 1;
  for (int64_t item = 0; item < items && part < parts; ++item) {
    sum += static_cast<double>(item_cost[item / blocks]);
    while (part < parts && sum >= total * part / parts) bounds[part++] = item + 1;
  }
  return bounds;
}

struct Team {
  int me, size;
};

// This thread's place in the running parallel region's team (a team of one without OpenMP).
inline Team this_team() {
#if defined(_OPENMP)
  return {omp_get_thread_num(), omp_get_num_threads()};
#else
  return {0, 1};
#endif
}

// exp(x) of eight floats at once: x = n ln 2 + r (n whole, |r| <= ln 2 / 2, ln 2 in two parts),
// exp(r) by Cephes' expf polynomial, times 2^n written into the exponent bits; x clamped to
// [-87.3, 88.3], where 2^n stays a normal float. Hand-written rather than glibc's vector exp
// (libmvec): GCC calls that only under -ffast-math, and not every C library has it; this is the
// same arithmetic in every build. The silu below is within 2 ulp of float64's (torch's: 1.3).
inline v8 exp8(v8 x) {
  const v8 hi = v8{} + 88.3762626647949f, lo = v8{} - 87.3365447505531f;
  x = x < hi ? x : hi;
  x = x > lo ? x : lo;
  const v8 magic = v8{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to a whole number
  const v8 n = (x * 1.44269504088896341f + magic) - magic;
  const v8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  v8 p = v8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v8 y = p * (r * r) + r + 1.f;
  typedef int32_t v8i __attribute__((vector_size(32)));
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  return y * reinterpret_cast<const v8&>(bits);
}

// out[j * stride] = silu(gate[j]) * up[j] for j < n (silu(g) = g / (1 + exp(-g))): eight at a
// time, the last few through a padded vector, so every element takes the same arithmetic
// wherever it sits (a row's result never depends on its batch). Against std::exp one at a time
// (what this replaced): 1.02-1.06x the whole expert layer at 8-512 rows an expert of 1024 x 1024,
// 1.11-1.18x at 8-256 rows of 256 x 512, where the exponentials are a larger share.
inline v8 silu_times8(v8 g, v8 u) {
  const v8 s = g / (1.f + exp8(-g));
  return (g < -88.3762626647949f ? v8{} : s) * u;  // past the clamp silu is below 4e-37: zero
}

inline void silu_times(const float* gate, const float* up, int n, float* out, int64_t stride = 1) {
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 h = silu_times8(load(gate + j), load(up + j));
    if (stride == 1) *reinterpret_cast<v8u*>(out + j) = h;
    else
      for (int l = 0; l < 8; ++l) out[(j + l) * stride] = h[l];
  }
  if (j < n) {
    float g[8] = {}, u[8] = {};
    for (int l = 0; j + l < n; ++l) g[l] = gate[j + l], u[l] = up[j + l];
    const v8 h = silu_times8(load(g), load(u));
    for (int l = 0; j + l < n; ++l) out[(j + l) * stride] = h[l];
  }
}

// Expert e's work items: blocks of `block` weight rows, of its gate rows in a routed layer's first
// phase (the up block is n_len rows on) and of its w2 rows in the second; -> (first weight, rows).
// Any layout that keeps a block's rows together at row * len (plain rows or tiles).
template <typename T>
struct ExpertBlocks {
  const T* w13;
  const T* w2;
  int block, n_len, k_len, n_blocks, k_blocks;
  ExpertBlocks(const T* w13_, const T* w2_, int block_, int n_len_, int k_len_)
      : w13(w13_), w2(w2_), block(block_), n_len(n_len_), k_len(k_len_), n_blocks((n_len_ + block_ - 1) / block_),
        k_blocks((k_len_ + block_ - 1) / block_) {}
  std::pair<const T*, int> gate(int e, int64_t item) const {
    const int j0 = static_cast<int>(item % n_blocks) * block;
    return {w13 + (static_cast<int64_t>(e) * 2 * n_len + j0) * k_len, std::min(block, n_len - j0)};
  }
  std::pair<const T*, int> down(int e, int64_t item) const {
    const int c0 = static_cast<int>(item % k_blocks) * block;
    return {w2 + (static_cast<int64_t>(e) * k_len + c0) * n_len, std::min(block, k_len - c0)};
  }
};

// This thread's share of a routed layer's two phases: items bounds1[me]..bounds1[me + 1] through
// up(e, m, j0, gate weights, n, gate ahead, up ahead), a barrier, then bounds2's through down(e,
// m, c0, w2 weights, n, ahead); item = expert's place in `experts` * blocks + block. With
// `prefetch`, from kAheadRows rows an item is handed the next item's blocks (the last first-phase
// item: the second phase's first) to fetch as it computes.
template <typename T, typename Up, typename Down>
void run_phases(const ExpertBlocks<T>& b, const std::vector<int32_t>& experts, const int64_t* starts,
                const std::vector<int64_t>& bounds1, const std::vector<int64_t>& bounds2, int me, bool prefetch, Up up,
                Down down) {
  for (int64_t item = bounds1[me]; item < bounds1[me + 1]; ++item) {
    const int e = experts[item / b.n_blocks];
    const int m = static_cast<int>(starts[e + 1] - starts[e]);
    const auto [wg, n] = b.gate(e, item);
    Ahead gate_ahead, up_ahead;
    if (prefetch && m >= kAheadRows && item + 1 < bounds1[me + 1]) {
      const auto [next, rows] = b.gate(experts[(item + 1) / b.n_blocks], item + 1);
      gate_ahead = weights_ahead(next, rows, b.k_len);
      up_ahead = weights_ahead(next + static_cast<int64_t>(b.n_len) * b.k_len, rows, b.k_len);
    } else if (prefetch && m >= kAheadRows && bounds2[me] < bounds2[me + 1]) {
      const auto [next, rows] = b.down(experts[bounds2[me] / b.k_blocks], bounds2[me]);
      up_ahead = weights_ahead(next, rows, b.n_len);
    }
    up(e, m, static_cast<int>(item % b.n_blocks) * b.block, wg, n, gate_ahead, up_ahead);
  }
#pragma omp barrier
  for (int64_t item = bounds2[me]; item < bounds2[me + 1]; ++item) {
    const int e = experts[item / b.k_blocks];
    const int m = static_cast<int>(starts[e + 1] - starts[e]);
    const auto [wd, n] = b.down(e, item);
    Ahead ahead;
    if (prefetch && m >= kAheadRows && item + 1 < bounds2[me + 1]) {
      const auto [next, rows] = b.down(experts[(item + 1) / b.k_blocks], item + 1);
      ahead = weights_ahead(next, rows, b.n_len);
    }
    down(e, m, static_cast<int>(item % b.k_blocks) * b.block, wd, n, ahead);
  }
}

// h = silu(x gate^T) * (x up^T), y = h w2^T for the rows of the experts flagged in `take`
// (starts[e]..starts[e + 1]): all experts' rows split over the threads at once, by cost
// (balanced_bounds). An expert with more than kPanelRows rows has x packed into panels first, and
// h written as panels; one with fewer keeps both as rows.
// lanes > 0: w13 and w2 in tiles of that many lanes (batchgen_moe_routed_tiled), every expert
// through tiled_dots with x and h as rows, in blocks of three tiles. A block of weight rows starts
// at the same offset in either layout.
void moe_rows(int32_t num_threads, const float* x, const float* w13, const float* w2, const int64_t* starts,
              const uint8_t* take, float* y, int32_t num_experts, int32_t k_len, int32_t n_len, int lanes = 0) {
  const bool tiled = lanes > 0;
  auto as_panels = [&](int64_t m) { return !tiled && m > kPanelRows; };
  auto dots_of = [&](const float* xe, int64_t ldx, int m, const float* w, int k, int n, float* out, int64_t ldo,
                     Ahead ahead = {}) {
#if defined(__AVX512F__)
    if (lanes == 16) return tiled_dots<16>(xe, ldx, m, w, k, n, out, ldo, ahead);
#endif
    if (lanes == 8) return tiled_dots<8>(xe, ldx, m, w, k, n, out, ldo, ahead);
    any_dots(xe, ldx, m, w, k, n, out, ldo);
  };
  const int block = tiled ? 3 * lanes : kBlock;
  const ExpertBlocks<float> blocks(w13, w2, block, n_len, k_len);
  std::vector<int32_t> experts;
  std::vector<std::pair<int32_t, int32_t>> panels;  // (expert, panel) to pack
  std::vector<int64_t> at(num_experts + 1, 0);  // each expert's first row in the scratch (padded for panels)
  int64_t most = 0;  // rows of the largest expert taken
  for (int e = 0; e < num_experts; ++e) {
    const int64_t m = starts[e + 1] - starts[e];
    const bool active = take[e] && m > 0;
    if (active) experts.push_back(e), most = m > most ? m : most;
    if (active && as_panels(m))
      for (int p = 0; p < padded(m) / kLanes; ++p) panels.emplace_back(e, p);
    at[e + 1] = at[e] + (!active ? 0 : as_panels(m) ? padded(m) : m);
  }
  const int64_t active = static_cast<int64_t>(experts.size()), num_panels = static_cast<int64_t>(panels.size());
  // every entry written before it is read (the panels of x only for the packed experts)
  thread_local Scratch xp_scratch, h_scratch;
  std::unique_ptr<float[]> xp_spill, h_spill;
  float* const xp = num_panels ? room(xp_scratch, at[num_experts] * k_len, xp_spill) : nullptr;
  float* const h = room(h_scratch, at[num_experts] * n_len + 1, h_spill);
  std::vector<int64_t> item_cost(active);
  for (int64_t a = 0; a < active; ++a) {
    const int64_t m = starts[experts[a] + 1] - starts[experts[a]];
    item_cost[a] = (as_panels(m) ? padded(m) : m) + kBlockReadRows;
  }
  std::vector<int64_t> bounds1, bounds2;  // each thread's items in the two phases
  auto x_of = [&](int e) {
    return as_panels(starts[e + 1] - starts[e]) ? xp + at[e] * k_len : x + starts[e] * k_len;
  };
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    thread_local Scratch gate_up;
    std::unique_ptr<float[]> gate_up_spill;
    float *gate = room(gate_up, 2 * most * block, gate_up_spill), *up = gate + most * block;
#pragma omp for schedule(static)
    for (int64_t a = 0; a < num_panels; ++a) {
      const int e = panels[a].first;
      pack_panel(x + starts[e] * k_len, k_len, static_cast<int>(starts[e + 1] - starts[e]), k_len, panels[a].second,
                 xp + at[e] * k_len);
    }
    const Team team = this_team();
#pragma omp single
    {  // (after the packing's barrier; by the team's size, which may be smaller than asked for)
      bounds1 = balanced_bounds(item_cost, blocks.n_blocks, team.size);
      bounds2 = balanced_bounds(item_cost, blocks.k_blocks, team.size);
    }
    run_phases(
        blocks, experts, starts, bounds1, bounds2, team.me, tiled,
        [&](int e, int m, int j0, const float* wg, int n, Ahead gate_ahead, Ahead up_ahead) {  // h = silu(x gate^T) * (x up^T)
          dots_of(x_of(e), k_len, m, wg, k_len, n, gate, block, gate_ahead);
          dots_of(x_of(e), k_len, m, wg + static_cast<int64_t>(n_len) * k_len, k_len, n, up, block, up_ahead);
          float* he = h + at[e] * n_len;
          if (!as_panels(m)) {
            for (int i = 0; i < m; ++i) silu_times(gate + i * block, up + i * block, n, he + i * n_len + j0);
            return;
          }
          for (int i = 0; i < padded(m); ++i) {  // h as panels, the padding lanes zero
            float* lane = he + (i / kLanes) * static_cast<int64_t>(n_len) * kLanes + i % kLanes;
            if (i < m) silu_times(gate + i * block, up + i * block, n, lane + static_cast<int64_t>(j0) * kLanes, kLanes);
            else
              for (int j = 0; j < n; ++j) lane[static_cast<int64_t>(j0 + j) * kLanes] = 0.f;
          }
        },
        [&](int e, int m, int c0, const float* wd, int n, Ahead ahead) {  // y = h w2^T
          dots_of(h + at[e] * n_len, n_len, m, wd, n_len, n, y + starts[e] * k_len + c0, k_len, ahead);
        });
  }
}

// out[k] = sum over a of y[pos[a]][k] * weights[a] (0 where pos[a] < 0), from zero in choice
// order, each product rounded before it is added (no fused multiply-add): torch's mul_ then sum.
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void sum_choices(const float* y, const int64_t* pos, const float* weights, int num_choices, int k_len, float* out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  for (int k = 0; k < k_len; ++k) {
    float sum = 0.f;
    for (int a = 0; a < num_choices; ++a) sum += pos[a] >= 0 ? y[pos[a] * k_len + k] * weights[a] : 0.f;
    out[k] = sum;
  }
}

// The routed slots (token t's choice a is slot t * A + a) ordered by expert, stably: starts[e] is
// expert e's first place, pos[slot] the slot's place (-1: unrouted, an id outside [0, E)).
// false (nothing else meaningful) when an expert has more than max_rows slots.
bool sort_slots(const int64_t* ids, int64_t slots, int32_t num_experts, int32_t max_rows, std::vector<int64_t>& starts,
                std::vector<int64_t>& pos) {
  starts.assign(num_experts + 1, 0);
  for (int64_t s = 0; s < slots; ++s)
    if (ids[s] >= 0 && ids[s] < num_experts) ++starts[ids[s] + 1];
  for (int e = 0; e < num_experts; ++e) {
    if (starts[e + 1] > max_rows) return false;
    starts[e + 1] += starts[e];
  }
  pos.assign(slots, -1);
  std::vector<int64_t> fill(starts.begin(), starts.end() - 1);
  for (int64_t s = 0; s < slots; ++s)
    if (ids[s] >= 0 && ids[s] < num_experts) pos[s] = fill[ids[s]]++;
  return true;
}

// The routed layer (batchgen_moe_routed_small_rows, batchgen_moe_routed_tiled).
int32_t moe_routed(int32_t num_threads, const float* x, int64_t num_tokens, int32_t num_choices, const int64_t* ids,
                   const float* weights, const float* w13, const float* w2, int32_t num_experts, int32_t k_len,
                   int32_t n_len, int32_t max_rows, float* out, int lanes) {
  const int64_t slots = num_tokens * num_choices;
  std::vector<int64_t> starts, pos;
  if (!sort_slots(ids, slots, num_experts, max_rows, starts, pos)) return 1;
  const int64_t routed = starts[num_experts];
  // scratch, every entry written before it is read
  thread_local Scratch rows_scratch, y_scratch;
  std::unique_ptr<float[]> rows_spill, y_spill;
  float* const rows = room(rows_scratch, routed * k_len, rows_spill);
  float* const y = room(y_scratch, routed * k_len, y_spill);
  std::vector<uint8_t> take(num_experts);
  for (int e = 0; e < num_experts; ++e) take[e] = starts[e + 1] > starts[e];
  const bool parallel = num_threads > 1 && slots * k_len >= (1 << 15);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
  for (int64_t s = 0; s < slots; ++s)
    if (pos[s] >= 0)
      for (int k = 0; k < k_len; ++k) rows[pos[s] * k_len + k] = x[(s / num_choices) * k_len + k];
  if (routed > 0)
    moe_rows(num_threads, rows, w13, w2, starts.data(), take.data(), y, num_experts, k_len, n_len, lanes);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
  for (int64_t t = 0; t < num_tokens; ++t)
    sum_choices(y, pos.data() + t * num_choices, weights + t * num_choices, num_choices, k_len,
                out + t * k_len);
  return 0;
}

// A dense product's blocks of `block` weight rows (its Nout in steps of `block`) split over the
// threads in contiguous ranges: run(c0, n, next, next_rows) computes rows c0..c0 + n of the output
// columns into y, prefetching the next block (next_rows rows from next; 0 when this thread has
// none or m < kAheadRows); then bias (fp32, or null) is added to those columns.
template <typename Run>
void over_blocks(int32_t num_threads, int32_t m, int32_t n_out, int block, const float* bias, float* y, Run run) {
  const int64_t items = (n_out + block - 1) / block;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && items > 1)
  {
    const Team team = this_team();
    const int64_t first = items * team.me / team.size, last = items * (team.me + 1) / team.size;
    for (int64_t item = first; item < last; ++item) {
      const int c0 = static_cast<int>(item * block);
      const int n = std::min(block, n_out - c0);
      const int next = c0 + block;
      run(c0, n, next, m >= kAheadRows && item + 1 < last ? std::min(block, n_out - next) : 0);
      if (bias)
        for (int i = 0; i < m; ++i)
          for (int c = c0; c < c0 + n; ++c) y[static_cast<int64_t>(i) * n_out + c] += bias[c];
    }
  }
}

#if defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
#define BATCHGEN_HAS_BF16 1
// ---- Experts in bf16 (AVX512-BF16) --------------------------------------------------------------
// Tiles of 16 lanes whose k runs in pairs: w13 [E, 2N / 16, K / 2, 16, 2] and w2 [E, K / 16, N / 2,
// 16, 2] (tile[kp][lane][j] = w[16 p + lane][2 kp + j]), so that one vdpbf16ps multiplies a pair
// of x's elements, broadcast, against that pair of 16 weight rows and adds both products to fp32
// accumulators: twice the multiply-adds an instruction of the fp32 tile, from half the bytes.
// Measured alone (one Zen 4 core, the 8 x 3 tile in cache): 232 GFLOP/s against the fp32 tile's
// 117. x and h (silu(gate) * up) are bf16, as a bf16 model's activations are; every sum is fp32
// and is rounded to bf16 only where h is stored. The block and work split are the fp32 tiles'.
typedef uint16_t bf16;
constexpr int kBf16Lanes = 16;

#define BATCHGEN_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// out[r * ldo + c] = dot(x row r, weight row c) for RM rows of x (bf16, row stride ldx) and the
// 16 NV weight rows of NV bf16 tiles at w, fp32; ahead's lines spread over the k loop.
template <int RM, int NV>
BATCHGEN_BF16 inline void bf16_tile(const bf16* x, int64_t ldx, const bf16* w, int k_len, float* out, int64_t ldo,
                                    Ahead ahead) {
  const char* next = ahead.at;
  int64_t due = 0;
  const int pairs = k_len / 2;
  __m512 acc[RM][NV];
  for (int r = 0; r < RM; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t stride = static_cast<int64_t>(k_len) * kBf16Lanes;  // elements a tile
  for (int kp = 0; kp < pairs; ++kp) {
    __m512i b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(w + v * stride + static_cast<int64_t>(kp) * 2 * kBf16Lanes);
    for (int r = 0; r < RM; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * kp, sizeof pair);
      const __m512i a = _mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)a, (__m512bh)b[v]);
    }
    if (ahead.lines) {
      for (due += ahead.lines; due >= pairs; due -= pairs, next += 64) __builtin_prefetch(next, 0, 2);
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + r * ldo + v * kBf16Lanes, acc[r][v]);
}

template <int NV, int RM>
BATCHGEN_BF16 inline void bf16_last_rows(const bf16* x, int64_t ldx, int m, const bf16* w, int k_len, float* out,
                                         int64_t ldo, Ahead ahead) {
  if constexpr (RM > 1) {
    if (m < RM) return bf16_last_rows<NV, RM - 1>(x, ldx, m, w, k_len, out, ldo, ahead);
  }
  bf16_tile<RM, NV>(x, ldx, w, k_len, out, ldo, ahead);
}

// All m rows of x, eight at a time, against the n (16, 32 or 48) weight rows of the tiles at w;
// ahead's lines shared out over the passes.
BATCHGEN_BF16 inline void bf16_dots(const bf16* x, int64_t ldx, int m, const bf16* w, int k_len, int n, float* out,
                                    int64_t ldo, Ahead ahead) {
  constexpr int RM = 8;
  const int passes = (m + RM - 1) / RM;
  for (int pass = 0, i = 0; i < m; ++pass, i += RM) {
    const int64_t from = ahead.lines * pass / passes, to = ahead.lines * (pass + 1) / passes;
    const Ahead share = ahead.at ? Ahead{ahead.at + 64 * from, to - from} : Ahead{};
    const bf16* xi = x + i * ldx;
    float* oi = out + i * ldo;
    const int rows = m - i < RM ? m - i : RM;
    switch (n / kBf16Lanes) {
      case 3: bf16_last_rows<3, RM>(xi, ldx, rows, w, k_len, oi, ldo, share); break;
      case 2: bf16_last_rows<2, RM>(xi, ldx, rows, w, k_len, oi, ldo, share); break;
      default: bf16_last_rows<1, RM>(xi, ldx, rows, w, k_len, oi, ldo, share); break;
    }
  }
}

// dst[j] = src[j] rounded to bf16 (to nearest, ties to even), for n a multiple of 16.
BATCHGEN_BF16 void store_bf16(const float* src, int n, bf16* dst) {
  for (int j = 0; j < n; j += kBf16Lanes)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + j)));
}

// h = bf16(silu(x gate^T) * (x up^T)), y = h w2^T (fp32) for the routed rows of every expert
// (rows: bf16, sorted by expert, starts[e]..starts[e + 1]), all experts' rows split over the
// threads at once by cost, as moe_rows splits the fp32 tiles' work.
BATCHGEN_BF16 void bf16_experts(int32_t num_threads, const bf16* rows, const bf16* w13, const bf16* w2,
                                const int64_t* starts, float* y, int32_t num_experts, int32_t k_len, int32_t n_len) {
  constexpr int block = 3 * kBf16Lanes;
  const ExpertBlocks<bf16> blocks(w13, w2, block, n_len, k_len);
  std::vector<int32_t> experts;
  std::vector<int64_t> item_cost;
  int64_t most = 0;
  for (int e = 0; e < num_experts; ++e) {
    const int64_t m = starts[e + 1] - starts[e];
    if (m > 0) experts.push_back(e), item_cost.push_back(m + kBlockReadRows), most = m > most ? m : most;
  }
  const int64_t routed = starts[num_experts];
  thread_local Scratch h_scratch;
  std::unique_ptr<float[]> h_spill;  // h as bf16 in a float buffer of half as many
  bf16* const h = reinterpret_cast<bf16*>(room(h_scratch, (routed * n_len + 1) / 2, h_spill));
  std::vector<int64_t> bounds1, bounds2;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    thread_local Scratch gate_up;
    std::unique_ptr<float[]> gate_up_spill;
    float* gate = room(gate_up, 2 * most * block + block, gate_up_spill);
    float *up = gate + most * block, *silu = up + most * block;
    const Team team = this_team();
#pragma omp single
    {
      bounds1 = balanced_bounds(item_cost, blocks.n_blocks, team.size);
      bounds2 = balanced_bounds(item_cost, blocks.k_blocks, team.size);
    }
    run_phases(
        blocks, experts, starts, bounds1, bounds2, team.me, true,
        [&](int e, int m, int j0, const bf16* wg, int n, Ahead gate_ahead, Ahead up_ahead) {  // h = silu(x gate^T) * (x up^T)
          const bf16* xe = rows + starts[e] * k_len;
          bf16_dots(xe, k_len, m, wg, k_len, n, gate, block, gate_ahead);
          bf16_dots(xe, k_len, m, wg + static_cast<int64_t>(n_len) * k_len, k_len, n, up, block, up_ahead);
          for (int i = 0; i < m; ++i) {
            silu_times(gate + i * block, up + i * block, n, silu);
            store_bf16(silu, n, h + (starts[e] + i) * n_len + j0);
          }
        },
        [&](int e, int m, int c0, const bf16* wd, int n, Ahead ahead) {  // y = h w2^T
          bf16_dots(h + starts[e] * n_len, n_len, m, wd, n_len, n, y + starts[e] * k_len + c0, k_len, ahead);
        });
  }
}

// The routed layer on bf16 experts: x [T, K] bf16, out [T, K] fp32 (as sum_choices sums the
// fp32 expert outputs; the caller rounds it).
BATCHGEN_BF16 int32_t moe_routed_bf16(int32_t num_threads, const bf16* x, int64_t num_tokens, int32_t num_choices,
                                      const int64_t* ids, const float* weights, const bf16* w13, const bf16* w2,
                                      int32_t num_experts, int32_t k_len, int32_t n_len, float* out) {
  const int64_t slots = num_tokens * num_choices;
  std::vector<int64_t> starts, pos;
  sort_slots(ids, slots, num_experts, INT32_MAX, starts, pos);
  const int64_t routed = starts[num_experts];
  thread_local Scratch rows_scratch, y_scratch;
  std::unique_ptr<float[]> rows_spill, y_spill;
  bf16* const rows = reinterpret_cast<bf16*>(room(rows_scratch, (routed * k_len + 1) / 2, rows_spill));
  float* const y = room(y_scratch, routed * k_len, y_spill);
  const bool parallel = num_threads > 1 && slots * k_len >= (1 << 15);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
  for (int64_t s = 0; s < slots; ++s)
    if (pos[s] >= 0) std::memcpy(rows + pos[s] * k_len, x + (s / num_choices) * k_len, sizeof(bf16) * k_len);
  if (routed > 0) bf16_experts(num_threads, rows, w13, w2, starts.data(), y, num_experts, k_len, n_len);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
  for (int64_t t = 0; t < num_tokens; ++t)
    sum_choices(y, pos.data() + t * num_choices, weights + t * num_choices, num_choices, k_len, out + t * k_len);
  return 0;
}

// y [M, Nout] (fp32) = x [M, K] (bf16, row stride ldx) w^T + bias (fp32, or null), w in bf16
// tiles ([Nout / 16, K / 2, 16, 2]): linear_tiled's split and prefetching on the bf16 tile.
BATCHGEN_BF16 void linear_bf16(int32_t num_threads, const bf16* x, int64_t ldx, const bf16* wt, const float* bias,
                               float* y, int32_t m, int32_t k_len, int32_t n_out) {
  over_blocks(num_threads, m, n_out, 3 * kBf16Lanes, bias, y, [&](int c0, int n, int next, int next_rows) {
    const Ahead ahead = next_rows ? weights_ahead(wt + static_cast<int64_t>(next) * k_len, next_rows, k_len) : Ahead{};
    bf16_dots(x, ldx, m, wt + static_cast<int64_t>(c0) * k_len, k_len, n, y + c0, n_out, ahead);
  });
}
#endif

// y [M, Nout] = x [M, K] (row stride ldx) w^T + bias, w in tiles of `lanes` lanes ([Nout / L, K,
// L], Nout and K multiples of L): blocks of three tiles split over the threads in contiguous
// ranges, each block prefetching the next one's weights as it computes (from kAheadRows rows).
template <int L>
void linear_tiled(int32_t num_threads, const float* x, int64_t ldx, const float* wt, const float* bias, float* y,
                  int32_t m, int32_t k_len, int32_t n_out) {
  over_blocks(num_threads, m, n_out, 3 * L, bias, y, [&](int c0, int n, int next, int next_rows) {
    const Ahead ahead = next_rows ? weights_ahead(wt + static_cast<int64_t>(next) * k_len, next_rows, k_len) : Ahead{};
    tiled_dots<L>(x, ldx, m, wt + static_cast<int64_t>(c0) * k_len, k_len, n, y + c0, n_out, ahead);
  });
}

}  // namespace

extern "C" {

int32_t batchgen_abi_version() { return 1; }

// Returns 0, or 1 when m < 1 (nothing written).
int32_t batchgen_linear_small_rows(int32_t num_threads, const float* x, int64_t ldx, const float* w, const float* bias,
                                   float* y, int32_t m, int32_t k_len, int32_t n_out) {
  if (m < 1) return 1;
  const int64_t items = (n_out + kBlock - 1) / kBlock;
  std::unique_ptr<float[]> panels(m > kPanelRows ? new float[padded(m) * k_len] : nullptr);
  const int num_panels = panels ? static_cast<int>(padded(m) / kLanes) : 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && items > 1)
  {
#pragma omp for schedule(static)
    for (int p = 0; p < num_panels; ++p) pack_panel(x, ldx, m, k_len, p, panels.get());
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int c0 = static_cast<int>(item) * kBlock;
      const int n = c0 + kBlock < n_out ? kBlock : n_out - c0;
      any_dots(panels ? panels.get() : x, ldx, m, w + static_cast<int64_t>(c0) * k_len, k_len, n, y + c0, n_out);
      if (bias)
        for (int i = 0; i < m; ++i)
          for (int c = c0; c < c0 + n; ++c) y[static_cast<int64_t>(i) * n_out + c] += bias[c];
    }
  }
  return 0;
}

// Returns 0.
int32_t batchgen_moe_small_rows(int32_t num_threads, const float* x, const float* w13, const float* w2,
                                const int64_t* starts, const uint8_t* take, float* y, int32_t num_experts,
                                int32_t k_len, int32_t n_len) {
  moe_rows(num_threads, x, w13, w2, starts, take, y, num_experts, k_len, n_len);
  return 0;
}

// Returns 0, or 1 when an expert has more than max_rows rows (nothing written).
int32_t batchgen_moe_routed_small_rows(int32_t num_threads, const float* x, int64_t num_tokens, int32_t num_choices,
                                       const int64_t* ids, const float* weights, const float* w13, const float* w2,
                                       int32_t num_experts, int32_t k_len, int32_t n_len, int32_t max_rows,
                                       float* out) {
  return moe_routed(num_threads, x, num_tokens, num_choices, ids, weights, w13, w2, num_experts, k_len, n_len,
                    max_rows, out, 0);
}

// out[j] = silu(gate[j]) * up[j] for j < n, as the expert kernels compute h (their silu, for tests).
void batchgen_silu_times(int32_t n, const float* gate, const float* up, float* out) {
  silu_times(gate, up, n, out);
}

// Returns 0, or 1 when m < 1, 2 when this build has no tiles of `lanes` lanes (nothing written).
int32_t batchgen_linear_tiled(int32_t num_threads, const float* x, int64_t ldx, const float* wt, const float* bias,
                              float* y, int32_t m, int32_t k_len, int32_t n_out, int32_t lanes) {
  if (m < 1) return 1;
#if defined(__AVX512F__)
  if (lanes == 16) return linear_tiled<16>(num_threads, x, ldx, wt, bias, y, m, k_len, n_out), 0;
#endif
  if (lanes == 8) return linear_tiled<8>(num_threads, x, ldx, wt, bias, y, m, k_len, n_out), 0;
  return 2;
}

// Lanes of the widest tiles batchgen_moe_routed_tiled takes in this build: 16 with AVX-512, else 8.
int32_t batchgen_tile_lanes() { return kWidestLanes; }

// Returns 0, or 2 when this build has no tiles of `lanes` lanes (nothing written). w13t, w2t:
// tiles of 8 or 16 lanes (up to batchgen_tile_lanes()); n_len and k_len multiples of lanes.
int32_t batchgen_moe_routed_tiled(int32_t num_threads, const float* x, int64_t num_tokens, int32_t num_choices,
                                  const int64_t* ids, const float* weights, const float* w13t, const float* w2t,
                                  int32_t num_experts, int32_t k_len, int32_t n_len, int32_t lanes, float* out) {
  if (lanes != 8 && lanes != kWidestLanes) return 2;
  return moe_routed(num_threads, x, num_tokens, num_choices, ids, weights, w13t, w2t, num_experts, k_len, n_len,
                    INT32_MAX, out, lanes);
}


// 1 where this build and this CPU run bf16 experts (AVX512-BF16: batchgen_moe_routed_bf16), else 0.
int32_t batchgen_bf16_experts_supported() {
#if defined(BATCHGEN_HAS_BF16)
  return __builtin_cpu_supports("avx512bf16") ? 1 : 0;
#else
  return 0;
#endif
}

// batchgen_linear_tiled on a weight in bf16 tiles ([Nout / 16, K / 2, 16, 2]): x [M, K] bf16 (row
// stride ldx), bias fp32 or null, y [M, Nout] fp32; K and Nout multiples of 16. Returns 0, or 2
// where this build or CPU has no AVX512-BF16 (nothing written).
int32_t batchgen_linear_bf16(int32_t num_threads, const uint16_t* x, int64_t ldx, const uint16_t* wt, const float* bias,
                             float* y, int32_t m, int32_t k_len, int32_t n_out) {
  if (!batchgen_bf16_experts_supported() || k_len % 16 || n_out % 16) return 2;
#if defined(BATCHGEN_HAS_BF16)
  linear_bf16(num_threads, x, ldx, wt, bias, y, m, k_len, n_out);
  return 0;
#else
  return 2;
#endif
}

// batchgen_moe_routed_tiled on experts in bf16 tiles (see moe_routed_bf16): x [T, K] bf16, out
// [T, K] fp32; n_len and k_len multiples of 16. Returns 0, or 2 where this build or CPU has no
// AVX512-BF16 (nothing written).
int32_t batchgen_moe_routed_bf16(int32_t num_threads, const uint16_t* x, int64_t num_tokens, int32_t num_choices,
                                 const int64_t* ids, const float* weights, const uint16_t* w13t, const uint16_t* w2t,
                                 int32_t num_experts, int32_t k_len, int32_t n_len, float* out) {
  if (!batchgen_bf16_experts_supported() || k_len % 16 || n_len % 16) return 2;
#if defined(BATCHGEN_HAS_BF16)
  return moe_routed_bf16(num_threads, x, num_tokens, num_choices, ids, weights, w13t, w2t, num_experts, k_len, n_len,
                         out);
#else
  return 2;
#endif
}

}  // extern "C"

