#pragma once
// Vectorisable exp and tanh for f32. glibc's expf/tanhf do not vectorise
// (docs/bench-log/code-figures.md); these compile to a few AVX2/FMA instructions per 8 elements
// inside `omp simd` loops (given -fno-trapping-math, which the build sets: without it GCC keeps the
// clamps as branches and the loops stay scalar). f64 keeps the libm functions (it serves gradient
// checks, not speed). Error bounds are tested in tests/autograd/backend/test_vec_math.cpp.
#include <bit>
#include <cmath>
#include <cstdint>

namespace kvlab::cpu {

// exp(x) with relative error below 2e-7 on [-87, 88]; clamps outside (exp(-87) ~ 1.6e-38).
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // Round to nearest by adding and removing 1.5 * 2^23 (std::nearbyint/floor do not
  // vectorise under GCC's default -ftrapping-math).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693145751953125f;  // ln2 split in two for an exact first product
  r = r - n * 1.428606765330187045e-06f;
  // Minimax-style polynomial for exp(r) on [-ln2/2, ln2/2].
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(e);
}

inline float fast_tanh(float x) {
  // tanh(x) = 1 - 2 / (exp(2x) + 1); the absolute error stays below 3e-7.
  return 1.0f - 2.0f / (fast_exp(2.0f * x) + 1.0f);
}

template <class T>
inline T exp_t(T x) {
  if constexpr (sizeof(T) == 4) return fast_exp(x); else return std::exp(x);
}
template <class T>
inline T tanh_t(T x) {
  if constexpr (sizeof(T) == 4) return fast_tanh(x); else return std::tanh(x);
}

// sigmoid(a) as (1 + tanh(a / 2)) / 2: tanh_t vectorises. SwiGLU's silu(a) = a * sigmoid(a).
template <class T>
inline T sigmoid_t(T a) {
  return T(0.5) + T(0.5) * tanh_t(T(0.5) * a);
}

// Largest of x[0 .. n), n >= 1 (the ternary form vectorises; std::max does not).
template <class T>
inline T row_max(const T* x, int64_t n) {
  T mx = x[0];
#pragma omp simd reduction(max : mx)
  for (int64_t j = 1; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  return mx;
}

// Blocks of exp terms are summed in T (a vectorised loop), the blocks in double: the row sum
// keeps double-like accuracy without giving up the vector loop.
constexpr int64_t kExpBlock = 64;

// sum over j of exp(x[j] - shift).
template <class T>
inline double sum_exp_shift(const T* x, int64_t n, T shift) {
  double total = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kExpBlock) {
    const int64_t j1 = j0 + kExpBlock < n ? j0 + kExpBlock : n;
    T part = 0;
#pragma omp simd reduction(+ : part)
    for (int64_t j = j0; j < j1; ++j) part += exp_t(x[j] - shift);
    total += part;
  }
  return total;
}

// x[j] = exp(x[j] - shift) in place; returns their sum.
template <class T>
inline double exp_shift_inplace(T* x, int64_t n, T shift) {
  double total = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kExpBlock) {
    const int64_t j1 = j0 + kExpBlock < n ? j0 + kExpBlock : n;
    T part = 0;
#pragma omp simd reduction(+ : part)
    for (int64_t j = j0; j < j1; ++j) {
      x[j] = exp_t(x[j] - shift);
      part += x[j];
    }
    total += part;
  }
  return total;
}

}  // namespace kvlab::cpu
