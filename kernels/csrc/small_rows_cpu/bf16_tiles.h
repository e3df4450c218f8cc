// Experts and dense weights in bf16 tiles (AVX512-BF16), k in pairs. Included, in order, by
// ../small_rows_cpu.cpp: the library is one translation unit, and this part of it sits in its
// anonymous namespace.
#pragma once

#include "common.h"
#include "fp32_tiles.h"
#include "work_split.h"
#include "silu.h"
#include "experts.h"

namespace {

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
  PhaseItems items;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    thread_local Scratch gate_up;
    std::unique_ptr<float[]> gate_up_spill;
    float* gate = room(gate_up, 2 * most * block + block, gate_up_spill);
    float *up = gate + most * block, *silu = up + most * block;
    const Team team = this_team();
#pragma omp single
    {
      items.share(item_cost, blocks.n_blocks, blocks.k_blocks, team.size);
    }
    run_phases(
        blocks, experts, starts, items, team.me, true,
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
  return routed_layer(num_threads, x, num_tokens, num_choices, ids, weights, num_experts, k_len, INT32_MAX, out,
                      [&](const bf16* rows, const int64_t* starts, float* y) {
                        bf16_experts(num_threads, rows, w13, w2, starts, y, num_experts, k_len, n_len);
                      });
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

}  // namespace
