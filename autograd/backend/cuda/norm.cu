// Layer normalisation and softmax over the last dimension: one block per row, sums in T through
// the block reductions of common.cuh. dw and db of layernorm are reduced in a fixed order (per
// row-chunk partials, then a sum over the chunks), so they are deterministic.
#include "autograd/backend/cuda/common.cuh"
#include "autograd/backend/kernels.h"

namespace kvlab::cuda {
namespace {

constexpr int kRowThreads = 256;  // block size of the row kernels (at most)
// dw/db partials: at most this many row chunks, each of at least kMinChunkRows rows.
constexpr int64_t kMaxRowChunks = 256;
constexpr int64_t kMinChunkRows = 32;

template <class T>
__global__ void layernorm_forward_kernel(T* out, T* mean, T* rstd, const T* x, const T* w,
                                         const T* b, int64_t N, int64_t C, double eps) {
  __shared__ T shared[32];
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const T* xi = x + i * C;
    T m = 0;  // RMSNorm (no mean) subtracts nothing
    if (mean != nullptr) {
      T s = 0;
      for (int64_t j = threadIdx.x; j < C; j += blockDim.x) s += xi[j];
      m = block_sum(s, shared) / static_cast<T>(C);
    }
    T v = 0;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const T d = xi[j] - m;
      v += d * d;
    }
    // Biased variance; the square root in double as on the CPU.
    const double var = static_cast<double>(block_sum(v, shared)) / static_cast<double>(C);
    const T r = static_cast<T>(1.0 / sqrt(var + eps));
    T* oi = out + i * C;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
      oi[j] = (xi[j] - m) * r * w[j] + (b != nullptr ? b[j] : T(0));
    if (threadIdx.x == 0) {
      if (mean != nullptr) mean[i] = m;
      rstd[i] = r;
    }
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dout * w (no mean(g) term for
// RMSNorm, mean null); one block per row.
template <class T>
__global__ void layernorm_backward_dx_kernel(T* dx, const T* dout, const T* x, const T* w,
                                             const T* mean, const T* rstd, int64_t N, int64_t C) {
  __shared__ T shared[32];
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const T* xi = x + i * C;
    const T* gi = dout + i * C;
    const T m = mean != nullptr ? mean[i] : T(0), r = rstd[i];
    T sum_g = 0, sum_gx = 0;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const T xhat = (xi[j] - m) * r;
      const T g = gi[j] * w[j];
      sum_g += g;
      sum_gx += g * xhat;
    }
    const T mg = mean != nullptr ? block_sum(sum_g, shared) / static_cast<T>(C) : T(0);
    const T mgx = block_sum(sum_gx, shared) / static_cast<T>(C);
    T* di = dx + i * C;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const T xhat = (xi[j] - m) * r;
      di[j] = r * (gi[j] * w[j] - mg - xhat * mgx);
    }
  }
}

// Grid (column blocks, row chunks): the thread of column j sums its chunk's rows in order into
// pdw, pdb (row_chunks, C) at [blockIdx.y, j].
template <class T>
__global__ void layernorm_dwdb_partial_kernel(T* pdw, T* pdb, const T* dout, const T* x,
                                              const T* mean, const T* rstd, int64_t N, int64_t C,
                                              int64_t chunk_rows) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= C) return;
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t i1 = i0 + chunk_rows < N ? i0 + chunk_rows : N;
  T sw = 0, sb = 0;
  for (int64_t i = i0; i < i1; ++i) {
    const T g = dout[i * C + j];
    const T xhat = (x[i * C + j] - (mean != nullptr ? mean[i] : T(0))) * rstd[i];
    sw += g * xhat;
    sb += g;
  }
  pdw[static_cast<int64_t>(blockIdx.y) * C + j] = sw;
  pdb[static_cast<int64_t>(blockIdx.y) * C + j] = sb;
}

// dw[j], db[j] = the partials of column j summed over the chunks in chunk order.
template <class T>
__global__ void layernorm_dwdb_final_kernel(T* dw, T* db, const T* pdw, const T* pdb,
                                            int64_t row_chunks, int64_t C) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < C;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    T sw = 0, sb = 0;
    for (int64_t k = 0; k < row_chunks; ++k) {
      sw += pdw[k * C + j];
      sb += pdb[k * C + j];
    }
    dw[j] = sw;
    if (db != nullptr) db[j] = sb;
  }
}

template <class T>
__global__ void softmax_forward_kernel(T* out, const T* x, int64_t N, int64_t C) {
  __shared__ T shared[32];
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const T* xi = x + i * C;
    T mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) mx = max(mx, xi[j]);
    mx = block_max(mx, shared);
    T s = 0;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) s += exp_t(xi[j] - mx);
    const T inv = T(1) / block_sum(s, shared);
    T* oi = out + i * C;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) oi[j] = exp_t(xi[j] - mx) * inv;
  }
}

template <class T>
__global__ void softmax_backward_kernel(T* dx, const T* dout, const T* out, int64_t N, int64_t C) {
  __shared__ T shared[32];
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const T* yi = out + i * C;
    const T* gi = dout + i * C;
    T dot = 0;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) dot += yi[j] * gi[j];
    dot = block_sum(dot, shared);
    T* di = dx + i * C;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) di[j] = yi[j] * (gi[j] - dot);
  }
}

}  // namespace

template <class T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* x, const T* w, const T* b, int64_t N,
                       int64_t C, double eps) {
  if (N == 0 || C == 0) return;
  layernorm_forward_kernel<T><<<blocks_for(N, 1), row_threads(C, kRowThreads), 0, stream()>>>(
      out, mean, rstd, x, w, b, N, C, eps);
  KVLAB_LAUNCH_CHECK();
}

template <class T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dout, const T* x, const T* w, const T* mean,
                        const T* rstd, int64_t N, int64_t C) {
  if (C == 0) return;
  if (N == 0) {  // sums over no rows
    CUDA_CHECK(cudaMemsetAsync(dw, 0, static_cast<size_t>(C) * sizeof(T), stream()));
    if (db != nullptr)
      CUDA_CHECK(cudaMemsetAsync(db, 0, static_cast<size_t>(C) * sizeof(T), stream()));
    return;
  }
  const int threads = row_threads(C, kRowThreads);
  layernorm_backward_dx_kernel<T>
      <<<blocks_for(N, 1), threads, 0, stream()>>>(dx, dout, x, w, mean, rstd, N, C);
  KVLAB_LAUNCH_CHECK();

  // The chunking depends on N only, so the summation order is fixed for a given shape.
  int64_t chunk_rows = (N + kMaxRowChunks - 1) / kMaxRowChunks;
  if (chunk_rows < kMinChunkRows) chunk_rows = kMinChunkRows;
  const int64_t row_chunks = (N + chunk_rows - 1) / chunk_rows;
  T* partial = nullptr;  // pdw, pdb: (row_chunks, C) each
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&partial),
                             static_cast<size_t>(2 * row_chunks * C) * sizeof(T), stream()));
  T* pdw = partial;
  T* pdb = partial + row_chunks * C;
  const dim3 grid(static_cast<unsigned>((C + threads - 1) / threads),
                  static_cast<unsigned>(row_chunks));
  layernorm_dwdb_partial_kernel<T>
      <<<grid, threads, 0, stream()>>>(pdw, pdb, dout, x, mean, rstd, N, C, chunk_rows);
  KVLAB_LAUNCH_CHECK();
  layernorm_dwdb_final_kernel<T>
      <<<blocks_for(C), kThreads, 0, stream()>>>(dw, db, pdw, pdb, row_chunks, C);
  KVLAB_LAUNCH_CHECK();
  CUDA_CHECK(cudaFreeAsync(partial, stream()));
}

template <class T>
void softmax_forward(T* out, const T* x, int64_t N, int64_t C) {
  if (N == 0 || C == 0) return;
  softmax_forward_kernel<T>
      <<<blocks_for(N, 1), row_threads(C, kRowThreads), 0, stream()>>>(out, x, N, C);
  KVLAB_LAUNCH_CHECK();
}

template <class T>
void softmax_backward(T* dx, const T* dout, const T* out, int64_t N, int64_t C) {
  if (N == 0 || C == 0) return;
  softmax_backward_kernel<T>
      <<<blocks_for(N, 1), row_threads(C, kRowThreads), 0, stream()>>>(dx, dout, out, N, C);
  KVLAB_LAUNCH_CHECK();
}

KVLAB_NORM_KERNELS(KVLAB_INSTANTIATE, float)
KVLAB_NORM_KERNELS(KVLAB_INSTANTIATE, double)

}  // namespace kvlab::cuda
