// ops/embedding.cpp: row lookup and its scatter-add gradient.
#include "tests/autograd/gradcheck.h"

namespace {

using namespace kvlab;
using kvtest::all_close;
using kvtest::gradcheck;
using kvtest::param;
using kvtest::throws_with;
using kvtest::vals;

std::vector<double> naive_embedding(const Tensor& ids, const Tensor& w) {
  const auto iv = ids.to_vector<int32_t>();
  const auto wv = vals(w);
  const int64_t C = w.size(1);
  std::vector<double> out;
  for (int32_t id : iv)
    for (int64_t c = 0; c < C; ++c) out.push_back(wv[static_cast<size_t>(id * C + c)]);
  return out;
}

TEST(OpsEmbedding, ForwardMatchesNaive) {
  Generator gen(1);
  for (DType dt : {DType::F64, DType::F32}) {
    Tensor w = kvtest::randn({11, 17}, gen, dt);
    Tensor ids = kvtest::ids_tensor({3, 0, 10, 3, 7, 3}, {2, 3});
    Tensor y = embedding(ids, w);
    EXPECT_EQ(y.sizes(), (Shape{2, 3, 17}));
    EXPECT_EQ(y.dtype(), dt);
    EXPECT_TRUE(all_close(y, naive_embedding(ids, w), 0));
    // 1-D ids, a single id, a scalar id.
    Tensor one = kvtest::ids_tensor({5}, {1});
    EXPECT_TRUE(all_close(embedding(one, w), naive_embedding(one, w), 0));
    Tensor sc = kvtest::ids_tensor({9}, {});
    EXPECT_EQ(embedding(sc, w).sizes(), (Shape{17}));
    EXPECT_TRUE(all_close(embedding(sc, w), naive_embedding(sc, w), 0));
  }
  // Strided ids (a transposed view) read in logical order.
  Tensor w = kvtest::randn({5, 3}, gen);
  Tensor ids = kvtest::ids_tensor({0, 1, 2, 3, 4, 0}, {2, 3});
  Tensor idt = transpose(ids, 0, 1);
  EXPECT_TRUE(all_close(embedding(idt, w), naive_embedding(idt.contiguous(), w), 0));
}

TEST(OpsEmbedding, WeightGradientWithRepeatedIds) {
  Generator gen(2);
  Tensor w = param({6, 5}, gen);
  Tensor ids = kvtest::ids_tensor({2, 4, 2, 2, 0, 4, 1}, {7});
  Tensor g = kvtest::randn({7, 5}, gen);
  embedding(ids, w).backward(g);
  // Naive scatter-add: dW[v] = sum over positions i with ids[i] == v of g[i].
  std::vector<double> want(30, 0.0);
  const auto gv = vals(g);
  const auto iv = ids.to_vector<int32_t>();
  for (int i = 0; i < 7; ++i)
    for (int c = 0; c < 5; ++c) want[iv[i] * 5 + c] += gv[i * 5 + c];
  EXPECT_TRUE(all_close(w.grad(), want, 1e-15));
  // Rows never looked up (3, 5) get exactly zero.
  const auto dw = vals(w.grad());
  for (int c = 0; c < 5; ++c) {
    EXPECT_EQ(dw[3 * 5 + c], 0.0);
    EXPECT_EQ(dw[5 * 5 + c], 0.0);
  }
}

TEST(OpsEmbedding, Gradcheck) {
  Generator gen(3);
  Tensor w = param({7, 3}, gen);
  Tensor ids = kvtest::ids_tensor({1, 1, 6, 0, 1, 6}, {2, 3});
  EXPECT_TRUE(
      gradcheck([](const std::vector<Tensor>& in) { return embedding(in[0], in[1]); }, {ids, w}));
  Tensor w1 = param({1, 17}, gen);
  Tensor zeros = kvtest::ids_tensor({0, 0, 0}, {3});
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return embedding(in[0], in[1]); },
                        {zeros, w1}));
  // A large gather so the threaded backward path runs too.
  Tensor big_w = param({50, 700}, gen);
  Tensor big_ids = kvtest::random_ids({64}, 50, gen);
  Tensor gb = kvtest::randn({64, 700}, gen);
  embedding(big_ids, big_w).backward(gb);
  std::vector<double> want(50 * 700, 0.0);
  const auto gv = vals(gb);
  const auto iv = big_ids.to_vector<int32_t>();
  for (int i = 0; i < 64; ++i)
    for (int c = 0; c < 700; ++c) want[iv[i] * 700 + c] += gv[i * 700 + c];
  EXPECT_TRUE(all_close(big_w.grad(), want, 1e-14));
}

TEST(OpsEmbedding, BadInputsThrow) {
  Tensor w = Tensor::zeros({5, 3});
  EXPECT_TRUE(throws_with(
      [&] {
        embedding(kvtest::ids_tensor({0, -1}, {2}), w);
      },
      {"embedding", "-1", "(5, 3)"}));
  EXPECT_TRUE(throws_with([&] { embedding(kvtest::ids_tensor({5}, {1}), w); },
                          {"embedding", "5", "(5, 3)"}));
  EXPECT_TRUE(throws_with([&] { embedding(Tensor::zeros({2}), w); }, {"embedding", "i32", "f32"}));
  EXPECT_TRUE(throws_with([&] { embedding(kvtest::ids_tensor({0}, {1}), Tensor::zeros({5})); },
                          {"embedding", "(5)"}));
}

}  // namespace
