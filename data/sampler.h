#pragma once
// Training batches at random positions and fixed evaluation windows over one split's token ids.
#include <cstdint>
#include <span>
#include <vector>

#include "platform/random.h"

namespace kvlab {

// Draws batch_size windows of block_size + 1 consecutive tokens at uniformly random starts, as
// nanoGPT's get_batch does. Keeps a pointer to `ids`: the vector must outlive the sampler and
// keep its size while the sampler is used.
//
// A task's split (Corpus::train_targets, example_tokens) passes its targets and the example
// length: windows then start at multiples of `period` and y is taken from the targets.
class BatchSampler {
 public:
  BatchSampler(const std::vector<int32_t>& ids, int batch_size, int block_size, uint64_t seed,
               const std::vector<int32_t>* targets = nullptr, int64_t period = 0);
  BatchSampler(std::vector<int32_t>&&, int, int, uint64_t) = delete;  // would dangle

  // x gets each window's first block_size tokens, y the same shifted by one (the targets).
  void next(std::vector<int32_t>& x, std::vector<int32_t>& y);  // (B, T) each

  int batch_size() const { return batch_size_; }
  int block_size() const { return block_size_; }
  // The generator state: restoring it (from a checkpoint) reproduces the following batches.
  Generator::State state() const { return gen_.state(); }
  void set_state(const Generator::State& state) { gen_.set_state(state); }

 private:
  const std::vector<int32_t>* ids_;
  const std::vector<int32_t>* targets_;  // null: the next tokens
  int64_t period_;                       // 0: any start
  int batch_size_;
  int block_size_;
  Generator gen_;
};

// Evaluation window starts: `count` draws from Generator(seed), uniform over
// [0, n_tokens - block_size) (with a period: over its multiples that start a whole window),
// the distribution BatchSampler trains on. They depend only on the arguments, so every run and
// every attention variant is evaluated on the same windows of a split.
std::vector<int64_t> fixed_windows(int64_t n_tokens, int block_size, int count,
                                   uint64_t seed = 1234, int64_t period = 0);

// Gathers the windows at `starts`: x and y become (starts.size(), block_size), y shifted by one
// (from `targets` where given).
void fill_windows(const std::vector<int32_t>& ids, std::span<const int64_t> starts, int block_size,
                  std::vector<int32_t>& x, std::vector<int32_t>& y,
                  const std::vector<int32_t>* targets = nullptr);

}  // namespace kvlab
