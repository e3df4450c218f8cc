// bfloat16 as the CPU kernels read and write it: a float's top 16 bits, rounded to nearest even
// as torch rounds (a NaN stays a quiet NaN). T = float or uint16_t (bf16 bits), so a kernel
// templated on its storage type reads and writes either through the same two calls. Included by
// the attention, rope and RMSNorm libraries (every library's build key covers csrc/common/*.h).
#pragma once

#include <cstdint>
#include <cstring>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) {
    *p = 0x7fc0;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}

}  // namespace
