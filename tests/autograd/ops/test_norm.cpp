// ops/norm.cpp: layer_norm and softmax.
#include <cmath>

#include "tests/autograd/gradcheck.h"

namespace {

using namespace kvlab;
using kvtest::all_close;
using kvtest::gradcheck;
using kvtest::param;
using kvtest::throws_with;
using kvtest::vals;

std::vector<double> naive_layer_norm(const Tensor& x, const Tensor& w, const Tensor& b,
                                     double eps) {
  const auto xv = vals(x), wv = vals(w), bv = vals(b);
  const int64_t C = x.size(-1), N = x.numel() / C;
  std::vector<double> out(xv.size());
  for (int64_t n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < C; ++c) m += xv[n * C + c];
    m /= static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) v += (xv[n * C + c] - m) * (xv[n * C + c] - m);
    v /= static_cast<double>(C);  // biased variance, as PyTorch
    for (int64_t c = 0; c < C; ++c)
      out[n * C + c] = (xv[n * C + c] - m) / std::sqrt(v + eps) * wv[c] + bv[c];
  }
  return out;
}

std::vector<double> naive_softmax(const Tensor& x) {
  const auto xv = vals(x);
  const int64_t C = x.size(-1), N = x.numel() / C;
  std::vector<double> out(xv.size());
  for (int64_t n = 0; n < N; ++n) {
    double mx = -INFINITY, s = 0;
    for (int64_t c = 0; c < C; ++c) mx = std::max(mx, xv[n * C + c]);
    for (int64_t c = 0; c < C; ++c) s += std::exp(xv[n * C + c] - mx);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = std::exp(xv[n * C + c] - mx) / s;
  }
  return out;
}

TEST(OpsNorm, LayerNormForwardMatchesNaive) {
  Generator gen(1);
  for (Shape xs :
       {Shape{3, 17}, Shape{2, 3, 5}, Shape{17}, Shape{4, 1}, Shape{1, 3}, Shape{5, 300}})
    for (DType dt : {DType::F64, DType::F32}) {
      SCOPED_TRACE(testing::Message() << shape_str(xs) << " " << dtype_name(dt));
      const int64_t C = xs.back();
      // Rows with a non-zero mean and a scale far from 1 exercise the centring.
      Tensor x = add(kvtest::randn(xs, gen, dt, 3.0), Tensor::full({1}, 2.0, dt));
      Tensor w = kvtest::randn({C}, gen, dt), b = kvtest::randn({C}, gen, dt);
      Tensor y = layer_norm(x, w, b);
      EXPECT_EQ(y.sizes(), xs);
      EXPECT_TRUE(all_close(y, naive_layer_norm(x, w, b, 1e-5), dt == DType::F64 ? 1e-12 : 1e-5));
      Tensor y2 = layer_norm(x, w, b, 0.5);  // eps is honoured
      EXPECT_TRUE(all_close(y2, naive_layer_norm(x, w, b, 0.5), dt == DType::F64 ? 1e-12 : 1e-5));
    }
}

TEST(OpsNorm, LayerNormUnitWeightGivesZeroMeanUnitVariance) {
  Generator gen(2);
  Tensor x = kvtest::randn({4, 64}, gen, DType::F64, 5.0);
  Tensor y =
      layer_norm(x, Tensor::full({64}, 1.0, DType::F64), Tensor::zeros({64}, DType::F64), 1e-12);
  const auto yv = vals(y);
  for (int r = 0; r < 4; ++r) {
    double m = 0, v = 0;
    for (int c = 0; c < 64; ++c) m += yv[r * 64 + c] / 64;
    for (int c = 0; c < 64; ++c) v += (yv[r * 64 + c] - m) * (yv[r * 64 + c] - m) / 64;
    EXPECT_NEAR(m, 0.0, 1e-12);
    EXPECT_NEAR(v, 1.0, 1e-10);
  }
}

TEST(OpsNorm, LayerNormGradcheck) {
  Generator gen(3);
  for (Shape xs : {Shape{3, 17}, Shape{2, 3, 5}, Shape{1, 3}, Shape{3}, Shape{2, 1}}) {
    SCOPED_TRACE(shape_str(xs));
    const int64_t C = xs.back();
    Tensor x = param(xs, gen), w = param({C}, gen), b = param({C}, gen);
    EXPECT_TRUE(gradcheck(
        [](const std::vector<Tensor>& in) { return layer_norm(in[0], in[1], in[2]); }, {x, w, b}));
  }
  // Only x differentiable; strided input; larger eps.
  Tensor x = param({5, 4}, gen);
  Tensor w = kvtest::randn({5}, gen), b = kvtest::randn({5}, gen);
  EXPECT_TRUE(gradcheck(
      [&](const std::vector<Tensor>& in) { return layer_norm(transpose(in[0], 0, 1), w, b, 0.1); },
      {x}));
}

TEST(OpsNorm, LayerNormF32GradientsMatchF64) {
  Generator gen(4);
  Tensor x = param({6, 33}, gen), w = param({33}, gen), b = param({33}, gen);
  Tensor g = kvtest::randn({6, 33}, gen);
  layer_norm(x, w, b).backward(g);
  Tensor x32 = x.detach().to(DType::F32).set_requires_grad();
  Tensor w32 = w.detach().to(DType::F32).set_requires_grad();
  Tensor b32 = b.detach().to(DType::F32).set_requires_grad();
  layer_norm(x32, w32, b32).backward(g.to(DType::F32));
  EXPECT_TRUE(all_close(x32.grad(), x.grad(), 1e-5));
  EXPECT_TRUE(all_close(w32.grad(), w.grad(), 1e-5));
  EXPECT_TRUE(all_close(b32.grad(), b.grad(), 1e-5));
}

TEST(OpsNorm, ThreadedLayerNormBackwardEqualsRowChunks) {
  // N * C above the kernel's threading threshold: dw and db are reduced over per-thread
  // partials. Rows are independent, so the same rows in small (single-threaded) chunks must
  // give the same dx, and dw, db must be the chunks' sums.
  Generator gen(7);
  const int64_t N = 96, C = 257, chunk = 8;
  Tensor x = param({N, C}, gen), w = param({C}, gen), b = param({C}, gen);
  Tensor g = kvtest::randn({N, C}, gen);
  Tensor y = layer_norm(x, w, b);
  y.backward(g);
  std::vector<double> dw(C, 0.0), db(C, 0.0);
  for (int64_t r = 0; r < N; r += chunk) {
    Tensor xc = narrow(x, 0, r, chunk).detach().clone().set_requires_grad();
    Tensor wc = w.detach().clone().set_requires_grad(), bc = b.detach().clone().set_requires_grad();
    Tensor yc = layer_norm(xc, wc, bc);
    EXPECT_TRUE(all_close(yc, narrow(y, 0, r, chunk), 1e-14));
    yc.backward(narrow(g, 0, r, chunk).contiguous());
    EXPECT_TRUE(all_close(xc.grad(), narrow(x.grad(), 0, r, chunk), 1e-13)) << "rows " << r;
    const auto dwc = vals(wc.grad()), dbc = vals(bc.grad());
    for (int64_t j = 0; j < C; ++j) {
      dw[j] += dwc[j];
      db[j] += dbc[j];
    }
  }
  EXPECT_TRUE(all_close(w.grad(), dw, 1e-12));
  EXPECT_TRUE(all_close(b.grad(), db, 1e-12));
  // And f32 on the threaded path agrees with f64.
  Tensor x32 = x.detach().to(DType::F32).set_requires_grad();
  Tensor w32 = w.detach().to(DType::F32).set_requires_grad();
  Tensor b32 = b.detach().to(DType::F32).set_requires_grad();
  layer_norm(x32, w32, b32).backward(g.to(DType::F32));
  EXPECT_TRUE(all_close(x32.grad(), x.grad(), 1e-4));
  EXPECT_TRUE(all_close(w32.grad(), w.grad(), 1e-4));
  EXPECT_TRUE(all_close(b32.grad(), b.grad(), 1e-4));
}

TEST(OpsNorm, ThreadedSoftmaxMatchesNaive) {
  Generator gen(8);
  Tensor x = param({40, 513}, gen, DType::F64, 3.0);
  Tensor y = softmax(x);
  EXPECT_TRUE(all_close(y, naive_softmax(x), 1e-14));
  Tensor g = kvtest::randn({40, 513}, gen);
  y.backward(g);
  // dx = y * (g - sum(y * g)) per row.
  const auto yv = vals(y), gv = vals(g);
  std::vector<double> want(yv.size());
  for (int r = 0; r < 40; ++r) {
    double dot = 0;
    for (int j = 0; j < 513; ++j) dot += yv[r * 513 + j] * gv[r * 513 + j];
    for (int j = 0; j < 513; ++j) want[r * 513 + j] = yv[r * 513 + j] * (gv[r * 513 + j] - dot);
  }
  EXPECT_TRUE(all_close(x.grad(), want, 1e-14));
}

TEST(OpsNorm, SoftmaxForwardMatchesNaive) {
  Generator gen(5);
  for (Shape xs : {Shape{3, 17}, Shape{17}, Shape{2, 3, 1}, Shape{1, 3}, Shape{4, 1000}})
    for (DType dt : {DType::F64, DType::F32}) {
      SCOPED_TRACE(testing::Message() << shape_str(xs) << " " << dtype_name(dt));
      Tensor x = kvtest::randn(xs, gen, dt, 4.0);
      Tensor y = softmax(x);
      // f32 sums C exponentials in f32: ~sqrt(C) roundings of the row sum.
      EXPECT_TRUE(all_close(y, naive_softmax(x), dt == DType::F64 ? 1e-14 : 1e-5));
      // Rows sum to one.
      const auto yv = vals(y);
      const int64_t C = xs.back();
      for (int64_t r = 0; r < x.numel() / C; ++r) {
        double s = 0;
        for (int64_t c = 0; c < C; ++c) s += yv[r * C + c];
        EXPECT_NEAR(s, 1.0, dt == DType::F64 ? 1e-14 : 1e-5);
      }
    }
}

TEST(OpsNorm, SoftmaxIsShiftInvariantAndStable) {
  Tensor x = Tensor::from_vector(std::vector<double>{1000, 1001, 1002, -1000, 0, 1000}, {2, 3});
  const auto y = vals(softmax(x));
  for (double v : y) EXPECT_TRUE(std::isfinite(v));
  const double e1 = std::exp(-1.0), e2 = std::exp(-2.0);
  EXPECT_NEAR(y[2], 1 / (1 + e1 + e2), 1e-15);
  EXPECT_NEAR(y[0], e2 / (1 + e1 + e2), 1e-15);
  EXPECT_NEAR(y[5], 1.0, 1e-15);
  EXPECT_EQ(y[3], 0.0);
  const auto y32 = vals(softmax(x.to(DType::F32)));
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y32[i], y[i], 1e-6) << i;
  // Uniform row: 1/C each.
  EXPECT_TRUE(all_close(softmax(Tensor::full({1, 17}, -3.0, DType::F64)),
                        std::vector<double>(17, 1.0 / 17), 1e-15));
}

TEST(OpsNorm, SoftmaxGradcheck) {
  Generator gen(6);
  for (Shape xs : {Shape{3, 17}, Shape{17}, Shape{2, 3, 1}, Shape{2, 1, 3}}) {
    Tensor x = param(xs, gen, DType::F64, 2.0);
    EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return softmax(in[0]); }, {x}))
        << shape_str(xs);
  }
  Tensor x = param({4, 3}, gen);
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) { return softmax(transpose(in[0], 0, 1)); }, {x}));
}

std::vector<double> naive_rms_norm(const Tensor& x, const Tensor& w, double eps) {
  const auto xv = vals(x), wv = vals(w);
  const int64_t C = x.size(-1), N = x.numel() / C;
  std::vector<double> out(xv.size());
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += xv[n * C + c] * xv[n * C + c];
    ms /= static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = xv[n * C + c] / std::sqrt(ms + eps) * wv[c];
  }
  return out;
}

TEST(OpsNorm, RmsNormForwardMatchesNaive) {
  Generator gen(11);
  for (Shape xs : {Shape{3, 17}, Shape{2, 3, 5}, Shape{17}, Shape{4, 1}, Shape{5, 300}})
    for (DType dt : {DType::F64, DType::F32}) {
      SCOPED_TRACE(testing::Message() << shape_str(xs) << " " << dtype_name(dt));
      const int64_t C = xs.back();
      // A non-zero mean: RMSNorm must not subtract it.
      Tensor x = add(kvtest::randn(xs, gen, dt, 3.0), Tensor::full({1}, 2.0, dt));
      Tensor w = kvtest::randn({C}, gen, dt);
      const double tol = dt == DType::F64 ? 1e-12 : 1e-5;
      EXPECT_TRUE(all_close(rms_norm(x, w), naive_rms_norm(x, w, 1e-5), tol));
      EXPECT_TRUE(all_close(rms_norm(x, w, 0.5), naive_rms_norm(x, w, 0.5), tol));
    }
}

TEST(OpsNorm, RmsNormGradcheck) {
  Generator gen(12);
  for (Shape xs : {Shape{3, 17}, Shape{2, 3, 5}, Shape{1, 3}, Shape{3}}) {
    SCOPED_TRACE(shape_str(xs));
    Tensor x = param(xs, gen), w = param({xs.back()}, gen);
    EXPECT_TRUE(
        gradcheck([](const std::vector<Tensor>& in) { return rms_norm(in[0], in[1]); }, {x, w}));
  }
  // The threaded backward (N * C above the threshold) against f64 differences too.
  Tensor x = param({64, 96}, gen), w = param({96}, gen);
  EXPECT_TRUE(
      gradcheck([](const std::vector<Tensor>& in) { return rms_norm(in[0], in[1], 0.1); }, {x, w}));
}

TEST(OpsNorm, LayerNormWithoutBiasIsTheBiasFreeFormula) {
  Generator gen(13);
  Tensor x = param({4, 9}, gen), w = param({9}, gen);
  EXPECT_TRUE(all_close(layer_norm(x, w, Tensor()),
                        naive_layer_norm(x, w, Tensor::zeros({9}, DType::F64), 1e-5), 1e-12));
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) { return layer_norm(in[0], in[1], Tensor()); }, {x, w}));
}

TEST(OpsNorm, BadInputsThrow) {
  Tensor x = Tensor::zeros({3, 5});
  EXPECT_TRUE(throws_with([&] { layer_norm(x, Tensor::zeros({4}), Tensor::zeros({5})); },
                          {"layer_norm", "(3, 5)", "(4)"}));
  EXPECT_TRUE(throws_with([&] { layer_norm(x, Tensor::zeros({5}), Tensor::zeros({6})); },
                          {"layer_norm", "(3, 5)", "(6)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        layer_norm(x, Tensor::zeros({5, 1}), Tensor::zeros({5}));
      },
      {"layer_norm", "(5, 1)"}));
  EXPECT_TRUE(
      throws_with([&] { layer_norm(x, Tensor::zeros({5}, DType::F64), Tensor::zeros({5})); },
                  {"layer_norm", "f64"}));
  EXPECT_TRUE(throws_with([&] { layer_norm(x, Tensor::zeros({5}), Tensor::zeros({5}), 0.0); },
                          {"layer_norm", "eps"}));
  EXPECT_TRUE(throws_with([&] { layer_norm(x, Tensor(), Tensor::zeros({5})); }, {"layer_norm"}));
  EXPECT_TRUE(throws_with([&] { rms_norm(x, Tensor::zeros({4})); }, {"rms_norm", "(3, 5)", "(4)"}));
  EXPECT_TRUE(throws_with([&] { rms_norm(x, Tensor::zeros({5}), -1.0); }, {"rms_norm", "eps"}));
  EXPECT_TRUE(throws_with([&] { softmax(Tensor::zeros({3, 0})); }, {"softmax", "(3, 0)"}));
  EXPECT_TRUE(throws_with([&] { softmax(Tensor::zeros({3}, DType::I32)); }, {"softmax", "i32"}));
}

}  // namespace
