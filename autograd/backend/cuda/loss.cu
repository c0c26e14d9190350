// Embedding lookup and the fused cross-entropy loss. Everything here is deterministic: the
// embedding gradient sorts the rows by id and sums each id's rows in row order, and the loss sums
// per-row values in a fixed order in one block.
#include <climits>
#include <cub/device/device_radix_sort.cuh>

#include "autograd/backend/cuda/common.cuh"
#include "autograd/backend/kernels.h"

namespace kvlab::cuda {
namespace {

constexpr int kRowThreads = 512;  // block size of the kernels that stride over a row of V
constexpr int kLossThreads = 1024;

template <class T>
__global__ void embedding_forward_kernel(T* out, const int32_t* ids, const T* weight, int64_t N,
                                         int64_t C) {
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const T* wi = weight + static_cast<int64_t>(ids[i]) * C;
    T* oi = out + i * C;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) oi[j] = wi[j];
  }
}

__global__ void iota_kernel(int32_t* x, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = static_cast<int32_t>(i);
}

// sorted_ids, sorted_rows (N): the ids in ascending order, each with its row of dout, rows of one
// id in ascending order (the sort is stable). The block at the first position of each id's run
// adds that run's rows, in order, to the id's row of dweight: no two blocks write the same row.
template <class T>
__global__ void embedding_backward_kernel(T* dweight, const T* dout, const int32_t* sorted_ids,
                                          const int32_t* sorted_rows, int64_t N, int64_t C) {
  for (int64_t p = blockIdx.x; p < N; p += gridDim.x) {
    const int32_t id = sorted_ids[p];
    if (p > 0 && sorted_ids[p - 1] == id) continue;
    int64_t end = p + 1;
    while (end < N && sorted_ids[end] == id) ++end;
    T* drow = dweight + static_cast<int64_t>(id) * C;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      T acc = 0;
#pragma unroll 4
      for (int64_t q = p; q < end; ++q) acc += dout[static_cast<int64_t>(sorted_rows[q]) * C + j];
      drow[j] += acc;
    }
  }
}

// lse (N) = logsumexp of each row of logits (N, V); row_loss (N) = lse - the target's logit, 0 on
// ignored rows.
template <class T>
__global__ void cross_entropy_lse_kernel(T* lse, T* row_loss, const T* logits,
                                         const int32_t* targets, int64_t N, int64_t V,
                                         int32_t ignore_index) {
  __shared__ T shared[32];
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const T* li = logits + i * V;
    T mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = max(mx, li[j]);
    mx = block_max(mx, shared);
    T s = 0;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) s += exp_t(li[j] - mx);
    s = block_sum(s, shared);
    if (threadIdx.x == 0) {
      const T l = mx + static_cast<T>(log(static_cast<double>(s)));
      const int32_t t = targets[i];
      lse[i] = l;
      row_loss[i] = t == ignore_index ? T(0) : l - li[t];
    }
  }
}

// One block: *loss = (sum of row_loss in double) / count, 0 when count is 0.
template <class T>
__global__ void cross_entropy_loss_kernel(T* loss, const T* row_loss, int64_t N, int64_t count) {
  __shared__ double shared[32];
  double s = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) s += static_cast<double>(row_loss[i]);
  s = block_sum(s, shared);
  if (threadIdx.x == 0) *loss = count ? static_cast<T>(s / static_cast<double>(count)) : T(0);
}

template <class T>
__global__ void cross_entropy_backward_kernel(T* dlogits, const T* logits, const T* lse,
                                              const int32_t* targets, int64_t N, int64_t V,
                                              int32_t ignore_index, const T* dloss, int64_t count) {
  const T scale =
      count ? static_cast<T>(static_cast<double>(*dloss) / static_cast<double>(count)) : T(0);
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    T* di = dlogits + i * V;
    const int32_t t = targets[i];
    if (t == ignore_index) {
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) di[j] = T(0);
      continue;
    }
    const T* li = logits + i * V;
    const T l = lse[i];
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      T d = exp_t(li[j] - l) * scale;
      if (j == t) d -= scale;
      di[j] = d;
    }
  }
}

}  // namespace

template <class T>
void embedding_forward(T* out, const int32_t* ids, const T* weight, int64_t N, int64_t C) {
  if (N == 0 || C == 0) return;
  embedding_forward_kernel<T>
      <<<blocks_for(N, 1), row_threads(C, 256), 0, stream()>>>(out, ids, weight, N, C);
  KVLAB_LAUNCH_CHECK();
}

template <class T>
void embedding_backward(T* dweight, const T* dout, const int32_t* ids, int64_t N, int64_t /*V*/,
                        int64_t C) {
  if (N == 0 || C == 0) return;
  KVLAB_CHECK(N <= INT_MAX, "embedding backward: ", N, " rows exceed the 32-bit row index");
  const int n = static_cast<int>(N);
  int32_t* buf = nullptr;  // sorted_ids, rows, sorted_rows: (N) each
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&buf),
                             3 * static_cast<size_t>(N) * sizeof(int32_t), stream()));
  int32_t* sorted_ids = buf;
  int32_t* rows = buf + N;
  int32_t* sorted_rows = buf + 2 * N;
  iota_kernel<<<blocks_for(N), kThreads, 0, stream()>>>(rows, N);
  KVLAB_LAUNCH_CHECK();

  size_t temp_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, ids, sorted_ids, rows,
                                             sorted_rows, n, 0, 32, stream()));
  void* temp = nullptr;
  CUDA_CHECK(cudaMallocAsync(&temp, temp_bytes, stream()));
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, ids, sorted_ids, rows, sorted_rows,
                                             n, 0, 32, stream()));
  CUDA_CHECK(cudaFreeAsync(temp, stream()));

  // Up to 1024 threads: one column each for the usual widths, as a long run of one id is serial.
  embedding_backward_kernel<T><<<blocks_for(N, 1), row_threads(C, 1024), 0, stream()>>>(
      dweight, dout, sorted_ids, sorted_rows, N, C);
  KVLAB_LAUNCH_CHECK();
  CUDA_CHECK(cudaFreeAsync(buf, stream()));
}

template <class T>
void cross_entropy_forward(T* loss, T* lse, const T* logits, const int32_t* targets, int64_t N,
                           int64_t V, int32_t ignore_index, int64_t count) {
  if (N == 0 || V == 0) {  // no rows to count: the loss is 0
    CUDA_CHECK(cudaMemsetAsync(loss, 0, sizeof(T), stream()));
    return;
  }
  T* row_loss = nullptr;  // (N)
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&row_loss),
                             static_cast<size_t>(N) * sizeof(T), stream()));
  cross_entropy_lse_kernel<T><<<blocks_for(N, 1), row_threads(V, kRowThreads), 0, stream()>>>(
      lse, row_loss, logits, targets, N, V, ignore_index);
  KVLAB_LAUNCH_CHECK();
  cross_entropy_loss_kernel<T><<<1, kLossThreads, 0, stream()>>>(loss, row_loss, N, count);
  KVLAB_LAUNCH_CHECK();
  CUDA_CHECK(cudaFreeAsync(row_loss, stream()));
}

template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const T* lse, const int32_t* targets,
                            int64_t N, int64_t V, int32_t ignore_index, const T* dloss,
                            int64_t count) {
  if (N == 0 || V == 0) return;
  cross_entropy_backward_kernel<T><<<blocks_for(N, 1), row_threads(V, kRowThreads), 0, stream()>>>(
      dlogits, logits, lse, targets, N, V, ignore_index, dloss, count);
  KVLAB_LAUNCH_CHECK();
}

KVLAB_LOSS_KERNELS(KVLAB_INSTANTIATE, float)
KVLAB_LOSS_KERNELS(KVLAB_INSTANTIATE, double)

}  // namespace kvlab::cuda
