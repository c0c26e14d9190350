// NCCL on the GPU (label `cuda`; skipped without a GPU): a one-rank group's all-reduce equals
// the reduction the CPU path computes for the same gradients (the mean over one rank: the
// input). Several ranks need one GPU each: docs/benchmarks.md says how to run them on a
// multi-GPU machine.
#include <gtest/gtest.h>

#include <vector>

#include "autograd/backend/collectives.h"
#include "autograd/backend/cuda/runtime.h"
#include "platform/random.h"
#include "train/comm.h"

namespace kvlab {
namespace {

TEST(Nccl, OneRankAllReduceEqualsTheCpuReduction) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA GPU is visible";
  Generator gen(3);
  std::vector<float> v(100003);
  for (float& x : v) x = static_cast<float>(gen.normal());
  std::vector<float> want = v;
  local_communicator()->allreduce_mean(std::span<float>(want), "cpu reference");
  const Tensor host = Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
  const Tensor dev = host.to(Device::CUDA);
  DeviceGroup group(1, 0, device_group_id(), 60.0);
  group.allreduce_mean(dev.data<float>(), dev.numel(), "test all-reduce");
  EXPECT_EQ(dev.to_vector<float>(), want);
}

}  // namespace
}  // namespace kvlab
