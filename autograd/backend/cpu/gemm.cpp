#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <type_traits>

#include "autograd/backend/cpu/dot_simd.h"
#include "autograd/backend/kernels.h"
#include "platform/parallel.h"

namespace kvlab::cpu {

#if defined(KVLAB_ROW_KERNELS)
namespace {

// Rows of A up to which gemm<float> runs the row kernels rather than the BLAS, for a @ w^T
// and for a @ b: below them the row kernels beat OpenBLAS's sgemm over attention's cached
// keys and values (docs/bench-log/code-figures.md).
constexpr int64_t kFewRowsWt = 4, kFewRowsB = 8;

// y (M, N) = alpha * a (M, K) @ w^T + beta * y for a few rows of a, w (N, K) row-major at
// stride ldw: the rows of w split across the threads (in blocks of 8). At M = 1 it is faster
// than OpenBLAS's sgemv (docs/bench-log/code-figures.md).
void few_rows_times_wt(int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t lda,
                       const float* w, int64_t ldw, float beta, float* y, int64_t ldy) {
  // Short rows of w (attention's keys, K = HS <= 64) take one row of a at a time: a block read
  // again from L1 costs less than a tile's registers there; at HS 128 the tiles win
  // (docs/bench-log/code-figures.md).
  const int64_t step = K <= 64 ? 1 : M;
  auto rows = [&](int64_t n0, int64_t n1) {
    auto src = [&](int64_t nb) { return F32Rows{w + nb * kRows * ldw, ldw, kCols}; };
    for (int64_t m = 0; m < M; m += step)
      row_blocks(y + m * ldy, ldy, a + m * lda, lda, src, std::min(step, M - m), K, n0, n1, N,
                 alpha, beta);
  };
  parallel_blocks(N, kRows, N * K, rows);
}

// Rows of a a tile of the product with b takes: one chunk of accumulators each, 8 vectors.
constexpr int64_t kAxpyTileRows = 8 / kParts;

// Columns [0, n) (n <= 16) of rows [0, R) of y = alpha * a (R, K) @ b (K, n) + beta * y, b's
// rows read in order, once. Row r's sum over k runs in U interleaved accumulators (k mod U),
// added at the end: one chain of dependent FMAs a row would leave the FMA units idle at a few
// rows (a one-row product ran at a third of OpenBLAS's sgemv speed).
template <int R>
[[gnu::always_inline]] inline void axpy_tile(float* y, int64_t ldy, const float* a, int64_t lda,
                                             const float* b, int64_t ldb, int64_t K, int64_t n,
                                             float alpha, float beta) {
  constexpr int64_t U = std::max<int64_t>(1, 8 / (R * kParts));
  Chunk acc[U][R];
  for (auto& row : acc)
    for (auto& c : row)
      for (auto& v : c.v) v = vzero();
  auto step = [&](int64_t k, int64_t u, auto whole) {  // whole: a bool_constant, n == 16
    const float* bk = b + k * ldb;
    const Chunk w = whole() ? load_chunk(bk) : load_chunk_first(bk, n);
    for (int r = 0; r < R; ++r) {
      const Vec x = vbroadcast(a[r * lda + k]);
      for (int64_t h = 0; h < kParts; ++h) acc[u][r].v[h] = vfmadd(x, w.v[h], acc[u][r].v[h]);
    }
  };
  auto run = [&](auto whole) {
    int64_t k = 0;
    for (; k + U <= K; k += U)
      for (int64_t u = 0; u < U; ++u) step(k + u, u, whole);
    for (; k < K; ++k) step(k, 0, whole);
  };
  if (n == kCols)
    run(std::true_type());
  else
    run(std::false_type());
  for (int r = 0; r < R; ++r) {
    for (int64_t u = 1; u < U; ++u)
      for (int64_t h = 0; h < kParts; ++h) acc[0][r].v[h] = vadd(acc[0][r].v[h], acc[u][r].v[h]);
    alignas(64) float out[kCols];
    for (int64_t h = 0; h < kParts; ++h) vstore(out + h * kLanes, acc[0][r].v[h]);
    float* yr = y + r * ldy;
    for (int64_t j = 0; j < n; ++j)
      yr[j] = beta == 0.0f ? alpha * out[j] : alpha * out[j] + beta * yr[j];
  }
}

// Columns [n0, n1) of y (M, N) = alpha * a (M, K) @ b (K, N) + beta * y, b row-major at
// stride ldb, 16 columns and a tile of rows of a at a time.
void axpy_columns(int64_t M, int64_t K, float alpha, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float beta, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t j = n0; j < n1; j += kCols) {
    const int64_t n = std::min(kCols, n1 - j);
    for (int64_t m = 0; m < M; m += kAxpyTileRows) {
      auto tile = [&](auto rows_of_a) {
        axpy_tile<rows_of_a()>(y + m * ldy + j, ldy, a + m * lda, lda, b + j, ldb, K, n, alpha,
                               beta);
      };
      with_rows<kAxpyTileRows>(M - m, tile);
    }
  }
}

// y (M, N) = alpha * a (M, K) @ b (K, N) + beta * y for a few rows of a (attention's
// probabilities times the cached values): the columns split across the threads (in chunks of
// 16).
void few_rows_times_b(int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t lda,
                      const float* b, int64_t ldb, float beta, float* y, int64_t ldy) {
  parallel_blocks(N, kCols, N * K, [&](int64_t lo, int64_t hi) {
    axpy_columns(M, K, alpha, a, lda, b, ldb, beta, y, ldy, lo, hi);
  });
}


}  // namespace
#endif

// OpenBLAS (OpenMP build) behind one function: it shares libgomp's pool with our kernels and
// runs single-threaded when called from inside a parallel region. A product with a few rows
// of A goes to our row kernels where AVX-512 or AVX2 is available (decode: a Linear's a @ W^T
// at batch 1, attention's q k^T and p v over the cache), else one row to the BLAS's GEMV,
// which is much faster than its GEMM at M = 1.
template <>
void gemm<float>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                 int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // the BLAS rejects zero-length GEMV operands: C = beta * C by hand
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
#if defined(KVLAB_ROW_KERNELS)
  if (!ta && tb && M <= kFewRowsWt) {
    few_rows_times_wt(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  if (!ta && !tb && M <= kFewRowsB) {
    few_rows_times_b(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
#endif
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
  // OpenBLAS's own threading shares packed panels between its threads and loses to their
  // synchronisation at a small model's shapes, against each thread running a single-threaded
  // product on its own block of rows (docs/bench-log/code-figures.md). So the pool splits the rows
  // of C (or, for a few rows, its columns) and each thread calls the BLAS on its block, which
  // inside the parallel region runs single-threaded. Every element is still one BLAS dot product in
  // the BLAS's order.
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
#pragma omp parallel for num_threads(static_cast<int>(parts)) schedule(static, 1)
  for (int64_t p = 0; p < parts; ++p) {
    // Blocks of a multiple of 16 rows/columns (the kernels' register tile).
    const auto [lo, hi] = split_range(extent, p, parts, 16);
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

KVLAB_GEMM_KERNELS(KVLAB_INSTANTIATE, float)
KVLAB_GEMM_KERNELS(KVLAB_INSTANTIATE, double)

}  // namespace kvlab::cpu
