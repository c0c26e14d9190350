// The CUDA runtime side of the backend: device discovery, the stream, the cuBLAS handle, the
// caching device allocator and plain memory transfers.
#include <dlfcn.h>

#include <cstdlib>

#include "autograd/backend/allocator.h"
#include "autograd/backend/cuda/common.cuh"
#include "autograd/backend/cuda/runtime.h"

namespace kvlab {

bool cuda_built() { return true; }

void check_device_available(Device d) {
  if (d == Device::CPU) return;
  KVLAB_CHECK(cuda::device_count() > 0,
              "cuda: no CUDA GPU is visible to this process (no driver, no device, or "
              "CUDA_VISIBLE_DEVICES hides them); use the cpu device");
}

namespace {
// Device blocks: plain cudaMalloc, never managed memory. Out of memory is reported as null so
// the caching allocator can give its cache back and retry; any other failure throws.
void* cuda_raw_alloc(size_t n) {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, n);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // reset the last-error slot: this failure is handled here
    // The kernels' scratch pool keeps what it freed (stream() below): give that back, retry.
    int device = 0;
    cudaMemPool_t pool = nullptr;
    if (cudaStreamSynchronize(cuda::stream()) == cudaSuccess &&
        cudaGetDevice(&device) == cudaSuccess &&
        cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess &&
        cudaMemPoolTrimTo(pool, 0) == cudaSuccess && cudaMalloc(&p, n) == cudaSuccess)
      return p;
    cudaGetLastError();
    return nullptr;
  }
  CUDA_CHECK(err);
  return p;
}
// Errors are ignored: at process exit the context may already be gone.
void cuda_raw_free(void* p) { cudaFree(p); }
void cuda_raw_fill(void* p, unsigned char byte, size_t n) {
  CUDA_CHECK(cudaMemsetAsync(p, byte, n, cuda::stream()));
}
}  // namespace

Allocator& cuda_allocator() {
  static CachingAllocator alloc("cuda", cuda_raw_alloc, cuda_raw_free, cuda_raw_fill);
  return alloc;
}

}  // namespace kvlab

namespace kvlab::cuda {

void throw_cuda(const char* file, int line, const char* expr, const char* what) {
  throw Error(detail::cat("cuda: ", expr, " failed at ", file, ":", line, ": ", what));
}

int device_count() {
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  }();
  return count;
}

cudaStream_t stream() {
  static const cudaStream_t s = [] {
    check_device_available(Device::CUDA);
    cudaStream_t created = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    // Kernels take scratch space with cudaMallocAsync; the pool keeps freed memory instead of
    // returning it to the driver at every synchronisation.
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    cudaMemPool_t pool = nullptr;
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t keep = UINT64_MAX;
    CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    return created;
  }();
  return s;
}

const Cublas& cublas() {
  static const Cublas api = [] {
    void* lib = nullptr;
    for (const char* name : {KVLAB_CUBLAS_SONAME, KVLAB_CUDA_LIBDIR "/" KVLAB_CUBLAS_SONAME})
      if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    KVLAB_CHECK(lib != nullptr, "cuda: cannot load cuBLAS (", KVLAB_CUBLAS_SONAME,
                "): ", dlerror());
    auto sym = [&](const char* name) {
      void* f = dlsym(lib, name);
      KVLAB_CHECK(f != nullptr, "cuda: ", KVLAB_CUBLAS_SONAME, " has no ", name);
      return f;
    };
    Cublas c;
    c.create = reinterpret_cast<decltype(c.create)>(sym("cublasCreate_v2"));
    c.set_stream = reinterpret_cast<decltype(c.set_stream)>(sym("cublasSetStream_v2"));
    c.set_math_mode = reinterpret_cast<decltype(c.set_math_mode)>(sym("cublasSetMathMode"));
    c.status_string = reinterpret_cast<decltype(c.status_string)>(sym("cublasGetStatusString"));
    c.sgemm = reinterpret_cast<decltype(c.sgemm)>(sym("cublasSgemm_v2"));
    c.dgemm = reinterpret_cast<decltype(c.dgemm)>(sym("cublasDgemm_v2"));
    c.sgemm_strided_batched =
        reinterpret_cast<decltype(c.sgemm_strided_batched)>(sym("cublasSgemmStridedBatched"));
    c.dgemm_strided_batched =
        reinterpret_cast<decltype(c.dgemm_strided_batched)>(sym("cublasDgemmStridedBatched"));
    c.gemm_ex = reinterpret_cast<decltype(c.gemm_ex)>(sym("cublasGemmEx"));
    c.gemm_strided_batched_ex =
        reinterpret_cast<decltype(c.gemm_strided_batched_ex)>(sym("cublasGemmStridedBatchedEx"));
    return c;
  }();
  return api;
}

cublasHandle_t cublas_handle() {
  static const cublasHandle_t h = [] {
    cublasHandle_t created = nullptr;
    CUBLAS_CHECK(cublas().create(&created));
    CUBLAS_CHECK(cublas().set_stream(created, stream()));
    // Plain FP32 arithmetic (no TF32): the f32 path is the one compared against the CPU.
    CUBLAS_CHECK(cublas().set_math_mode(created, CUBLAS_DEFAULT_MATH));
    return created;
  }();
  return h;
}

void synchronize() { CUDA_CHECK(cudaStreamSynchronize(stream())); }

void memcpy_to_device(void* dst, const void* src, size_t nbytes) {
  if (nbytes == 0) return;
  // From pageable memory the call returns once the source has been staged: the caller may
  // reuse its buffer right away.
  CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, stream()));
}

void memcpy_to_host(void* dst, const void* src, size_t nbytes) {
  if (nbytes == 0) return;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, stream()));
  synchronize();
}

void memcpy_on_device(void* dst, const void* src, size_t nbytes) {
  if (nbytes == 0) return;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, stream()));
}

void memset_zero(void* dst, size_t nbytes) {
  if (nbytes == 0) return;
  CUDA_CHECK(cudaMemsetAsync(dst, 0, nbytes, stream()));
}

}  // namespace kvlab::cuda
