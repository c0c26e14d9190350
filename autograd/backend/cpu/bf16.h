#pragma once
// bf16 <-> f32 on the CPU, for copies and for kernels reading a bf16 KV cache. bf16 is the top
// half of an f32: widening is exact, narrowing rounds to nearest even.
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kvlab::cpu {

inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x7fffffu)) return 0x7fc0;  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Whether every value of x (n) is a bf16 value (its low 16 bits zero): narrowing is exact.
// Chunk by chunk, each without an early exit so that it vectorises, stopping after the first
// chunk that has another value (an f32 matrix is told apart in its first chunk).
inline bool all_bf16(const float* x, int64_t n) {
  constexpr int64_t kChunk = 1024;
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    uint32_t low = 0;
    for (int64_t i = i0; i < std::min(n, i0 + kChunk); ++i) {
      uint32_t bits;
      std::memcpy(&bits, x + i, 4);
      low |= bits & 0xffffu;
    }
    if (low != 0) return false;
  }
  return true;
}

}  // namespace kvlab::cpu
