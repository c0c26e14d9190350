#include "infer/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <numeric>

namespace kvlab {

int64_t kv_cache_formula_bytes(int64_t L, int64_t B, int64_t S, int64_t NKV, int64_t HS,
                               int64_t bytes_per_elem) {
  return 2 * L * B * S * NKV * HS * bytes_per_elem;
}

// Active rows [first, first + count) of a ContiguousKVCache seen as a cache of their own.
class ContiguousKVCache::RowRange final : public DecodeKVCache {
 public:
  explicit RowRange(ContiguousKVCache& parent) : parent_(parent) {}
  void select(int64_t first, int64_t count) {
    first_ = first;
    lengths_.assign(parent_.lengths_.begin() + first, parent_.lengths_.begin() + first + count);
  }
  int64_t batch() const override { return static_cast<int64_t>(lengths_.size()); }
  int64_t capacity() const override { return parent_.capacity_; }
  const std::vector<int64_t>& lengths() const override { return lengths_; }
  std::pair<Tensor, Tensor> append(int layer, const Tensor& k, const Tensor& v) override {
    return parent_.append_rows(layer, first_, k, v);
  }
  KVRows layer_rows(int layer, int64_t T) override {
    return parent_.layer_rows_of(layer, first_, batch(), T);
  }
  void advance(int64_t T) override {
    for (size_t i = 0; i < lengths_.size(); ++i) {
      lengths_[i] += T;
      parent_.lengths_[static_cast<size_t>(first_) + i] += T;
    }
  }

 private:
  ContiguousKVCache& parent_;
  int64_t first_ = 0;
  std::vector<int64_t> lengths_;
};

ContiguousKVCache::ContiguousKVCache(int64_t n_layer, int64_t max_batch, int64_t capacity,
                                     int64_t n_kv_head, int64_t head_size, DType dtype,
                                     Device device)
    : n_layer_(n_layer),
      max_batch_(max_batch),
      capacity_(capacity),
      n_kv_head_(n_kv_head),
      head_size_(head_size),
      dtype_(dtype),
      batch_(max_batch) {
  KVLAB_CHECK(n_layer >= 1 && max_batch >= 1 && capacity >= 1 && n_kv_head >= 1 && head_size >= 1,
              "kv cache: every size must be positive, got L = ", n_layer, ", B = ", max_batch,
              ", S = ", capacity, ", NKV = ", n_kv_head, ", HS = ", head_size);
  KVLAB_CHECK(dtype == DType::F32 || dtype == DType::F64 || dtype == DType::BF16,
              "kv cache: dtype ", dtype_name(dtype), " is not supported (f32, f64 or bf16)");
  const Shape shape{max_batch, n_kv_head, capacity, head_size};
  for (int64_t l = 0; l < n_layer; ++l) {
    // Zeroed so that positions past a row's length hold finite values (the attention op never
    // reads them, but a debugger or a test dumping the buffer should not see garbage).
    k_.push_back(Tensor::zeros(shape, dtype, device));
    v_.push_back(Tensor::zeros(shape, dtype, device));
  }
  const size_t row_bytes =
      static_cast<size_t>(n_kv_head * capacity * head_size) * dtype_size(dtype);
  for (int64_t l = 0; l < n_layer; ++l)
    for (int64_t b = 0; b < max_batch; ++b) {
      const size_t at = static_cast<size_t>(b) * row_bytes;
      k_rows_.push_back(static_cast<char*>(k_[static_cast<size_t>(l)].raw_data()) + at);
      v_rows_.push_back(static_cast<char*>(v_[static_cast<size_t>(l)].raw_data()) + at);
    }
  lengths_.assign(static_cast<size_t>(max_batch), 0);
  range_ = std::make_unique<RowRange>(*this);
}

ContiguousKVCache::~ContiguousKVCache() = default;

Tensor ContiguousKVCache::view(const Tensor& buf, int64_t first, int64_t n, int64_t S) const {
  const int64_t sh = capacity_ * head_size_, sb = n_kv_head_ * sh;
  return buf.as_strided({n, n_kv_head_, S, head_size_}, {sb, sh, head_size_, 1}, first * sb);
}

std::pair<Tensor, Tensor> ContiguousKVCache::append(int layer, const Tensor& k, const Tensor& v) {
  return append_rows(layer, 0, k, v);
}

KVRows ContiguousKVCache::layer_rows(int layer, int64_t T) {
  return layer_rows_of(layer, 0, batch_, T);
}

int64_t ContiguousKVCache::slot_length(int layer, int64_t first, int64_t n, int64_t T) const {
  KVLAB_CHECK(layer >= 0 && layer < n_layer_, "kv cache: layer ", layer, " outside [0, ", n_layer_,
              ")");
  KVLAB_CHECK(first >= 0 && n >= 0 && first + n <= batch_ && T >= 0, "kv cache: ", T,
              " positions for rows [", first, ", ", first + n, ") of a cache of ", batch_,
              " active rows");
  int64_t max_len = 0;
  for (int64_t b = first; b < first + n; ++b) {
    const int64_t len = lengths_[static_cast<size_t>(b)];
    KVLAB_CHECK(len + T <= capacity_, "kv cache: row ", b, " holds ", len, " positions, ", T,
                " more exceed its capacity of ", capacity_);
    max_len = std::max(max_len, len);
  }
  return max_len + T;
}

std::pair<Tensor, Tensor> ContiguousKVCache::views_rows(int layer, int64_t first, int64_t n,
                                                        int64_t T) {
  const int64_t S = slot_length(layer, first, n, T);
  return {view(k_[static_cast<size_t>(layer)], first, n, S),
          view(v_[static_cast<size_t>(layer)], first, n, S)};
}

KVRows ContiguousKVCache::layer_rows_of(int layer, int64_t first, int64_t n, int64_t T) {
  const int64_t S = slot_length(layer, first, n, T);
  const size_t row0 = static_cast<size_t>(layer * max_batch_ + first);
  return {k_rows_.data() + row0,
          v_rows_.data() + row0,
          n,
          n_kv_head_,
          head_size_,
          S,
          capacity_ * head_size_,
          head_size_,
          dtype_,
          k_[static_cast<size_t>(layer)].device()};
}

std::pair<Tensor, Tensor> ContiguousKVCache::append_rows(int layer, int64_t first, const Tensor& k,
                                                         const Tensor& v) {
  KVLAB_CHECK(k.dim() == 4 && k.sizes() == v.sizes(), "kv cache: k ", k.shape_str(), " and v ",
              v.shape_str(), " must both be (B, NKV, T, HS)");
  const int64_t n = k.size(0), T = k.size(2);
  KVLAB_CHECK(
      first >= 0 && first + n <= batch_ && k.size(1) == n_kv_head_ && k.size(3) == head_size_,
      "kv cache: k ", k.shape_str(), " does not fit rows [", first, ", ", first + n,
      ") of a cache of ", batch_, " active rows with NKV = ", n_kv_head_, ", HS = ", head_size_);
  // A bf16 cache stores f32 keys and values rounded to bf16.
  const DType input = dtype_ == DType::BF16 ? DType::F32 : dtype_;
  KVLAB_CHECK(k.dtype() == input && v.dtype() == input, "kv cache: k/v dtype ",
              dtype_name(k.dtype()), " does not fit the cache's ", dtype_name(dtype_));
  auto views = views_rows(layer, first, n, T);
  const Tensor& kb = k_[static_cast<size_t>(layer)];
  const Tensor& vb = v_[static_cast<size_t>(layer)];
  const size_t esize = dtype_size(dtype_);
  const size_t row_bytes = static_cast<size_t>(head_size_) * esize;
  const int64_t sh = capacity_ * head_size_, sb = n_kv_head_ * sh;
  auto store = [&](const Tensor& buf, const Tensor& src) {
    char* dst = static_cast<char*>(buf.raw_data());
    if (src.stride(3) == 1 && src.dtype() == buf.dtype() && buf.device() == Device::CPU &&
        src.device() == Device::CPU) {
      // One memcpy per (b, h, t) row of HS elements.
      const char* s = static_cast<const char*>(src.raw_data());
      const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t b = first + i, len = lengths_[static_cast<size_t>(b)];
        for (int64_t h = 0; h < n_kv_head_; ++h)
          for (int64_t t = 0; t < T; ++t)
            std::memcpy(dst + static_cast<size_t>(b * sb + h * sh + (len + t) * head_size_) * esize,
                        s + static_cast<size_t>(i * s0 + h * s1 + t * s2) * esize, row_bytes);
      }
      return;
    }
    for (int64_t i = 0; i < n; ++i) {  // strides, a dtype or a device: a strided copy per row
      const int64_t b = first + i, len = lengths_[static_cast<size_t>(b)];
      buf.as_strided({1, n_kv_head_, T, head_size_}, {sb, sh, head_size_, 1},
                     b * sb + len * head_size_)
          .copy_from(src.as_strided({1, n_kv_head_, T, head_size_},
                                    {src.stride(0), src.stride(1), src.stride(2), src.stride(3)},
                                    src.offset() + i * src.stride(0)));
    }
  };
  store(kb, k);
  store(vb, v);
  return views;
}

void ContiguousKVCache::advance(int64_t T) {
  KVLAB_CHECK(T >= 0, "kv cache: advance by ", T);
  for (auto& len : lengths_) {
    KVLAB_CHECK(len + T <= capacity_, "kv cache: advancing past the capacity of ", capacity_);
    len += T;
  }
}

void ContiguousKVCache::reset() {
  batch_ = max_batch_;
  lengths_.assign(static_cast<size_t>(max_batch_), 0);
}

void ContiguousKVCache::reset_row(int64_t b) {
  KVLAB_CHECK(b >= 0 && b < batch_, "kv cache: row ", b, " outside the ", batch_, " active rows");
  lengths_[static_cast<size_t>(b)] = 0;
}

DecodeKVCache& ContiguousKVCache::rows(int64_t first, int64_t count) {
  KVLAB_CHECK(first >= 0 && count >= 1 && first + count <= batch_, "kv cache: rows [", first, ", ",
              first + count, ") outside the ", batch_, " active rows");
  range_->select(first, count);
  return *range_;
}

void ContiguousKVCache::move_row(int64_t src, int64_t dst) {
  KVLAB_CHECK(src >= 0 && src < batch_ && dst >= 0 && dst < batch_, "kv cache: move_row ", src,
              " -> ", dst, " outside the ", batch_, " active rows");
  if (src == dst) return;
  const int64_t len = lengths_[static_cast<size_t>(src)];
  for (int64_t l = 0; l < n_layer_; ++l)
    for (const Tensor* buf : {&k_[static_cast<size_t>(l)], &v_[static_cast<size_t>(l)]})
      view(*buf, dst, 1, len).copy_from(view(*buf, src, 1, len));  // the valid positions only
  lengths_[static_cast<size_t>(dst)] = len;
}

void ContiguousKVCache::fork_row(int64_t src, int64_t dst) { move_row(src, dst); }

int64_t ContiguousKVCache::positions_stored() const {
  return std::accumulate(lengths_.begin(), lengths_.end(), int64_t{0});
}

void ContiguousKVCache::truncate_batch(int64_t count) {
  KVLAB_CHECK(count >= 0 && count <= batch_, "kv cache: truncate to ", count, " of ", batch_,
              " active rows");
  batch_ = count;
  lengths_.resize(static_cast<size_t>(count));
}

int64_t ContiguousKVCache::bytes() const {
  int64_t total = 0;
  for (size_t l = 0; l < k_.size(); ++l)
    total += static_cast<int64_t>(k_[l].storage()->nbytes() + v_[l].storage()->nbytes());
  return total;
}

}  // namespace kvlab
