#include <cblas.h>
#include <omp.h>

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

// Small products in parallel with a single-threaded BLAS each; otherwise one by one with the
// BLAS's threads (no parallel region around it: see for_each_task in attention.cpp).
template <class T>
void gemm_batched(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                  int64_t lda, int64_t sa, const T* B, int64_t ldb, int64_t sb, T beta, T* C,
                  int64_t ldc, int64_t sc, int64_t batch) {
  auto one = [&](int64_t i) {
    gemm<T>(ta, tb, M, N, K, alpha, A + i * sa, lda, B + i * sb, ldb, beta, C + i * sc, ldc);
  };
  if (batch >= omp_get_max_threads()) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < batch; ++i) one(i);
  } else {
    for (int64_t i = 0; i < batch; ++i) one(i);
  }
}

template void gemm_batched<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*,
                                  int64_t, int64_t, const float*, int64_t, int64_t, float,
                                  float*, int64_t, int64_t, int64_t);
template void gemm_batched<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*,
                                   int64_t, int64_t, const double*, int64_t, int64_t, double,
                                   double*, int64_t, int64_t, int64_t);

}  // namespace kvlab::cpu
