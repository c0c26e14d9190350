// backend/cpu/vec_math.h: error bounds of the vectorisable exp and tanh, and of the f32 GELU
// kernel built on them.
#include <cmath>
#include <limits>
#include <vector>

#include "autograd/backend/cpu/vec_math.h"
#include "autograd/backend/kernels.h"
#include "tests/autograd/gradcheck.h"

namespace {

using kvlab::cpu::fast_exp;
using kvlab::cpu::fast_tanh;

double gelu_ref(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}
double gelu_grad_ref(double x) {
  const double c = std::sqrt(2 / M_PI), u = c * (x + 0.044715 * x * x * x);
  const double th = std::tanh(u);
  return 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * c * (1 + 3 * 0.044715 * x * x);
}

// Evenly spaced f32 points over [lo, hi] (both ends included), plus small values of both signs
// down to 2^-40, where cancellation is most delicate.
std::vector<float> sweep(float lo, float hi, int64_t n) {
  std::vector<float> xs;
  xs.reserve(static_cast<size_t>(n + 1));
  for (int64_t i = 0; i <= n; ++i)
    xs.push_back(static_cast<float>(lo + (static_cast<double>(hi) - lo) * static_cast<double>(i) /
                                             static_cast<double>(n)));
  for (int e = 10; e <= 40; ++e)
    for (int i = 0; i < 64; ++i)
      for (float sign : {-1.0f, 1.0f})
        xs.push_back(sign * std::ldexp(1.0f + static_cast<float>(i) / 64.0f, -e));
  return xs;
}

TEST(VecMath, FastExpRelativeErrorBound) {
  const std::vector<float> xs = sweep(-87.0f, 88.0f, 4'000'000);
  double worst = 0;
  float worst_x = 0;
  for (float x : xs) {
    const double want = std::exp(static_cast<double>(x));
    const double err = std::abs(static_cast<double>(fast_exp(x)) - want) / want;
    if (!(err <= worst)) {
      worst = err;
      worst_x = x;
    }
  }
  EXPECT_LE(worst, 2e-7) << "at x = " << worst_x;
  // Exact and boundary points.
  EXPECT_EQ(fast_exp(0.0f), 1.0f);
  EXPECT_EQ(fast_exp(-100.0f), fast_exp(-87.0f));  // clamped, not denormal or zero
  EXPECT_GT(fast_exp(-100.0f), 0.0f);
  EXPECT_EQ(fast_exp(100.0f), fast_exp(88.0f));
  EXPECT_TRUE(std::isfinite(fast_exp(1e30f)));
  EXPECT_TRUE(std::isnormal(fast_exp(-87.0f)));
}

TEST(VecMath, FastExpIsMonotoneOnAGrid) {
  float prev = 0;
  for (int i = -8700; i <= 8800; ++i) {
    const float y = fast_exp(static_cast<float>(i) * 0.01f);
    EXPECT_GE(y, prev) << i;
    prev = y;
  }
}

TEST(VecMath, FastTanhAbsoluteErrorBound) {
  const std::vector<float> xs = sweep(-20.0f, 20.0f, 2'000'000);
  double worst = 0;
  float worst_x = 0;
  for (float x : xs) {
    const double err =
        std::abs(static_cast<double>(fast_tanh(x)) - std::tanh(static_cast<double>(x)));
    if (!(err <= worst)) {
      worst = err;
      worst_x = x;
    }
  }
  EXPECT_LE(worst, 3e-7) << "at x = " << worst_x;
  EXPECT_EQ(fast_tanh(0.0f), 0.0f);
  EXPECT_EQ(fast_tanh(50.0f), 1.0f);
  EXPECT_EQ(fast_tanh(-50.0f), -1.0f);
}

TEST(VecMath, DoubleVersionsUseLibm) {
  for (double x : {-3.5, -0.1, 0.0, 0.7, 12.0}) {
    EXPECT_EQ(kvlab::cpu::exp_t(x), std::exp(x));
    EXPECT_EQ(kvlab::cpu::tanh_t(x), std::tanh(x));
  }
  EXPECT_EQ(kvlab::cpu::exp_t(1.5f), fast_exp(1.5f));
  EXPECT_EQ(kvlab::cpu::tanh_t(1.5f), fast_tanh(1.5f));
}

TEST(VecMath, GeluF32KernelWithinBound) {
  std::vector<float> xs = sweep(-12.0f, 12.0f, 1'000'000);
  std::vector<float> out(xs.size());
  kvlab::cpu::gelu_forward<float>(out.data(), xs.data(), static_cast<int64_t>(xs.size()));
  double worst = 0;
  float worst_x = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const double x = xs[i];
    const double err = std::abs(out[i] - gelu_ref(x)) / std::max(1.0, std::abs(x));
    if (!(err <= worst)) {
      worst = err;
      worst_x = xs[i];
    }
  }
  EXPECT_LE(worst, 1e-6) << "at x = " << worst_x;
}

TEST(VecMath, GeluF32BackwardKernelClose) {
  std::vector<float> xs = sweep(-12.0f, 12.0f, 200'000);
  std::vector<float> ones(xs.size(), 1.0f), dx(xs.size());
  kvlab::cpu::gelu_backward<float>(dx.data(), ones.data(), xs.data(),
                                   static_cast<int64_t>(xs.size()));
  double worst = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const double x = xs[i];
    worst = std::max(worst, std::abs(dx[i] - gelu_grad_ref(x)) / std::max(1.0, std::abs(x)));
  }
  EXPECT_LE(worst, 2e-6);
}

}  // namespace
