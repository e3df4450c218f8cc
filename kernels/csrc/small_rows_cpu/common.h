// The small-rows kernels' shared pieces: kept scratch, prefetch bookkeeping (vector types: ../common/vec8.h).
// Included, in order, by ../small_rows_cpu.cpp: the library is one translation unit, and this part
// of it sits in its anonymous namespace.
#pragma once

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

#include "../common/vec8.h"

namespace {

// Short weight rows (a dot product of at most kPrefetchLen) are fetched kPrefetch floats ahead
// in software: a row of 1-2 KiB ends before the hardware prefetcher has followed it. Measured
// with 2 experts' rows streamed from memory (2 threads): 1.4-1.85x at width 256 and 1.1-1.2x at
// 512 for 1-8 rows; none at 1024; a 5% loss at 4096, so longer rows are prefetched one group of
// rows ahead instead (dots_rows).
constexpr int kPrefetch = 1024;
constexpr int kPrefetchLen = 512;

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

}  // namespace
