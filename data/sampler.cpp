#include "data/sampler.h"

#include <algorithm>

#include "platform/error.h"

namespace kvlab {
namespace {

void check_fits(size_t n_tokens, int block_size, const char* who) {
  KVLAB_CHECK(block_size >= 1, who, ": block_size must be positive, got ", block_size);
  KVLAB_CHECK(n_tokens >= static_cast<size_t>(block_size) + 1, who, ": ", n_tokens,
              " tokens are too few for block_size ", block_size, " (need at least ", block_size + 1,
              ")");
}

void copy_window(const std::vector<int32_t>& ids, size_t start, size_t block_size, int32_t* x,
                 int32_t* y) {
  const int32_t* src = ids.data() + start;
  std::copy(src, src + block_size, x);
  std::copy(src + 1, src + block_size + 1, y);
}

}  // namespace

BatchSampler::BatchSampler(const std::vector<int32_t>& ids, int batch_size, int block_size,
                           uint64_t seed)
    : ids_(&ids), batch_size_(batch_size), block_size_(block_size), gen_(seed) {
  KVLAB_CHECK(batch_size >= 1, "sampler: batch_size must be positive, got ", batch_size);
  check_fits(ids.size(), block_size, "sampler");
}

void BatchSampler::next(std::vector<int32_t>& x, std::vector<int32_t>& y) {
  check_fits(ids_->size(), block_size_, "sampler");
  const auto T = static_cast<size_t>(block_size_);
  x.resize(static_cast<size_t>(batch_size_) * T);
  y.resize(x.size());
  const uint64_t n_starts = ids_->size() - T;
  for (size_t b = 0; b < static_cast<size_t>(batch_size_); ++b) {
    copy_window(*ids_, gen_.below(n_starts), T, x.data() + b * T, y.data() + b * T);
  }
}

std::vector<int64_t> fixed_windows(int64_t n_tokens, int block_size, int count, uint64_t seed) {
  KVLAB_CHECK(n_tokens >= 0 && count >= 0, "fixed_windows: n_tokens ", n_tokens, " and count ",
              count, " must not be negative");
  check_fits(static_cast<size_t>(n_tokens), block_size, "fixed_windows");
  Generator gen(seed);
  std::vector<int64_t> starts(static_cast<size_t>(count));
  for (int64_t& s : starts)
    s = static_cast<int64_t>(gen.below(static_cast<uint64_t>(n_tokens - block_size)));
  return starts;
}

void fill_windows(const std::vector<int32_t>& ids, std::span<const int64_t> starts, int block_size,
                  std::vector<int32_t>& x, std::vector<int32_t>& y) {
  check_fits(ids.size(), block_size, "fill_windows");
  const auto T = static_cast<size_t>(block_size);
  const auto max_start = static_cast<int64_t>(ids.size() - T - 1);
  x.resize(starts.size() * T);
  y.resize(x.size());
  for (size_t i = 0; i < starts.size(); ++i) {
    KVLAB_CHECK(starts[i] >= 0 && starts[i] <= max_start, "fill_windows: window start ", starts[i],
                " is outside [0, ", max_start, "] for ", ids.size(), " tokens and block_size ",
                block_size);
    copy_window(ids, static_cast<size_t>(starts[i]), T, x.data() + i * T, y.data() + i * T);
  }
}

}  // namespace kvlab
