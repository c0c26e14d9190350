// ops/matmul.cpp: matmul (2-D, batched, shared b, every transpose) and linear.
#include <array>

#include "tests/autograd/gradcheck.h"

namespace {

using namespace kvlab;
using kvtest::all_close;
using kvtest::gradcheck;
using kvtest::param;
using kvtest::throws_with;
using kvtest::vals;

// Naive op(a) @ op(b) in double over plain nested loops. a is (..., M, K) or (..., K, M) when
// ta; b is (..., K, N) or (..., N, K) when tb, or 2-D and shared by every batch entry.
std::vector<double> naive_matmul(const Tensor& a, const Tensor& b, bool ta, bool tb,
                                 Shape* out_shape) {
  const auto av = vals(a), bv = vals(b);
  const int64_t ar = a.size(-2), ac = a.size(-1), br = b.size(-2), bc = b.size(-1);
  const int64_t M = ta ? ac : ar, K = ta ? ar : ac, N = tb ? br : bc;
  const int64_t batch = a.numel() / (ar * ac);
  const bool shared = b.dim() == 2 && a.dim() > 2;
  std::vector<double> out(static_cast<size_t>(batch * M * N));
  for (int64_t i = 0; i < batch; ++i) {
    const double* A = av.data() + i * ar * ac;
    const double* B = bv.data() + (shared ? 0 : i * br * bc);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double x = ta ? A[k * ac + m] : A[m * ac + k];
          const double y = tb ? B[n * bc + k] : B[k * bc + n];
          s += x * y;
        }
        out[static_cast<size_t>((i * M + m) * N + n)] = s;
      }
  }
  *out_shape = Shape(a.sizes().begin(), a.sizes().end() - 2);
  out_shape->push_back(M);
  out_shape->push_back(N);
  return out;
}

// Operand shape for op(x) of logical size (rows, cols) with the given batch prefix.
Shape operand(Shape batch, int64_t rows, int64_t cols, bool trans) {
  batch.push_back(trans ? cols : rows);
  batch.push_back(trans ? rows : cols);
  return batch;
}

struct MMCase {
  Shape batch;  // leading dims of a (and of b unless shared_b)
  int64_t M, K, N;
  bool shared_b;
};

const std::vector<MMCase> kForwardCases = {
    {{}, 3, 17, 5, false},
    {{}, 1, 17, 3, false},  // M = 1: the GEMV path for f32
    {{}, 17, 3, 1, false},
    {{}, 1, 1, 1, false},  // N = 1: GEMV the other way
    {{}, 1, 5, 1, false},
    {{2}, 3, 5, 4, false},
    {{2}, 1, 5, 3, false},
    {{2, 3}, 3, 4, 5, false},
    {{2}, 3, 17, 4, true},
    {{2, 3}, 1, 4, 5, true},
    {{3}, 17, 3, 1, true},
    // M = 1 with B^T large enough to be split across threads, in blocks of 8 rows plus a
    // remainder, K not a multiple of the 16-lane vector (the row-dot-product kernel)
    {{}, 1, 300, 131, false},
    {{}, 1, 70, 517, false},
};

TEST(OpsMatmul, ForwardMatchesNaiveAllTransposes) {
  Generator gen(1);
  for (const MMCase& c : kForwardCases)
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      if (c.shared_b && ta) continue;  // not supported: needs a batched b
      for (DType dt : {DType::F64, DType::F32}) {
        SCOPED_TRACE(testing::Message() << "batch " << shape_str(c.batch) << " M=" << c.M << " K="
                                        << c.K << " N=" << c.N << " ta=" << ta << " tb=" << tb
                                        << " shared=" << c.shared_b << " " << dtype_name(dt));
        Tensor a = kvtest::randn(operand(c.batch, c.M, c.K, ta), gen, dt);
        Tensor b = kvtest::randn(operand(c.shared_b ? Shape{} : c.batch, c.K, c.N, tb), gen, dt);
        Tensor y = matmul(a, b, ta, tb);
        Shape want_shape;
        const auto want = naive_matmul(a, b, ta, tb, &want_shape);
        EXPECT_EQ(y.sizes(), want_shape);
        EXPECT_TRUE(all_close(y, want, dt == DType::F64 ? 1e-13 : 1e-5));
      }
    }
}

TEST(OpsMatmul, HandComputedProduct) {
  Tensor a = Tensor::from_vector(std::vector<double>{1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = Tensor::from_vector(std::vector<double>{7, 8, 9, 10, 11, 12}, {3, 2});
  EXPECT_EQ(vals(matmul(a, b)), (std::vector<double>{58, 64, 139, 154}));
  EXPECT_EQ(vals(matmul(a, a, false, true)), (std::vector<double>{14, 32, 32, 77}));
  EXPECT_EQ(vals(matmul(a.to(DType::F32), a.to(DType::F32), true, false)),
            (std::vector<double>{17, 22, 27, 22, 29, 36, 27, 36, 45}));
}

TEST(OpsMatmul, StridedOperands) {
  Generator gen(2);
  Tensor a = kvtest::randn({2, 5, 3}, gen, DType::F32),
         b = kvtest::randn({2, 4, 5}, gen, DType::F32);
  Tensor at = transpose(a, 1, 2), bt = transpose(b, 1, 2);  // (2, 3, 5), (2, 5, 4) as views
  Shape s;
  EXPECT_TRUE(all_close(matmul(at, bt),
                        naive_matmul(at.contiguous(), bt.contiguous(), false, false, &s), 1e-5));
  Tensor w = kvtest::randn({7, 6}, gen, DType::F32);
  Tensor wn = narrow(w, 1, 1, 5);  // (7, 5) inside rows of 6
  EXPECT_TRUE(all_close(matmul(at, wn, false, true),
                        naive_matmul(at.contiguous(), wn.contiguous(), false, true, &s), 1e-5));
}

TEST(OpsMatmul, Gradcheck2DAllTransposes) {
  Generator gen(3);
  const std::vector<std::array<int64_t, 3>> sizes = {
      {3, 17, 5}, {1, 3, 1}, {17, 1, 3}, {1, 1, 1}, {3, 5, 17}};
  for (const auto& [M, K, N] : sizes)
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      SCOPED_TRACE(testing::Message() << M << "x" << K << "x" << N << " ta=" << ta << " tb=" << tb);
      Tensor a = param(operand({}, M, K, ta), gen), b = param(operand({}, K, N, tb), gen);
      EXPECT_TRUE(gradcheck(
          [=](const std::vector<Tensor>& in) { return matmul(in[0], in[1], ta, tb); }, {a, b}));
    }
}

TEST(OpsMatmul, GradcheckBatched3DAnd4D) {
  Generator gen(4);
  for (Shape batch : {Shape{2}, Shape{3}, Shape{2, 2}, Shape{1, 3}})
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      SCOPED_TRACE(testing::Message()
                   << "batch " << shape_str(batch) << " ta=" << ta << " tb=" << tb);
      Tensor a = param(operand(batch, 3, 4, ta), gen), b = param(operand(batch, 4, 5, tb), gen);
      EXPECT_TRUE(gradcheck(
          [=](const std::vector<Tensor>& in) { return matmul(in[0], in[1], ta, tb); }, {a, b}));
    }
}

TEST(OpsMatmul, GradcheckSharedB) {
  Generator gen(5);
  for (Shape batch : {Shape{2}, Shape{2, 3}, Shape{1}})
    for (bool tb : {false, true}) {
      SCOPED_TRACE(testing::Message() << "batch " << shape_str(batch) << " tb=" << tb);
      Tensor a = param(operand(batch, 3, 5, false), gen), b = param(operand({}, 5, 4, tb), gen);
      EXPECT_TRUE(gradcheck(
          [=](const std::vector<Tensor>& in) { return matmul(in[0], in[1], false, tb); }, {a, b}));
    }
}

TEST(OpsMatmul, GradcheckStridedInputs) {
  Generator gen(6);
  Tensor a = param({2, 5, 3}, gen), b = param({4, 5}, gen);
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) {
        return matmul(transpose(in[0], 1, 2), transpose(in[1], 0, 1), false, false);
      },
      {a, b}));
}

TEST(OpsMatmul, F32GradientsMatchF64) {
  // The f32 backward runs through the GEMV branches (M = 1 or N = 1) of every transpose.
  Generator gen(10);
  for (const MMCase& c : kForwardCases)
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      if (c.shared_b && ta) continue;
      SCOPED_TRACE(testing::Message()
                   << "batch " << shape_str(c.batch) << " M=" << c.M << " K=" << c.K << " N=" << c.N
                   << " ta=" << ta << " tb=" << tb << " shared=" << c.shared_b);
      Tensor a = param(operand(c.batch, c.M, c.K, ta), gen);
      Tensor b = param(operand(c.shared_b ? Shape{} : c.batch, c.K, c.N, tb), gen);
      Tensor a32 = a.detach().to(DType::F32).set_requires_grad();
      Tensor b32 = b.detach().to(DType::F32).set_requires_grad();
      Tensor up = kvtest::randn(matmul(a.detach(), b.detach(), ta, tb).sizes(), gen);
      matmul(a, b, ta, tb).backward(up);
      matmul(a32, b32, ta, tb).backward(up.to(DType::F32));
      EXPECT_TRUE(all_close(a32.grad(), a.grad(), 1e-5));
      EXPECT_TRUE(all_close(b32.grad(), b.grad(), 1e-5));
    }
}

TEST(OpsMatmul, EmptyInnerDimensionGivesZeros) {
  // ENGINE BUG (autograd/backend/cpu/gemm.cpp:14-24, gemm<float>): with K = 0 the GEMV
  // branches (M == 1 or N == 1) call cblas_sgemv with a zero-length dimension (and lda = 0,
  // which OpenBLAS rejects: "SGEMV parameter number 6 had an illegal value"); sgemv returns
  // without applying beta, so C keeps whatever the recycled buffer held. Fix: before the GEMV
  // branches, `if (K == 0) { fill C (M, N) with beta * C, i.e. zeros when beta == 0; return; }`.
  // op(a) @ op(b) with K = 0 is an all-zero (M, N) matrix, whatever the output buffer held.
  for (DType dt : {DType::F64, DType::F32})
    for (auto [M, N] : std::vector<std::pair<int64_t, int64_t>>{{3, 4}, {1, 4}, {3, 1}, {1, 1}}) {
      SCOPED_TRACE(testing::Message() << "M=" << M << " N=" << N << " " << dtype_name(dt));
      for (int i = 0; i < 3; ++i) {  // recycle blocks with non-zero contents first
        Tensor junk = Tensor::full({M, N}, 7.0, dt);
      }
      Tensor y = matmul(Tensor::zeros({M, 0}, dt), Tensor::zeros({0, N}, dt));
      EXPECT_EQ(y.sizes(), (Shape{M, N}));
      EXPECT_TRUE(all_close(y, std::vector<double>(static_cast<size_t>(M * N), 0.0), 0));
    }
}

// Naive x (..., in) @ w^T + bias.
std::vector<double> naive_linear(const Tensor& x, const Tensor& w, const Tensor& bias) {
  const auto xv = vals(x), wv = vals(w);
  const std::vector<double> bv = bias.defined() ? vals(bias) : std::vector<double>();
  const int64_t in = w.size(1), out = w.size(0), N = x.numel() / in;
  std::vector<double> y(static_cast<size_t>(N * out));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < out; ++o) {
      double s = bias.defined() ? bv[static_cast<size_t>(o)] : 0.0;
      for (int64_t i = 0; i < in; ++i)
        s += xv[static_cast<size_t>(n * in + i)] * wv[static_cast<size_t>(o * in + i)];
      y[static_cast<size_t>(n * out + o)] = s;
    }
  return y;
}

TEST(OpsMatmul, LinearForwardMatchesNaive) {
  Generator gen(7);
  for (Shape xs : {Shape{3, 17}, Shape{2, 3, 17}, Shape{17}, Shape{1, 17}, Shape{2, 1, 17}})
    for (int64_t out : {1, 5})
      for (bool with_bias : {false, true})
        for (DType dt : {DType::F64, DType::F32}) {
          SCOPED_TRACE(testing::Message() << shape_str(xs) << " out " << out << " bias "
                                          << with_bias << " " << dtype_name(dt));
          Tensor x = kvtest::randn(xs, gen, dt), w = kvtest::randn({out, 17}, gen, dt);
          Tensor b = with_bias ? kvtest::randn({out}, gen, dt) : Tensor();
          Tensor y = linear(x, w, b);
          Shape ys = xs;
          ys.back() = out;
          EXPECT_EQ(y.sizes(), ys);
          EXPECT_TRUE(all_close(y, naive_linear(x, w, b), dt == DType::F64 ? 1e-13 : 1e-5));
        }
}

TEST(OpsMatmul, LinearGradcheck) {
  Generator gen(8);
  for (Shape xs : {Shape{3, 5}, Shape{2, 3, 5}, Shape{5}, Shape{1, 1, 5}})
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE(testing::Message() << shape_str(xs) << " bias " << with_bias);
      Tensor x = param(xs, gen), w = param({3, 5}, gen);
      if (with_bias) {
        Tensor b = param({3}, gen);
        EXPECT_TRUE(gradcheck(
            [](const std::vector<Tensor>& in) { return linear(in[0], in[1], in[2]); }, {x, w, b}));
      } else {
        EXPECT_TRUE(
            gradcheck([](const std::vector<Tensor>& in) { return linear(in[0], in[1]); }, {x, w}));
      }
    }
  // Weight only (x constant), and a transposed input view.
  Tensor x = kvtest::randn({4, 5}, gen), w = param({3, 5}, gen);
  EXPECT_TRUE(gradcheck([&](const std::vector<Tensor>& in) { return linear(x, in[0]); }, {w}));
  Tensor xt = param({5, 4}, gen);
  EXPECT_TRUE(
      gradcheck([](const std::vector<Tensor>& in) { return linear(transpose(in[0], 0, 1), in[1]); },
                {xt, w}));
}

TEST(OpsMatmul, LinearF32GradientsMatchF64) {
  Generator gen(11);
  for (Shape xs : {Shape{1, 17}, Shape{2, 3, 17}, Shape{17}})
    for (int64_t out : {1, 5}) {
      SCOPED_TRACE(testing::Message() << shape_str(xs) << " out " << out);
      Tensor x = param(xs, gen), w = param({out, 17}, gen), b = param({out}, gen);
      Tensor x32 = x.detach().to(DType::F32).set_requires_grad();
      Tensor w32 = w.detach().to(DType::F32).set_requires_grad();
      Tensor b32 = b.detach().to(DType::F32).set_requires_grad();
      Shape ys = xs;
      ys.back() = out;
      Tensor up = kvtest::randn(ys, gen);
      linear(x, w, b).backward(up);
      linear(x32, w32, b32).backward(up.to(DType::F32));
      EXPECT_TRUE(all_close(x32.grad(), x.grad(), 1e-5));
      EXPECT_TRUE(all_close(w32.grad(), w.grad(), 1e-5));
      EXPECT_TRUE(all_close(b32.grad(), b.grad(), 1e-5));
    }
}

TEST(OpsMatmul, LinearEqualsMatmulWithTransposedWeight) {
  Generator gen(9);
  Tensor x = kvtest::randn({2, 3, 17}, gen, DType::F32),
         w = kvtest::randn({5, 17}, gen, DType::F32);
  EXPECT_TRUE(all_close(linear(x, w), matmul(x, w, false, true), 1e-6));
}

TEST(OpsMatmul, BadInputsThrow) {
  Tensor a = Tensor::zeros({4, 8}), b = Tensor::zeros({9, 2});
  EXPECT_TRUE(throws_with([&] { matmul(a, b); }, {"matmul", "(4, 8)", "(9, 2)", "inner"}));
  EXPECT_TRUE(throws_with(
      [&] {
        matmul(a, Tensor::zeros({4, 2}), false, false);
      },
      {"matmul", "(4, 8)"}));
  EXPECT_NO_THROW(matmul(a, Tensor::zeros({4, 2}), true, false));
  EXPECT_TRUE(throws_with(
      [&] {
        matmul(Tensor::zeros({2, 3, 4}), Tensor::zeros({3, 4, 5}));
      },
      {"matmul", "(2, 3, 4)", "(3, 4, 5)", "batch"}));
  EXPECT_TRUE(throws_with(
      [&] {
        matmul(Tensor::zeros({2, 2, 3, 4}), Tensor::zeros({2, 4, 5}));
      },
      {"matmul", "(2, 2, 3, 4)", "(2, 4, 5)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        matmul(Tensor::zeros({4}), Tensor::zeros({4, 2}));
      },
      {"matmul", "(4)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        matmul(Tensor::zeros({2, 4, 3}), Tensor::zeros({4, 5}), true, false);
      },
      {"matmul", "(2, 4, 3)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        matmul(a, Tensor::zeros({8, 2}, DType::F64));
      },
      {"matmul", "f32", "f64"}));
  EXPECT_TRUE(throws_with(
      [&] {
        matmul(Tensor::zeros({4, 8}, DType::I32), Tensor::zeros({8, 2}, DType::I32));
      },
      {"matmul", "i32"}));
  EXPECT_TRUE(throws_with(
      [&] {
        linear(Tensor::zeros({3, 7}), Tensor::zeros({5, 8}));
      },
      {"linear", "(3, 7)", "(5, 8)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        linear(Tensor::zeros({3, 8}), Tensor::zeros({5, 8}), Tensor::zeros({4}));
      },
      {"linear", "(4)", "(5, 8)"}));
}

TEST(Matmul, Bf16PrecisionLeavesCpuProductsInF32) {
  Generator gen(12);
  const Tensor x = kvtest::randn({5, 33}, gen, DType::F32);
  const Tensor w = kvtest::randn({7, 33}, gen, DType::F32);
  const std::vector<float> f32 = linear(x, w).to_vector<float>();
  {
    const MatmulPrecisionGuard bf16(MatmulPrecision::BF16);
    EXPECT_EQ(matmul_precision(), MatmulPrecision::BF16);
    EXPECT_EQ(linear(x, w).to_vector<float>(), f32);
  }
  EXPECT_EQ(matmul_precision(), MatmulPrecision::F32);  // restored
}

}  // namespace
