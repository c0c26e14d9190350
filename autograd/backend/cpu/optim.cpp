#include <algorithm>
#include <cmath>
#include <vector>

#include "autograd/backend/kernels.h"
#include "platform/parallel.h"

namespace kvlab::cpu {

namespace {

// PyTorch's AdamW order of operations, so parity holds to rounding:
// p *= 1 - lr*wd; m, v updated; p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
void adamw_range(const AdamWTensor& t, int64_t i0, int64_t i1) {
  const AdamWStep& s = t.step;
  const float decay = 1.0f - s.lr * s.weight_decay;
  const float step_size = s.lr / s.bias_correction1;
  const float bc2_sqrt = std::sqrt(s.bias_correction2);
  float* p = t.param;
  float* m = t.m;
  float* v = t.v;
  const float* g = t.grad;
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) {
    const float gi = g[i] * s.grad_scale;
    m[i] = s.beta1 * m[i] + (1.0f - s.beta1) * gi;
    v[i] = s.beta2 * v[i] + (1.0f - s.beta2) * gi * gi;
    const float denom = std::sqrt(v[i]) / bc2_sqrt + s.eps;
    p[i] = p[i] * decay - step_size * m[i] / denom;
  }
}

}  // namespace

// One parallel region for all tensors, each thread an equal share of their concatenated
// elements: a model's ~50 parameters, most of them small, would otherwise cost a region (or a
// single-threaded loop) each.
void adamw_update_many(std::span<const AdamWTensor> tensors) {
  int64_t total = 0;
  for (const AdamWTensor& t : tensors) total += t.n;
  parallel_range(total, total, [&](int64_t lo, int64_t hi) {
    int64_t offset = 0;
    for (const AdamWTensor& t : tensors) {
      const int64_t b = std::max(lo, offset), e = std::min(hi, offset + t.n);
      if (b < e) adamw_range(t, b - offset, e - offset);
      offset += t.n;
    }
  });
}

// Squares in double over fixed chunks of every tensor, summed in order (ordered_chunk_sum_many):
// the same result for any thread count.
double sum_squares_many(std::span<const FloatSpan> xs) {
  std::vector<int64_t> lengths;
  lengths.reserve(xs.size());
  for (const FloatSpan& x : xs) lengths.push_back(x.n);
  return ordered_chunk_sum_many(lengths, [&](size_t t, int64_t i0, int64_t i1) {
    const float* x = xs[t].data + i0;  // locals: GCC gathers through a reference
    const int64_t n = i1 - i0;
    double s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
    return s;
  });
}

}  // namespace kvlab::cpu
