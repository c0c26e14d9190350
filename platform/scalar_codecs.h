#pragma once
// The scalar codecs of the formats without blocks (platform/formats.h), inline for the kernels
// that read and write them value by value: bf16, the top half of an f32 (widening is exact,
// narrowing rounds to nearest even), and fp8 E4M3. IEEE half, ggml's scale type, is with its
// blocks in ggml_blocks.h.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvlab {

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

// The largest finite E4M3 value; fp8 rows saturate there (E4M3 has no infinity).
constexpr float kFp8Max = 448.0f;

// The exact value of an E4M3 byte: its sign, exponent and mantissa moved into an f32's places
// (a number 2^120 too small, subnormals included), scaled back by a power of two.
inline float fp8_value(uint8_t b) {
  const uint32_t bits = (uint32_t{b} & 0x80u) << 24 | (uint32_t{b} & 0x7Fu) << 20;
  return std::bit_cast<float>(bits) * 0x1p120f;
}

// y (finite) to the nearest E4M3 value (ties to even), saturating at +-448.
inline uint8_t fp8_encode(float y) {
  const auto sign = static_cast<uint8_t>(std::signbit(y) ? 0x80 : 0);
  const float a = std::min(std::fabs(y), kFp8Max);
  if (a < 0x1p-6f)  // subnormal: multiples of 2^-9 (8 of them is the smallest normal, 0x08)
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f)));
  uint32_t bits = std::bit_cast<uint32_t>(a);
  bits += 0x7FFFFu + ((bits >> 20) & 1u);  // round to 3 mantissa bits, ties to even
  const uint32_t exponent = (bits >> 23) - 127 + 7, mantissa = (bits >> 20) & 7u;
  return static_cast<uint8_t>(sign | exponent << 3 | mantissa);
}

}  // namespace kvlab
