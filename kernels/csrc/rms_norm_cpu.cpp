// RMSNorm with each row read once from memory: the CPU replacement of torch's composite (pow, mean,
// add, rsqrt, mul, then the weight's mul: five passes over a prompt step's activations).
//
// x: [rows, n] (row stride given, unit last stride); weight: [n]; out: [rows, n] contiguous.
// out = (x * r) * weight with r = 1 / sqrt(sum(x * x) / n + eps), each operation rounded on its
// own as torch's composite rounds it (built with -ffp-contract=off) and the sum in torch's order,
// so the floats are torch's (batchgen_kernels.cpu_rms_norm checks that against torch before it
// uses the kernel for a width). bfloat16 follows transformers' RMSNorm: the row in fp32, x * r
// rounded to bf16, then weight * that rounded again. A row's result never depends on the other
// rows or the thread count.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/bf16.h"

namespace {

// x rounded to T (float: itself; bf16: to nearest even)
template <typename T>
inline T rounded(float x) {
  T r;
  store(&r, x);
  return r;
}

// torch's order for a contiguous row's sum on the CPU (ATen's cascade sum, SumKernel.cpp, with
// eight-lane vectors: what torch 2.13 runs on AVX2 and AVX-512 machines alike): the row as
// vectors of eight, those as groups of four accumulated into four vectors through a cascade of
// levels sixteen groups apart, the leftover vectors into the first, the four vectors summed in
// order, then the elements past the last whole vector, then the eight lanes in order.
constexpr int kTorchLanes = 8;
constexpr int kIlp = 4;
constexpr int kLevels = 4;
constexpr int kLevelPower = 4;  // max(4, ceil(log2(groups)) / 4): 4 up to 2^19 groups

template <typename T>
inline float sum_of_squares(const T* x, int n) {
  float acc[kLevels][kIlp][kTorchLanes] = {};
  auto add_vector = [&](float* into, int64_t v) {
    for (int l = 0; l < kTorchLanes; ++l) {
      const float e = to_float(x[v * kTorchLanes + l]);
      into[l] += e * e;
    }
  };
  const int64_t vectors = n / kTorchLanes, groups = vectors / kIlp;
  constexpr int64_t step = int64_t{1} << kLevelPower, mask = step - 1;
  int64_t i = 0;
  while (i + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < kTorchLanes; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.f;
        }
      if ((i & (mask << (j * kLevelPower))) != 0) break;
    }
  }
  for (; i < groups; ++i)
    for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < kTorchLanes; ++l) acc[0][k][l] += acc[j][k][l];
  float* lanes = acc[0][0];
  for (int64_t v = groups * kIlp; v < vectors; ++v) add_vector(lanes, v);
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < kTorchLanes; ++l) lanes[l] += acc[0][k][l];
  float total = 0.f;
  for (int64_t e = vectors * kTorchLanes; e < n; ++e) {
    const float v = to_float(x[e]);
    total += v * v;
  }
  for (int l = 0; l < kTorchLanes; ++l) total += lanes[l];
  return total;
}

template <typename T>
inline void norm_row(const T* x, const T* weight, T* out, int n, float eps) {
  const float r = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int i = 0; i < n; ++i) {
    const T normed = rounded<T>(to_float(x[i]) * r);
    store(out + i, to_float(normed) * to_float(weight[i]));
  }
}

template <typename T>
void run(const void* x_, int64_t x_stride, const void* weight_, void* out_, int64_t rows, int32_t n, float eps,
         int32_t num_threads) {
  const T* x = static_cast<const T*>(x_);
  const T* weight = static_cast<const T*>(weight_);
  T* out = static_cast<T*>(out_);
  // a prompt step's thousands of rows split over the threads; a decode step's few stay on one
  // (a fork costs more than they do)
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && rows * n >= (1 << 16))
  for (int64_t t = 0; t < rows; ++t) norm_row(x + t * x_stride, weight, out + t * n, n, eps);
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16 (x, weight and out alike); num_threads: at most this many.
void batchgen_rms_norm(int32_t dtype, const void* x, int64_t x_stride, const void* weight, void* out, int64_t rows,
                       int32_t n, float eps, int32_t num_threads) {
  if (dtype == 0)
    run<float>(x, x_stride, weight, out, rows, n, eps, num_threads);
  else
    run<uint16_t>(x, x_stride, weight, out, rows, n, eps, num_threads);
}

int32_t batchgen_abi_version() { return 1; }
}
