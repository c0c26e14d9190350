// ops/reduce.cpp: sum, mean, sum_to.
#include "tests/autograd/gradcheck.h"

namespace {

using namespace kvlab;
using kvtest::all_close;
using kvtest::gradcheck;
using kvtest::param;
using kvtest::vals;

TEST(OpsReduce, SumAndMeanForward) {
  std::vector<double> v(17);
  for (int i = 0; i < 17; ++i) v[i] = i + 1;  // 1..17: sum 153
  Tensor x = Tensor::from_vector(v, {17});
  EXPECT_EQ(sum(x).dim(), 0);
  EXPECT_DOUBLE_EQ(sum(x).item(), 153.0);
  EXPECT_DOUBLE_EQ(mean(x).item(), 9.0);
  EXPECT_FLOAT_EQ(static_cast<float>(sum(x.to(DType::F32)).item()), 153.0f);
  EXPECT_EQ(sum(x.to(DType::F32)).dtype(), DType::F32);
  // A strided view sums its own elements only.
  Tensor m = reshape(x, {1, 17});
  EXPECT_DOUBLE_EQ(sum(narrow(m, 1, 2, 3)).item(), 3.0 + 4.0 + 5.0);

  // Large f32 sums stay accurate (chunked, accumulated in double).
  Generator gen(1);
  Tensor big = kvtest::randn({100003}, gen, DType::F32);
  double want = 0;
  for (double e : vals(big)) want += e;
  EXPECT_NEAR(sum(big).item(), want, 1e-3);
  EXPECT_NEAR(mean(big).item(), want / 100003.0, 1e-8);
}

TEST(OpsReduce, SumAndMeanGradcheck) {
  Generator gen(2);
  for (Shape s : {Shape{}, Shape{1}, Shape{3}, Shape{17}, Shape{3, 17}, Shape{2, 3, 1}}) {
    Tensor x = param(s, gen);
    EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return sum(in[0]); }, {x}))
        << shape_str(s);
    EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return mean(in[0]); }, {x}))
        << shape_str(s);
  }
  // Nested: mean of x * sum(x) broadcast against a scalar-shaped tensor.
  Tensor x = param({3, 5}, gen);
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) { return mul(in[0], reshape(sum(in[0]), {1})); }, {x}));
}

TEST(OpsReduce, SumToReducesBroadcastDims) {
  Tensor x = Tensor::from_vector(std::vector<double>{1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(vals(sum_to(x, {3})), (std::vector<double>{5, 7, 9}));
  EXPECT_EQ(vals(sum_to(x, {1, 3})), (std::vector<double>{5, 7, 9}));
  EXPECT_EQ(vals(sum_to(x, {2, 1})), (std::vector<double>{6, 15}));
  EXPECT_EQ(vals(sum_to(x, {1})), (std::vector<double>{21}));
  EXPECT_EQ(vals(sum_to(x, {})), (std::vector<double>{21}));
  EXPECT_TRUE(sum_to(x, {2, 3}).same(x));
  Tensor y = Tensor::from_vector(std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8}, {2, 2, 2});
  EXPECT_EQ(vals(sum_to(y, {2, 1, 2})), (std::vector<double>{4, 6, 12, 14}));
  EXPECT_EQ(vals(sum_to(y, {2, 1})), (std::vector<double>{1 + 2 + 5 + 6, 3 + 4 + 7 + 8}));
  EXPECT_EQ(vals(sum_to(transpose(y, 0, 2), {2})),
            (std::vector<double>{1 + 2 + 3 + 4, 5 + 6 + 7 + 8}));
  EXPECT_THROW(sum_to(x, {1, 2, 3}), Error);
}

TEST(OpsReduce, BadInputsThrow) {
  EXPECT_TRUE(kvtest::throws_with([] { mean(Tensor::zeros({0, 3})); }, {"mean", "(0, 3)"}));
  EXPECT_TRUE(kvtest::throws_with([] { sum(Tensor::zeros({3}, DType::I32)); }, {"sum", "i32"}));
}

}  // namespace
