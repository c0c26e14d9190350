#pragma once
// The interface GPT::forward uses to read and extend a KV cache. It lives here, below infer/,
// because the model code is shared by training and inference; infer/ implements it
// (preallocated, or paged: blocks reached through block tables, which the attention reads).
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "autograd/backend/kernel_types.h"
#include "autograd/tensor.h"

namespace kvlab {

class KVCache {
 public:
  virtual ~KVCache() = default;
  virtual int64_t batch() const = 0;
  virtual int64_t capacity() const = 0;  // S_max: positions each row can hold
  // Cached positions per row before the current forward.
  virtual const std::vector<int64_t>& lengths() const = 0;
  // Per row, the sequence position its first cached slot holds: 0 unless the row dropped its
  // oldest positions to go on past the context (GenerationKVCache::drop_front, RoPE only). Row
  // b's slot i holds position position_offsets()[b] + i; its keys are rotated there.
  virtual const std::vector<int64_t>& position_offsets() const = 0;
  // Stores k, v (B, NKV, T, HS) of `layer` at each row's current length and returns what the
  // attention op reads: views (B, NKV, S, HS) with S = max(lengths) + T, or, where kv_blocks()
  // is set, the layer's pools of blocks, read through it. A quantised cache's views hold its
  // rows' bytes, not HS values (platform/kv_rows.h). Row b's valid length is
  // lengths()[b] + T.
  virtual std::pair<Tensor, Tensor> append(int layer, const Tensor& k, const Tensor& v) = 0;
  // Null for a cache whose append() returns (B, NKV, S, HS) views; a paged cache's block tables
  // (AttentionOptions::kv_blocks), the same for every layer, valid until advance().
  virtual const KVBlocks* kv_blocks() const { return nullptr; }
  // An fp8 cache's scales of `layer` (AttentionOptions::kv_scales); empty for other dtypes.
  virtual std::span<const float> kv_scales(int /*layer*/) const { return {}; }
  // Called once every layer has appended: every row's length grows by T.
  virtual void advance(int64_t T) = 0;
};

}  // namespace kvlab
