#pragma once
// The interface GPT::forward uses to read and extend a KV cache. It lives here, below infer/,
// because the model code is shared by training and inference; infer/ implements it
// (preallocated today; a paged, block-table implementation fits the same calls).
#include <cstdint>
#include <utility>
#include <vector>

#include "autograd/tensor.h"

namespace kvlab {

class KVCache {
 public:
  virtual ~KVCache() = default;
  virtual int64_t batch() const = 0;
  virtual int64_t capacity() const = 0;  // S_max: positions each row can hold
  // Cached positions per row before the current forward.
  virtual const std::vector<int64_t>& lengths() const = 0;
  // Stores k, v (B, NKV, T, HS) of `layer` at each row's current length and returns views
  // (B, NKV, S, HS) with S = max(lengths) + T that the attention op reads; row b's valid
  // length is lengths()[b] + T.
  virtual std::pair<Tensor, Tensor> append(int layer, const Tensor& k, const Tensor& v) = 0;
  // Called once every layer has appended: every row's length grows by T.
  virtual void advance(int64_t T) = 0;
};

}  // namespace kvlab
