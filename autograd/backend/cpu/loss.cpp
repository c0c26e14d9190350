#include <omp.h>

#include <algorithm>
#include <cmath>

#include "autograd/backend/cpu/vec_math.h"
#include "autograd/backend/kernels.h"
#include "platform/parallel.h"

namespace kvlab::cpu {

template <class T>
void embedding_forward(T* out, const int32_t* ids, const T* weight, int64_t N, int64_t C) {
  parallel_range(N, N * C, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      std::copy_n(weight + static_cast<int64_t>(ids[i]) * C, C, out + i * C);
  });
}

// Each thread owns a slice of the C columns and walks all rows in order, so repeated ids
// accumulate without races and in a fixed order.
template <class T>
void embedding_backward(T* dweight, const T* dout, const int32_t* ids, int64_t N, int64_t /*V*/,
                        int64_t C) {
  parallel_range(C, N * C, [&](int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < N; ++i) {
      T* drow = dweight + static_cast<int64_t>(ids[i]) * C;
      const T* g = dout + i * C;
      for (int64_t j = c0; j < c1; ++j) drow[j] += g[j];
    }
  });
}

template <class T>
void cross_entropy_forward(T* loss, T* lse, const T* logits, const int32_t* targets, int64_t N,
                           int64_t V, int32_t ignore_index, int64_t count) {
  parallel_range(N, N * V, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T* li = logits + i * V;
      const T mx = row_max(li, V);
      lse[i] = mx + static_cast<T>(std::log(sum_exp_shift(li, V, mx)));
    }
  });
  double total = 0;  // summed in row order: deterministic for any thread count
  for (int64_t i = 0; i < N; ++i)
    if (targets[i] != ignore_index) total += static_cast<double>(lse[i] - logits[i * V + targets[i]]);
  *loss = count ? static_cast<T>(total / static_cast<double>(count)) : T(0);
}

template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const T* lse, const int32_t* targets,
                            int64_t N, int64_t V, int32_t ignore_index, const T* dloss,
                            int64_t count) {
  const T scale = count ? static_cast<T>(static_cast<double>(*dloss) / static_cast<double>(count)) : T(0);
  parallel_range(N, N * V, [&](int64_t i0, int64_t i1) {
    const T f = scale;  // a local: captured by reference it is reloaded per vector (see gelu)
    for (int64_t i = i0; i < i1; ++i) {
      T* di = dlogits + i * V;
      if (targets[i] == ignore_index) {
        std::fill_n(di, V, T(0));
        continue;
      }
      const T* li = logits + i * V;
      const T l = lse[i];
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) di[j] = exp_t(li[j] - l) * f;
      di[targets[i]] -= f;
    }
  });
}

KVLAB_LOSS_KERNELS(KVLAB_INSTANTIATE, float)
KVLAB_LOSS_KERNELS(KVLAB_INSTANTIATE, double)

}  // namespace kvlab::cpu
