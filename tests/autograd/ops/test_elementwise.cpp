// ops/elementwise.cpp: add, sub, mul (broadcasting), scale, gelu, dropout.
#include <cmath>

#include "tests/autograd/gradcheck.h"

namespace {

using namespace kvlab;
using kvtest::all_close;
using kvtest::gradcheck;
using kvtest::param;
using kvtest::throws_with;
using kvtest::vals;

double gelu_ref(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

// Naive NumPy broadcasting in double: right-aligned, size 1 stretches.
std::vector<double> naive_binary(char op, const Tensor& a, const Tensor& b, Shape* out_shape) {
  const Shape &sa = a.sizes(), &sb = b.sizes();
  const size_t nd = std::max(sa.size(), sb.size());
  Shape pa(nd, 1), pb(nd, 1), so(nd);
  for (size_t i = 0; i < sa.size(); ++i) pa[nd - sa.size() + i] = sa[i];
  for (size_t i = 0; i < sb.size(); ++i) pb[nd - sb.size() + i] = sb[i];
  for (size_t i = 0; i < nd; ++i) so[i] = std::max(pa[i], pb[i]);
  const auto av = vals(a), bv = vals(b);
  std::vector<double> out(static_cast<size_t>(shape_numel(so)));
  for (int64_t flat = 0; flat < shape_numel(so); ++flat) {
    int64_t rem = flat, ia = 0, ib = 0, ma = 1, mb = 1;
    for (size_t d = nd; d-- > 0;) {
      const int64_t i = rem % so[d];
      rem /= so[d];
      ia += (pa[d] == 1 ? 0 : i) * ma;
      ib += (pb[d] == 1 ? 0 : i) * mb;
      ma *= pa[d];
      mb *= pb[d];
    }
    const double x = av[static_cast<size_t>(ia)], y = bv[static_cast<size_t>(ib)];
    out[static_cast<size_t>(flat)] = op == '+' ? x + y : op == '-' ? x - y : x * y;
  }
  *out_shape = so;
  return out;
}

struct BroadcastCase {
  Shape a, b;
};
const std::vector<BroadcastCase> kBroadcastCases = {
    {{3, 17}, {3, 17}}, {{3, 17}, {17}},   {{17}, {3, 17}},     {{2, 3, 1}, {1, 17}},
    {{1}, {3, 17}},     {{3, 17}, {1}},    {{}, {2, 3}},        {{1}, {1}},
    {{3}, {3}},         {{17, 1}, {1, 3}}, {{2, 1, 3}, {4, 1}}, {{2, 3, 4, 5}, {3, 1, 5}},
};

TEST(OpsElementwise, BinaryForwardMatchesNaiveBroadcast) {
  Generator gen(1);
  for (const auto& c : kBroadcastCases)
    for (DType dt : {DType::F64, DType::F32})
      for (char op : {'+', '-', '*'}) {
        SCOPED_TRACE(testing::Message() << shape_str(c.a) << " " << op << " " << shape_str(c.b)
                                        << " " << dtype_name(dt));
        Tensor a = kvtest::randn(c.a, gen, dt), b = kvtest::randn(c.b, gen, dt);
        Tensor y = op == '+' ? add(a, b) : op == '-' ? sub(a, b) : mul(a, b);
        Shape want_shape;
        const auto want = naive_binary(op, a, b, &want_shape);
        EXPECT_EQ(y.sizes(), want_shape);
        EXPECT_EQ(y.dtype(), dt);
        EXPECT_TRUE(all_close(y, want, dt == DType::F64 ? 1e-15 : 1e-6));
      }
}

TEST(OpsElementwise, BinaryOnStridedViews) {
  Generator gen(2);
  Tensor a = kvtest::randn({5, 3}, gen), b = kvtest::randn({3, 5}, gen);
  Tensor at = transpose(a, 0, 1);  // (3, 5) with strides (1, 3)
  Tensor bn = narrow(b, 1, 1, 3);  // (3, 3) inside rows of 5
  Shape s;
  EXPECT_TRUE(all_close(add(at, b), naive_binary('+', at.contiguous(), b, &s), 1e-15));
  EXPECT_TRUE(all_close(mul(bn, transpose(bn, 0, 1)),
                        naive_binary('*', bn.contiguous(), transpose(bn, 0, 1).contiguous(), &s),
                        1e-15));
  // 3-D with a transposed operand goes through the general (not row) path.
  Tensor c = kvtest::randn({2, 4, 3}, gen), d = kvtest::randn({2, 3, 4}, gen);
  EXPECT_TRUE(all_close(sub(c, transpose(d, 1, 2)),
                        naive_binary('-', c, transpose(d, 1, 2).contiguous(), &s), 1e-15));
}

TEST(OpsElementwise, BinaryGradcheckWithBroadcasts) {
  Generator gen(3);
  for (const auto& c : kBroadcastCases) {
    SCOPED_TRACE(testing::Message() << shape_str(c.a) << " with " << shape_str(c.b));
    Tensor a = param(c.a, gen), b = param(c.b, gen);
    EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return add(in[0], in[1]); }, {a, b}));
    EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return sub(in[0], in[1]); }, {a, b}));
    EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return mul(in[0], in[1]); }, {a, b}));
  }
}

TEST(OpsElementwise, ThreadedBinaryAndBiasGradient) {
  // Sizes above the kernels' threading threshold, in both the row path (2-D) and the general
  // path (3-D); the bias-style gradient (sum over rows) takes the threaded sum_to path.
  Generator gen(11);
  Tensor a = param({300, 211}, gen), b = param({211}, gen);
  Shape s;
  Tensor y = mul(a, b);
  EXPECT_TRUE(all_close(y, naive_binary('*', a, b, &s), 1e-15));
  Tensor g = kvtest::randn({300, 211}, gen);
  add(a, b).backward(g);
  const auto gv = vals(g);
  std::vector<double> col(211, 0.0);
  for (int r = 0; r < 300; ++r)
    for (int j = 0; j < 211; ++j) col[j] += gv[r * 211 + j];
  EXPECT_TRUE(all_close(b.grad(), col, 1e-13));
  EXPECT_TRUE(all_close(a.grad(), gv, 0));
  Tensor c = kvtest::randn({40, 30, 33}, gen, DType::F32),
         d = kvtest::randn({30, 1}, gen, DType::F32);
  EXPECT_TRUE(all_close(sub(c, d), naive_binary('-', c, d, &s), 1e-6));
  Tensor big = kvtest::randn({70000}, gen, DType::F32);
  std::vector<double> want = vals(big);
  for (double& v : want) v *= 0.5;
  EXPECT_TRUE(all_close(scale(big, 0.5), want, 1e-7));
}

TEST(OpsElementwise, BinaryGradcheckOneSideConstant) {
  Generator gen(4);
  Tensor a = param({3, 17}, gen);
  Tensor b = kvtest::randn({17}, gen);
  EXPECT_TRUE(gradcheck([&](const std::vector<Tensor>& in) { return sub(b, in[0]); }, {a}));
  EXPECT_TRUE(gradcheck([&](const std::vector<Tensor>& in) { return mul(b, in[0]); }, {a}));
  EXPECT_FALSE(b.grad().defined());
}

TEST(OpsElementwise, ScaleAndOperators) {
  Generator gen(5);
  Tensor x = kvtest::randn({3, 17}, gen), y = kvtest::randn({3, 17}, gen);
  std::vector<double> want = vals(x);
  for (double& v : want) v *= -1.75;
  EXPECT_TRUE(all_close(scale(x, -1.75), want, 1e-15));
  EXPECT_TRUE(all_close(x * -1.75, want, 1e-15));
  EXPECT_TRUE(all_close(x + y, add(x, y), 0));
  EXPECT_TRUE(all_close(x - y, sub(x, y), 0));
  EXPECT_TRUE(all_close(x * y, mul(x, y), 0));
  // scale of a strided view reads in logical order
  Tensor xt = transpose(x, 0, 1);
  std::vector<double> wt = vals(xt);
  for (double& v : wt) v *= 2;
  EXPECT_TRUE(all_close(scale(xt, 2.0), wt, 1e-15));
  EXPECT_EQ(scale(xt, 2.0).sizes(), (Shape{17, 3}));
  for (Shape s : {Shape{1}, Shape{3}, Shape{17}, Shape{2, 3, 5}}) {
    Tensor p = param(s, gen);
    EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return scale(in[0], 0.37); }, {p}));
  }
}

TEST(OpsElementwise, GeluForwardMatchesTanhFormula) {
  Generator gen(6);
  Tensor x = kvtest::randn({7, 17}, gen, DType::F64, 3.0);
  std::vector<double> want = vals(x);
  for (double& v : want) v = gelu_ref(v);
  EXPECT_TRUE(all_close(gelu(x), want, 1e-14));
  EXPECT_TRUE(all_close(gelu(x.to(DType::F32)), want, 1e-5));
  // A few hand-computable points: gelu(0) = 0, odd part x/2.
  Tensor pts = Tensor::from_vector(std::vector<double>{0.0, 1.0, -1.0}, {3});
  const auto g = vals(gelu(pts));
  EXPECT_EQ(g[0], 0.0);
  EXPECT_NEAR(g[1] - g[2], 1.0, 1e-15);  // gelu(x) - gelu(-x) = x
  EXPECT_NEAR(g[1], 0.8411919906082768, 1e-12);
}

TEST(OpsElementwise, GeluGradcheck) {
  Generator gen(7);
  for (Shape s : {Shape{1}, Shape{3}, Shape{17}, Shape{3, 17}, Shape{2, 1, 3}}) {
    Tensor x = param(s, gen, DType::F64, 2.0);
    EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return gelu(in[0]); }, {x}))
        << shape_str(s);
  }
  // Through a strided view.
  Tensor x = param({3, 5}, gen);
  EXPECT_TRUE(
      gradcheck([](const std::vector<Tensor>& in) { return gelu(transpose(in[0], 0, 1)); }, {x}));
}

TEST(OpsElementwise, GeluF32BackwardMatchesF64) {
  Generator gen(8);
  Tensor x64 = param({4, 17}, gen, DType::F64, 2.0);
  Tensor x32 = x64.detach().to(DType::F32).set_requires_grad();
  Tensor g = kvtest::randn({4, 17}, gen);
  gelu(x64).backward(g);
  gelu(x32).backward(g.to(DType::F32));
  EXPECT_EQ(x32.grad().dtype(), DType::F32);
  EXPECT_TRUE(all_close(x32.grad(), x64.grad(), 1e-5));
}

TEST(OpsElementwise, DropoutGradcheckFixedSeed) {
  Generator gen(9);
  for (Shape s : {Shape{17}, Shape{3, 17}, Shape{2, 3, 5}}) {
    Tensor x = param(s, gen);
    EXPECT_TRUE(
        gradcheck([](const std::vector<Tensor>& in) { return dropout(in[0], 0.3, 1234); }, {x}))
        << shape_str(s);
  }
}

TEST(OpsElementwise, DropoutMaskStatistics) {
  const double p = 0.3;
  const int64_t n = 200000;
  Tensor x = Tensor::full({n}, 1.0, DType::F64);
  const auto y = vals(dropout(x, p, 42));
  int64_t zeros = 0;
  for (double v : y) {
    if (v == 0) {
      ++zeros;
    } else {
      ASSERT_NEAR(v, 1.0 / (1.0 - p), 1e-15);  // survivors scaled by 1/(1-p)
    }
  }
  // Binomial: std of the fraction is sqrt(p(1-p)/n) ~ 0.001; allow 5 sigma.
  EXPECT_NEAR(static_cast<double>(zeros) / static_cast<double>(n), p, 0.005);

  // Same seed: the same mask (also across dtypes and for a different input); other seed: not.
  const auto y2 = vals(dropout(x, p, 42));
  EXPECT_EQ(y, y2);
  Tensor x32 = Tensor::full({n}, 2.0, DType::F32);
  const auto y32 = vals(dropout(x32, p, 42));
  int64_t same_mask = 0, differ = 0;
  const auto y3 = vals(dropout(x, p, 43));
  for (int64_t i = 0; i < n; ++i) {
    same_mask += (y[i] == 0) == (y32[i] == 0);
    differ += (y[i] == 0) != (y3[i] == 0);
  }
  EXPECT_EQ(same_mask, n);
  // Independent masks disagree on 2p(1-p) = 42% of elements.
  EXPECT_NEAR(static_cast<double>(differ) / static_cast<double>(n), 2 * p * (1 - p), 0.01);
}

TEST(OpsElementwise, DropoutZeroIsIdentityAndBackwardUsesSameMask) {
  Generator gen(10);
  Tensor x = param({5, 7}, gen);
  EXPECT_TRUE(all_close(dropout(x, 0.0, 1), x, 0));
  Tensor y = dropout(x, 0.5, 99);
  sum(y).backward();
  const auto yv = vals(y), gv = vals(x.grad());
  for (size_t i = 0; i < yv.size(); ++i) EXPECT_EQ(gv[i], yv[i] == 0 ? 0.0 : 2.0) << i;
}

TEST(OpsElementwise, SwigluMatchesNaiveAndGradcheck) {
  Generator gen(21);
  for (DType dt : {DType::F64, DType::F32}) {
    Tensor gate = kvtest::randn({3, 2, 5}, gen, dt, 3.0), up = kvtest::randn({3, 2, 5}, gen, dt);
    const auto gv = vals(gate), uv = vals(up);
    std::vector<double> want;
    for (size_t i = 0; i < gv.size(); ++i) want.push_back(gv[i] / (1 + std::exp(-gv[i])) * uv[i]);
    EXPECT_TRUE(all_close(swiglu(gate, up), want, dt == DType::F64 ? 1e-14 : 2e-6))
        << dtype_name(dt);
  }
  Tensor gate = param({4, 6}, gen, DType::F64, 2.0), up = param({4, 6}, gen);
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return swiglu(in[0], in[1]); },
                        {gate, up}));
  // Large enough for the threaded kernels: each row as computed alone (one thread).
  Tensor big_gate = param({64, 256}, gen, DType::F64, 2.0), big_up = param({64, 256}, gen);
  Tensor g = kvtest::randn({64, 256}, gen);
  Tensor y = swiglu(big_gate, big_up);
  y.backward(g);
  for (int64_t r : {0, 31, 63}) {
    Tensor rg = narrow(big_gate, 0, r, 1).detach().contiguous().set_requires_grad();
    Tensor ru = narrow(big_up, 0, r, 1).detach().contiguous().set_requires_grad();
    Tensor yr = swiglu(rg, ru);
    yr.backward(narrow(g, 0, r, 1).contiguous());
    EXPECT_EQ(vals(yr), vals(narrow(y, 0, r, 1))) << r;
    EXPECT_EQ(vals(rg.grad()), vals(narrow(big_gate.grad(), 0, r, 1))) << r;
    EXPECT_EQ(vals(ru.grad()), vals(narrow(big_up.grad(), 0, r, 1))) << r;
  }
}

// Position p's angle for channel pair j: p * theta^(-2j / HS).
std::vector<double> naive_rope(const std::vector<double>& x, const std::vector<int32_t>& pos,
                               int64_t H, int64_t HS, double theta) {
  std::vector<double> out(x.size());
  const int64_t half = HS / 2;
  for (size_t r = 0; r < pos.size(); ++r)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < half; ++j) {
        const double a = pos[r] * std::pow(theta, -2.0 * static_cast<double>(j) / HS);
        const size_t o = (r * H + h) * HS + j;
        out[o] = x[o] * std::cos(a) - x[o + half] * std::sin(a);
        out[o + half] = x[o + half] * std::cos(a) + x[o] * std::sin(a);
      }
  return out;
}

TEST(OpsElementwise, RopeMatchesNaiveRotation) {
  Generator gen(22);
  const int64_t B = 2, T = 5, H = 3, HS = 8, P = 40;
  std::vector<int32_t> pos(B * T);
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int32_t>((i * 7 + 3) % P);
  const Tensor positions = Tensor::from_vector(pos, {B, T});
  for (double theta : {10000.0, 500.0})
    for (DType dt : {DType::F64, DType::F32}) {
      Tensor x = kvtest::randn({B, T, H, HS}, gen, dt);
      Tensor y = rope(x, positions, rope_table(P, HS, theta, dt, Device::CPU));
      EXPECT_TRUE(all_close(y, naive_rope(vals(x), pos, H, HS, theta),
                            dt == DType::F64 ? 1e-14 : 1e-6))
          << dtype_name(dt) << " theta " << theta;
    }
}

TEST(OpsElementwise, RopeScoresDependOnlyOnRelativePosition) {
  // The property RoPE exists for: q at p rotated against k at s scores the same as at p + d and
  // s + d, and position 0 is the identity.
  Generator gen(23);
  const int64_t HS = 16;
  const Tensor table = rope_table(64, HS, 10000.0, DType::F64, Device::CPU);
  Tensor q = kvtest::randn({1, 1, HS}, gen), k = kvtest::randn({1, 1, HS}, gen);
  const auto at = [&](const Tensor& x, int32_t p) {
    return vals(rope(x, Tensor::from_vector(std::vector<int32_t>{p}, {1}), table));
  };
  const auto dot = [](const std::vector<double>& a, const std::vector<double>& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
  };
  EXPECT_EQ(at(q, 0), vals(q));
  const double base = dot(at(q, 9), at(k, 4));
  for (int32_t d : {1, 7, 30}) EXPECT_NEAR(dot(at(q, 9 + d), at(k, 4 + d)), base, 1e-12) << d;
  EXPECT_GT(std::abs(dot(at(q, 9), at(k, 5)) - base), 1e-6);  // and it does depend on it
}

TEST(OpsElementwise, RopeGradcheck) {
  Generator gen(24);
  const Tensor table = rope_table(16, 6, 100.0, DType::F64, Device::CPU);
  Tensor x = param({2, 3, 2, 6}, gen);
  const Tensor positions =
      Tensor::from_vector(std::vector<int32_t>{0, 3, 15, 2, 2, 9}, {2, 3});
  EXPECT_TRUE(gradcheck(
      [&](const std::vector<Tensor>& in) { return rope(in[0], positions, table); }, {x}));
}

TEST(OpsElementwise, BadInputsThrow) {
  Tensor a = Tensor::zeros({3, 4}), b = Tensor::zeros({5});
  EXPECT_TRUE(throws_with([&] { add(a, b); }, {"add", "(3, 4)", "(5)"}));
  EXPECT_TRUE(throws_with([&] { sub(a, b); }, {"sub", "(3, 4)", "(5)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        mul(Tensor::zeros({2, 3}), Tensor::zeros({3, 2}));
      },
      {"mul", "(2, 3)", "(3, 2)"}));
  EXPECT_TRUE(throws_with([&] { add(Tensor::zeros({2}), Tensor::zeros({2}, DType::F64)); },
                          {"add", "f32", "f64"}));
  EXPECT_TRUE(throws_with([&] { gelu(Tensor::zeros({2, 3}, DType::I32)); }, {"gelu", "i32"}));
  EXPECT_TRUE(throws_with([&] { scale(Tensor::zeros({2}, DType::I32), 2.0); }, {"scale", "i32"}));
  EXPECT_TRUE(throws_with([&] { dropout(a, 1.0, 0); }, {"dropout", "1"}));
  EXPECT_TRUE(throws_with([&] { dropout(a, -0.1, 0); }, {"dropout"}));
  EXPECT_TRUE(throws_with([&] { add(a, Tensor()); }, {"add"}));
  EXPECT_TRUE(throws_with([&] { swiglu(Tensor::zeros({2, 3}), Tensor::zeros({3, 2})); },
                          {"swiglu", "(2, 3)", "(3, 2)"}));
  const Tensor table = rope_table(4, 4, 10000.0, DType::F32, Device::CPU);
  const Tensor pos2 = Tensor::from_vector(std::vector<int32_t>{0, 4}, {2});
  EXPECT_TRUE(throws_with([&] { rope(Tensor::zeros({2, 1, 4}), pos2, table); },
                          {"rope", "position 4", "4"}));
  EXPECT_TRUE(throws_with(
      [&] { rope(Tensor::zeros({3, 1, 4}), pos2, table); }, {"rope", "positions", "(3, 1, 4)"}));
  EXPECT_TRUE(throws_with([&] { rope(Tensor::zeros({2, 1, 6}), pos2, table); },
                          {"rope", "table", "6"}));
  EXPECT_TRUE(throws_with([&] { rope_table(4, 5, 10000.0, DType::F32, Device::CPU); },
                          {"rope_table", "even"}));
}

}  // namespace
