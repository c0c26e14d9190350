#pragma once
// Communication between data-parallel training ranks. A Communicator is either local (one
// process, every collective a no-op) or MPI (one rank per process, started by mpirun). Every
// collective must be called by every rank in the same order. The MPI one never blocks forever:
// a collective that does not complete within timeout_s throws kvlab::Error naming this rank,
// the collective and the ranks that did not answer, and the job is then aborted at exit so no
// rank hangs. Device (GPU) buffers are reduced with NCCL inside the MPI communicator, which
// shares NCCL's unique id over MPI (builds with CUDA and NCCL).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "nn/module.h"

namespace kvlab {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual int local_rank() const = 0;       // rank among the processes of this machine
  virtual std::string backend() const = 0;  // "local" | "mpi"
  virtual double timeout_s() const = 0;

  // In place: every rank ends with the element-wise mean over ranks (f32: sum, then times
  // 1 / world_size), bit-identical on every rank. `what` names the operation in errors.
  virtual void allreduce_mean(std::span<float> data, std::string_view what) = 0;
  // The same for a contiguous f32 tensor on any device: host memory goes through the span
  // version, GPU memory through NCCL (MPI communicators of a CUDA build with NCCL).
  virtual void allreduce_mean(const Tensor& flat, std::string_view what);
  // In place: every rank ends with the element-wise sum over ranks (f64).
  virtual void allreduce_sum(std::span<double> data, std::string_view what) = 0;
  // Copies root's bytes into every other rank's `data` (same size on every rank).
  virtual void broadcast(std::span<std::byte> data, int root, std::string_view what) = 0;
  // Every rank's `mine` (the same length everywhere), concatenated in rank order, on `root`;
  // an empty vector on the other ranks.
  virtual std::vector<uint64_t> gather(std::span<const uint64_t> mine, int root,
                                       std::string_view what) = 0;
  // Rank r contributes counts[r] floats (`mine`); `out` (sum of counts) receives them in rank
  // order: on every rank (allgatherv) or on root only (gatherv; `out` is ignored elsewhere).
  virtual void allgatherv(std::span<const float> mine, std::span<float> out,
                          std::span<const int64_t> counts, std::string_view what) = 0;
  virtual void gatherv(std::span<const float> mine, std::span<float> out,
                       std::span<const int64_t> counts, int root, std::string_view what) = 0;
  virtual void barrier(std::string_view what) = 0;

  // Collective: the ranks that pass the same `color` form a new communicator, ranked in this
  // one's order, with this one's timeout (a local communicator returns itself).
  virtual std::shared_ptr<Communicator> split(int color, std::string_view what) = 0;

  // Called after an error on this rank that the other ranks may not share: the process then
  // ends the whole job at exit (MPI_Abort) instead of waiting for the others in MPI_Finalize.
  virtual void fail() {}
};

// One process: rank 0 of 1; collectives return their input.
std::shared_ptr<Communicator> local_communicator();

// True when an MPI launcher started this process (mpirun/mpiexec, or srun with PMI/PMIx).
bool launched_by_mpi();
// The number of ranks the launcher started (from its environment; 1 without a launcher).
int launcher_world_size();

// The communicator of this process: MPI over all ranks when launched by mpirun and kvlab was
// built with MPI (KVLAB_HAVE_MPI), local otherwise; a process that was not launched by mpirun
// never initialises MPI. The first MPI call initialises MPI (later calls return the same
// communicator; timeout_s is taken from the first); MPI is finalised at exit, or the job is
// aborted when a collective failed or fail() was called. Throws when launched with more than
// one rank by a kvlab built without MPI (each rank would train its own copy).
std::shared_ptr<Communicator> world_communicator(double timeout_s = 120.0);

inline constexpr size_t kDefaultBucketBytes = size_t{8} << 20;  // 8 MiB

// Averages the gradients of `params` over the ranks: they are copied into flat buckets of at
// most bucket_bytes, one all-reduce per bucket, and copied back. Parameters without a gradient
// are skipped (every rank has the same graph, so the same ones). No-op with one rank.
// The gradients may live on the CPU or a GPU (all on one device); the bucket lives there too.
class GradientReducer {
 public:
  explicit GradientReducer(size_t bucket_bytes = kDefaultBucketBytes);
  void allreduce_mean(Communicator& comm, const NamedTensors& params);
  int64_t buckets_last_step() const { return buckets_; }

 private:
  size_t bucket_elems_;
  Tensor buffer_;  // (bucket_elems) on the gradients' device
  int64_t buckets_ = 0;
};

// True when `value` is the same on every rank (collective; every rank gets the answer).
bool same_on_all_ranks(Communicator& comm, uint64_t value, std::string_view what);

// FNV-1a over bytes, continuing from `h` (for comparing states across ranks).
uint64_t hash_bytes(const void* data, size_t n, uint64_t h = 0xcbf29ce484222325ull);

}  // namespace kvlab
