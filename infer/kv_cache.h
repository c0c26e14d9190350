#pragma once
// KV caches for generation. GPT::forward talks to the abstract KVCache of
// nn/kv_cache_interface.h (append one forward's keys and values, then advance); DecodeStep
// (infer/decode/decode_step.h)
// writes and reads a cache's memory itself, through DecodeKVCache::layer_rows. The engine
// also needs to reset rows, prefill one row or a run of rows on its own, and drop finished
// rows from the batch.
// GenerationKVCache names those extra calls; ContiguousKVCache implements them over
// preallocated (B, NKV, S_max, HS) buffers.
//
// The paged cache, PagedKVCache (infer/paged_kv_cache.h), is the other GenerationKVCache: per
// layer a pool of (NKV, kv_block_size, HS) blocks that a BlockManager hands out to sequences,
// each reaching its own through a block table. Its prepare() takes the blocks a forward needs
// (copying a shared partly filled block first: copy-on-write); append() writes into them, the
// attention op reads the pools through the tables (KVCache::kv_blocks), and DecodeStep stores
// and attends through them too (KVRows::blocks): nothing is gathered into one place. Its rows
// are sequences of the manager: rows() restricts the block tables to some rows, move_row()
// swaps sequences instead of copying memory, reset_row() and truncate_batch() hand the rows'
// blocks back, and bytes() counts blocks in use, not B * S_max.
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "autograd/backend/kernel_types.h"
#include "autograd/tensor.h"
#include "nn/gpt.h"
#include "nn/kv_cache_interface.h"

namespace kvlab {

// What a cache holds, whatever its kind: per layer and position, n_kv_head rows of head_size
// values for K and for V (one row serving as both where values_are_keys: MLA's latent row),
// stored as dtype; a row reaches at most `context` positions.
struct KVCacheLayout {
  int64_t n_layer = 0;
  int64_t n_kv_head = 0;
  int64_t head_size = 0;
  int64_t context = 0;
  DType dtype = DType::F32;
  bool values_are_keys = false;
};
// Model c's cache of dtype: cache_heads() rows of cache_width() values, the context its
// block_size.
KVCacheLayout kv_cache_layout(const GPTConfig& c, DType dtype);

// 2 (K and V) * L * B * S * NKV * kv_row_bytes(dtype, HS): what a (B, NKV, S, HS) cache per
// layer for K and for V must take, a quantised row's scales included (platform/kv_rows.h). An fp8
// cache also holds its 2 * L * NKV f32 scales, which this counts too.
int64_t kv_cache_formula_bytes(int64_t L, int64_t B, int64_t S, int64_t NKV, int64_t HS,
                               DType dtype);
// 2 * L * NKV * kv_row_bytes(dtype, HS): the bytes one position takes in every layer's K and V.
int64_t kv_bytes_per_token(int64_t L, int64_t NKV, int64_t HS, DType dtype);
// The same for a cache of `layout`: half that where values are keys (one row serves as both).
int64_t kv_bytes_per_token(const KVCacheLayout& layout);
// The same for model c's cache: its K and V heads, or MLA's one latent row of cache_width()
// values per layer, which serves as key and value.
int64_t kv_bytes_per_token(const GPTConfig& c, DType dtype);
// B * S positions of that, plus fp8's scales: what a cache for model c must take.
int64_t kv_cache_formula_bytes(const GPTConfig& c, int64_t B, int64_t S, DType dtype);

// Writes one (position, KV head) row of HS f32 values (src, at element stride `stride`) into a
// cache's row of dtype at dst: f32 as they are, bf16 rounded to nearest even, fp8, int8 and
// int4 quantised (platform/kv_rows.h; fp8 with its head's scale; src then contiguous). False,
// having written a zeroed row, where a quantised row meets an infinity or a NaN: the caller
// refuses it, naming where (kv_nonfinite_error).
bool store_kv_row(DType dtype, void* dst, const float* src, int64_t stride, int64_t HS,
                  float fp8_scale);
// Checks an fp8 cache's scales, (L, 2 NKV) positive and finite, each key's equal to its
// value's where values_are_keys, or that a cache of another dtype was given none.
void check_fp8_scales(DType dtype, const std::vector<float>& scales, int64_t L, int64_t NKV,
                      bool values_are_keys);
// Layer `layer`'s 2 NKV scales of an fp8 cache's (L, 2 NKV) scales; empty for none.
std::span<const float> layer_fp8_scales(const std::vector<float>& scales, int layer, int64_t NKV);
[[noreturn]] void kv_nonfinite_error(DType dtype, int layer, int64_t row, int64_t head,
                                     int64_t position);

// One layer of a cache where DecodeStep reads and writes it, without a Tensor: row b's keys of
// KV head h at position p are the head_size contiguous elements of `dtype` from
// k[b] + h * head_stride + p * pos_stride (counted in elements), its values likewise from v[b].
// A paged cache sets `blocks`: k[b] and v[b] are then the layer's pools (block 0, head 0) and
// position p lies in block blocks->table[b * width + p / block_len] of them, at
// block * block_stride + h * head_stride + (p % block_len) * pos_stride.
// The cache's own memory: what is written there is what the cache holds.
struct KVRows {
  void* const* k = nullptr;  // (rows) each row's head 0, position 0
  void* const* v = nullptr;  // (rows)
  int64_t rows = 0, n_kv_head = 0, head_size = 0;
  int64_t positions = 0;  // S = max(lengths) + T: the positions a step's rows reach
  int64_t head_stride = 0, pos_stride = 0;
  // f32, bf16, or quantised (platform/kv_rows.h): then strides count bytes, and a row is
  // kv_row_bytes(dtype, head_size) of them.
  DType dtype = DType::F32;
  Device device = Device::CPU;
  // An fp8 cache's scales of this layer (2 NKV: every KV head's keys', then its values'), or null.
  const float* scales = nullptr;
  // Null for rows that each lie in one piece; a paged cache's block tables (every row's,
  // covering its positions up to `positions`), the same for every layer.
  const KVBlocks* blocks = nullptr;
};

// A KVCache whose memory its caller may write and read itself: DecodeStep's threads write the
// keys and values they compute straight into it, so that no thread waits while another copies.
class DecodeKVCache : public KVCache {
 public:
  // Where `layer`'s rows lie for T new positions at each row's length, storing nothing: the
  // caller writes row b's keys and values at positions lengths()[b] .. lengths()[b] + T - 1,
  // then calls advance(T). Throws unless the layer exists and every row has room for T more.
  // Every layer's stay valid together until advance(), and making them makes no Tensor and
  // allocates nothing: DecodeStep takes every layer's at every step, before its parallel
  // region.
  virtual KVRows layer_rows(int layer, int64_t T) = 0;
  // Called by the Engine before each forward of tokens (B, T) (row-major) into this cache: a
  // cache that takes memory as it goes takes it here, so that running out is an error before
  // anything is written. Nothing to do for a cache allocated up front.
  virtual void prepare(std::span<const int32_t> /*tokens*/) {}
};

class GenerationKVCache : public DecodeKVCache {
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
  virtual DecodeKVCache& rows(int64_t first, int64_t count) = 0;
  // Row dst takes row src's cached positions (and length), both active; what becomes of src
  // is the cache's (a contiguous cache leaves it as it was, a paged one gives it dst's old
  // sequence): the caller drops or resets it.
  virtual void move_row(int64_t src, int64_t dst) = 0;
  // Row dst becomes a copy of row src (its positions and length; both active) and src is kept:
  // a paged cache shares src's blocks (copy-on-write), a contiguous one copies the positions.
  virtual void fork_row(int64_t src, int64_t dst) = 0;
  // Prefix caching, for active row `row` while it is empty, before a prefill of `tokens`: takes
  // what the cache already holds for the tokens' first whole blocks (never the last token,
  // whose logits the prefill is for) and returns the positions taken, the row's length now.
  // A cache without prefix caching takes none.
  virtual int64_t reuse_prefix(int64_t /*row*/, std::span<const int32_t> /*tokens*/) { return 0; }
  // Keeps active rows [0, count) and drops the rest (count <= batch()).
  virtual void truncate_batch(int64_t count) = 0;
  // Row b forgets its oldest n cached positions (0 < n <= its length): the rest move to the
  // front, keeping the keys and values they were computed with, and its position offset grows
  // by n. What lets a RoPE model go on past its context without a re-prefill (its keys are
  // rotated at their positions, and attention sees only their differences). A paged cache
  // drops whole blocks: n a multiple of its kv_block_size.
  virtual void drop_front(int64_t b, int64_t n) = 0;
  // The memory this cache holds, measured from its allocations (not computed from a formula).
  virtual int64_t bytes() const = 0;
  // Positions the active rows store (one held by several rows counted once), and positions
  // the memory counted by bytes() can store: their ratio is the cache's utilisation.
  virtual int64_t positions_stored() const = 0;
  virtual int64_t positions_held() const = 0;
};

// Per layer, K and V as (B_max, NKV, S_max, HS) buffers allocated once; row b's positions
// 0 .. lengths()[b] - 1 are valid. Only NKV heads are stored, never repeated per query head.
// dtype f32, f64 or bf16, or on the CPU fp8, int8 or int4, whose buffers' last dim is a row's
// bytes (platform/kv_rows.h); fp8 takes its scales, (L, 2 NKV) as KVRows::scales reads them.
// values_are_keys (MLA's latent cache; fp8 with equal key and value scales): one buffer per
// layer, which append() and the views give as K and as V alike; append() stores only k.
class ContiguousKVCache final : public GenerationKVCache {
 public:
  ContiguousKVCache(int64_t n_layer, int64_t max_batch, int64_t capacity, int64_t n_kv_head,
                    int64_t head_size, DType dtype = DType::F32, Device device = Device::CPU,
                    std::vector<float> fp8_scales = {}, bool values_are_keys = false);
  // Rows of `layout`, each reaching `capacity` positions.
  ContiguousKVCache(const KVCacheLayout& layout, int64_t max_batch, int64_t capacity, Device device,
                    std::vector<float> fp8_scales);
  ~ContiguousKVCache() override;

  // ---- KVCache ----
  int64_t batch() const override { return batch_; }
  int64_t capacity() const override { return capacity_; }
  const std::vector<int64_t>& lengths() const override { return lengths_; }
  const std::vector<int64_t>& position_offsets() const override { return offsets_; }
  // k, v (B, NKV, T, HS), any strides: copied into each row at its length. Returns narrow
  // views (B, NKV, max(lengths) + T, HS) of the buffers (row b valid up to lengths[b] + T).
  std::pair<Tensor, Tensor> append(int layer, const Tensor& k, const Tensor& v) override;
  void advance(int64_t T) override;
  std::span<const float> kv_scales(int layer) const override;

  // ---- DecodeKVCache ----
  KVRows layer_rows(int layer, int64_t T) override;

  // ---- GenerationKVCache ----
  int64_t max_batch() const override { return max_batch_; }
  void reset() override;
  void reset_row(int64_t b) override;
  DecodeKVCache& rows(int64_t first, int64_t count) override;
  void move_row(int64_t src, int64_t dst) override;  // copies
  void fork_row(int64_t src, int64_t dst) override;  // copies, as move_row does
  void truncate_batch(int64_t count) override;
  void drop_front(int64_t b, int64_t n) override;  // moves the rest down (a copy per layer)
  int64_t bytes() const override;
  // Every active row's length; held: the whole allocation, max_batch * capacity.
  int64_t positions_stored() const override;
  int64_t positions_held() const override { return max_batch_ * capacity_; }

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
  // Views (n, NKV, S, HS) of those rows, or where they lie (S = slot_length).
  std::pair<Tensor, Tensor> views_rows(int layer, int64_t first, int64_t n, int64_t T);
  KVRows layer_rows_of(int layer, int64_t first, int64_t n, int64_t T);
  // Rows first .. first + n - 1 of a layer's buffer as a view (n, NKV, S, HS).
  Tensor view(const Tensor& buf, int64_t first, int64_t n, int64_t S) const;
  // A layer's distinct buffers: K and V, or the one both are.
  std::vector<const Tensor*> buffers(int64_t layer) const;

  int64_t n_layer_, max_batch_, capacity_, n_kv_head_, head_size_;
  DType dtype_;
  int64_t row_;  // elements of dtype_ a (position, head) row: head_size_, or a quantised row's bytes
  std::vector<float> scales_;  // fp8: (L, 2 NKV)
  bool values_are_keys_;       // v_ is k_
  int64_t batch_;
  std::vector<Tensor> k_, v_;  // per layer (B_max, NKV, S_max, HS)
  // (L, B_max): where each row of each layer's buffers starts, for layer_rows.
  std::vector<void*> k_rows_, v_rows_;
  std::vector<int64_t> lengths_;  // (batch_) cached positions per active row
  std::vector<int64_t> offsets_;  // (batch_) position_offsets()
  std::unique_ptr<RowRange> range_;
};

}  // namespace kvlab
