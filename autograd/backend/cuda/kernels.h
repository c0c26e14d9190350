#pragma once
// CUDA kernels: the same interface as cpu/kernels.h, on device memory, so an op calls either
// backend with one argument list (backend/dispatch.h). Plain C++: no CUDA header leaks out of
// autograd/backend/cuda/. Float kernels are instantiated for float and double; every call is
// asynchronous on the backend's stream unless it returns a host value.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "autograd/backend/device.h"
#include "autograd/backend/kernel_types.h"

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

// ---- copies (copy.cu) ----
void strided_copy(void* dst, DType dst_type, const Strides& dst_strides, const void* src,
                  DType src_type, const Strides& src_strides, const std::vector<int64_t>& sizes);

// ---- GEMM through cuBLAS (gemm.cu) ----
template <class T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);
template <class T>
void gemm_batched(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                  int64_t lda, int64_t stride_a, const T* B, int64_t ldb, int64_t stride_b, T beta,
                  T* C, int64_t ldc, int64_t stride_c, int64_t batch);

// Mixed precision: A and B bf16 (raw 16-bit storage), C f32, products accumulated in f32 on
// the tensor cores. Same layout conventions as gemm / gemm_batched.
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const uint16_t* A, int64_t lda, int64_t stride_a, const uint16_t* B, int64_t ldb,
               int64_t stride_b, float beta, float* C, int64_t ldc, int64_t stride_c,
               int64_t batch);

// ---- elementwise and reductions (elementwise.cu) ----
template <class T>
void binary_forward(BinaryOp op, T* out, const std::vector<int64_t>& sizes, const T* a,
                    const Strides& a_strides, const T* b, const Strides& b_strides);
template <class T>
void scale_forward(T* out, const T* x, T s, int64_t n);
template <class T>
void sum_to(T* out, const std::vector<int64_t>& out_sizes, const T* x,
            const std::vector<int64_t>& x_sizes);
template <class T>
void sum_all(T* out, const T* x, int64_t n, T divisor);
template <class T>
void add_inplace(T* dst, const T* src, int64_t n);
template <class T>
void gelu_forward(T* out, const T* x, int64_t n);
template <class T>
void gelu_backward(T* dx, const T* dout, const T* x, int64_t n);
template <class T>
void dropout_forward(T* out, const T* x, int64_t n, double p, uint64_t seed);
template <class T>
void dropout_backward(T* dx, const T* dout, int64_t n, double p, uint64_t seed);

// ---- normalisation (norm.cu) ----
template <class T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* x, const T* w, const T* b, int64_t N,
                       int64_t C, double eps);
template <class T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dout, const T* x, const T* w, const T* mean,
                        const T* rstd, int64_t N, int64_t C);
template <class T>
void softmax_forward(T* out, const T* x, int64_t N, int64_t C);
template <class T>
void softmax_backward(T* dx, const T* dout, const T* out, int64_t N, int64_t C);

// ---- embedding and loss (loss.cu) ----
template <class T>
void embedding_forward(T* out, const int32_t* ids, const T* weight, int64_t N, int64_t C);
template <class T>
void embedding_backward(T* dweight, const T* dout, const int32_t* ids, int64_t N, int64_t V,
                        int64_t C);
template <class T>
void cross_entropy_forward(T* loss, T* lse, const T* logits, const int32_t* targets, int64_t N,
                           int64_t V, int32_t ignore_index, int64_t count);
template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const T* lse, const int32_t* targets,
                            int64_t N, int64_t V, int32_t ignore_index, const T* dloss,
                            int64_t count);

// ---- attention (attention.cu): flash style, tiled, online softmax, no (T, S) buffer ----
// KV = T, or uint16_t for K/V stored as bf16 (a bf16 KV cache; T = float): widened on load.
template <class T, class KV = T>
void attention_forward(T* out, HeadView out_v, const T* q, HeadView q_v, const KV* k, HeadView k_v,
                       const KV* v, HeadView v_v, const AttentionShape& s);
template <class T>
void attention_backward(T* dq, HeadView dq_v, T* dk, HeadView dk_v, T* dv, HeadView dv_v,
                        const T* dout, HeadView dout_v, const T* q, HeadView q_v, const T* k,
                        HeadView k_v, const T* v, HeadView v_v, const AttentionShape& s);

// ---- optimiser (optim.cu) ----
// One launch over all the tensors; one launch pair and one host sync for the sum.
void adamw_update_many(std::span<const AdamWTensor> tensors);
double sum_squares_many(std::span<const FloatSpan> xs);

}  // namespace kvlab::cuda
