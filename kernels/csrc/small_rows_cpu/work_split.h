// How the threads share a layer's work: blocks of weight rows, split by cost, the routed layer's
// two phases. Included, in order, by ../small_rows_cpu.cpp: the library is one translation unit,
// and this part of it sits in its anonymous namespace.
#pragma once

#include "common.h"

namespace {

constexpr int kBlock = 24;  // weight rows per work item (tiled: three tiles, 3 L)
// From this many rows an expert, a tiled work item prefetches the next item's weights into L2 as
// it computes (tiled_tile's Ahead): at a few rows an expert the hardware prefetcher only follows
// the block being read, so reading the weights and the multiply-adds otherwise take turns.
// Measured (8 experts of 1024 x 1024 from memory, 2 threads, Zen 4): 1.13-1.34x at 6-24 rows an
// expert, 1.03-1.12x at 32-64, level at 512; at 1-2 rows, where reading is all there is, 0.97x.
constexpr int kAheadRows = 3;

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

}  // namespace
