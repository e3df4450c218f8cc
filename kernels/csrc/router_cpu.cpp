// A MoE layer's router on CPU in one call: logits = x W^T in fp32, scores = softmax or sigmoid of
// them, the top k of scores (plus a correction bias where the model has one), their scores as
// the weights, renormalized to sum to one and scaled where the model asks.
//
// torch runs this as seven or more operators (linear, softmax, topk, gather, sum, div, mul), each
// a dispatch and a pass of its own; at a decode step's rows that is most of the router's time,
// and the product itself, against E = 8 weight rows, is a shape sgemm handles poorly. Here each
// token's E dot products share its row's loads, and the rest works on E floats in registers.
//
// x: [T, K] (row stride ldx); w: [E, K]; bias: [E] or null; weights: [T, A] fp32; ids: [T, A]
// int64. A token's dot products are each summed in one fixed order (eight lanes over k, then the
// lanes, then the tail), so a token's routing never depends on its batch. The floats are not
// torch's (whose sgemm sums in its own order): the weights agree with torch's within the rounding
// of the product, a few 1e-6 relative at K = 1024-2048 (tests/kernels/test_cpu_router.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/vec8.h"

namespace {

constexpr int kRowsTogether = 4;  // weight rows sharing one pass over x's row

// logits[e] = x . w[e] for e < E.
void token_logits(const float* x, const float* w, int32_t k_len, int32_t num_experts, float* logits) {
  const int32_t whole = k_len / 8 * 8;
  int32_t e = 0;
  for (; e + kRowsTogether <= num_experts; e += kRowsTogether) {
    const float* r[kRowsTogether];
    v8 acc[kRowsTogether] = {};
    for (int j = 0; j < kRowsTogether; ++j) r[j] = w + static_cast<int64_t>(e + j) * k_len;
    for (int32_t k = 0; k < whole; k += 8) {
      const v8 xv = load(x + k);
      for (int j = 0; j < kRowsTogether; ++j) acc[j] += xv * load(r[j] + k);
    }
    for (int j = 0; j < kRowsTogether; ++j) {
      float s = hsum(acc[j]);
      for (int32_t k = whole; k < k_len; ++k) s += x[k] * r[j][k];
      logits[e + j] = s;
    }
  }
  for (; e < num_experts; ++e) {
    const float* r = w + static_cast<int64_t>(e) * k_len;
    v8 acc = {};
    for (int32_t k = 0; k < whole; k += 8) acc += load(x + k) * load(r + k);
    float s = hsum(acc);
    for (int32_t k = whole; k < k_len; ++k) s += x[k] * r[k];
    logits[e] = s;
  }
}

struct RouterShape {
  int32_t k_len, num_experts, top_k;
  bool sigmoid, normalize;
  float norm_eps, scale;
};

// scores: room for 2 E floats, taken: for E flags (the calling thread's scratch).
void route_token(const float* x, const float* w, const float* bias, const RouterShape& s, float* scores,
                 uint8_t* taken, float* weights, int64_t* ids) {
  const int32_t E = s.num_experts;
  token_logits(x, w, s.k_len, E, scores);
  if (s.sigmoid) {
    for (int32_t e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-scores[e]));
  } else {
    float most = scores[0];
    for (int32_t e = 1; e < E; ++e) most = scores[e] > most ? scores[e] : most;
    float sum = 0.f;
    for (int32_t e = 0; e < E; ++e) sum += scores[e] = std::exp(scores[e] - most);
    for (int32_t e = 0; e < E; ++e) scores[e] /= sum;
  }
  // the top k by choice value (score + bias), largest first, among equals the lower expert; a
  // NaN ranks above every number, as in torch.topk
  float* const choice = scores + E;
  for (int32_t e = 0; e < E; ++e) choice[e] = bias ? scores[e] + bias[e] : scores[e];
  std::fill(taken, taken + E, uint8_t{0});
  auto above = [](float c, float b) { return std::isnan(c) ? !std::isnan(b) : c > b; };
  float total = 0.f;
  for (int32_t a = 0; a < s.top_k; ++a) {
    int32_t best = -1;
    for (int32_t e = 0; e < E; ++e)
      if (!taken[e] && (best < 0 || above(choice[e], choice[best]))) best = e;
    taken[best] = 1;
    ids[a] = best;
    weights[a] = scores[best];
    total += scores[best];
  }
  if (s.normalize)
    for (int32_t a = 0; a < s.top_k; ++a) weights[a] /= total + s.norm_eps;
  if (s.scale != 1.0f)
    for (int32_t a = 0; a < s.top_k; ++a) weights[a] *= s.scale;
}

}  // namespace

extern "C" {

int32_t batchgen_abi_version() { return 1; }

// Returns 0, or 1 when top_k is not in [1, E] (nothing written).
int32_t batchgen_route(int32_t num_threads, const float* x, int64_t ldx, const float* w, const float* bias,
                       int64_t num_tokens, int32_t k_len, int32_t num_experts, int32_t top_k, int32_t sigmoid,
                       int32_t normalize, float norm_eps, float scale, float* weights, int64_t* ids) {
  if (top_k < 1 || top_k > num_experts) return 1;
  const RouterShape s{k_len, num_experts, top_k, sigmoid != 0, normalize != 0, norm_eps, scale};
  // a prompt step's thousands of tokens, and a decode step's hundred or more, over the threads;
  // a few tokens stay on one (a fork costs more than they do)
  const bool parallel = num_threads > 1 && num_tokens * num_experts * static_cast<int64_t>(k_len) >= (int64_t{1} << 20);
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
    std::vector<float> scores(2 * static_cast<size_t>(num_experts));
    std::vector<uint8_t> taken(num_experts);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t)
      route_token(x + t * ldx, w, bias, s, scores.data(), taken.data(), weights + t * top_k, ids + t * top_k);
  }
  return 0;
}

}  // extern "C"
