// Eight fp32 lanes in GCC/Clang vector types (AVX2 where the build targets it, narrower vectors
// elsewhere): the type, an unaligned load, and the horizontal sum in the fixed order every kernel
// that uses it sums in (so their floats do not depend on the build's vector width).
#pragma once

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

inline v8 load(const float* p) { return *reinterpret_cast<const v8u*>(p); }

inline float hsum(v8 v) {
  const float a = (v[0] + v[4]) + (v[2] + v[6]);
  const float b = (v[1] + v[5]) + (v[3] + v[7]);
  return a + b;
}

}  // namespace
