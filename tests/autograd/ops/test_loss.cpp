// ops/loss.cpp: mean cross-entropy with ignore_index.
#include <cmath>

#include "tests/autograd/gradcheck.h"

namespace {

using namespace kvlab;
using kvtest::all_close;
using kvtest::gradcheck;
using kvtest::param;
using kvtest::throws_with;
using kvtest::vals;

// Mean over non-ignored rows of -log softmax(logits)[target], in double.
double naive_cross_entropy(const Tensor& logits, const Tensor& targets, int32_t ignore) {
  const auto lv = vals(logits);
  const auto tv = targets.to_vector<int32_t>();
  const int64_t V = logits.size(-1);
  double total = 0;
  int count = 0;
  for (size_t n = 0; n < tv.size(); ++n) {
    if (tv[n] == ignore) continue;
    double mx = -INFINITY, s = 0;
    for (int64_t j = 0; j < V; ++j) mx = std::max(mx, lv[n * V + j]);
    for (int64_t j = 0; j < V; ++j) s += std::exp(lv[n * V + j] - mx);
    total += mx + std::log(s) - lv[n * V + tv[n]];
    ++count;
  }
  return count ? total / count : 0.0;
}

TEST(OpsLoss, HandComputedUniformLogits) {
  // Equal logits: the loss is log(V) whatever the target.
  Tensor logits = Tensor::zeros({3, 4}, DType::F64);
  Tensor targets = kvtest::ids_tensor({0, 3, 2}, {3});
  EXPECT_NEAR(cross_entropy(logits, targets).item(), std::log(4.0), 1e-15);
  // Two classes, logits (0, log 3): p = (1/4, 3/4).
  Tensor two = Tensor::from_vector(std::vector<double>{0, std::log(3.0)}, {1, 2});
  EXPECT_NEAR(cross_entropy(two, kvtest::ids_tensor({1}, {1})).item(), -std::log(0.75), 1e-15);
  EXPECT_NEAR(cross_entropy(two, kvtest::ids_tensor({0}, {1})).item(), -std::log(0.25), 1e-15);
}

TEST(OpsLoss, ForwardMatchesNaiveWithIgnoreIndex) {
  Generator gen(1);
  for (DType dt : {DType::F64, DType::F32}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor logits = kvtest::randn({2, 3, 17}, gen, dt, 3.0);
    Tensor targets = kvtest::ids_tensor({4, -1, 16, 0, -1, 9}, {2, 3});
    const double want = naive_cross_entropy(logits, targets, -1);
    const double got = cross_entropy(logits, targets).item();
    EXPECT_NEAR(got, want, (dt == DType::F64 ? 1e-13 : 1e-5) * std::max(1.0, std::abs(want)));
    // The mean is over the 4 counted rows, not all 6: compare with the unignored rows alone.
    Tensor kept_logits = Tensor::empty({4, 17}, dt);
    const std::vector<int> rows = {0, 2, 3, 5};
    Tensor flat = reshape(logits, {6, 17});
    for (int i = 0; i < 4; ++i) narrow(kept_logits, 0, i, 1).copy_from(narrow(flat, 0, rows[i], 1));
    const double kept = cross_entropy(kept_logits, kvtest::ids_tensor({4, 16, 0, 9}, {4})).item();
    EXPECT_NEAR(got, kept, dt == DType::F64 ? 1e-13 : 1e-5);
    // A custom ignore index.
    Tensor t2 = kvtest::ids_tensor({4, -100, 16, 0, -100, 9}, {2, 3});
    EXPECT_NEAR(cross_entropy(logits, t2, -100).item(), want,
                (dt == DType::F64 ? 1e-13 : 1e-5) * std::max(1.0, want));
  }
  // Large logits stay finite (log-sum-exp with the max subtracted).
  Tensor big = Tensor::from_vector(std::vector<double>{1000, 0, -1000}, {1, 3});
  EXPECT_NEAR(cross_entropy(big, kvtest::ids_tensor({1}, {1})).item(), 1000.0, 1e-9);
  EXPECT_NEAR(cross_entropy(big.to(DType::F32), kvtest::ids_tensor({0}, {1})).item(), 0.0, 1e-6);
}

TEST(OpsLoss, Gradcheck) {
  Generator gen(2);
  Tensor logits = param({2, 3, 17}, gen);
  Tensor targets = kvtest::ids_tensor({4, -1, 16, 0, -1, 9}, {2, 3});
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return cross_entropy(in[0], in[1]); },
                        {logits, targets}));
  // Ignored rows get exactly zero gradient.
  const auto g = vals(logits.grad());
  for (int j = 0; j < 17; ++j) {
    EXPECT_EQ(g[1 * 17 + j], 0.0);
    EXPECT_EQ(g[4 * 17 + j], 0.0);
  }
  for (Shape s : {Shape{1, 1}, Shape{1, 3}, Shape{5, 3}}) {
    Tensor l = param(s, gen);
    Tensor t = kvtest::random_ids({s[0]}, static_cast<int32_t>(s[1]), gen);
    EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return cross_entropy(in[0], in[1]); },
                          {l, t}))
        << shape_str(s);
  }
  // Composed with a scale so the upstream gradient is not 1.
  Tensor l = param({3, 5}, gen);
  Tensor t = kvtest::ids_tensor({2, 2, -1}, {3});
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) { return scale(cross_entropy(in[0], in[1]), -3.5); },
      {l, t}));
}

TEST(OpsLoss, GradientIsSoftmaxMinusOneHotOverCount) {
  Generator gen(3);
  Tensor logits = param({3, 4}, gen);
  Tensor targets = kvtest::ids_tensor({1, -1, 3}, {3});
  cross_entropy(logits, targets).backward();
  const auto lv = vals(logits), gv = vals(logits.grad());
  for (int n : {0, 2}) {
    double s = 0;
    for (int j = 0; j < 4; ++j) s += std::exp(lv[n * 4 + j]);
    for (int j = 0; j < 4; ++j) {
      const double want = (std::exp(lv[n * 4 + j]) / s - (j == (n == 0 ? 1 : 3))) / 2.0;
      EXPECT_NEAR(gv[n * 4 + j], want, 1e-15);
    }
  }
}

TEST(OpsLoss, AllIgnoredGivesZero) {
  Generator gen(4);
  Tensor logits = param({2, 5}, gen);
  Tensor y = cross_entropy(logits, kvtest::ids_tensor({-1, -1}, {2}));
  EXPECT_EQ(y.item(), 0.0);
  y.backward();
  EXPECT_TRUE(all_close(logits.grad(), std::vector<double>(10, 0.0), 0));
}

TEST(OpsLoss, F32GradientMatchesF64) {
  Generator gen(5);
  Tensor l64 = param({6, 50}, gen, DType::F64, 2.0);
  Tensor l32 = l64.detach().to(DType::F32).set_requires_grad();
  Tensor t = kvtest::random_ids({6}, 50, gen);
  cross_entropy(l64, t).backward();
  cross_entropy(l32, t).backward();
  EXPECT_TRUE(all_close(l32.grad(), l64.grad(), 1e-6));
}

TEST(OpsLoss, ThreadedRowsAndScalarTarget) {
  // N * V above the threading threshold: forward against the naive mean, backward against
  // (softmax - onehot) / count.
  Generator gen(6);
  const int64_t N = 48, V = 517;
  Tensor logits = param({N, V}, gen, DType::F64, 2.0);
  std::vector<int32_t> t(N);
  for (int64_t i = 0; i < N; ++i) t[i] = i % 5 == 0 ? -1 : static_cast<int32_t>((i * 37) % V);
  Tensor targets = kvtest::ids_tensor(t, {N});
  Tensor loss = cross_entropy(logits, targets);
  EXPECT_NEAR(loss.item(), naive_cross_entropy(logits, targets, -1), 1e-12);
  loss.backward();
  const auto lv = vals(logits);
  std::vector<double> want(lv.size(), 0.0);
  int count = 0;
  for (int32_t v : t) count += v != -1;
  for (int64_t i = 0; i < N; ++i) {
    if (t[i] == -1) continue;
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(lv[i * V + j]);
    for (int64_t j = 0; j < V; ++j)
      want[i * V + j] = (std::exp(lv[i * V + j]) / s - (j == t[i])) / count;
  }
  EXPECT_TRUE(all_close(logits.grad(), want, 1e-14));

  // 1-D logits with a scalar (0-dim) target.
  Tensor l1 = param({5}, gen);
  Tensor t1 = kvtest::ids_tensor({3}, {});
  EXPECT_NEAR(cross_entropy(l1, t1).item(), naive_cross_entropy(l1, t1, -1), 1e-14);
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return cross_entropy(in[0], in[1]); },
                        {l1, t1}));
}

TEST(OpsLoss, BadInputsThrow) {
  Tensor logits = Tensor::zeros({2, 5});
  EXPECT_TRUE(throws_with(
      [&] {
        cross_entropy(logits, kvtest::ids_tensor({0, 5}, {2}));
      },
      {"cross_entropy", "5", "[0, 5)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        cross_entropy(logits, kvtest::ids_tensor({-2, 0}, {2}));
      },
      {"cross_entropy", "-2"}));
  EXPECT_TRUE(throws_with(
      [&] {
        cross_entropy(logits, kvtest::ids_tensor({0, 1, 2}, {3}));
      },
      {"cross_entropy", "(2, 5)", "(3)"}));
  EXPECT_TRUE(
      throws_with([&] { cross_entropy(logits, Tensor::zeros({2})); }, {"cross_entropy", "i32"}));
  EXPECT_TRUE(throws_with(
      [&] {
        cross_entropy(Tensor::zeros({2, 0}), Tensor::zeros({2}, DType::I32));
      },
      {"cross_entropy", "(2, 0)"}));
}

}  // namespace
