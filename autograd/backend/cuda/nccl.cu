// NCCL communicators in non-blocking mode, polled against a deadline (collectives.h).
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "autograd/backend/collectives.h"
#include "autograd/backend/cuda/common.cuh"
#include "autograd/backend/cuda/runtime.h"

#define NCCL_CHECK(expr)                                                                   \
  do {                                                                                     \
    const ncclResult_t kvlab_nr_ = (expr);                                                 \
    if (kvlab_nr_ != ncclSuccess && kvlab_nr_ != ncclInProgress)                           \
      ::kvlab::cuda::throw_cuda(__FILE__, __LINE__, #expr, ncclGetErrorString(kvlab_nr_)); \
  } while (0)

// The declarations are the backend-neutral ones of collectives.h, in kvlab; the definitions
// use the CUDA backend's stream and launch helpers.
namespace kvlab {

using cuda::blocks_for;
using cuda::device_count;
using cuda::kThreads;
using cuda::stream;

void select_device(int index) {
  check_device_available(Device::CUDA);
  CUDA_CHECK(cudaSetDevice(index % device_count()));
}

DeviceGroupId device_group_id() {
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id));
  DeviceGroupId out{};
  static_assert(sizeof(id) == sizeof(DeviceGroupId));
  std::memcpy(out.data(), &id, sizeof(id));
  return out;
}

struct DeviceGroup::Impl {
  ncclComm_t comm = nullptr;
  int world = 1;
  double timeout_s = 0;

  // Waits until the communicator has no operation in progress and `done` holds, polling its
  // asynchronous error; past the deadline the communicator is aborted.
  template <class Done>
  void wait(std::string_view what, Done&& done) {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    for (;;) {
      ncclResult_t state = ncclSuccess;
      NCCL_CHECK(ncclCommGetAsyncError(comm, &state));
      if (state != ncclSuccess && state != ncclInProgress) {
        ncclCommAbort(comm);
        comm = nullptr;
        KVLAB_CHECK(false, "nccl: ", what, " failed: ", ncclGetErrorString(state));
      }
      if (state == ncclSuccess && done()) return;
      if (std::chrono::steady_clock::now() > deadline) {
        ncclCommAbort(comm);
        comm = nullptr;
        KVLAB_CHECK(false, "nccl: ", what, " did not complete within ", timeout_s,
                    " s (a rank died or stalled)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
};

DeviceGroup::DeviceGroup(int world, int rank, const DeviceGroupId& id, double timeout_s)
    : impl_(std::make_unique<Impl>()) {
  impl_->world = world;
  impl_->timeout_s = timeout_s;
  ncclUniqueId uid;
  std::memcpy(&uid, id.data(), sizeof(uid));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // calls return at once; wait() bounds how long we wait
  stream();             // the device's stream exists before the communicator
  NCCL_CHECK(ncclCommInitRankConfig(&impl_->comm, world, uid, rank, &config));
  impl_->wait("communicator set-up", [] { return true; });
}

DeviceGroup::~DeviceGroup() {
  if (!impl_ || !impl_->comm) return;
  // Non-blocking communicators finalize before they are destroyed. Errors are ignored (this may
  // run at exit) and the wait is bounded, so a dead peer cannot hang the process.
  ncclComm_t comm = impl_->comm;
  ncclResult_t state = ncclCommFinalize(comm);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while ((state == ncclSuccess || state == ncclInProgress) &&
         ncclCommGetAsyncError(comm, &state) == ncclSuccess && state == ncclInProgress &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (state == ncclSuccess)
    ncclCommDestroy(comm);
  else
    ncclCommAbort(comm);
}

namespace {
__global__ void scale_kernel(float* x, int64_t n, float s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= s;
}
}  // namespace

void DeviceGroup::allreduce_mean(float* data, int64_t n, std::string_view what) {
  KVLAB_CHECK(impl_->comm != nullptr, "nccl: ", what, ": the communicator was aborted earlier");
  if (n == 0) return;
  NCCL_CHECK(
      ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat, ncclSum, impl_->comm, stream()));
  impl_->wait(what, [] { return true; });  // enqueued
  cudaEvent_t ev;
  CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(ev, stream()));
  impl_->wait(what, [&] {
    const cudaError_t q = cudaEventQuery(ev);
    if (q == cudaErrorNotReady) return false;
    CUDA_CHECK(q);
    return true;
  });
  CUDA_CHECK(cudaEventDestroy(ev));
  // The same multiplication on every rank keeps the ranks' results bit-identical.
  scale_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(data, n,
                                                         1.0f / static_cast<float>(impl_->world));
  KVLAB_LAUNCH_CHECK();
}

}  // namespace kvlab
