#include <cblas.h>
#include <omp.h>

#include <algorithm>

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
  // OpenBLAS's own threading shares packed panels between its threads and loses 20-50% to
  // their synchronisation at a small model's shapes (768 x 128..512 x 128..512 on two threads:
  // 80-155 GFLOP/s against 145-200 when each thread runs a single-threaded product on its own
  // block of rows, see docs/benchmarks.md). So the pool splits the rows of C (or, for a few
  // rows, its columns) and each thread calls the BLAS on its block, which inside the parallel
  // region runs single-threaded. Every element is still one BLAS dot product in the BLAS's order.
  auto call = [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                m1 - m0, n1 - n0, K, alpha, ta ? A + m0 : A + m0 * lda, lda,
                tb ? B + n0 * ldb : B + n0, ldb, beta, C + m0 * ldc + n0, ldc);
  };
  constexpr int64_t kMinBlock = 32;  // rows (or columns) per thread worth a product of its own
  const int64_t threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const bool by_rows = M >= 2 * kMinBlock;
  const int64_t extent = by_rows ? M : N;
  const int64_t parts = std::min<int64_t>(threads, extent / kMinBlock);
  if (parts < 2) {
    call(0, M, 0, N);
    return;
  }
  // Blocks of a multiple of 16 rows/columns (the kernels' register tile) where possible.
  const int64_t block = std::max<int64_t>(16, (extent / parts + 15) / 16 * 16);
#pragma omp parallel for num_threads(static_cast<int>(parts)) schedule(static, 1)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t lo = std::min(extent, p * block);
    const int64_t hi = p == parts - 1 ? extent : std::min(extent, lo + block);
    if (lo >= hi) continue;
    if (by_rows)
      call(lo, hi, 0, N);
    else
      call(0, M, lo, hi);
  }
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
