#pragma once
// How a KV cache lays out one (position, KV head) row of head_size values for each cache dtype:
// the bytes a row takes, scales included. Shared by the caches (infer/), the attention op and
// the CPU kernels that quantise and read the rows (cpu/kv_quant.h).
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
#include <cstdint>
#include <string>

#include "autograd/backend/device.h"

namespace kvlab {

inline bool is_quantised(DType t) {
  return t == DType::FP8 || t == DType::INT8 || t == DType::INT4;
}

// int4's channels a group: 32 where head_size is a multiple of it, else the whole row.
inline int64_t kv_int4_group(int64_t head_size) { return head_size % 32 == 0 ? 32 : head_size; }

// Bytes of one (position, KV head) row of head_size values.
inline int64_t kv_row_bytes(DType t, int64_t head_size) {
  switch (t) {
    case DType::INT8: return 4 + head_size;
    case DType::INT4: return 4 * (head_size / kv_int4_group(head_size)) + head_size / 2;
    default: return static_cast<int64_t>(dtype_size(t)) * head_size;
  }
}

// What keeps a KV cache of dtype t with this head size from existing, or "" (f32, bf16 and the
// quantised types; int4 packs two channels a byte, so it needs an even head size).
inline std::string kv_dtype_problem(DType t, int64_t head_size) {
  const bool storable = t == DType::F32 || t == DType::BF16 || is_quantised(t);
  if (!storable)
    return std::string("KV cache dtype ") + dtype_name(t) +
           " is not supported (f32, bf16, fp8, int8 or int4)";
  if (t == DType::INT4 && head_size % 2 != 0)
    return "an int4 KV cache packs two channels a byte: head size " + std::to_string(head_size) +
           " is odd";
  return "";
}

}  // namespace kvlab
