// Products on plain (untiled) weights: rows of x for few rows, packed panels for more. Included, in
// order, by ../small_rows_cpu.cpp: the library is one translation unit, and this part of it sits in
// its anonymous namespace.
#pragma once

#include "common.h"

namespace {

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

}  // namespace
