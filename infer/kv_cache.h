#pragma once
// KV caches for generation. GPT::forward talks to the abstract KVCache of nn/kv_cache.h
// (append one forward's keys and values, or write them through slots, then advance); the
// engine also needs to reset rows, prefill one row or a run of rows on its own, and drop
// finished rows from the batch.
// GenerationKVCache names those extra calls; ContiguousKVCache implements them over
// preallocated (B, NKV, S_max, HS) buffers.
//
// Room for a paged cache: a block-table implementation would derive from GenerationKVCache
// too, keep a pool of (NKV, block, HS) blocks per layer plus a (B, max_blocks) table, and
//  - append(): write each row's new positions into its current block (taking a free block
//    from the pool when one fills) instead of at an offset of one big buffer;
//  - slots(), slot_views(): the views must be the cache's own memory, which scattered
//    blocks are not, so the fused CPU decode step (their only caller) would take the block
//    table as well, for its cache writes and its attention alike;
//  - the views it returns: the attention op reads (B, NKV, S, HS) strided views today, so a
//    paged cache would either gather into a scratch buffer or pass its block table to a
//    paged attention kernel (the only change outside infer/);
//  - rows(): the same block table restricted to some rows;
//  - move_row(): swap block-table rows instead of copying memory;
//  - bytes(): blocks in use times the block size, not B * S_max.
// The engine uses only the GenerationKVCache calls, so it does not change.
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "autograd/tensor.h"
#include "nn/kv_cache.h"

namespace kvlab {

// 2 (K and V) * L * B * S * NKV * HS * bytes_per_elem: what a (B, NKV, S, HS) cache per layer
// for K and for V must take.
int64_t kv_cache_formula_bytes(int64_t L, int64_t B, int64_t S, int64_t NKV, int64_t HS,
                               int64_t bytes_per_elem);

class GenerationKVCache : public KVCache {
 public:
  // Rows that can be active at once, and the active count (batch() <= max_batch()).
  virtual int64_t max_batch() const = 0;
  // Forgets every row (lengths 0) and makes all max_batch() rows active again.
  virtual void reset() = 0;
  // Forgets row b (length 0); its memory is kept.
  virtual void reset_row(int64_t b) = 0;
  // A cache over active rows [first, first + count) sharing this one's memory: a forward of
  // just those rows (prefilling one prompt, re-prefilling one row after a slide) appends into
  // them. The view stays valid until the next rows() call.
  virtual KVCache& rows(int64_t first, int64_t count) = 0;
  // Copies row src's cached positions (and length) over row dst (both active).
  virtual void move_row(int64_t src, int64_t dst) = 0;
  // Keeps active rows [0, count) and drops the rest (count <= batch()).
  virtual void truncate_batch(int64_t count) = 0;
  // The memory this cache holds, measured from its allocations (not computed from a formula).
  virtual int64_t bytes() const = 0;
};

// Per layer, K and V as (B_max, NKV, S_max, HS) buffers allocated once; row b's positions
// 0 .. lengths()[b] - 1 are valid. Only NKV heads are stored, never repeated per query head.
class ContiguousKVCache final : public GenerationKVCache {
 public:
  ContiguousKVCache(int64_t n_layer, int64_t max_batch, int64_t capacity, int64_t n_kv_head,
                    int64_t head_size, DType dtype = DType::F32, Device device = Device::CPU);
  ~ContiguousKVCache() override;

  // ---- KVCache ----
  int64_t batch() const override { return batch_; }
  int64_t capacity() const override { return capacity_; }
  const std::vector<int64_t>& lengths() const override { return lengths_; }
  // k, v (B, NKV, T, HS), any strides: copied into each row at its length. Returns narrow
  // views (B, NKV, max(lengths) + T, HS) of the buffers (row b valid up to lengths[b] + T).
  std::pair<Tensor, Tensor> append(int layer, const Tensor& k, const Tensor& v) override;
  // Views of the buffers themselves: what the caller writes into them is cached.
  std::pair<Tensor, Tensor> slots(int layer, int64_t T) override;
  std::pair<SlotView, SlotView> slot_views(int layer, int64_t T) override;  // slots()'s, untensored
  void advance(int64_t T) override;

  // ---- GenerationKVCache ----
  int64_t max_batch() const override { return max_batch_; }
  void reset() override;
  void reset_row(int64_t b) override;
  KVCache& rows(int64_t first, int64_t count) override;
  void move_row(int64_t src, int64_t dst) override;
  void truncate_batch(int64_t count) override;
  int64_t bytes() const override;

  int64_t n_layer() const { return n_layer_; }
  int64_t n_kv_head() const { return n_kv_head_; }
  int64_t head_size() const { return head_size_; }
  DType dtype() const { return dtype_; }
  // The whole buffers of a layer, (B_max, NKV, S_max, HS), for inspection and tests.
  const Tensor& k_buffer(int layer) const { return k_[static_cast<size_t>(layer)]; }
  const Tensor& v_buffer(int layer) const { return v_[static_cast<size_t>(layer)]; }

 private:
  class RowRange;
  friend class RowRange;
  // Writes k, v (n, NKV, T, HS) into rows first .. first + n - 1 at their lengths and returns
  // views (n, NKV, max_len + T, HS) of those rows.
  std::pair<Tensor, Tensor> append_rows(int layer, int64_t first, const Tensor& k, const Tensor& v);
  // S = max_len + T for rows first .. first + n - 1, once they are checked to exist and to
  // have room for T more positions.
  int64_t slot_length(int layer, int64_t first, int64_t n, int64_t T) const;
  // Views (n, NKV, S, HS) of those rows, or where they lie.
  std::pair<Tensor, Tensor> slots_rows(int layer, int64_t first, int64_t n, int64_t T);
  std::pair<SlotView, SlotView> slot_views_rows(int layer, int64_t first, int64_t n, int64_t T);
  // Rows first .. first + n - 1 of a layer's buffer as (n, NKV, S, HS): where they lie, or a view.
  SlotView rows_of(const Tensor& buf, int64_t first, int64_t n, int64_t S) const;
  Tensor view(const Tensor& buf, int64_t first, int64_t n, int64_t S) const;

  int64_t n_layer_, max_batch_, capacity_, n_kv_head_, head_size_;
  DType dtype_;
  int64_t batch_;
  std::vector<Tensor> k_, v_;     // per layer (B_max, NKV, S_max, HS)
  std::vector<int64_t> lengths_;  // (batch_) cached positions per active row
  std::unique_ptr<RowRange> range_;
};

}  // namespace kvlab
