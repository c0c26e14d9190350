#include "nn/adamw.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kvlab {
namespace {

// Two AdamW steps on a 2-D weight (decayed) and a 1-D bias (not decayed) against the update
// written out in double.
TEST(AdamW, MatchesTheUpdateRuleAndDecaysOnly2D) {
  Tensor w = Tensor::from_vector<float>({0.5f, -1.0f, 2.0f, 0.25f}, {2, 2}).set_requires_grad();
  Tensor b = Tensor::from_vector<float>({0.1f, -0.2f}, {2}).set_requires_grad();
  AdamWConfig cfg;
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.99;
  cfg.eps = 1e-8;
  cfg.weight_decay = 0.5;
  AdamW opt({{"w", w}, {"b", b}}, cfg);
  const std::vector<std::vector<float>> gw = {{0.1f, -0.3f, 0.2f, 0.0f}, {0.2f, 0.1f, -0.1f, 0.4f}};
  const std::vector<std::vector<float>> gb = {{1.0f, -2.0f}, {0.5f, 0.5f}};
  std::vector<double> pw = {0.5, -1.0, 2.0, 0.25}, pb = {0.1, -0.2};
  std::vector<double> mw(4, 0), vw(4, 0), mb(2, 0), vb(2, 0);
  const double lr = 0.1, scale = 0.5;
  for (int step = 1; step <= 2; ++step) {
    w.set_grad(Tensor::from_vector<float>(gw[step - 1], {2, 2}));
    b.set_grad(Tensor::from_vector<float>(gb[step - 1], {2}));
    opt.step(lr, scale);
    auto ref = [&](std::vector<double>& p, std::vector<double>& m, std::vector<double>& v,
                   const std::vector<float>& g, double wd) {
      for (size_t i = 0; i < p.size(); ++i) {
        const double gi = g[i] * scale;
        m[i] = 0.9 * m[i] + 0.1 * gi;
        v[i] = 0.99 * v[i] + 0.01 * gi * gi;
        const double mh = m[i] / (1 - std::pow(0.9, step)), vh = v[i] / (1 - std::pow(0.99, step));
        p[i] = p[i] * (1 - lr * wd) - lr * mh / (std::sqrt(vh) + 1e-8);
      }
    };
    ref(pw, mw, vw, gw[step - 1], 0.5);
    ref(pb, mb, vb, gb[step - 1], 0.0);
  }
  const auto w_now = w.to_vector<double>(), b_now = b.to_vector<double>();
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(w_now[i], pw[i], 1e-6) << i;
  for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(b_now[i], pb[i], 1e-6) << i;
  EXPECT_EQ(opt.step_count(), 2);
}

TEST(AdamW, ClipFactorAndNorm) {
  Tensor a = Tensor::zeros({2}).set_requires_grad();
  a.set_grad(Tensor::from_vector<float>({3.0f, 4.0f}, {2}));
  EXPECT_NEAR(global_grad_norm({{"a", a}}), 5.0, 1e-12);
  EXPECT_NEAR(clip_factor(5.0, 1.0), 1.0 / (5.0 + 1e-6), 1e-12);
  EXPECT_EQ(clip_factor(0.5, 1.0), 1.0);
  EXPECT_EQ(clip_factor(5.0, 0.0), 1.0);
}

}  // namespace
}  // namespace kvlab
