// Measurements of the device itself, for benchmarks that report fractions of what the GPU can
// do: dense GEMM throughput and device-to-device copy bandwidth, timed with CUDA events.
#include <cuda_bf16.h>

#include <algorithm>
#include <vector>

#include "autograd/backend/cuda/common.cuh"
#include "autograd/backend/cuda/runtime.h"
#include "platform/random.h"

namespace kvlab::cuda {

namespace {
// Median seconds of `reps` timed calls of fn after two untimed ones.
template <class F>
double median_seconds(F&& fn, int reps) {
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 2; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    CUDA_CHECK(cudaEventRecord(start, stream()));
    fn();
    CUDA_CHECK(cudaEventRecord(stop, stream()));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    t.push_back(ms * 1e-3);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
// Uniform values in [-1, 1): the tensor cores run measurably faster on zeros, so a peak
// measured on zero matrices would flatter nothing but the denominator of an MFU.
__global__ void random_fill_kernel(void* p, DType t, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v =
        static_cast<float>(hash64(seed, static_cast<uint64_t>(i)) >> 40) * (2.0f / 16777216.0f) -
        1.0f;
    if (t == DType::BF16)
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
    else
      static_cast<float*>(p)[i] = v;
  }
}
}  // namespace

double gemm_tflops(DType dtype, int64_t n) {
  KVLAB_CHECK(dtype == DType::F32 || dtype == DType::BF16, "gemm_tflops: f32 or bf16, not ",
              dtype_name(dtype));
  const size_t elems = static_cast<size_t>(n * n), esize = dtype_size(dtype);
  void *a = nullptr, *b = nullptr, *c = nullptr;
  CUDA_CHECK(cudaMalloc(&a, elems * esize));
  CUDA_CHECK(cudaMalloc(&b, elems * esize));
  CUDA_CHECK(cudaMalloc(&c, elems * sizeof(float)));
  random_fill_kernel<<<blocks_for(static_cast<int64_t>(elems)), kThreads, 0, stream()>>>(
      a, dtype, static_cast<int64_t>(elems), 1);
  KVLAB_LAUNCH_CHECK();
  random_fill_kernel<<<blocks_for(static_cast<int64_t>(elems)), kThreads, 0, stream()>>>(
      b, dtype, static_cast<int64_t>(elems), 2);
  KVLAB_LAUNCH_CHECK();
  const int m = static_cast<int>(n);
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType in = dtype == DType::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  // bf16 inputs accumulate in f32 on the tensor cores; f32 stays plain FP32 (no TF32).
  const cublasComputeType_t compute =
      dtype == DType::BF16 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_PEDANTIC;
  const double s = median_seconds(
      [&] {
        CUBLAS_CHECK(cublas().gemm_ex(cublas_handle(), CUBLAS_OP_N, CUBLAS_OP_N, m, m, m, &one, a,
                                      in, m, b, in, m, &zero, c, CUDA_R_32F, m, compute,
                                      CUBLAS_GEMM_DEFAULT));
      },
      10);
  CUDA_CHECK(cudaFree(a));
  CUDA_CHECK(cudaFree(b));
  CUDA_CHECK(cudaFree(c));
  return 2.0 * static_cast<double>(n) * n * n / s / 1e12;
}

double copy_gbps(size_t nbytes) {
  void *src = nullptr, *dst = nullptr;
  CUDA_CHECK(cudaMalloc(&src, nbytes));
  CUDA_CHECK(cudaMalloc(&dst, nbytes));
  CUDA_CHECK(cudaMemsetAsync(src, 1, nbytes, stream()));
  const double s = median_seconds([&] { memcpy_on_device(dst, src, nbytes); }, 10);
  CUDA_CHECK(cudaFree(src));
  CUDA_CHECK(cudaFree(dst));
  return 2.0 * static_cast<double>(nbytes) / s / 1e9;  // read + write
}

}  // namespace kvlab::cuda
