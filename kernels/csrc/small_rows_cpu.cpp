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
#include "small_rows_cpu/common.h"
#include "small_rows_cpu/plain_rows.h"
#include "small_rows_cpu/fp32_tiles.h"
#include "small_rows_cpu/work_split.h"
#include "small_rows_cpu/silu.h"
#include "small_rows_cpu/experts.h"
#include "small_rows_cpu/bf16_tiles.h"

namespace {

// y [M, Nout] = x [M, K] (row stride ldx) w^T + bias, w in tiles of `lanes` lanes ([Nout / L, K,
// L], Nout and K multiples of L): blocks of three tiles shared out among the threads (over_blocks),
// each block prefetching the next one's weights as it computes (from kAheadRows rows).
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
