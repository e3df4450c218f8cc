// How the threads share a layer's work: blocks of weight rows, split by cost, the routed layer's
// two phases. Included, in order, by ../small_rows_cpu.cpp: the library is one translation unit,
// and this part of it sits in its anonymous namespace.
#pragma once

#include <atomic>

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

// A phase's work items shared out among the threads: thread i starts on its own range,
// bounds[i]..bounds[i + 1], taking items from its front; once it is empty the thread takes items
// from the back of the range with the most left. A static split leaves a thread whose estimate
// ran over still working while the others wait at the phase's end (a compiled harness around the
// expert layer, skewed routing: the two threads' phase ends 2-5% of a call apart at 32-512 tokens;
// a benchmark job's expert calls replayed with timers: waits of 0.2-0.5% of the layer's time with
// stealing); taking from the back leaves the owner's front, and the weights it prefetched, alone.
// Which thread computes an item never changes its floats. A range is one word, front << 32 | back
// (a layer has far fewer than 2^31 items), so a claim is one compare-and-swap, and each range has
// a cache line of its own.
class SharedItems {
 public:
  explicit SharedItems(const std::vector<int64_t>& bounds) : ranges_(bounds.size() - 1) {
    for (size_t i = 0; i + 1 < bounds.size(); ++i) ranges_[i].word.store(pack(bounds[i], bounds[i + 1]));
  }
  // -> the next item for thread `me` (-1: none left in any range) and, in `next`, the item it
  // will most likely take after it (-1: none), whose weights it may fetch ahead.
  int64_t take(int me, int64_t& next) {
    std::atomic<uint64_t>& own = ranges_[me].word;
    uint64_t word = own.load(std::memory_order_relaxed);
    while (front(word) < back(word))
      if (own.compare_exchange_weak(word, pack(front(word) + 1, back(word)), std::memory_order_relaxed)) {
        next = front(word) + 1 < back(word) ? front(word) + 1 : -1;
        return front(word);
      }
    for (;;) {
      size_t victim = ranges_.size();
      int64_t most = 0;
      for (size_t i = 0; i < ranges_.size(); ++i) {
        const uint64_t w = ranges_[i].word.load(std::memory_order_relaxed);
        if (back(w) - front(w) > most) most = back(w) - front(w), victim = i;
      }
      if (victim == ranges_.size()) return next = -1;
      std::atomic<uint64_t>& range = ranges_[victim].word;
      word = range.load(std::memory_order_relaxed);
      while (front(word) < back(word))
        if (range.compare_exchange_weak(word, pack(front(word), back(word) - 1), std::memory_order_relaxed)) {
          next = back(word) - 2 >= front(word) ? back(word) - 2 : -1;
          return back(word) - 1;
        }
    }
  }
  // The first item left in thread `me`'s range (-1: none).
  int64_t first_own(int me) const {
    const uint64_t w = ranges_[me].word.load(std::memory_order_relaxed);
    return front(w) < back(w) ? front(w) : -1;
  }

 private:
  struct alignas(64) Range {
    std::atomic<uint64_t> word{0};
  };
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back);
  }
  static int64_t front(uint64_t word) { return static_cast<int64_t>(word >> 32); }
  static int64_t back(uint64_t word) { return static_cast<int64_t>(word & 0xffffffffu); }
  std::vector<Range> ranges_;
};

// Both phases' shared items, made once per call by one thread of the team (by the team's size,
// which may be smaller than asked for) and read by all after the barrier that follows.
struct PhaseItems {
  std::unique_ptr<SharedItems> first, second;
  void share(const std::vector<int64_t>& item_cost, int64_t first_blocks, int64_t second_blocks, int parts) {
    first = std::make_unique<SharedItems>(balanced_bounds(item_cost, first_blocks, parts));
    second = std::make_unique<SharedItems>(balanced_bounds(item_cost, second_blocks, parts));
  }
};

// This thread's share of a routed layer's two phases: items of `items.first` through up(e, m, j0,
// gate weights, n, gate ahead, up ahead), a barrier, then `items.second`'s through down(e, m, c0,
// w2 weights, n, ahead); item = expert's place in `experts` * blocks + block. With `prefetch`,
// from kAheadRows rows an item is handed the blocks of the item the thread will likely take next
// (after its last first-phase item: its first second-phase item) to fetch as it computes.
template <typename T, typename Up, typename Down>
void run_phases(const ExpertBlocks<T>& b, const std::vector<int32_t>& experts, const int64_t* starts,
                PhaseItems& items, int me, bool prefetch, Up up, Down down) {
  int64_t next = -1;
  for (int64_t item = items.first->take(me, next); item >= 0; item = items.first->take(me, next)) {
    const int e = experts[item / b.n_blocks];
    const int m = static_cast<int>(starts[e + 1] - starts[e]);
    const auto [wg, n] = b.gate(e, item);
    Ahead gate_ahead, up_ahead;
    const int64_t second = next < 0 ? items.second->first_own(me) : -1;
    if (prefetch && m >= kAheadRows && next >= 0) {
      const auto [ahead, rows] = b.gate(experts[next / b.n_blocks], next);
      gate_ahead = weights_ahead(ahead, rows, b.k_len);
      up_ahead = weights_ahead(ahead + static_cast<int64_t>(b.n_len) * b.k_len, rows, b.k_len);
    } else if (prefetch && m >= kAheadRows && second >= 0) {
      const auto [ahead, rows] = b.down(experts[second / b.k_blocks], second);
      up_ahead = weights_ahead(ahead, rows, b.n_len);
    }
    up(e, m, static_cast<int>(item % b.n_blocks) * b.block, wg, n, gate_ahead, up_ahead);
  }
#pragma omp barrier
  for (int64_t item = items.second->take(me, next); item >= 0; item = items.second->take(me, next)) {
    const int e = experts[item / b.k_blocks];
    const int m = static_cast<int>(starts[e + 1] - starts[e]);
    const auto [wd, n] = b.down(e, item);
    Ahead ahead;
    if (prefetch && m >= kAheadRows && next >= 0) {
      const auto [next_w, rows] = b.down(experts[next / b.k_blocks], next);
      ahead = weights_ahead(next_w, rows, b.n_len);
    }
    down(e, m, static_cast<int>(item % b.k_blocks) * b.block, wd, n, ahead);
  }
}

// A dense product's blocks of `block` weight rows (its Nout in steps of `block`) shared out among
// the threads (SharedItems, from ranges of equal count): run(c0, n, next, next_rows) computes rows
// c0..c0 + n of the output columns into y, prefetching the block the thread will likely take next
// (next_rows rows from next; 0 when there is none or m < kAheadRows); then bias (fp32, or null)
// is added to those columns.
template <typename Run>
void over_blocks(int32_t num_threads, int32_t m, int32_t n_out, int block, const float* bias, float* y, Run run) {
  const int64_t items = (n_out + block - 1) / block;
  std::unique_ptr<SharedItems> shared;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && items > 1)
  {
    const Team team = this_team();
#pragma omp single
    {  // by the team's size, which may be smaller than asked for
      std::vector<int64_t> bounds(team.size + 1);
      for (int i = 0; i <= team.size; ++i) bounds[i] = items * i / team.size;
      shared = std::make_unique<SharedItems>(bounds);
    }
    int64_t next_item = -1;
    for (int64_t item = shared->take(team.me, next_item); item >= 0; item = shared->take(team.me, next_item)) {
      const int c0 = static_cast<int>(item * block);
      const int n = std::min(block, n_out - c0);
      const int next = static_cast<int>(next_item * block);
      run(c0, n, next, m >= kAheadRows && next_item >= 0 ? std::min(block, n_out - next) : 0);
      if (bias)
        for (int i = 0; i < m; ++i)
          for (int c = c0; c < c0 + n; ++c) y[static_cast<int64_t>(i) * n_out + c] += bias[c];
    }
  }
}

}  // namespace
