#pragma once
// Collectives over device memory, declared without naming a backend: the data-parallel
// trainer (train/comm.*) reduces device gradients with them, after sharing the group's id
// over MPI. The CUDA backend implements them over NCCL (cuda/nccl.cu), in builds with
// KVLAB_WITH_NCCL; no other build defines them. Every wait is bounded: a collective that does
// not finish within the timeout aborts the group and throws kvlab::Error naming the
// operation, instead of hanging.
#include <array>
#include <cstdint>
#include <memory>
#include <string_view>

namespace kvlab {

// Makes GPU `index % (GPUs visible)` this process's device. Call before any other CUDA use
// (the stream and every allocation belong to the device current at their creation).
void select_device(int index);

using DeviceGroupId = std::array<char, 128>;  // NCCL's unique id
DeviceGroupId device_group_id();  // on one rank; the others receive it

class DeviceGroup {
 public:
  // Joins the group of `world` ranks as `rank`; waits at most timeout_s for the others.
  DeviceGroup(int world, int rank, const DeviceGroupId& id, double timeout_s);
  ~DeviceGroup();
  DeviceGroup(const DeviceGroup&) = delete;
  DeviceGroup& operator=(const DeviceGroup&) = delete;
  // In place on device memory: every rank ends with the element-wise mean (sum, then times
  // 1 / world), bit-identical on every rank.
  void allreduce_mean(float* data, int64_t n, std::string_view what);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlab
