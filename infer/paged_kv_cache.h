#pragma once
// A paged KV cache: keys and values in a pool of blocks of kv_block_size positions per layer,
// each sequence reaching its own through the block table its BlockManager keeps
// (infer/block_manager.h). The attention op reads the pools through those tables
// (KVCache::kv_blocks), so a sequence's positions never lie in one place and are never gathered
// there.
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "autograd/backend/kernel_types.h"
#include "autograd/tensor.h"
#include "infer/block_manager.h"
#include "infer/kv_cache.h"

namespace kvlab {

// The op path's KVCache over a BlockManager's blocks, on the CPU. Per layer, K and V are pools
// (n_blocks, NKV, kv_block_size, HS) of f32 or bf16, allocated once: KV head g's positions of
// a block are contiguous rows, so decode attention reads a block's keys of one head in one
// stream. Row b of a forward's batch is sequence rows()[b] of the manager, which owns the
// sequences (add, fork, free, take_prefix); this cache writes keys and values and performs the
// copies the manager's copy-on-write asks for.
//
// A forward of T tokens a row: reserve(tokens) (or prepare(), which throws instead of
// returning false) makes room in every row's blocks; then GPT::forward appends every layer's
// keys and values, or DecodeStep (T = 1) writes them through layer_rows' block tables, and
// either calls advance(T), which commits the tokens to the manager (keying the blocks they
// fill, for prefix caching).
//
// As a GenerationKVCache, the Engine's rows are sequences of the manager: reset() and
// reset_row() free the rows' sequences and add fresh, empty ones; move_row() swaps two rows'
// sequences (no keys or values move); truncate_batch() frees the dropped rows' sequences.
// These free whatever sequences the rows are, including ones given to set_rows().
class PagedKVCache final : public GenerationKVCache {
 public:
  // capacity: positions one sequence may reach (its block table's width is capacity /
  // kv_block_size, rounded up). dtype f32 or bf16 (f32 keys and values rounded as stored), or
  // fp8, int8 or int4 (quantised as stored; a pool's last dim is then a row's bytes,
  // platform/kv_rows.h), fp8 with its scales, (L, 2 NKV) as KVRows::scales reads them.
  // max_batch > 0 makes that many fresh sequences the rows (as reset() does); 0 leaves the
  // rows to set_rows().
  // values_are_keys (MLA's latent cache; fp8 with equal key and value scales): one pool per
  // layer, given as K and as V.
  PagedKVCache(BlockManager& blocks, int64_t n_layer, int64_t n_kv_head, int64_t head_size,
               int64_t capacity, DType dtype = DType::F32, int64_t max_batch = 0,
               std::vector<float> fp8_scales = {}, bool values_are_keys = false);
  ~PagedKVCache() override;

  // The sequences the batch's rows are, in order: distinct, each held by the manager; they
  // are then all max_batch() rows. Call again after the manager's sequences changed outside
  // this cache (a take_prefix, a fork).
  void set_rows(std::vector<SeqId> ids);
  const std::vector<SeqId>& row_ids() const { return ids_; }

  // Before a forward of T = tokens.size() / batch() tokens a row (row-major (B, T)): makes
  // room for them in every row's blocks, copying first, in every layer, a shared partly filled
  // last block its row is about to write (copy-on-write), and keeps the tokens for advance().
  // False, having changed nothing, when the pool cannot supply the blocks. Throws unless every
  // row has room for T more positions within capacity().
  bool reserve(std::span<const int32_t> tokens);
  // reserve(), throwing kvlab::Error (having changed nothing) that names the pool's size and
  // the blocks the forward asked for when the pool cannot supply them.
  void prepare(std::span<const int32_t> tokens) override;

  // ---- KVCache ----
  int64_t batch() const override { return static_cast<int64_t>(ids_.size()); }
  int64_t capacity() const override { return capacity_; }
  const std::vector<int64_t>& lengths() const override { return lengths_; }
  const std::vector<int64_t>& position_offsets() const override { return offsets_; }
  // k, v (B, NKV, T, HS) f32, any strides, T as reserved: written at each row's positions
  // lengths()[b] .. + T - 1 through its block table. Returns the layer's pools.
  std::pair<Tensor, Tensor> append(int layer, const Tensor& k, const Tensor& v) override;
  // Commits the reserved tokens: every row's length grows by T.
  void advance(int64_t T) override;
  const KVBlocks* kv_blocks() const override { return &view_; }
  std::span<const float> kv_scales(int layer) const override;

  // ---- DecodeKVCache ----
  // The layer's pools and the rows' block tables (KVRows::blocks), for the T positions a row
  // reserve() made room for. Throws unless T is what was reserved.
  KVRows layer_rows(int layer, int64_t T) override;

  // ---- GenerationKVCache ----
  int64_t max_batch() const override { return max_batch_; }
  void reset() override;
  void reset_row(int64_t b) override;
  // A cache over the same pools whose rows are rows [first, first + count) of this one; its
  // advance() moves this one's lengths too.
  DecodeKVCache& rows(int64_t first, int64_t count) override;
  void move_row(int64_t src, int64_t dst) override;  // swaps the two rows' sequences
  // Row dst's sequence is freed and dst becomes a fork of src's (BlockManager::fork).
  void fork_row(int64_t src, int64_t dst) override;
  // BlockManager::take_prefix for the row's sequence.
  int64_t reuse_prefix(int64_t row, std::span<const int32_t> tokens) override;
  void truncate_batch(int64_t count) override;
  // BlockManager::drop_front: n a multiple of kv_block_size.
  void drop_front(int64_t b, int64_t n) override;
  // The manager's blocks in use times the bytes one block takes in every layer's pools (and an
  // fp8 cache's scales).
  int64_t bytes() const override;
  // The manager's: positions in the blocks in use, and those blocks' positions.
  int64_t positions_stored() const override;
  int64_t positions_held() const override;

  // Forgets every row, as reset() does, and makes max_batch fresh rows.
  void reset_rows(int64_t max_batch);

  int64_t kv_block_size() const { return block_len_; }
  // A layer's pools (n_blocks, NKV, kv_block_size, HS, or a quantised row's bytes), for
  // inspection and tests.
  const Tensor& k_pool(int layer) const { return k_[static_cast<size_t>(layer)]; }
  const Tensor& v_pool(int layer) const { return v_[static_cast<size_t>(layer)]; }

 private:
  // A view of rows [first, first + count) of parent, sharing its pools.
  PagedKVCache(PagedKVCache& parent, int64_t first, int64_t count);
  // Rebuilds what follows from ids_ (row pointers, lengths) and forgets any reservation.
  void refresh();
  // An id the manager does not hold.
  SeqId unused_id();
  // An id the manager does not hold, added to it as an empty sequence.
  SeqId add_fresh();
  // Blocks a forward of T positions a row needs; throws unless every row has room within
  // capacity().
  int64_t blocks_needed(int64_t T);
  // Copies the first c.positions positions of block c.src over block c.dst, K and V of every
  // layer.
  void copy_block(const BlockCopy& c);
  // Writes src (B, NKV, T, HS) f32 into layer's pool of K (which 0) or V (1) at each row's new
  // positions.
  void store(int layer, int which, const Tensor& src, int64_t T);

  BlockManager& blocks_;
  int64_t n_layer_, n_kv_head_, head_size_, capacity_, block_len_, width_;
  DType dtype_;
  int64_t row_;                // elements of dtype_ a (position, head) row (platform/kv_rows.h)
  std::vector<float> scales_;  // fp8: (L, 2 NKV)
  bool values_are_keys_;       // v_ is k_
  std::vector<Tensor> k_, v_;  // per layer (n_blocks, NKV, kv_block_size, row_)
  // (L, batch): every row's pointer into each layer's pools, for layer_rows: the pool itself,
  // since a paged row is reached through its block table.
  std::vector<void*> k_rows_, v_rows_;
  std::vector<SeqId> ids_;
  std::vector<int64_t> lengths_;  // (batch) the sequences' lengths before the current forward
  std::vector<int64_t> offsets_;  // (batch) the sequences' offsets
  std::vector<int32_t> table_;    // (batch, width_) the sequences' block tables, -1 past them
  KVBlocks view_{};               // over table_
  std::vector<int32_t> tokens_;   // the reserved forward's tokens, (batch, reserved_)
  int64_t reserved_ = 0;          // T of the reserved forward, 0 when none is
  int64_t max_batch_ = 0;
  SeqId next_id_ = 0;  // where unused_id() starts looking
  // A rows() view: the cache it is a view of, and the first of that cache's rows it covers.
  PagedKVCache* parent_ = nullptr;
  int64_t first_ = 0;
  std::unique_ptr<PagedKVCache> range_;  // the last rows() view
};

}  // namespace kvlab
