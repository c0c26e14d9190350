#include <cblas.h>

#include "autograd/backend/cpu/kernels.h"

namespace kvlab::cpu {

// OpenBLAS (OpenMP build) behind one function: it shares libgomp's pool with our kernels and
// runs single-threaded when called from inside a parallel region. A product with one row or
// one column goes to GEMV, which is ~10x faster than GEMM at M = 1 (decode).
template <>
void gemm<float>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                 int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // the BLAS rejects zero-length GEMV operands: C = beta * C by hand
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  if (M == 1) {  // c (1, N) = a (1, K) @ op(B): y = op(B)^T a
    // op(B) is (K, N); as a row-major matrix B is (K, N) when !tb, (N, K) when tb.
    cblas_sgemv(CblasRowMajor, tb ? CblasNoTrans : CblasTrans, tb ? N : K, tb ? K : N, alpha, B,
                ldb, A, ta ? lda : 1, beta, C, 1);
    return;
  }
  if (N == 1 && ldc >= 1) {  // c (M, 1) = op(A) (M, K) @ b (K, 1)
    cblas_sgemv(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, ta ? K : M, ta ? M : K, alpha, A,
                lda, B, tb ? 1 : ldb, beta, C, ldc);
    return;
  }
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M,
              N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

template <>
void gemm<double>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                  const double* A, int64_t lda, const double* B, int64_t ldb, double beta,
                  double* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M,
              N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace kvlab::cpu
