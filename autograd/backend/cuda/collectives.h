#pragma once
// NCCL behind a plain C++ interface (no CUDA header leaks out): the data-parallel trainer
// (train/comm.*) reduces device gradients with it, after sharing the unique id over MPI.
// Every wait is bounded: a collective that does not finish within the timeout aborts the NCCL
// communicator and throws kvlab::Error naming the operation, instead of hanging.
#include <array>
#include <cstdint>
#include <memory>
#include <string_view>

namespace kvlab::cuda {

// Makes GPU `index % device_count()` this process's device. Call before any other CUDA use
// (the stream and every allocation belong to the device current at their creation).
void select_device(int index);

using NcclId = std::array<char, 128>;
NcclId nccl_unique_id();  // on one rank; the others receive it

class NcclGroup {
 public:
  // Joins the group of `world` ranks as `rank`; waits at most timeout_s for the others.
  NcclGroup(int world, int rank, const NcclId& id, double timeout_s);
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  // In place on device memory: every rank ends with the element-wise mean (sum, then times
  // 1 / world), bit-identical on every rank.
  void allreduce_mean(float* data, int64_t n, std::string_view what);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlab::cuda
