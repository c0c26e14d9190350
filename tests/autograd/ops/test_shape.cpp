// ops/shape.cpp: reshape, transpose, narrow, concat, split.
#include "tests/autograd/gradcheck.h"

namespace {

using namespace kvlab;
using kvtest::all_close;
using kvtest::gradcheck;
using kvtest::param;
using kvtest::throws_with;
using kvtest::vals;

std::vector<double> iota(int64_t n) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<double>(i);
  return v;
}

TEST(OpsShape, ReshapeForward) {
  Tensor x = Tensor::from_vector(iota(2 * 3 * 17), {2, 3, 17});
  EXPECT_EQ(reshape(x, {6, 17}).sizes(), (Shape{6, 17}));
  EXPECT_EQ(reshape(x, {-1}).sizes(), (Shape{102}));
  EXPECT_EQ(reshape(x, {2, -1}).sizes(), (Shape{2, 51}));
  EXPECT_EQ(reshape(x, {-1, 1, 17}).sizes(), (Shape{6, 1, 17}));
  EXPECT_EQ(vals(reshape(x, {17, 6})), iota(102));
  Tensor s = reshape(Tensor::from_vector(std::vector<double>{5}, {1, 1}), {});
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.item(), 5.0);
}

TEST(OpsShape, ReshapeGradcheck) {
  Generator gen(1);
  Tensor x = param({2, 3, 17}, gen);
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) {
        return reshape(in[0], {17, -1});
      },
      {x}));
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return reshape(in[0], {-1}); }, {x}));
  // Reshape of a non-contiguous view (a copy) and of a scalar-like tensor.
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) {
        return reshape(transpose(in[0], 0, 2), {-1, 3});
      },
      {x}));
  Tensor one = param({1}, gen);
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) {
        return reshape(in[0], {1, 1, 1});
      },
      {one}));
}

TEST(OpsShape, TransposeForwardAndGradcheck) {
  Tensor x = Tensor::from_vector(iota(6), {2, 3});
  Tensor t = transpose(x);  // default: last two dims
  EXPECT_EQ(t.sizes(), (Shape{3, 2}));
  EXPECT_EQ(vals(t), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(t.storage().get(), x.storage().get());
  EXPECT_TRUE(all_close(transpose(t), x, 0));

  Generator gen(2);
  Tensor y = param({2, 3, 17}, gen);
  for (auto [d0, d1] : std::vector<std::pair<int, int>>{{0, 2}, {1, 2}, {-1, -3}, {1, 1}})
    EXPECT_TRUE(gradcheck(
        [d0 = d0, d1 = d1](const std::vector<Tensor>& in) { return transpose(in[0], d0, d1); },
        {y}))
        << d0 << "," << d1;
}

TEST(OpsShape, NarrowForwardAndGradcheck) {
  Tensor x = Tensor::from_vector(iota(12), {3, 4});
  EXPECT_EQ(vals(narrow(x, 0, 1, 2)), (std::vector<double>{4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(vals(narrow(x, 1, 3, 1)), (std::vector<double>{3, 7, 11}));
  EXPECT_EQ(vals(narrow(x, -1, 1, 2)), (std::vector<double>{1, 2, 5, 6, 9, 10}));
  EXPECT_EQ(narrow(x, 1, 4, 0).numel(), 0);
  EXPECT_EQ(narrow(x, 1, 1, 2).storage().get(), x.storage().get());

  Generator gen(3);
  Tensor y = param({3, 17}, gen);
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return narrow(in[0], 1, 5, 7); }, {y}));
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return narrow(in[0], 0, 2, 1); }, {y}));
  // Two overlapping narrows of the same input: gradients accumulate.
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) {
        return mul(narrow(in[0], 1, 0, 10), narrow(in[0], 1, 7, 10));
      },
      {y}));
}

TEST(OpsShape, ConcatForwardAndGradcheck) {
  Tensor a = Tensor::from_vector(std::vector<double>{1, 2, 3, 4}, {2, 2});
  Tensor b = Tensor::from_vector(std::vector<double>{5, 6}, {2, 1});
  EXPECT_EQ(vals(concat({a, b}, 1)), (std::vector<double>{1, 2, 5, 3, 4, 6}));
  EXPECT_EQ(vals(concat({a, transpose(b, 0, 1)}, 0)), (std::vector<double>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(vals(concat({a}, -1)), vals(a));

  Generator gen(4);
  Tensor p = param({2, 1, 3}, gen), q = param({2, 5, 3}, gen), r = param({2, 3, 3}, gen);
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) {
        return concat({in[0], in[1], in[2]}, 1);
      },
      {p, q, r}));
  Tensor u = param({3, 17}, gen), v = param({1, 17}, gen);
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) {
        return concat({in[0], in[1]}, 0);
      },
      {u, v}));
  Tensor w = param({3, 2}, gen), w2 = param({5, 3}, gen);
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) {
        return concat({in[0], transpose(in[1], 0, 1)}, -1);
      },
      {w, w2}));
  // One input constant, one used twice.
  Tensor c = kvtest::randn({3, 17}, gen);
  EXPECT_TRUE(gradcheck(
      [&](const std::vector<Tensor>& in) {
        return concat({in[0], c, in[0]}, 0);
      },
      {u}));
}

TEST(OpsShape, SplitForwardAndGradcheck) {
  Tensor x = Tensor::from_vector(iota(17), {1, 17});
  std::vector<Tensor> parts = split(x, 5, 1);
  ASSERT_EQ(parts.size(), 4u);
  EXPECT_EQ(parts[0].sizes(), (Shape{1, 5}));
  EXPECT_EQ(parts[3].sizes(), (Shape{1, 2}));
  EXPECT_EQ(vals(parts[3]), (std::vector<double>{15, 16}));
  EXPECT_EQ(parts[2].storage().get(), x.storage().get());  // views
  EXPECT_EQ(split(x, 17, 1).size(), 1u);
  EXPECT_EQ(split(x, 100, -1).size(), 1u);

  Generator gen(5);
  Tensor y = param({3, 17}, gen);
  // Recombine the parts in a different order with different weights so every part matters.
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) {
        std::vector<Tensor> ps = split(in[0], 5, 1);
        std::vector<Tensor> mixed;
        for (size_t i = ps.size(); i-- > 0;)
          mixed.push_back(scale(ps[i], 1.0 + static_cast<double>(i)));
        return concat(mixed, 1);
      },
      {y}));
  Tensor z = param({4, 3}, gen);
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) {
        std::vector<Tensor> ps = split(in[0], 2, 0);
        return mul(ps[0], ps[1]);
      },
      {z}));
}

TEST(OpsShape, BadInputsThrow) {
  Tensor x = Tensor::zeros({2, 3});
  EXPECT_TRUE(throws_with([&] { reshape(x, {4, 2}); }, {"reshape", "(2, 3)", "(4, 2)"}));
  EXPECT_TRUE(throws_with([&] { reshape(x, {4, -1}); }, {"reshape", "(2, 3)", "(4, -1)"}));
  EXPECT_TRUE(throws_with([&] { reshape(x, {-1, -1}); }, {"reshape", "-1"}));
  EXPECT_TRUE(throws_with([&] { reshape(x, {-2, 3}); }, {"reshape"}));
  Tensor y = Tensor::zeros({4, 8});
  EXPECT_TRUE(throws_with([&] { narrow(y, 1, 6, 3); }, {"narrow", "(4, 8)"}));
  EXPECT_TRUE(throws_with([&] { narrow(y, 0, -1, 2); }, {"narrow", "(4, 8)"}));
  EXPECT_TRUE(throws_with([&] { narrow(y, 2, 0, 1); }, {"narrow", "dim"}));
  EXPECT_TRUE(throws_with([&] { transpose(y, 0, 2); }, {"transpose", "dim"}));
  EXPECT_TRUE(throws_with(
      [&] {
        concat({y, Tensor::zeros({3, 7})}, 0);
      },
      {"concat", "(3, 7)", "(4, 8)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        concat({y, Tensor::zeros({4, 8}, DType::F64)}, 0);
      },
      {"concat", "f64"}));
  EXPECT_TRUE(throws_with([&] { concat({}, 0); }, {"concat"}));
  EXPECT_TRUE(throws_with([&] { split(y, 0, 0); }, {"split", "0"}));
}

}  // namespace
