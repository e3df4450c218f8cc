// Products on weights in tiles of L lanes (fp32): one x element broadcast against L weight rows.
// Included, in order, by ../small_rows_cpu.cpp: the library is one translation unit, and this part
// of it sits in its anonymous namespace.
#pragma once

#include "common.h"

namespace {

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
  typedef v8 vec;
  typedef v8u vec_u;
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

}  // namespace
