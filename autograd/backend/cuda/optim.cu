// AdamW step and the sum of squares behind the global gradient norm (f32 parameters only).
#include <cmath>

#include "autograd/backend/cuda/common.cuh"
#include "autograd/backend/cuda/kernels.h"

namespace kvlab::cuda {
namespace {

constexpr unsigned kMaxSumBlocks = 1024;  // partials of sum_squares; also the final block size

// The CPU's order of operations (PyTorch's). The square root and the divisions are the IEEE
// round-to-nearest ones whatever the -prec-sqrt/-prec-div/fast-math flags of the build.
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, AdamWStep s,
                             float decay, float step_size, float bc2_sqrt) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gi = g[i] * s.grad_scale;
    const float mi = s.beta1 * m[i] + (1.0f - s.beta1) * gi;
    const float vi = s.beta2 * v[i] + (1.0f - s.beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = __fdiv_rn(__fsqrt_rn(vi), bc2_sqrt) + s.eps;
    p[i] = p[i] * decay - __fdiv_rn(step_size * mi, denom);
  }
}

// partial (gridDim.x): each block's sum of x[i]^2 in double over its grid-stride elements.
__global__ void sum_squares_partial_kernel(double* partial, const float* x, int64_t n) {
  __shared__ double shared[32];
  double s = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double xi = x[i];
    s += xi * xi;
  }
  s = block_sum(s, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// One block: *out = the sum of partial (count).
__global__ void sum_partials_kernel(double* out, const double* partial, int64_t count) {
  __shared__ double shared[32];
  double s = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
  s = block_sum(s, shared);
  if (threadIdx.x == 0) *out = s;
}

}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWStep& step) {
  if (n == 0) return;
  // The scalar factors exactly as the CPU computes them.
  const float decay = 1.0f - step.lr * step.weight_decay;
  const float step_size = step.lr / step.bias_correction1;
  const float bc2_sqrt = std::sqrt(step.bias_correction2);
  adamw_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(param, grad, m, v, n, step, decay,
                                                         step_size, bc2_sqrt);
  KVLAB_LAUNCH_CHECK();
}

double sum_squares(const float* x, int64_t n) {
  if (n == 0) return 0.0;
  // The grid depends on n only, so the order of the sums is fixed for a given n.
  const unsigned blocks = blocks_for(n) < kMaxSumBlocks ? blocks_for(n) : kMaxSumBlocks;
  double* buf = nullptr;  // partials (blocks), then the result (1)
  CUDA_CHECK(
      cudaMallocAsync(reinterpret_cast<void**>(&buf), (blocks + 1) * sizeof(double), stream()));
  sum_squares_partial_kernel<<<blocks, kThreads, 0, stream()>>>(buf, x, n);
  KVLAB_LAUNCH_CHECK();
  sum_partials_kernel<<<1, kMaxSumBlocks, 0, stream()>>>(buf + blocks, buf, blocks);
  KVLAB_LAUNCH_CHECK();
  double result = 0;
  CUDA_CHECK(
      cudaMemcpyAsync(&result, buf + blocks, sizeof(double), cudaMemcpyDeviceToHost, stream()));
  CUDA_CHECK(cudaFreeAsync(buf, stream()));
  CUDA_CHECK(cudaStreamSynchronize(stream()));
  return result;
}

}  // namespace kvlab::cuda
