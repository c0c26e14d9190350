#pragma once
// How a KV cache lays out one (position, KV head) row of head_size values for each cache dtype,
// and the codecs of its quantised rows: one row of f32 values to its bytes and back. Shared by
// the caches (infer/), the attention op and the CPU kernels. The caches quantise what they
// store with quantise_kv_row; the attention reads rows either dequantised in registers by its
// row kernel (autograd/backend/cpu/attend_row.cpp) or widened by dequantise_kv_row. Both
// compute each value with the same f32 operations (int8: code * scale; int4: fma(code, scale,
// min); fp8: its exact value times the scale), so every reader sees the same values.
//
//   f32, bf16  head_size values.
//   fp8        head_size E4M3 bytes; the scale is per (layer, KV head), held by the cache
//              beside its pools (KVRows::scales), not in the row.
//   int8       an f32 scale, then head_size int8 codes in [-127, 127]: x = code * scale.
//   int4       per group of kv_int4_group(head_size) channels a bf16 scale and a bf16 minimum
//              (all groups' pairs first), then the codes in [0, 15], two a byte: in a group of
//              G, byte i holds channel i in its low nibble and channel i + G / 2 in its high
//              one, so that a vector of a half's channels is one load and one shift:
//              x = code * scale + min.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "platform/formats.h"
#include "platform/scalar_codecs.h"

namespace kvlab {

inline bool is_quantised(DType t) {
  return t == DType::FP8 || t == DType::INT8 || t == DType::INT4;
}

// Bytes of one (position, KV head) row of head_size values.
inline int64_t kv_row_bytes(DType t, int64_t head_size) {
  return format_row_bytes(format_of(t), head_size);
}

// What keeps a KV cache of dtype t with this head size from existing, or "" (the formats with
// the kKVEntries role; int4 packs two channels a byte, so it needs an even head size).
inline std::string kv_dtype_problem(DType t, int64_t head_size) {
  if (!format_of(t).holds(kKVEntries))
    return std::string("KV cache dtype ") + dtype_name(t) + " is not supported (" +
           format_names(kKVEntries, " or ") + ")";
  if (t == DType::INT4 && head_size % 2 != 0)
    return "an int4 KV cache packs two channels a byte: head size " + std::to_string(head_size) +
           " is odd";
  return "";
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

}  // namespace kvlab
