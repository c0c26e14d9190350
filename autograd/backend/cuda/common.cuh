#pragma once
// Internal to autograd/backend/cuda/: error checks, the backend's stream and cuBLAS handle,
// launch sizes and block reductions shared by the kernels.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "platform/error.h"

namespace kvlab::cuda {

[[noreturn]] void throw_cuda(const char* file, int line, const char* expr, const char* what);

cudaStream_t stream();  // the one stream of the device this process uses

// cuBLAS, opened with dlopen on first use: linking it would map and relocate libcublasLt
// into every process, CPU-only runs included (docs/bench-log/code-figures.md).
struct Cublas {
  decltype(&cublasCreate_v2) create;
  decltype(&cublasSetStream_v2) set_stream;
  decltype(&cublasSetMathMode) set_math_mode;
  decltype(&cublasGetStatusString) status_string;
  decltype(&cublasSgemm_v2) sgemm;
  decltype(&cublasDgemm_v2) dgemm;
  decltype(&cublasSgemmStridedBatched) sgemm_strided_batched;
  decltype(&cublasDgemmStridedBatched) dgemm_strided_batched;
  // The header also has C++ overloads of these two (older computeType), so spelled out:
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*, cudaDataType,
                            int, const void*, void*, cudaDataType, int, cublasComputeType_t,
                            cublasGemmAlgo_t);
  cublasStatus_t (*gemm_strided_batched_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t,
                                            int, int, int, const void*, const void*, cudaDataType,
                                            int, long long, const void*, cudaDataType, int,
                                            long long, const void*, void*, cudaDataType, int,
                                            long long, int, cublasComputeType_t, cublasGemmAlgo_t);
};
const Cublas& cublas();
cublasHandle_t cublas_handle();  // bound to stream()

constexpr int kThreads = 256;  // default block size of elementwise kernels

inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535LL * 32 ? 65535LL * 32 : b));
}

// Threads of a block that strides over a row of C: a multiple of 32, no more than C needs.
inline int row_threads(int64_t C, int max_threads) {
  const int64_t t = (C + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : (t > max_threads ? max_threads : t));
}

__device__ inline float exp_t(float x) { return expf(x); }
__device__ inline double exp_t(double x) { return exp(x); }

// Up to kMaxDims dims of sizes and two operands' strides, passed to kernels by value.
constexpr int kMaxDims = 8;
struct Indexer {
  int nd;
  int64_t sizes[kMaxDims];
  int64_t strides[2][kMaxDims];
  // Element offsets of linear index i (row-major over sizes) in operand 0 and 1.
  __device__ void offsets(int64_t i, int64_t& o0, int64_t& o1) const {
    o0 = o1 = 0;
    for (int d = nd - 1; d >= 0; --d) {
      const int64_t idx = i % sizes[d];
      i /= sizes[d];
      o0 += idx * strides[0][d];
      o1 += idx * strides[1][d];
    }
  }
};
Indexer make_indexer(const char* op, const std::vector<int64_t>& sizes,
                     const std::vector<int64_t>& strides0, const std::vector<int64_t>& strides1);

// Sum over the 32 lanes of a warp; every lane gets the result.
template <class T>
__device__ inline T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <class T>
__device__ inline T warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. `shared` holds 32 values; the call synchronises the block.
template <class T>
__device__ inline T block_sum(T v, T* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : T(0);
  return warp_sum(v);
}
template <class T>
__device__ inline T block_max(T v, T* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : shared[0];
  return warp_max(v);
}

}  // namespace kvlab::cuda

#define CUDA_CHECK(expr)                                                                    \
  do {                                                                                      \
    const cudaError_t kvlab_err_ = (expr);                                                  \
    if (kvlab_err_ != cudaSuccess)                                                          \
      ::kvlab::cuda::throw_cuda(__FILE__, __LINE__, #expr, cudaGetErrorString(kvlab_err_)); \
  } while (0)

#define CUBLAS_CHECK(expr)                                                         \
  do {                                                                             \
    const cublasStatus_t kvlab_st_ = (expr);                                       \
    if (kvlab_st_ != CUBLAS_STATUS_SUCCESS)                                        \
      ::kvlab::cuda::throw_cuda(__FILE__, __LINE__, #expr,                         \
                                ::kvlab::cuda::cublas().status_string(kvlab_st_)); \
  } while (0)

// After every launch: a bad configuration is reported here, a fault at the next sync.
#define KVLAB_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())
