// The routed expert layer in fp32: slots sorted by expert, both products, the sum over the choices.
// Included, in order, by ../small_rows_cpu.cpp: the library is one translation unit, and this part
// of it sits in its anonymous namespace.
#pragma once

#include "common.h"
#include "plain_rows.h"
#include "fp32_tiles.h"
#include "work_split.h"
#include "silu.h"

namespace {

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
  PhaseItems items;  // the two phases' items, shared out among the threads
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
      items.share(item_cost, blocks.n_blocks, blocks.k_blocks, team.size);
    }
    run_phases(
        blocks, experts, starts, items, team.me, tiled,
        [&](int e, int m, int j0, const float* wg, int n, Ahead gate_ahead, Ahead up_ahead) {  // h = silu(x gate^T) * (x up^T)
          dots_of(x_of(e), k_len, m, wg, k_len, n, gate, block, gate_ahead);
          dots_of(x_of(e), k_len, m, wg + static_cast<int64_t>(n_len) * k_len, k_len, n, up, block, up_ahead);
          float* he = h + at[e] * n_len;
          if (!as_panels(m)) {
            for (int i = 0; i < m; ++i) silu_times(gate + i * block, up + i * block, n, he + static_cast<int64_t>(i) * n_len + j0);
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

// The routed layer around `experts`: the slots sorted by expert (sort_slots), x's rows [T, K] of
// type T gathered in that order, experts(rows, starts, y) writing each slot's fp32 output into y
// [routed, K], then each token's weighted sum over its choices (sum_choices) into out [T, K].
// -> 0, or 1 when an expert has more than max_rows slots (nothing written).
template <typename T, typename Experts>
int32_t routed_layer(int32_t num_threads, const T* x, int64_t num_tokens, int32_t num_choices, const int64_t* ids,
                     const float* weights, int32_t num_experts, int32_t k_len, int32_t max_rows, float* out,
                     Experts experts) {
  const int64_t slots = num_tokens * num_choices;
  std::vector<int64_t> starts, pos;
  if (!sort_slots(ids, slots, num_experts, max_rows, starts, pos)) return 1;
  const int64_t routed = starts[num_experts];
  // scratch, every entry written before it is read (the rows in floats' room: sizeof(T) / 4 each)
  thread_local Scratch rows_scratch, y_scratch;
  std::unique_ptr<float[]> rows_spill, y_spill;
  T* const rows = reinterpret_cast<T*>(
      room(rows_scratch, (routed * k_len * static_cast<int64_t>(sizeof(T)) + 3) / 4, rows_spill));
  float* const y = room(y_scratch, routed * k_len, y_spill);
  const bool parallel = num_threads > 1 && slots * k_len >= (1 << 15);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
  for (int64_t s = 0; s < slots; ++s)
    if (pos[s] >= 0) std::memcpy(rows + pos[s] * k_len, x + (s / num_choices) * k_len, sizeof(T) * k_len);
  if (routed > 0) experts(static_cast<const T*>(rows), starts.data(), y);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
  for (int64_t t = 0; t < num_tokens; ++t)
    sum_choices(y, pos.data() + t * num_choices, weights + t * num_choices, num_choices, k_len,
                out + t * k_len);
  return 0;
}

// The routed layer on fp32 experts (batchgen_moe_routed_small_rows, batchgen_moe_routed_tiled).
int32_t moe_routed(int32_t num_threads, const float* x, int64_t num_tokens, int32_t num_choices, const int64_t* ids,
                   const float* weights, const float* w13, const float* w2, int32_t num_experts, int32_t k_len,
                   int32_t n_len, int32_t max_rows, float* out, int lanes) {
  return routed_layer(num_threads, x, num_tokens, num_choices, ids, weights, num_experts, k_len, max_rows, out,
                      [&](const float* rows, const int64_t* starts, float* y) {
                        std::vector<uint8_t> take(num_experts);
                        for (int e = 0; e < num_experts; ++e) take[e] = starts[e + 1] > starts[e];
                        moe_rows(num_threads, rows, w13, w2, starts, take.data(), y, num_experts, k_len, n_len,
                                 lanes);
                      });
}

}  // namespace
