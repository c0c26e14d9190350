#include "infer/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "platform/kv_rows.h"
#include "platform/kv_rows.h"
#include "platform/scalar_codecs.h"

namespace kvlab {

namespace {

// An fp8 cache's 2 f32 scales per layer and cache head (MLA's: its latent row's, as key and
// value).
int64_t fp8_scale_bytes(int64_t L, int64_t NKV, DType dtype) {
  return dtype == DType::FP8 ? 2 * L * NKV * 4 : 0;
}

}  // namespace

int64_t kv_cache_formula_bytes(int64_t L, int64_t B, int64_t S, int64_t NKV, int64_t HS,
                               DType dtype) {
  return B * S * kv_bytes_per_token(L, NKV, HS, dtype) + fp8_scale_bytes(L, NKV, dtype);
}

KVCacheLayout kv_cache_layout(const GPTConfig& c, DType dtype) {
  return {.n_layer = c.n_layer,
          .n_kv_head = c.cache_heads(),
          .head_size = c.cache_width(),
          .context = c.block_size,
          .dtype = dtype,
          .values_are_keys = c.mla()};
}

int64_t kv_bytes_per_token(int64_t L, int64_t NKV, int64_t HS, DType dtype) {
  return 2 * L * NKV * kv_row_bytes(dtype, HS);
}

int64_t kv_bytes_per_token(const KVCacheLayout& layout) {
  const int64_t rows = layout.values_are_keys ? 1 : 2;  // K and V, or one row serving as both
  return rows * layout.n_layer * layout.n_kv_head * kv_row_bytes(layout.dtype, layout.head_size);
}

int64_t kv_bytes_per_token(const GPTConfig& c, DType dtype) {
  return kv_bytes_per_token(kv_cache_layout(c, dtype));
}

int64_t kv_cache_formula_bytes(const GPTConfig& c, int64_t B, int64_t S, DType dtype) {
  return B * S * kv_bytes_per_token(c, dtype) + fp8_scale_bytes(c.n_layer, c.cache_heads(), dtype);
}

bool store_kv_row(DType dtype, void* dst, const float* src, int64_t stride, int64_t HS,
                  float fp8_scale) {
  if (dtype == DType::F32) {
    auto* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < HS; ++i) d[i] = src[i * stride];
  } else if (dtype == DType::BF16) {
    auto* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < HS; ++i) d[i] = f32_to_bf16(src[i * stride]);
  } else {
    KVLAB_ASSERT(stride == 1, "store_kv_row: a quantised row is read contiguous");
    return quantise_kv_row(dtype, static_cast<uint8_t*>(dst), src, HS, fp8_scale);
  }
  return true;
}

void kv_nonfinite_error(DType dtype, int layer, int64_t row, int64_t head, int64_t position) {
  detail::throw_error(detail::cat("KV cache (", dtype_name(dtype), "): layer ", layer, ", row ",
                                  row, ", KV head ", head, ", position ", position,
                                  ": a key or value is infinite or NaN, which a quantised cache "
                                  "cannot store"));
}

std::span<const float> layer_fp8_scales(const std::vector<float>& scales, int layer, int64_t NKV) {
  if (scales.empty()) return {};
  return std::span<const float>(scales).subspan(static_cast<size_t>(layer * 2 * NKV),
                                                static_cast<size_t>(2 * NKV));
}

void check_fp8_scales(DType dtype, const std::vector<float>& scales, int64_t L, int64_t NKV,
                      bool values_are_keys) {
  if (dtype != DType::FP8) {
    KVLAB_CHECK(scales.empty(), "kv cache: scales are for an fp8 cache, not ", dtype_name(dtype));
    return;
  }
  KVLAB_CHECK(static_cast<int64_t>(scales.size()) == 2 * L * NKV,
              "kv cache: an fp8 cache takes 2 * L * NKV = ", 2 * L * NKV, " scales, got ",
              scales.size());
  for (const float s : scales)
    KVLAB_CHECK(std::isfinite(s) && s > 0, "kv cache: fp8 scale ", s, " is not positive and finite");
  // Rows that serve as keys and values are stored once, at the keys' scale, and read at both.
  for (int64_t l = 0; values_are_keys && l < L; ++l) {
    const std::span<const float> layer = layer_fp8_scales(scales, static_cast<int>(l), NKV);
    for (int64_t h = 0; h < NKV; ++h) {
      const float k = layer[static_cast<size_t>(h)], v = layer[static_cast<size_t>(NKV + h)];
      KVLAB_CHECK(k == v, "kv cache: its rows serve as keys and values, so an fp8 scale must be",
                  " both; layer ", l, ", KV head ", h, " has ", k, " for keys and ", v,
                  " for values");
    }
  }
}

// Active rows [first, first + count) of a ContiguousKVCache seen as a cache of their own.
class ContiguousKVCache::RowRange final : public DecodeKVCache {
 public:
  explicit RowRange(ContiguousKVCache& parent) : parent_(parent) {}
  void select(int64_t first, int64_t count) {
    first_ = first;
    lengths_.assign(parent_.lengths_.begin() + first, parent_.lengths_.begin() + first + count);
    offsets_.assign(parent_.offsets_.begin() + first, parent_.offsets_.begin() + first + count);
  }
  int64_t batch() const override { return static_cast<int64_t>(lengths_.size()); }
  int64_t capacity() const override { return parent_.capacity_; }
  const std::vector<int64_t>& lengths() const override { return lengths_; }
  const std::vector<int64_t>& position_offsets() const override { return offsets_; }
  std::pair<Tensor, Tensor> append(int layer, const Tensor& k, const Tensor& v) override {
    return parent_.append_rows(layer, first_, k, v);
  }
  KVRows layer_rows(int layer, int64_t T) override {
    return parent_.layer_rows_of(layer, first_, batch(), T);
  }
  std::span<const float> kv_scales(int layer) const override { return parent_.kv_scales(layer); }
  void advance(int64_t T) override {
    for (size_t i = 0; i < lengths_.size(); ++i) {
      lengths_[i] += T;
      parent_.lengths_[static_cast<size_t>(first_) + i] += T;
    }
  }

 private:
  ContiguousKVCache& parent_;
  int64_t first_ = 0;
  std::vector<int64_t> lengths_, offsets_;
};

ContiguousKVCache::ContiguousKVCache(int64_t n_layer, int64_t max_batch, int64_t capacity,
                                     int64_t n_kv_head, int64_t head_size, DType dtype,
                                     Device device, std::vector<float> fp8_scales,
                                     bool values_are_keys)
    : n_layer_(n_layer),
      max_batch_(max_batch),
      capacity_(capacity),
      n_kv_head_(n_kv_head),
      head_size_(head_size),
      dtype_(dtype),
      row_(kv_row_bytes(dtype, head_size) / static_cast<int64_t>(dtype_size(dtype))),
      scales_(std::move(fp8_scales)),
      values_are_keys_(values_are_keys),
      batch_(max_batch) {
  KVLAB_CHECK(n_layer >= 1 && max_batch >= 1 && capacity >= 1 && n_kv_head >= 1 && head_size >= 1,
              "kv cache: every size must be positive, got L = ", n_layer, ", B = ", max_batch,
              ", S = ", capacity, ", NKV = ", n_kv_head, ", HS = ", head_size);
  const std::string problem = dtype == DType::F64 ? "" : kv_dtype_problem(dtype, head_size);
  KVLAB_CHECK(problem.empty(), "kv cache: ", problem);
  KVLAB_CHECK(!is_quantised(dtype) || device == Device::CPU, "kv cache: dtype ", dtype_name(dtype),
              " is CPU-only");
  check_fp8_scales(dtype, scales_, n_layer, n_kv_head, values_are_keys);
  const Shape shape{max_batch, n_kv_head, capacity, row_};
  for (int64_t l = 0; l < n_layer; ++l) {
    // Zeroed so that positions past a row's length hold finite values (the attention op never
    // reads them, but a debugger or a test dumping the buffer should not see garbage).
    k_.push_back(Tensor::zeros(shape, dtype, device));
    v_.push_back(values_are_keys ? k_.back() : Tensor::zeros(shape, dtype, device));
  }
  const size_t row_bytes = static_cast<size_t>(n_kv_head * capacity * row_) * dtype_size(dtype);
  for (int64_t l = 0; l < n_layer; ++l)
    for (int64_t b = 0; b < max_batch; ++b) {
      const size_t at = static_cast<size_t>(b) * row_bytes;
      k_rows_.push_back(static_cast<char*>(k_[static_cast<size_t>(l)].raw_data()) + at);
      v_rows_.push_back(static_cast<char*>(v_[static_cast<size_t>(l)].raw_data()) + at);
    }
  lengths_.assign(static_cast<size_t>(max_batch), 0);
  offsets_.assign(static_cast<size_t>(max_batch), 0);
  range_ = std::make_unique<RowRange>(*this);
}

ContiguousKVCache::ContiguousKVCache(const KVCacheLayout& layout, int64_t max_batch,
                                     int64_t capacity, Device device, std::vector<float> fp8_scales)
    : ContiguousKVCache(layout.n_layer, max_batch, capacity, layout.n_kv_head, layout.head_size,
                        layout.dtype, device, std::move(fp8_scales), layout.values_are_keys) {}

ContiguousKVCache::~ContiguousKVCache() = default;

std::vector<const Tensor*> ContiguousKVCache::buffers(int64_t layer) const {
  const auto l = static_cast<size_t>(layer);
  if (values_are_keys_) return {&k_[l]};
  return {&k_[l], &v_[l]};
}

Tensor ContiguousKVCache::view(const Tensor& buf, int64_t first, int64_t n, int64_t S) const {
  const int64_t sh = capacity_ * row_, sb = n_kv_head_ * sh;
  return buf.as_strided({n, n_kv_head_, S, row_}, {sb, sh, row_, 1}, first * sb);
}

std::span<const float> ContiguousKVCache::kv_scales(int layer) const {
  return layer_fp8_scales(scales_, layer, n_kv_head_);
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
          capacity_ * row_,
          row_,
          dtype_,
          k_[static_cast<size_t>(layer)].device(),
          scales_.empty() ? nullptr : kv_scales(layer).data()};
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
  // A bf16 or quantised cache stores f32 keys and values, rounded or quantised.
  const DType input = dtype_ == DType::F64 ? dtype_ : DType::F32;
  KVLAB_CHECK(k.dtype() == input && v.dtype() == input, "kv cache: k/v dtype ",
              dtype_name(k.dtype()), " does not fit the cache's ", dtype_name(dtype_));
  auto views = views_rows(layer, first, n, T);
  const Tensor& kb = k_[static_cast<size_t>(layer)];
  const Tensor& vb = v_[static_cast<size_t>(layer)];
  if (is_quantised(dtype_)) {
    const std::span<const float> scales = kv_scales(layer);
    const int64_t rb = row_, sh = capacity_ * rb, sb = n_kv_head_ * sh;
    auto quantise = [&](const Tensor& buf, const Tensor& src_in, int64_t which) {
      const Tensor src = src_in.stride(3) == 1 ? src_in : src_in.contiguous();
      const float* s = src.data<float>();
      auto* dst = static_cast<uint8_t*>(buf.raw_data());
      for (int64_t i = 0; i < n; ++i) {
        const int64_t b = first + i, len = lengths_[static_cast<size_t>(b)];
        for (int64_t h = 0; h < n_kv_head_; ++h)
          for (int64_t t = 0; t < T; ++t)
            if (!store_kv_row(dtype_, dst + b * sb + h * sh + (len + t) * rb,
                              s + i * src.stride(0) + h * src.stride(1) + t * src.stride(2), 1,
                              head_size_, scales.empty() ? 0.0f : scales[which * n_kv_head_ + h]))
              kv_nonfinite_error(dtype_, layer, b, h, len + t);
      }
    };
    quantise(kb, k, 0);
    if (!values_are_keys_) quantise(vb, v, 1);
    return views;
  }
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
  if (!values_are_keys_) store(vb, v);
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
  offsets_.assign(static_cast<size_t>(max_batch_), 0);
}

void ContiguousKVCache::reset_row(int64_t b) {
  KVLAB_CHECK(b >= 0 && b < batch_, "kv cache: row ", b, " outside the ", batch_, " active rows");
  lengths_[static_cast<size_t>(b)] = 0;
  offsets_[static_cast<size_t>(b)] = 0;
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
    for (const Tensor* buf : buffers(l))
      view(*buf, dst, 1, len).copy_from(view(*buf, src, 1, len));  // the valid positions only
  lengths_[static_cast<size_t>(dst)] = len;
  offsets_[static_cast<size_t>(dst)] = offsets_[static_cast<size_t>(src)];
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
  offsets_.resize(static_cast<size_t>(count));
}

void ContiguousKVCache::drop_front(int64_t b, int64_t n) {
  KVLAB_CHECK(b >= 0 && b < batch_, "kv cache: row ", b, " outside the ", batch_, " active rows");
  const int64_t len = lengths_[static_cast<size_t>(b)], rest = len - n;
  KVLAB_CHECK(n >= 1 && n <= len, "kv cache: row ", b, " holds ", len, " positions, cannot drop ",
              n);
  const int64_t sh = capacity_ * row_, sb = n_kv_head_ * sh;
  for (int64_t l = 0; l < n_layer_ && rest > 0; ++l)
    for (const Tensor* buf : buffers(l)) {
      // Through a copy: the two ranges overlap when more is kept than dropped.
      Tensor tail = Tensor::empty({1, n_kv_head_, rest, row_}, dtype_, buf->device());
      tail.copy_from(buf->as_strided({1, n_kv_head_, rest, row_}, {sb, sh, row_, 1},
                                     b * sb + n * row_));
      view(*buf, b, 1, rest).copy_from(tail);
    }
  lengths_[static_cast<size_t>(b)] = rest;
  offsets_[static_cast<size_t>(b)] += n;
}

int64_t ContiguousKVCache::bytes() const {
  auto total = static_cast<int64_t>(scales_.size() * sizeof(float));
  for (int64_t l = 0; l < n_layer_; ++l)
    for (const Tensor* buf : buffers(l)) total += static_cast<int64_t>(buf->storage()->nbytes());
  return total;
}

}  // namespace kvlab
