#pragma once
// ZeRO stage 1 for data-parallel training: AdamW whose moments are sharded across the ranks.
// The parameters are seen as one flat vector (named_parameters order); rank r owns elements
// [N r / W, N (r + 1) / W) of it and keeps the first and second moments of those only. Each
// step a rank updates its shard with the same kernel AdamW uses, through the same dispatch (so
// the result is bit-identical to plain data parallelism, and the moments live on the
// parameters' device), then the updated parameters are all-gathered in flat buckets through
// host buffers. Checkpoints gather the full moments on rank 0, in AdamW's layout, so they load
// anywhere.
#include <filesystem>
#include <memory>
#include <vector>

#include "checkpoints/checkpoint.h"
#include "nn/adamw.h"
#include "train/comm.h"

namespace kvlab {

class ShardedAdamW {
 public:
  ShardedAdamW(NamedTensors params, const AdamWConfig& cfg, std::shared_ptr<Communicator> comm,
               size_t bucket_bytes = kDefaultBucketBytes);

  // Updates this rank's shard from the gradients (already averaged over the ranks; multiplied
  // by grad_scale first), then all-gathers the parameters. Returns the seconds spent in the
  // all-gather. Parameters without a gradient are skipped, as AdamW does.
  double step(double lr, double grad_scale = 1.0);
  int64_t step_count() const { return step_; }

  int64_t numel() const { return offsets_.back(); }
  int64_t shard_begin() const { return bounds_[static_cast<size_t>(comm_->rank())]; }
  int64_t shard_end() const { return bounds_[static_cast<size_t>(comm_->rank()) + 1]; }

  // Collective: the full moments, named and shaped like the parameters, on rank 0 (nothing is
  // written on the other ranks).
  void gather_moments(NamedArrays& m, NamedArrays& v);
  // Takes this rank's shard out of full moments (as written by AdamW or gather_moments).
  void load_moments(const NamedArrays& m, const NamedArrays& v, int64_t step,
                    const std::filesystem::path& file);

 private:
  // Calls fn(param index, offset in the parameter, flat position, count) for the runs of
  // flat elements [begin, end).
  template <class F>
  void for_range(int64_t begin, int64_t end, F&& fn) const;
  // Flat elements [pos, pos + n) of parameter i (at offset off in it), as a 1-D view.
  Tensor flat(size_t i, int64_t off, int64_t n) const;

  NamedTensors params_;
  AdamWConfig cfg_;
  std::shared_ptr<Communicator> comm_;
  std::vector<int64_t> offsets_;  // (P + 1,) flat start of each parameter, then N
  std::vector<int64_t> bounds_;   // (W + 1,) shard boundaries
  Tensor m_, v_;                  // (shard size,) f32, on the parameters' device
  Tensor send_, recv_;            // (bucket size,) f32 host buffers of the all-gather
  int64_t bucket_elems_;
  int64_t step_ = 0;
};

}  // namespace kvlab
