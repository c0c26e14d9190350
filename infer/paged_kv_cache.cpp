#include "infer/paged_kv_cache.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "infer/kv_cache.h"
#include "platform/error.h"
#include "platform/kv_rows.h"

namespace kvlab {

PagedKVCache::PagedKVCache(BlockManager& blocks, int64_t n_layer, int64_t n_kv_head,
                           int64_t head_size, int64_t capacity, DType dtype, int64_t max_batch,
                           std::vector<float> fp8_scales, bool values_are_keys)
    : blocks_(blocks),
      n_layer_(n_layer),
      n_kv_head_(n_kv_head),
      head_size_(head_size),
      capacity_(capacity),
      block_len_(blocks.block_size()),
      width_((capacity + blocks.block_size() - 1) / blocks.block_size()),
      dtype_(dtype),
      row_(kv_row_bytes(dtype, head_size) / static_cast<int64_t>(dtype_size(dtype))),
      scales_(std::move(fp8_scales)),
      values_are_keys_(values_are_keys) {
  KVLAB_CHECK(n_layer >= 1 && n_kv_head >= 1 && head_size >= 1 && capacity >= 1,
              "paged KV cache: every size must be positive, got L = ", n_layer, ", NKV = ",
              n_kv_head, ", HS = ", head_size, ", capacity ", capacity);
  const std::string problem = kv_dtype_problem(dtype, head_size);
  KVLAB_CHECK(problem.empty(), "paged KV cache: ", problem);
  check_fp8_scales(dtype, scales_, n_layer, n_kv_head, values_are_keys);
  const Shape shape{blocks.total_blocks(), n_kv_head, block_len_, row_};
  for (int64_t l = 0; l < n_layer; ++l) {
    // Zeroed so that positions no sequence has written hold finite values (the attention
    // never reads them).
    k_.push_back(Tensor::zeros(shape, dtype));
    v_.push_back(values_are_keys ? k_.back() : Tensor::zeros(shape, dtype));
  }
  view_ = {nullptr, width_, block_len_, n_kv_head * block_len_ * row_};
  KVLAB_CHECK(max_batch >= 0, "paged KV cache: max_batch ", max_batch, " is negative");
  max_batch_ = max_batch;
  if (max_batch > 0) reset();
}

PagedKVCache::PagedKVCache(PagedKVCache& parent, int64_t first, int64_t count)
    : blocks_(parent.blocks_),
      n_layer_(parent.n_layer_),
      n_kv_head_(parent.n_kv_head_),
      head_size_(parent.head_size_),
      capacity_(parent.capacity_),
      block_len_(parent.block_len_),
      width_(parent.width_),
      dtype_(parent.dtype_),
      row_(parent.row_),
      scales_(parent.scales_),
      values_are_keys_(parent.values_are_keys_),
      k_(parent.k_),
      v_(parent.v_),
      view_(parent.view_),
      max_batch_(count),
      parent_(&parent),
      first_(first) {
  ids_.assign(parent.ids_.begin() + first, parent.ids_.begin() + first + count);
  refresh();
}

PagedKVCache::~PagedKVCache() = default;

void PagedKVCache::set_rows(std::vector<SeqId> ids) {
  std::unordered_set<SeqId> seen;
  for (const SeqId id : ids) {
    KVLAB_CHECK(blocks_.contains(id), "paged KV cache: no sequence ", id);
    KVLAB_CHECK(seen.insert(id).second, "paged KV cache: sequence ", id, " is two rows");
  }
  ids_ = std::move(ids);
  max_batch_ = batch();
  refresh();
}

void PagedKVCache::refresh() {
  k_rows_.clear();
  v_rows_.clear();
  for (int64_t l = 0; l < n_layer_; ++l)
    for (size_t b = 0; b < ids_.size(); ++b) {
      k_rows_.push_back(k_[static_cast<size_t>(l)].raw_data());
      v_rows_.push_back(v_[static_cast<size_t>(l)].raw_data());
    }
  lengths_.clear();
  for (const SeqId id : ids_) lengths_.push_back(blocks_.length(id));
  offsets_.clear();
  for (const SeqId id : ids_) offsets_.push_back(blocks_.offset(id));
  table_.clear();
  view_.table = nullptr;
  reserved_ = 0;
}

SeqId PagedKVCache::unused_id() {
  while (blocks_.contains(next_id_)) ++next_id_;
  return next_id_++;
}

SeqId PagedKVCache::add_fresh() {
  const SeqId id = unused_id();
  blocks_.add(id);
  return id;
}

void PagedKVCache::reset_rows(int64_t max_batch) {
  KVLAB_CHECK(max_batch >= 1, "paged KV cache: max_batch ", max_batch, " is not positive");
  for (const SeqId id : ids_) blocks_.free(id);
  ids_.clear();
  max_batch_ = max_batch;
  reset();
}

void PagedKVCache::reset() {
  KVLAB_CHECK(parent_ == nullptr, "paged KV cache: reset() of a rows() view");
  for (const SeqId id : ids_) blocks_.free(id);
  ids_.clear();
  for (int64_t b = 0; b < max_batch_; ++b) ids_.push_back(add_fresh());
  refresh();
}

void PagedKVCache::reset_row(int64_t b) {
  KVLAB_CHECK(parent_ == nullptr, "paged KV cache: reset_row() of a rows() view");
  KVLAB_CHECK(b >= 0 && b < batch(), "paged KV cache: row ", b, " outside [0, ", batch(), ")");
  blocks_.free(ids_[static_cast<size_t>(b)]);
  ids_[static_cast<size_t>(b)] = add_fresh();
  refresh();
}

DecodeKVCache& PagedKVCache::rows(int64_t first, int64_t count) {
  KVLAB_CHECK(first >= 0 && count >= 1 && first + count <= batch(), "paged KV cache: rows [",
              first, ", ", first + count, ") outside [0, ", batch(), ")");
  range_.reset();
  range_.reset(new PagedKVCache(*this, first, count));
  return *range_;
}

void PagedKVCache::move_row(int64_t src, int64_t dst) {
  KVLAB_CHECK(src >= 0 && src < batch() && dst >= 0 && dst < batch(), "paged KV cache: move_row(",
              src, ", ", dst, ") outside [0, ", batch(), ")");
  // Row dst becomes src's sequence; src now holds dst's, which the caller drops or resets.
  std::swap(ids_[static_cast<size_t>(src)], ids_[static_cast<size_t>(dst)]);
  refresh();
}

void PagedKVCache::fork_row(int64_t src, int64_t dst) {
  KVLAB_CHECK(parent_ == nullptr, "paged KV cache: fork_row() of a rows() view");
  KVLAB_CHECK(src >= 0 && src < batch() && dst >= 0 && dst < batch() && src != dst,
              "paged KV cache: fork_row(", src, ", ", dst, ") needs two rows of [0, ", batch(),
              ")");
  blocks_.free(ids_[static_cast<size_t>(dst)]);
  const SeqId child = unused_id();
  blocks_.fork(ids_[static_cast<size_t>(src)], child);
  ids_[static_cast<size_t>(dst)] = child;
  refresh();
}

int64_t PagedKVCache::reuse_prefix(int64_t row, std::span<const int32_t> tokens) {
  KVLAB_CHECK(parent_ == nullptr, "paged KV cache: reuse_prefix() of a rows() view");
  KVLAB_CHECK(row >= 0 && row < batch(), "paged KV cache: row ", row, " outside [0, ", batch(),
              ")");
  const int64_t taken = blocks_.take_prefix(ids_[static_cast<size_t>(row)], tokens);
  refresh();
  return taken;
}

int64_t PagedKVCache::positions_stored() const { return blocks_.stats().positions; }

int64_t PagedKVCache::positions_held() const { return blocks_.stats().in_use * block_len_; }

void PagedKVCache::truncate_batch(int64_t count) {
  KVLAB_CHECK(count >= 0 && count <= batch(), "paged KV cache: truncate_batch(", count,
              ") outside [0, ", batch(), "]");
  for (size_t b = static_cast<size_t>(count); b < ids_.size(); ++b) blocks_.free(ids_[b]);
  ids_.resize(static_cast<size_t>(count));
  refresh();
}

void PagedKVCache::drop_front(int64_t b, int64_t n) {
  KVLAB_CHECK(parent_ == nullptr, "paged KV cache: drop_front() of a rows() view");
  KVLAB_CHECK(b >= 0 && b < batch(), "paged KV cache: row ", b, " outside [0, ", batch(), ")");
  KVLAB_CHECK(n % block_len_ == 0, "paged KV cache: drops whole blocks of ", block_len_,
              " positions, not ", n);
  blocks_.drop_front(ids_[static_cast<size_t>(b)], n / block_len_);
  refresh();
}

int64_t PagedKVCache::bytes() const {
  int64_t pools = 0;
  for (const std::vector<Tensor>* p : {&k_, &v_})
    if (p == &k_ || !values_are_keys_)
      for (const Tensor& pool : *p) pools += static_cast<int64_t>(pool.storage()->nbytes());
  return blocks_.stats().in_use * (pools / blocks_.total_blocks()) +
         static_cast<int64_t>(scales_.size() * sizeof(float));
}

std::span<const float> PagedKVCache::kv_scales(int layer) const {
  return layer_fp8_scales(scales_, layer, n_kv_head_);
}

int64_t PagedKVCache::blocks_needed(int64_t T) {
  for (int64_t b = 0; b < batch(); ++b) {
    const SeqId id = ids_[static_cast<size_t>(b)];
    const int64_t len = blocks_.length(id);
    lengths_[static_cast<size_t>(b)] = len;
    KVLAB_CHECK(len + T <= capacity_, "paged KV cache: sequence ", id, " holds ", len,
                " positions, ", T, " more exceed the capacity of ", capacity_);
  }
  return blocks_.blocks_needed(ids_, T);
}

void PagedKVCache::prepare(std::span<const int32_t> tokens) {
  if (reserve(tokens)) return;
  const int64_t B = batch(), T = static_cast<int64_t>(tokens.size()) / B;
  KVLAB_CHECK(false, "paged KV cache: out of blocks: a forward of ", T, " token(s) on ", B,
              " row(s) needs ", blocks_needed(T), " more blocks of ", block_len_,
              " positions, but the pool of ", blocks_.total_blocks(), " blocks has ",
              blocks_.blocks_available(), " available (give the cache a larger pool)");
}

bool PagedKVCache::reserve(std::span<const int32_t> tokens) {
  const int64_t B = batch(), n = static_cast<int64_t>(tokens.size());
  KVLAB_CHECK(B > 0 && n > 0 && n % B == 0, "paged KV cache: ", n, " tokens for ", B, " rows");
  const int64_t T = n / B;
  // Rows are distinct sequences, reserved in order: blocks_needed(ids, T) counts exactly what
  // the reserves below take, so when they all fit, none fails halfway.
  if (blocks_needed(T) > blocks_.blocks_available()) return false;
  table_.assign(static_cast<size_t>(B * width_), -1);
  for (int64_t b = 0; b < B; ++b) {
    const SeqId id = ids_[static_cast<size_t>(b)];
    const auto copies = blocks_.reserve(id, T);
    KVLAB_ASSERT(copies.has_value(), "paged KV cache: sequence ", id, " found no blocks");
    for (const BlockCopy& c : *copies) copy_block(c);
    const std::vector<BlockId>& t = blocks_.table(id);
    std::copy(t.begin(), t.end(), table_.begin() + b * width_);
  }
  view_.table = table_.data();
  tokens_.assign(tokens.begin(), tokens.end());
  reserved_ = T;
  return true;
}

void PagedKVCache::copy_block(const BlockCopy& c) {
  const size_t esize = dtype_size(dtype_);
  const int64_t head = block_len_ * row_, block = n_kv_head_ * head;
  const size_t bytes = static_cast<size_t>(c.positions * row_) * esize;
  for (std::vector<Tensor>* pools : {&k_, &v_}) {
    if (pools == &v_ && values_are_keys_) break;
    for (Tensor& pool : *pools) {
      char* base = static_cast<char*>(pool.raw_data());
      for (int64_t h = 0; h < n_kv_head_; ++h)
        std::memcpy(base + static_cast<size_t>(c.dst * block + h * head) * esize,
                    base + static_cast<size_t>(c.src * block + h * head) * esize, bytes);
    }
  }
}

void PagedKVCache::store(int layer, int which, const Tensor& src_in, int64_t T) {
  // A quantised row is quantised from contiguous values.
  const Tensor src = is_quantised(dtype_) && src_in.stride(3) != 1 ? src_in.contiguous() : src_in;
  Tensor& pool = (which == 0 ? k_ : v_)[static_cast<size_t>(layer)];
  const std::span<const float> scales = kv_scales(layer);
  const int64_t head = block_len_ * row_, block = n_kv_head_ * head;
  const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2), s3 = src.stride(3);
  const float* s = src.data<float>();
  auto* base = static_cast<char*>(pool.raw_data());
  const auto esize = static_cast<int64_t>(dtype_size(dtype_));
  for (int64_t b = 0; b < batch(); ++b) {
    const int64_t len = lengths_[static_cast<size_t>(b)];
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = len + t;
      const int64_t at = table_[static_cast<size_t>(b * width_ + p / block_len_)] * block +
                         (p % block_len_) * row_;
      for (int64_t h = 0; h < n_kv_head_; ++h)
        if (!store_kv_row(dtype_, base + (at + h * head) * esize, s + b * s0 + h * s1 + t * s2, s3,
                          head_size_, scales.empty() ? 0.0f : scales[which * n_kv_head_ + h]))
          kv_nonfinite_error(dtype_, layer, b, h, p);
    }
  }
}

std::pair<Tensor, Tensor> PagedKVCache::append(int layer, const Tensor& k, const Tensor& v) {
  KVLAB_CHECK(layer >= 0 && layer < n_layer_, "paged KV cache: layer ", layer, " outside [0, ",
              n_layer_, ")");
  KVLAB_CHECK(reserved_ > 0, "paged KV cache: append before reserve()");
  KVLAB_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == batch() &&
                  k.size(1) == n_kv_head_ && k.size(2) == reserved_ && k.size(3) == head_size_,
              "paged KV cache: k ", k.shape_str(), " and v ", v.shape_str(), " are not (",
              batch(), ", ", n_kv_head_, ", ", reserved_, ", ", head_size_, ") as reserved");
  KVLAB_CHECK(k.dtype() == DType::F32 && v.dtype() == DType::F32 && k.device() == Device::CPU &&
                  v.device() == Device::CPU,
              "paged KV cache: k and v must be f32 on the CPU");
  store(layer, 0, k, reserved_);
  if (!values_are_keys_) store(layer, 1, v, reserved_);
  return {k_[static_cast<size_t>(layer)], v_[static_cast<size_t>(layer)]};
}

KVRows PagedKVCache::layer_rows(int layer, int64_t T) {
  KVLAB_CHECK(layer >= 0 && layer < n_layer_, "paged KV cache: layer ", layer, " outside [0, ",
              n_layer_, ")");
  KVLAB_CHECK(reserved_ > 0 && T == reserved_, "paged KV cache: rows for ", T,
              " positions a row, but reserve() made room for ", reserved_);
  const int64_t longest = *std::max_element(lengths_.begin(), lengths_.end());
  const size_t row0 = static_cast<size_t>(layer) * ids_.size();
  return {k_rows_.data() + row0,
          v_rows_.data() + row0,
          batch(),
          n_kv_head_,
          head_size_,
          longest + T,
          block_len_ * row_,
          row_,
          dtype_,
          Device::CPU,
          scales_.empty() ? nullptr : kv_scales(layer).data(),
          &view_};
}

void PagedKVCache::advance(int64_t T) {
  KVLAB_CHECK(T == reserved_, "paged KV cache: advance(", T, ") after reserving ", reserved_);
  for (int64_t b = 0; b < batch(); ++b) {
    blocks_.commit(ids_[static_cast<size_t>(b)],
                   std::span(tokens_).subspan(static_cast<size_t>(b * T), static_cast<size_t>(T)));
    lengths_[static_cast<size_t>(b)] += T;
    if (parent_ != nullptr) parent_->lengths_[static_cast<size_t>(first_ + b)] += T;
  }
  reserved_ = 0;
}

}  // namespace kvlab
