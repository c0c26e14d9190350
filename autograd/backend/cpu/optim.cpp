#include <algorithm>
#include <cmath>
#include <vector>

#include "autograd/backend/cpu/kernels.h"
#include "autograd/backend/cpu/parallel.h"

namespace kvlab::cpu {

// PyTorch's AdamW order of operations, so parity holds to rounding:
// p *= 1 - lr*wd; m, v updated; p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWStep& s) {
  const float decay = 1.0f - s.lr * s.weight_decay;
  const float step_size = s.lr / s.bias_correction1;
  const float bc2_sqrt = std::sqrt(s.bias_correction2);
  parallel_range(n, n, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      const float gi = g[i] * s.grad_scale;
      m[i] = s.beta1 * m[i] + (1.0f - s.beta1) * gi;
      v[i] = s.beta2 * v[i] + (1.0f - s.beta2) * gi * gi;
      const float denom = std::sqrt(v[i]) / bc2_sqrt + s.eps;
      p[i] = p[i] * decay - step_size * m[i] / denom;
    }
  });
}

double sum_squares(const float* x, int64_t n) {
  return ordered_chunk_sum(n, [&](int64_t i0, int64_t i1) {
    double s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = i0; i < i1; ++i) s += static_cast<double>(x[i]) * x[i];
    return s;
  });
}

void adamw_update_many(std::span<const AdamWTensor> tensors) {
  for (const AdamWTensor& t : tensors) adamw_update(t.param, t.grad, t.m, t.v, t.n, t.step);
}

double sum_squares_many(std::span<const FloatSpan> xs) {
  double s = 0;
  for (const FloatSpan& x : xs) s += sum_squares(x.data, x.n);
  return s;
}

}  // namespace kvlab::cpu
