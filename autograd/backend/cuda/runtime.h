#pragma once
// What only the CUDA backend has, beside the kernel contract (backend/kernels.h): its runtime
// (runtime.cu), measurements of the device (probe.cu) and the mixed-precision GEMM (gemm.cu).
// Plain C++: no CUDA header leaks out of autograd/backend/cuda/.
#include <cstddef>
#include <cstdint>

#include "autograd/backend/device.h"

namespace kvlab::cuda {

// ---- runtime (runtime.cu) ----
int device_count();  // 0 when no driver or no GPU is present (never throws)
void synchronize();  // waits for the stream; errors of earlier kernels surface here
void memcpy_to_device(void* dst, const void* src, size_t nbytes);
void memcpy_to_host(void* dst, const void* src, size_t nbytes);  // waits for the result
void memcpy_on_device(void* dst, const void* src, size_t nbytes);
void memset_zero(void* dst, size_t nbytes);

// ---- measurements of the device (probe.cu), for benchmarks ----
double gemm_tflops(DType dtype, int64_t n);  // n x n x n cuBLAS GEMM, f32 or bf16 inputs
double copy_gbps(size_t nbytes);             // device-to-device copy, read + write bytes / s

// ---- mixed-precision GEMM (gemm.cu) ----
// A and B bf16 (raw 16-bit storage), C f32, products accumulated in f32 on the tensor cores.
// Same layout conventions as the contract's gemm / gemm_batched.
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const uint16_t* A, int64_t lda, int64_t stride_a, const uint16_t* B, int64_t ldb,
               int64_t stride_b, float beta, float* C, int64_t ldc, int64_t stride_c,
               int64_t batch);

}  // namespace kvlab::cuda
