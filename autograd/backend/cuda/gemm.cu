// GEMMs through cuBLAS. cuBLAS is column-major: a row-major (M, N) C is a column-major (N, M)
// C^T = op(B)^T op(A)^T, so the operands swap places and keep their transpose flags.
#include <climits>

#include "autograd/backend/cuda/common.cuh"
#include "autograd/backend/cuda/runtime.h"
#include "autograd/backend/kernels.h"

namespace kvlab::cuda {

namespace {

int as_int(int64_t v, const char* what) {
  KVLAB_CHECK(v >= 0 && v <= INT_MAX, "gemm: ", what, " = ", v, " exceeds cuBLAS's int range");
  return static_cast<int>(v);
}

cublasOperation_t op_of(bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; }

cublasStatus_t gemm_call(cublasOperation_t ob, cublasOperation_t oa, int n, int m, int k,
                         const float* alpha, const float* B, int ldb, long long sb, const float* A,
                         int lda, long long sa, const float* beta, float* C, int ldc, long long sc,
                         int batch) {
  if (batch == 1)
    return cublas().sgemm(cublas_handle(), ob, oa, n, m, k, alpha, B, ldb, A, lda, beta, C, ldc);
  return cublas().sgemm_strided_batched(cublas_handle(), ob, oa, n, m, k, alpha, B, ldb, sb, A, lda,
                                        sa, beta, C, ldc, sc, batch);
}

cublasStatus_t gemm_call(cublasOperation_t ob, cublasOperation_t oa, int n, int m, int k,
                         const double* alpha, const double* B, int ldb, long long sb,
                         const double* A, int lda, long long sa, const double* beta, double* C,
                         int ldc, long long sc, int batch) {
  if (batch == 1)
    return cublas().dgemm(cublas_handle(), ob, oa, n, m, k, alpha, B, ldb, A, lda, beta, C, ldc);
  return cublas().dgemm_strided_batched(cublas_handle(), ob, oa, n, m, k, alpha, B, ldb, sb, A, lda,
                                        sa, beta, C, ldc, sc, batch);
}

}  // namespace

template <class T>
void gemm_batched(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                  int64_t lda, int64_t sa, const T* B, int64_t ldb, int64_t sb, T beta, T* C,
                  int64_t ldc, int64_t sc, int64_t batch) {
  if (M == 0 || N == 0 || batch == 0) return;
  // cuBLAS checks leading dimensions >= 1 even when K == 0 makes an operand empty.
  const int64_t lda1 = lda < 1 ? 1 : lda, ldb1 = ldb < 1 ? 1 : ldb;
  CUBLAS_CHECK(gemm_call(op_of(tb), op_of(ta), as_int(N, "N"), as_int(M, "M"), as_int(K, "K"),
                         &alpha, B, as_int(ldb1, "ldb"), sb, A, as_int(lda1, "lda"), sa, &beta, C,
                         as_int(ldc, "ldc"), sc, as_int(batch, "batch")));
}

template <class T>
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda,
          const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  gemm_batched<T>(ta, tb, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1);
}

void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
               int64_t lda, int64_t sa, const uint16_t* B, int64_t ldb, int64_t sb, float beta,
               float* C, int64_t ldc, int64_t sc, int64_t batch) {
  if (M == 0 || N == 0 || batch == 0) return;
  const int64_t lda1 = lda < 1 ? 1 : lda, ldb1 = ldb < 1 ? 1 : ldb;
  CUBLAS_CHECK(cublas().gemm_strided_batched_ex(
      cublas_handle(), op_of(tb), op_of(ta), as_int(N, "N"), as_int(M, "M"), as_int(K, "K"), &alpha,
      B, CUDA_R_16BF, as_int(ldb1, "ldb"), sb, A, CUDA_R_16BF, as_int(lda1, "lda"), sa, &beta, C,
      CUDA_R_32F, as_int(ldc, "ldc"), sc, as_int(batch, "batch"), CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT));
}

KVLAB_GEMM_KERNELS(KVLAB_INSTANTIATE, float)
KVLAB_GEMM_KERNELS(KVLAB_INSTANTIATE, double)

}  // namespace kvlab::cuda
