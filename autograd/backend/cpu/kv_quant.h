#pragma once
// Quantised KV-cache rows on the CPU (layouts in backend/kv_format.h): one row of head_size f32
// values to its bytes and back. The caches quantise what they store with quantise_kv_row; the
// attention reads rows either dequantised in registers by its row kernel (attend_row.cpp) or
// widened by dequantise_kv_row. Both compute each value with the same f32 operations
// (int8: code * scale; int4: fma(code, scale, min); fp8: its exact value times the scale), so
// every reader sees the same values.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "autograd/backend/cpu/bf16.h"
#include "autograd/backend/kv_format.h"

namespace kvlab::cpu {

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

inline float int8_row_scale(const uint8_t* row) {
  float s;
  std::memcpy(&s, row, sizeof s);
  return s;
}

// Where channel i of an int4 row's codes lies: in its group of G, byte i % G % (G / 2) of the
// group's G / 2, the low nibble for the group's first half, the high one for its second.
inline int64_t int4_byte(int64_t i, int64_t G) { return i / G * (G / 2) + i % G % (G / 2); }
inline int int4_shift(int64_t i, int64_t G) { return static_cast<int>(i % G / (G / 2) * 4); }

// Group g's (scale, min) of an int4 row.
inline float int4_scale(const uint8_t* row, int64_t g) {
  uint16_t h;
  std::memcpy(&h, row + 4 * g, 2);
  return bf16_to_f32(h);
}
inline float int4_min(const uint8_t* row, int64_t g) {
  uint16_t h;
  std::memcpy(&h, row + 4 * g + 2, 2);
  return bf16_to_f32(h);
}

// dst (kv_row_bytes(t, HS) bytes) = x (HS values) in format t (fp8, int8 or int4); fp8_scale is
// the row's KV head's (fp8 only). Returns false, with the row zeroed, where x holds an infinity
// or a NaN: the caller refuses it, naming where it appeared.
inline bool quantise_kv_row(DType t, uint8_t* dst, const float* x, int64_t HS, float fp8_scale) {
  const int64_t bytes = kv_row_bytes(t, HS);
  if (!std::all_of(x, x + HS, [](float f) { return std::isfinite(f); })) {
    std::fill_n(dst, bytes, uint8_t{0});
    return false;
  }
  if (t == DType::FP8) {
    const float inv = fp8_scale > 0 ? 1.0f / fp8_scale : 0.0f;
    for (int64_t i = 0; i < HS; ++i) dst[i] = fp8_encode(x[i] * inv);
  } else if (t == DType::INT8) {
    float amax = 0;
    for (int64_t i = 0; i < HS; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax / 127.0f;
    std::memcpy(dst, &scale, sizeof scale);
    for (int64_t i = 0; i < HS; ++i) {
      const float c = scale > 0 ? std::clamp(std::nearbyint(x[i] / scale), -127.0f, 127.0f) : 0.0f;
      dst[4 + i] = static_cast<uint8_t>(static_cast<int8_t>(c));
    }
  } else {  // INT4: asymmetric, a (scale, min) a group, both as stored (bf16) when coding
    const int64_t G = kv_int4_group(HS), groups = HS / G;
    uint8_t* codes = dst + 4 * groups;
    std::fill_n(codes, HS / 2, uint8_t{0});
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + g * G;
      const auto [lo, hi] = std::minmax_element(xg, xg + G);
      const uint16_t min16 = f32_to_bf16(*lo), scale16 = f32_to_bf16((*hi - bf16_to_f32(min16)) / 15.0f);
      std::memcpy(dst + 4 * g, &scale16, 2);
      std::memcpy(dst + 4 * g + 2, &min16, 2);
      const float mn = bf16_to_f32(min16), scale = bf16_to_f32(scale16);
      for (int64_t i = 0; i < G; ++i) {
        const float c = scale > 0 ? std::clamp(std::nearbyint((xg[i] - mn) / scale), 0.0f, 15.0f) : 0.0f;
        const int64_t ch = g * G + i;
        codes[int4_byte(ch, G)] |= static_cast<uint8_t>(static_cast<uint32_t>(c) << int4_shift(ch, G));
      }
    }
  }
  return true;
}

// x (HS values) = the row `row` of format t holds; fp8_scale its KV head's (fp8 only).
inline void dequantise_kv_row(DType t, float* x, const uint8_t* row, int64_t HS, float fp8_scale) {
  if (t == DType::FP8) {
    for (int64_t i = 0; i < HS; ++i) x[i] = fp8_value(row[i]) * fp8_scale;
  } else if (t == DType::INT8) {
    const float scale = int8_row_scale(row);
    for (int64_t i = 0; i < HS; ++i)
      x[i] = static_cast<float>(static_cast<int8_t>(row[4 + i])) * scale;
  } else {
    const int64_t G = kv_int4_group(HS), groups = HS / G;
    const uint8_t* codes = row + 4 * groups;
    for (int64_t i = 0; i < HS; ++i) {
      const auto c = static_cast<float>(codes[int4_byte(i, G)] >> int4_shift(i, G) & 0xF);
      x[i] = std::fma(c, int4_scale(row, i / G), int4_min(row, i / G));
    }
  }
}

}  // namespace kvlab::cpu
