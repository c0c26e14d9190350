#pragma once
// CPU kernels. They see raw memory and sizes, never the graph. Float kernels are templates on
// T = float (the working type) or double (gradient checks), instantiated in the .cpp files.
// Outputs come first in argument lists; every buffer carries its shape in a comment.
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "autograd/backend/device.h"
#include "autograd/backend/kernel_types.h"

namespace kvlab::cpu {

// Copies a strided view into another of the same sizes, converting dtype (f32/f64/i32/bf16).
void strided_copy(void* dst, DType dst_type, const Strides& dst_strides, const void* src,
                  DType src_type, const Strides& src_strides, const std::vector<int64_t>& sizes);

// C = alpha * op(A) @ op(B) + beta * C, row-major, op = transpose when trans_*. One function
// behind which the BLAS sits; a single-row (or single-column) product takes the GEMV path.
template <class T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);
// `batch` independent products; operand i starts at A + i * stride_a (likewise B, C).
template <class T>
void gemm_batched(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha,
                  const T* A, int64_t lda, int64_t stride_a, const T* B, int64_t ldb,
                  int64_t stride_b, T beta, T* C, int64_t ldc, int64_t stride_c, int64_t batch);

// Products of a few rows against a weight packed for them (decode). Row-major w (N, K) is
// stored as blocks of 8 rows, each block as its column chunks of 8 x 16 floats (zero past row
// N and column K), so that a product reads one sequential stream instead of eight rows at
// once, and reads it once for all the rows. Each y[m, n] is summed in the order of gemm's
// one-row path, so the two give the same bits, and a row's result does not depend on the
// others. The bf16 form holds the values rounded to bf16 in half the bytes, two chunks to a
// 64-byte line (the low and high halves of its words), widened exactly as they are read: on
// a weight whose values are all bf16 it gives the same bits as the f32 form.
// packed_weight_size is 0 where there is no kernel for it (neither AVX-512 nor AVX2 with FMA):
// callers then keep to gemm.
// Elements of the packed forms of a (N, K) weight: floats, and bf16 values.
int64_t packed_weight_size(int64_t N, int64_t K);
int64_t packed_weight_bf16_size(int64_t N, int64_t K);
// packed (packed_weight_size(N, K)) = w (N, K), contiguous, in the packed form.
void pack_weight(float* packed, const float* w, int64_t N, int64_t K);
// packed (packed_weight_bf16_size(N, K)) = w rounded to bf16 (nearest even), in the bf16 form.
void pack_weight(uint16_t* packed, const float* w, int64_t N, int64_t K);
// y[m, n] = dot(w[n, :], a[m, :]) + beta * y[m, n] for m < M and n in [n0, n1): y (M, ldy),
// a (M, K at stride lda), w packed by pack_weight in either form.
void gemm_packed(float* y, int64_t ldy, const float* a, int64_t lda, const float* packed, int64_t M,
                 int64_t K, int64_t n0, int64_t n1, float beta);
void gemm_packed(float* y, int64_t ldy, const float* a, int64_t lda, const uint16_t* packed,
                 int64_t M, int64_t K, int64_t n0, int64_t n1, float beta);
// attend_one_query's row kernel (f32, AVX-512 or AVX2, HS up to 128 or 64): false, having
// written nothing, where there is none for this HS.
bool attend_one_query_kernel(float* out, const float* q, const float* k, int64_t kst,
                             const float* v, int64_t vst, int64_t n, int64_t HS, float scale,
                             float* p);

// ---- elementwise ----
// out (sizes, contiguous) = a op b, where a and b are read through broadcast strides (0 on a
// broadcast dim).
template <class T>
void binary_forward(BinaryOp op, T* out, const std::vector<int64_t>& sizes, const T* a,
                    const Strides& a_strides, const T* b, const Strides& b_strides);
template <class T>
void scale_forward(T* out, const T* x, T s, int64_t n);
// out (out_sizes) = sum of x (x_sizes, contiguous) over the dims broadcast from out_sizes
// (out_sizes right-aligned against x_sizes, each 1 or equal).
template <class T>
void sum_to(T* out, const std::vector<int64_t>& out_sizes, const T* x,
            const std::vector<int64_t>& x_sizes);
// out (a scalar) = (sum of x (n)) / divisor; fixed-chunk order: deterministic for any thread
// count.
template <class T>
void sum_all(T* out, const T* x, int64_t n, T divisor);
// dst += src
template <class T>
void add_inplace(T* dst, const T* src, int64_t n);

// GELU, tanh form as in GPT-2.
template <class T>
void gelu_forward(T* out, const T* x, int64_t n);
template <class T>
void gelu_backward(T* dx, const T* dout, const T* x, int64_t n);

// Dropout with a stateless mask: element i is dropped when hash(seed, i) < p.
template <class T>
void dropout_forward(T* out, const T* x, int64_t n, double p, uint64_t seed);
template <class T>
void dropout_backward(T* dx, const T* dout, int64_t n, double p, uint64_t seed);

// ---- normalisation ----
template <class T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* x, const T* w, const T* b, int64_t N,
                       int64_t C, double eps);  // x, out (N, C); mean, rstd (N)
template <class T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dout, const T* x, const T* w,
                        const T* mean, const T* rstd, int64_t N, int64_t C);  // dw, db (C)
template <class T>
void softmax_forward(T* out, const T* x, int64_t N, int64_t C);
template <class T>
void softmax_backward(T* dx, const T* dout, const T* out, int64_t N, int64_t C);

// ---- embedding and loss ----
template <class T>
void embedding_forward(T* out, const int32_t* ids, const T* weight, int64_t N, int64_t C);
template <class T>  // dweight (V, C) += scatter of dout (N, C) by ids; repeated ids accumulate
void embedding_backward(T* dweight, const T* dout, const int32_t* ids, int64_t N, int64_t V,
                        int64_t C);
// Fused log-softmax + negative log-likelihood. logits (N, V), targets (N), lse (N). loss (a
// scalar) = the mean over the `count` rows whose target is not ignore_index (0 when count is 0).
template <class T>
void cross_entropy_forward(T* loss, T* lse, const T* logits, const int32_t* targets, int64_t N,
                           int64_t V, int32_t ignore_index, int64_t count);
// dlogits (N, V) = (softmax - onehot) * (*dloss) / count on counted rows, 0 elsewhere; dloss is
// the incoming gradient of the scalar loss, read where it lives (no host round trip).
template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const T* lse, const int32_t* targets,
                            int64_t N, int64_t V, int32_t ignore_index, const T* dloss,
                            int64_t count);

// ---- attention ----
// out (B, NH, T, HS). Query t of row b sits at position S_b - T + t and sees keys
// 0 .. S_b - T + t. Backward recomputes the probabilities; nothing else is kept.
// KV = T, or uint16_t for K/V stored as bf16 (a bf16 KV cache; T = float): widened on read.
template <class T, class KV = T>
void attention_forward(T* out, HeadView out_v, const T* q, HeadView q_v, const KV* k, HeadView k_v,
                       const KV* v, HeadView v_v, const AttentionShape& s);
// Decode attention of one query over n >= 1 cached keys: out (HS) = softmax(scale q k^T) v,
// q (HS), k and v (n, HS) at row strides kst and vst, p (n) work. Single-threaded; it opens no
// parallel region and allocates nothing. In f32 the row kernel where there is one, otherwise
// the probabilities and products of the general attention.
template <class T>
void attend_one_query(T* out, const T* q, const T* k, int64_t kst, const T* v, int64_t vst,
                      int64_t n, int64_t HS, T scale, T* p);
// The decode attention (T = 1, no dropout) of part of a KV group: attention_forward uses it
// at T = 1, as the fused decode step does, for every group size. Each KV group g of
// row b is cut into `parts` tasks of consecutive query heads: task = (b * NKV + g) * parts + part,
// of B * NKV * parts. It opens no parallel region, so a caller that already runs one (the fused
// decode step) can split the tasks among its threads (parts > 1 when there are fewer groups
// than threads).
// `work` holds attention_decode_work(s) elements, s.S bounding every row's length:
// the task allocates nothing, so it cannot throw.
template <class T, class KV = T>
void attention_decode_task(T* out, HeadView out_v, const T* q, HeadView q_v, const KV* k,
                           HeadView k_v, const KV* v, HeadView v_v, const AttentionShape& s,
                           int64_t task, int64_t parts, T* work);
// Its work memory: one query's probabilities and, from a bf16 cache, the group's K and V
// widened.
template <class T, class KV = T>
int64_t attention_decode_work(const AttentionShape& s) {
  return (1 + (std::is_same_v<KV, T> ? 0 : 2 * s.HS)) * s.S;
}
// dq like q; dk, dv (B, NKV, S, HS) summed over each KV head's group of query heads.
template <class T>
void attention_backward(T* dq, HeadView dq_v, T* dk, HeadView dk_v, T* dv, HeadView dv_v,
                        const T* dout, HeadView dout_v, const T* q, HeadView q_v,
                        const T* k, HeadView k_v, const T* v, HeadView v_v,
                        const AttentionShape& s);

// ---- optimiser ----
// AdamW over several tensors, each with its own step (one pass for all of them).
void adamw_update_many(std::span<const AdamWTensor> tensors);
// Sum of squares in double over several tensors, for the global gradient norm, summed tensor
// by tensor in order (one launch and one host sync for all of them on a GPU).
double sum_squares_many(std::span<const FloatSpan> xs);

}  // namespace kvlab::cpu
