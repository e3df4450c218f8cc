// silu(gate) * up in vectors, as the expert kernels compute h. Included, in order, by
// ../small_rows_cpu.cpp: the library is one translation unit, and this part of it sits in its
// anonymous namespace.
#pragma once

#include "common.h"

namespace {

// exp(x) of eight floats at once: x = n ln 2 + r (n whole, |r| <= ln 2 / 2, ln 2 in two parts),
// exp(r) by Cephes' expf polynomial, times 2^n written into the exponent bits; x clamped to
// [-87.3, 88.3], where 2^n stays a normal float. Hand-written rather than glibc's vector exp
// (libmvec): GCC calls that only under -ffast-math, and not every C library has it; this is the
// same arithmetic in every build. The silu below is within 2 ulp of float64's (torch's: 1.3).
inline v8 exp8(v8 x) {
  const v8 hi = v8{} + 88.3762626647949f, lo = v8{} - 87.3365447505531f;
  x = x < hi ? x : hi;
  x = x > lo ? x : lo;
  const v8 magic = v8{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to a whole number
  const v8 n = (x * 1.44269504088896341f + magic) - magic;
  const v8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  v8 p = v8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v8 y = p * (r * r) + r + 1.f;
  typedef int32_t v8i __attribute__((vector_size(32)));
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  return y * (v8)bits;  // (a cast between vector types of one size keeps the bits)
}

// out[j * stride] = silu(gate[j]) * up[j] for j < n (silu(g) = g / (1 + exp(-g))): eight at a
// time, the last few through a padded vector, so every element takes the same arithmetic
// wherever it sits (a row's result never depends on its batch). Against std::exp one at a time
// (what this replaced): 1.02-1.06x the whole expert layer at 8-512 rows an expert of 1024 x 1024,
// 1.11-1.18x at 8-256 rows of 256 x 512, where the exponentials are a larger share.
inline v8 silu_times8(v8 g, v8 u) {
  const v8 s = g / (1.f + exp8(-g));
  return (g < -88.3762626647949f ? v8{} : s) * u;  // past the clamp silu is below 4e-37: zero
}

inline void silu_times(const float* gate, const float* up, int n, float* out, int64_t stride = 1) {
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 h = silu_times8(load(gate + j), load(up + j));
    if (stride == 1) *reinterpret_cast<v8u*>(out + j) = h;
    else
      for (int l = 0; l < 8; ++l) out[(j + l) * stride] = h[l];
  }
  if (j < n) {
    float g[8] = {}, u[8] = {};
    for (int l = 0; j + l < n; ++l) g[l] = gate[j + l], u[l] = up[j + l];
    const v8 h = silu_times8(load(g), load(u));
    for (int l = 0; j + l < n; ++l) out[(j + l) * stride] = h[l];
  }
}

}  // namespace
