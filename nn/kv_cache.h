#pragma once
// The interface GPT::forward uses to read and extend a KV cache. It lives here, below infer/,
// because the model code is shared by training and inference; infer/ implements it
// (preallocated today; a paged, block-table implementation fits the same calls).
#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "autograd/tensor.h"

namespace kvlab {

// Where a view that KVCache::slots() returns lies: its data, layout, element type and device,
// without the Tensor (sizes and strides of its first four dimensions).
struct SlotView {
  void* data = nullptr;
  int64_t dim = 0;
  std::array<int64_t, 4> sizes{}, strides{};
  DType dtype = DType::F32;
  Device device = Device::CPU;
  Tensor held;  // the view itself where one was made, kept alive with this
  static SlotView of(Tensor view) {
    SlotView s{view.raw_data(), view.dim(), {}, {}, view.dtype(), view.device(), Tensor()};
    for (int d = 0; d < std::min(view.dim(), 4); ++d) {
      s.sizes[static_cast<size_t>(d)] = view.size(d);
      s.strides[static_cast<size_t>(d)] = view.stride(d);
    }
    s.held = std::move(view);
    return s;
  }
};

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
  // The views append() would return for T new positions, storing nothing: the caller writes
  // row b's keys and values at positions lengths()[b] .. lengths()[b] + T - 1 of them itself,
  // before advance(T). The views must be the cache's own memory (what is written into them
  // is what the cache holds), and every layer's must stay valid together until advance():
  // the fused CPU decode step takes them all (as slot_views) before its parallel region, and
  // each thread writes the keys and values it computes, so that no thread waits while another
  // copies.
  virtual std::pair<Tensor, Tensor> slots(int layer, int64_t T) = 0;
  // Where slots()'s views lie, for a caller that needs no Tensor: the fused CPU decode step
  // takes every layer's at every step, and making the twelve views of a 6-layer model cost it
  // ~1.5 us a step. By default the views of slots(), held.
  virtual std::pair<SlotView, SlotView> slot_views(int layer, int64_t T) {
    auto [k, v] = slots(layer, T);
    return {SlotView::of(std::move(k)), SlotView::of(std::move(v))};
  }
  // Called once every layer has appended (or been written through slots): every row's
  // length grows by T.
  virtual void advance(int64_t T) = 0;
};

}  // namespace kvlab
