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

void copy_window(const std::vector<int32_t>& ids, const std::vector<int32_t>* targets,
                 size_t start, size_t block_size, int32_t* x, int32_t* y) {
  const int32_t* src = ids.data() + start;
  std::copy(src, src + block_size, x);
  const int32_t* next = (targets != nullptr ? targets->data() : ids.data()) + start + 1;
  std::copy(next, next + block_size, y);
}

// Window starts a split of n tokens offers: any of [0, n - T), or with a period the multiples
// of it with a whole window after them.
uint64_t start_count(size_t n_tokens, int block_size, int64_t period) {
  const auto T = static_cast<size_t>(block_size);
  if (period == 0) return n_tokens - T;
  KVLAB_CHECK(period >= block_size + 1, "sampler: examples of ", period,
              " tokens are shorter than a window of ", block_size + 1);
  return (n_tokens - T - 1) / static_cast<size_t>(period) + 1;
}

void check_targets(const std::vector<int32_t>& ids, const std::vector<int32_t>* targets,
                   const char* who) {
  KVLAB_CHECK(targets == nullptr || targets->size() == ids.size(), who, ": ", targets->size(),
              " targets for ", ids.size(), " tokens");
}

}  // namespace

BatchSampler::BatchSampler(const std::vector<int32_t>& ids, int batch_size, int block_size,
                           uint64_t seed, const std::vector<int32_t>* targets, int64_t period)
    : ids_(&ids),
      targets_(targets),
      period_(period),
      batch_size_(batch_size),
      block_size_(block_size),
      gen_(seed) {
  KVLAB_CHECK(batch_size >= 1, "sampler: batch_size must be positive, got ", batch_size);
  check_fits(ids.size(), block_size, "sampler");
  check_targets(ids, targets, "sampler");
  start_count(ids.size(), block_size, period);
}

void BatchSampler::next(std::vector<int32_t>& x, std::vector<int32_t>& y) {
  check_fits(ids_->size(), block_size_, "sampler");
  const auto T = static_cast<size_t>(block_size_);
  x.resize(static_cast<size_t>(batch_size_) * T);
  y.resize(x.size());
  const uint64_t n_starts = start_count(ids_->size(), block_size_, period_);
  const uint64_t stride = period_ > 0 ? static_cast<uint64_t>(period_) : 1;
  for (size_t b = 0; b < static_cast<size_t>(batch_size_); ++b) {
    copy_window(*ids_, targets_, gen_.below(n_starts) * stride, T, x.data() + b * T,
                y.data() + b * T);
  }
}

std::vector<int64_t> fixed_windows(int64_t n_tokens, int block_size, int count, uint64_t seed,
                                   int64_t period) {
  KVLAB_CHECK(n_tokens >= 0 && count >= 0, "fixed_windows: n_tokens ", n_tokens, " and count ",
              count, " must not be negative");
  check_fits(static_cast<size_t>(n_tokens), block_size, "fixed_windows");
  const uint64_t n_starts = start_count(static_cast<size_t>(n_tokens), block_size, period);
  const int64_t stride = period > 0 ? period : 1;
  Generator gen(seed);
  std::vector<int64_t> starts(static_cast<size_t>(count));
  for (int64_t& s : starts) s = static_cast<int64_t>(gen.below(n_starts)) * stride;
  return starts;
}

void fill_windows(const std::vector<int32_t>& ids, std::span<const int64_t> starts, int block_size,
                  std::vector<int32_t>& x, std::vector<int32_t>& y,
                  const std::vector<int32_t>* targets) {
  check_fits(ids.size(), block_size, "fill_windows");
  check_targets(ids, targets, "fill_windows");
  const auto T = static_cast<size_t>(block_size);
  const auto max_start = static_cast<int64_t>(ids.size() - T - 1);
  x.resize(starts.size() * T);
  y.resize(x.size());
  for (size_t i = 0; i < starts.size(); ++i) {
    KVLAB_CHECK(starts[i] >= 0 && starts[i] <= max_start, "fill_windows: window start ", starts[i],
                " is outside [0, ", max_start, "] for ", ids.size(), " tokens and block_size ",
                block_size);
    copy_window(ids, targets, static_cast<size_t>(starts[i]), T, x.data() + i * T,
                y.data() + i * T);
  }
}

}  // namespace kvlab
