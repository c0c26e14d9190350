#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "autograd/backend/cpu/vec_math.h"
#include "autograd/backend/kernels.h"
#include "platform/parallel.h"

namespace kvlab::cpu {

template <class T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* x, const T* w, const T* b, int64_t N,
                       int64_t C, double eps) {
  parallel_range(N, N * C, [&](int64_t i0, int64_t i1) {
    const T* wl = w;  // locals: see layernorm_backward
    const T* bl = b;
    const int64_t Cl = C;
    for (int64_t i = i0; i < i1; ++i) {
      const T* xi = x + i * Cl;
      // Sums in double: f32 rounding over a long row would otherwise show at the 1e-6 level.
      T m = 0;  // RMSNorm (no mean) subtracts nothing
      if (mean != nullptr) {
        double s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < Cl; ++j) s += xi[j];
        m = static_cast<T>(s / static_cast<double>(Cl));
        mean[i] = m;
      }
      double v = 0;
#pragma omp simd reduction(+ : v)
      for (int64_t j = 0; j < Cl; ++j) v += static_cast<double>((xi[j] - m) * (xi[j] - m));
      const T r = static_cast<T>(1.0 / std::sqrt(v / static_cast<double>(Cl) + eps));
      T* oi = out + i * Cl;
      if (bl != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < Cl; ++j) oi[j] = (xi[j] - m) * r * wl[j] + bl[j];
      } else {
#pragma omp simd
        for (int64_t j = 0; j < Cl; ++j) oi[j] = (xi[j] - m) * r * wl[j];
      }
      rstd[i] = r;
    }
  });
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dout * w, without the mean(g) term for
// RMSNorm (whose forward subtracted nothing). dw and db are reduced over
// rows into one partial buffer per thread, summed in thread order: deterministic for a fixed
// thread count.
template <class T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dout, const T* x, const T* w,
                        const T* mean, const T* rstd, int64_t N, int64_t C) {
  const int nt = N * C > kParallelMin ? omp_get_max_threads() : 1;
  std::vector<T> partial(static_cast<size_t>(nt) * 2 * C, T(0));
  auto rows = [&](int tid, int64_t i0, int64_t i1) {
    // Locals, not the captured references: through those GCC reloads w and the row pointers
    // inside the vector loops (gathers and spills).
    T* pdw = partial.data() + static_cast<size_t>(tid) * 2 * C;
    T* pdb = pdw + C;
    const T* wl = w;
    const int64_t Cl = C;
    for (int64_t i = i0; i < i1; ++i) {
      const T* xi = x + i * Cl;
      const T* gi = dout + i * Cl;
      T* di = dx + i * Cl;
      const T m = mean != nullptr ? mean[i] : T(0), r = rstd[i];
      double sum_g = 0, sum_gx = 0;
#pragma omp simd reduction(+ : sum_g, sum_gx)
      for (int64_t j = 0; j < Cl; ++j) {
        const T xhat = (xi[j] - m) * r;
        const T g = gi[j] * wl[j];
        sum_g += g;
        sum_gx += g * xhat;
        pdw[j] += gi[j] * xhat;
        pdb[j] += gi[j];
      }
      const T mg = mean != nullptr ? static_cast<T>(sum_g / static_cast<double>(Cl)) : T(0);
      const T mgx = static_cast<T>(sum_gx / static_cast<double>(Cl));
#pragma omp simd
      for (int64_t j = 0; j < Cl; ++j) {
        const T xhat = (xi[j] - m) * r;
        di[j] = r * (gi[j] * wl[j] - mg - xhat * mgx);
      }
    }
  };
  if (nt == 1) {
    rows(0, 0, N);
  } else {
#pragma omp parallel num_threads(nt)
    {
      const int tid = omp_get_thread_num(), n = omp_get_num_threads();
      rows(tid, N * tid / n, N * (tid + 1) / n);
    }
  }
  for (int64_t j = 0; j < C; ++j) {
    T sw = 0, sb = 0;
    for (int t = 0; t < nt; ++t) {
      sw += partial[static_cast<size_t>(t) * 2 * C + j];
      sb += partial[static_cast<size_t>(t) * 2 * C + C + j];
    }
    dw[j] = sw;
    if (db != nullptr) db[j] = sb;
  }
}

template <class T>
void softmax_forward(T* out, const T* x, int64_t N, int64_t C) {
  parallel_range(N, N * C, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T* xi = x + i * C;
      T* oi = out + i * C;
      std::copy_n(xi, C, oi);
      const double s = exp_shift_inplace(oi, C, row_max(xi, C));
      const T inv = static_cast<T>(1.0 / s);
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) oi[j] *= inv;
    }
  });
}

template <class T>
void softmax_backward(T* dx, const T* dout, const T* out, int64_t N, int64_t C) {
  parallel_range(N, N * C, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T* yi = out + i * C;
      const T* gi = dout + i * C;
      double dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < C; ++j) dot += yi[j] * gi[j];
      T* di = dx + i * C;
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) di[j] = yi[j] * (gi[j] - static_cast<T>(dot));
    }
  });
}

KVLAB_NORM_KERNELS(KVLAB_INSTANTIATE, float)
KVLAB_NORM_KERNELS(KVLAB_INSTANTIATE, double)

}  // namespace kvlab::cpu
