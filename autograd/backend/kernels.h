#pragma once
// The kernel contract: every kernel both backends implement, declared once, here, in
// kvlab::cpu (cpu/*.cpp, host memory) and in kvlab::cuda (cuda/*.cu, device memory), so that
// an op calls either with one argument list (backend/dispatch.h). Kernels see raw memory and
// sizes, never the graph. Outputs come first in argument lists; every buffer carries its shape
// in a comment. Plain C++: no CUDA header leaks out of autograd/backend/cuda/.
//
// Each group below is the list of one source file of each backend, written once as an X-macro:
// X(return type, name, (parameters written in T)). The header declares every entry as
// `template <class T> ret name params;` in both namespaces, and each backend's source file
// instantiates its group from the same list, for T = float (the working type) and double
// (gradient checks), with KVLAB_INSTANTIATE: explicit instantiations whose template arguments
// are deduced from the parameters, so a definition whose signature drifted from the contract
// fails to compile, in whichever backend it is. On the CUDA backend every call is
// asynchronous on its stream unless it returns a host value.
//
// Kernels only one backend has are not here: the CPU's decode products and attention are in
// cpu/decode_kernels.h, the CUDA runtime, probes and bf16 GEMM in cuda/runtime.h.
#include <cstdint>
#include <span>
#include <vector>

#include "autograd/backend/device.h"
#include "autograd/backend/kernel_types.h"

// ---- GEMM (cpu/gemm.cpp over the BLAS, cuda/gemm.cu over cuBLAS) ----
// gemm: C = alpha * op(A) @ op(B) + beta * C, row-major, op = transpose when trans_*; a
// single-row (or single-column) product takes the GEMV path on the CPU.
// gemm_batched: `batch` independent products; operand i starts at A + i * stride_a (likewise
// B, C).
#define KVLAB_GEMM_KERNELS(X, T)                                                              \
  X(void, gemm,                                                                               \
    (bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,        \
     int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc))                        \
  X(void, gemm_batched,                                                                       \
    (bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,        \
     int64_t lda, int64_t stride_a, const T* B, int64_t ldb, int64_t stride_b, T beta, T* C,  \
     int64_t ldc, int64_t stride_c, int64_t batch))

// ---- elementwise and reductions (elementwise.*) ----
#define KVLAB_ELEMENTWISE_KERNELS(X, T)                                                       \
  /* out (sizes, contiguous) = a op b, where a and b are read through broadcast strides (0 on \
     a broadcast dim). */                                                                     \
  X(void, binary_forward,                                                                     \
    (BinaryOp op, T* out, const std::vector<int64_t>& sizes, const T* a,                      \
     const Strides& a_strides, const T* b, const Strides& b_strides))                         \
  X(void, scale_forward, (T* out, const T* x, T s, int64_t n))                                \
  /* out (out_sizes) = sum of x (x_sizes, contiguous) over the dims broadcast from out_sizes  \
     (out_sizes right-aligned against x_sizes, each 1 or equal). */                           \
  X(void, sum_to,                                                                             \
    (T* out, const std::vector<int64_t>& out_sizes, const T* x,                               \
     const std::vector<int64_t>& x_sizes))                                                    \
  /* out (a scalar) = (sum of x (n)) / divisor; fixed-chunk order on the CPU: deterministic   \
     for any thread count. */                                                                 \
  X(void, sum_all, (T* out, const T* x, int64_t n, T divisor))                                \
  /* dst += src */                                                                            \
  X(void, add_inplace, (T* dst, const T* src, int64_t n))                                     \
  /* GELU, tanh form as in GPT-2. */                                                          \
  X(void, gelu_forward, (T* out, const T* x, int64_t n))                                      \
  X(void, gelu_backward, (T* dx, const T* dout, const T* x, int64_t n))                       \
  /* Dropout with a stateless mask: element i is dropped when hash(seed, i) < p. */           \
  X(void, dropout_forward, (T* out, const T* x, int64_t n, double p, uint64_t seed))          \
  X(void, dropout_backward, (T* dx, const T* dout, int64_t n, double p, uint64_t seed))      \
  /* SwiGLU: out = silu(gate) * up elementwise, silu(a) = a * sigmoid(a); out may be gate. */ \
  X(void, swiglu_forward, (T* out, const T* gate, const T* up, int64_t n))                    \
  X(void, swiglu_backward,                                                                    \
    (T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n))                 \
  /* Rotary position embedding, halves form: x, out (N, H, HS) with HS even, row i at         \
     position pos[i]; table (P, HS) holds each position's HS/2 cosines then HS/2 sines, and   \
     pos[i] < P. out[.., j] = x_j cos - x_(j+HS/2) sin, out[.., j + HS/2] = x_(j+HS/2) cos +  \
     x_j sin; `inverse` rotates by the opposite angle (the backward). out may be x. */        \
  X(void, rope_forward,                                                                       \
    (T* out, const T* x, const int32_t* pos, const T* table, int64_t N, int64_t H, int64_t HS, \
     bool inverse))

// ---- normalisation (norm.*) ----
#define KVLAB_NORM_KERNELS(X, T)                                                              \
  /* x, out (N, C); mean, rstd (N). mean null: RMSNorm (nothing subtracted, rstd of the     \
     mean square); b null: no bias (then db null too in the backward). */                     \
  X(void, layernorm_forward,                                                                  \
    (T* out, T* mean, T* rstd, const T* x, const T* w, const T* b, int64_t N, int64_t C,      \
     double eps))                                                                             \
  /* dw, db (C) */                                                                            \
  X(void, layernorm_backward,                                                                 \
    (T* dx, T* dw, T* db, const T* dout, const T* x, const T* w, const T* mean,               \
     const T* rstd, int64_t N, int64_t C))                                                    \
  X(void, softmax_forward, (T* out, const T* x, int64_t N, int64_t C))                        \
  X(void, softmax_backward, (T* dx, const T* dout, const T* out, int64_t N, int64_t C))

// ---- embedding and loss (loss.*) ----
#define KVLAB_LOSS_KERNELS(X, T)                                                              \
  X(void, embedding_forward,                                                                  \
    (T* out, const int32_t* ids, const T* weight, int64_t N, int64_t C))                      \
  /* dweight (V, C) += scatter of dout (N, C) by ids; repeated ids accumulate */              \
  X(void, embedding_backward,                                                                 \
    (T* dweight, const T* dout, const int32_t* ids, int64_t N, int64_t V, int64_t C))         \
  /* Fused log-softmax + negative log-likelihood. logits (N, V), targets (N), lse (N). loss   \
     (a scalar) = the mean over the `count` rows whose target is not ignore_index (0 when     \
     count is 0). */                                                                          \
  X(void, cross_entropy_forward,                                                              \
    (T* loss, T* lse, const T* logits, const int32_t* targets, int64_t N, int64_t V,          \
     int32_t ignore_index, int64_t count))                                                    \
  /* dlogits (N, V) = (softmax - onehot) * (*dloss) / count on counted rows, 0 elsewhere;     \
     dloss is the incoming gradient of the scalar loss, read where it lives (no host round    \
     trip). */                                                                                \
  X(void, cross_entropy_backward,                                                             \
    (T* dlogits, const T* logits, const T* lse, const int32_t* targets, int64_t N, int64_t V, \
     int32_t ignore_index, const T* dloss, int64_t count))

// ---- attention (attention.*) ----
// out (B, NH, T, HS). Query t of row b sits at position S_b - T + t and sees keys
// 0 .. S_b - T + t. Backward recomputes the probabilities; nothing else is kept.
// Forward reads K and V as KV: T, or uint16_t for K/V stored as bf16 (a bf16 KV cache;
// T = float), widened on read. Instantiated for <float, float>, <double, double> and
// <float, uint16_t>.
#define KVLAB_ATTENTION_FORWARD_KERNELS(X, T, KV)                                             \
  X(void, attention_forward,                                                                  \
    (T* out, HeadView out_v, const T* q, HeadView q_v, const KV* k, HeadView k_v, const KV* v, \
     HeadView v_v, const AttentionShape& s))
#define KVLAB_ATTENTION_KERNELS(X, T)                                                         \
  /* dq like q; dk, dv (B, NKV, S, HS) summed over each KV head's group of query heads. */    \
  X(void, attention_backward,                                                                 \
    (T* dq, HeadView dq_v, T* dk, HeadView dk_v, T* dv, HeadView dv_v, const T* dout,         \
     HeadView dout_v, const T* q, HeadView q_v, const T* k, HeadView k_v, const T* v,         \
     HeadView v_v, const AttentionShape& s))

// ---- kernels on one type, not templates (copy.*, optim.*): a definition with another
// signature is another overload, which the callers' link then misses ----
#define KVLAB_PLAIN_KERNELS(X)                                                                \
  /* Copies a strided view into another of the same sizes, converting dtype (f32/f64/i32/     \
     bf16). */                                                                                \
  X(void, strided_copy,                                                                       \
    (void* dst, DType dst_type, const Strides& dst_strides, const void* src, DType src_type,  \
     const Strides& src_strides, const std::vector<int64_t>& sizes))                          \
  /* AdamW over several tensors, each with its own step (one pass, or launch, for all). */    \
  X(void, adamw_update_many, (std::span<const AdamWTensor> tensors))                          \
  /* Sum of squares in double over several tensors, for the global gradient norm, summed     \
     tensor by tensor in order (one launch and one host sync for all of them on a GPU). */    \
  X(double, sum_squares_many, (std::span<const FloatSpan> xs))

#define KVLAB_DECLARE(ret, name, params) \
  template <class T>                     \
  ret name params;
#define KVLAB_DECLARE_KV(ret, name, params) \
  template <class T, class KV = T>          \
  ret name params;
#define KVLAB_DECLARE_PLAIN(ret, name, params) ret name params;
// The whole contract, in the namespace this is expanded in.
#define KVLAB_DECLARE_KERNELS                                  \
  KVLAB_GEMM_KERNELS(KVLAB_DECLARE, T)                         \
  KVLAB_ELEMENTWISE_KERNELS(KVLAB_DECLARE, T)                  \
  KVLAB_NORM_KERNELS(KVLAB_DECLARE, T)                         \
  KVLAB_LOSS_KERNELS(KVLAB_DECLARE, T)                         \
  KVLAB_ATTENTION_FORWARD_KERNELS(KVLAB_DECLARE_KV, T, KV)     \
  KVLAB_ATTENTION_KERNELS(KVLAB_DECLARE, T)                    \
  KVLAB_PLAIN_KERNELS(KVLAB_DECLARE_PLAIN)

namespace kvlab::cpu {
KVLAB_DECLARE_KERNELS
}  // namespace kvlab::cpu

namespace kvlab::cuda {
KVLAB_DECLARE_KERNELS
}  // namespace kvlab::cuda

#undef KVLAB_DECLARE_KERNELS
#undef KVLAB_DECLARE_PLAIN
#undef KVLAB_DECLARE_KV
#undef KVLAB_DECLARE

// In a backend's source file, after the definitions: KVLAB_NORM_KERNELS(KVLAB_INSTANTIATE,
// float) instantiates the group's definitions for T = float, deducing the template arguments
// from the contract's parameters.
#define KVLAB_INSTANTIATE(ret, name, params) template ret name params;
