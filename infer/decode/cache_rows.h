#pragma once
// The decode step's view of one layer's rows of the KV cache, and the stores of this step's
// new keys and values into them. Each thread writes the keys and values it computed straight
// into the cache (DecodeKVCache::layer_rows, taken before the parallel region), so that no
// thread waits while another copies.
#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "infer/kv_cache.h"
#include "platform/kv_rows.h"

namespace kvlab::decode {

// One layer's rows of the cache for this step (DecodeKVCache::layer_rows): host memory, f32,
// bf16 or quantised (platform/kv_rows.h), B rows of NKV heads of HS contiguous elements with room for
// every row's length (which counts this step's position), checked before the parallel region; the
// threads write their new keys and values straight into them. A paged cache's rows (KVRows::blocks)
// are reached through their block tables: the new position's block for the stores, every block for
// the attention, in place.
struct CacheRef {
  KVRows rows;
  HeadView k_strides, v_strides;  // within a row (its sb unused: each row has its own pointer)
  int64_t S;
  bool bf16, quantised;
  CacheRef(const KVRows& r, int64_t B, int64_t NKV, int64_t HS, std::span<const int64_t> lengths)
      : rows(r) {
    const bool ok =
        r.device == Device::CPU && kv_dtype_problem(r.dtype, HS).empty() &&
        (r.dtype != DType::FP8 || r.scales != nullptr) && r.rows == B && r.n_kv_head == NKV &&
        r.head_size == HS &&
        std::all_of(lengths.begin(), lengths.end(), [&](int64_t n) { return n <= r.positions; });
    const std::string shape = shape_str(Shape{r.rows, r.n_kv_head, r.positions, r.head_size});
    KVLAB_CHECK(ok, "decode step: the KV cache returned k ", shape, " ", dtype_name(r.dtype),
                " on ", device_name(r.device), ", v ", shape, " ", dtype_name(r.dtype),
                "; the CPU decode step writes and reads host (B, NKV, S, HS) rows of f32, bf16, "
                "fp8 (with its scales), int8 or int4 with contiguous heads");
    if (r.blocks != nullptr) {
      // The attention reads a paged row block by block (cpu::BlockRows, block_len a power of
      // two); the table must hold the block each row's new position lies in.
      const KVBlocks& kb = *r.blocks;
      const bool pow2 = kb.block_len > 0 && (kb.block_len & (kb.block_len - 1)) == 0;
      KVLAB_CHECK(pow2 && kb.table != nullptr, "decode step: the KV cache's blocks of ",
                  kb.block_len, " positions are not a power of two, or it has no block table");
      for (int64_t b = 0; b < B; ++b) {
        const int64_t block = (lengths[static_cast<size_t>(b)] - 1) / kb.block_len;
        KVLAB_CHECK(block < kb.width && kb.table[b * kb.width + block] >= 0, "decode step: row ", b,
                    "'s block table has no block for position ",
                    lengths[static_cast<size_t>(b)] - 1, " (reserve the positions first)");
      }
    }
    k_strides = v_strides = {0, r.head_stride, r.pos_stride};
    S = r.positions;
    bf16 = r.dtype == DType::BF16;
    quantised = is_quantised(r.dtype);
  }
  // Where position p of row b lies from the row's pointer, in elements (head 0).
  int64_t position(int64_t b, int64_t p) const {
    if (rows.blocks == nullptr) return p * rows.pos_stride;
    const KVBlocks& kb = *rows.blocks;
    return kb.table[b * kb.width + p / kb.block_len] * kb.block_stride +
           p % kb.block_len * rows.pos_stride;
  }
  // fn(tag) with tag's ::type the rows' elements: float, uint16_t for bf16, or uint8_t for a
  // quantised row's bytes.
  template <class F>
  void typed(F&& fn) const {
    if (bf16)
      fn(std::type_identity<uint16_t>{});
    else if (quantised)
      fn(std::type_identity<uint8_t>{});
    else
      fn(std::type_identity<float>{});
  }
};

// Row b's new keys (which 0) or values (1) of KV head h, src (B, NKV * HS), quantised into
// the cache at the row's last position (length - 1). False where they are not finite.
static inline bool store_new_quantised(const CacheRef& kv, int which, const float* src, int64_t b,
                                       int64_t h, int64_t KVD, int64_t HS, const int64_t* lengths) {
  const KVRows& r = kv.rows;
  auto* row = static_cast<uint8_t*>((which == 0 ? r.k : r.v)[b]) + kv.position(b, lengths[b] - 1) +
              h * r.head_stride;
  const float scale = r.scales != nullptr ? r.scales[which * r.n_kv_head + h] : 0.0f;
  return store_kv_row(r.dtype, row, src + b * KVD + h * HS, 1, HS, scale);
}

// Elements [lo, hi) of each row's new keys (or values) src (B, NKV * HS) into the cache rows
// dst (a pointer per row, laid out as kv says) at the row's last position (length - 1); a
// bf16 cache rounds them as append would.
template <class KV>
static inline void store_new(void* const* dst, const CacheRef& kv, const float* src, int64_t B,
                             int64_t KVD, int64_t HS, const int64_t* lengths, int64_t lo,
                             int64_t hi) {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t at = kv.position(b, lengths[b] - 1);
    for (int64_t j = lo; j < hi;) {  // a run of one head's elements at a time
      const int64_t head = j / HS, n = std::min(hi, (head + 1) * HS) - j;
      KV* out = static_cast<KV*>(dst[b]) + at + head * kv.rows.head_stride + j % HS;
      store_kv_row(kv.rows.dtype, out, src + b * KVD + j, 1, n, 0.0f);  // f32 or bf16: any run
      j += n;
    }
  }
}

}  // namespace kvlab::decode
