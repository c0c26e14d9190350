#include <type_traits>

#ifdef KVLAB_WITH_CUDA
#include "autograd/backend/cuda/runtime.h"
#endif
#include "autograd/ops/common.h"
#include "autograd/ops/ops.h"

namespace kvlab {

using namespace ops_detail;

namespace {
thread_local MatmulPrecision g_precision = MatmulPrecision::F32;
}  // namespace

MatmulPrecision matmul_precision() { return g_precision; }
MatmulPrecisionGuard::MatmulPrecisionGuard(MatmulPrecision p) : prev_(g_precision) {
  g_precision = p;
}
MatmulPrecisionGuard::~MatmulPrecisionGuard() { g_precision = prev_; }

namespace {

// c = op(a) op(b) + beta c over `batch` matrices of a, b, c (contiguous buffers; matrix i
// starts sa, sb, sc elements after the previous), on the buffers' device. In bf16 precision on
// a GPU the f32 operands are rounded to bf16 copies and multiplied on the tensor cores with f32
// accumulation; everywhere else the product is the plain one of the dtype.
template <class T>
void product(MatmulPrecision precision, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
             const Tensor& a, int64_t lda, int64_t sa, const Tensor& b, int64_t ldb, int64_t sb,
             T beta, const Tensor& c, int64_t ldc, int64_t sc, int64_t batch) {
  const Device dev = c.device();
#ifdef KVLAB_WITH_CUDA
  if constexpr (std::is_same_v<T, float>) {
    if (precision == MatmulPrecision::BF16 && dev == Device::CUDA) {
      const Tensor a16 = a.to(DType::BF16), b16 = b.to(DType::BF16);  // same layout, rounded
      cuda::gemm_bf16(ta, tb, M, N, K, 1.0f, static_cast<const uint16_t*>(a16.raw_data()), lda, sa,
                      static_cast<const uint16_t*>(b16.raw_data()), ldb, sb, beta, c.data<float>(),
                      ldc, sc, batch);
      return;
    }
  }
#endif
  (void)precision;
  if (batch == 1)
    KVLAB_KERNEL(dev, gemm<T>(ta, tb, M, N, K, T(1), a.data<T>(), lda, b.data<T>(), ldb, beta,
                              c.data<T>(), ldc));
  else
    KVLAB_KERNEL(dev, gemm_batched<T>(ta, tb, M, N, K, T(1), a.data<T>(), lda, sa, b.data<T>(), ldb,
                                      sb, beta, c.data<T>(), ldc, sc, batch));
}

std::string mm_desc(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  return detail::cat(a.shape_str(), ta ? "^T" : "", " @ ", b.shape_str(), tb ? "^T" : "");
}

// op(a) @ op(b) without recording. a (..., M, K) or (..., K, M); b (..., K, N), (..., N, K), or
// a 2-D matrix shared by every leading index of a (then a must not be transposed).
Tensor matmul_raw(const Tensor& a_in, const Tensor& b_in, bool ta, bool tb,
                  MatmulPrecision precision) {
  check_defined("matmul", a_in);
  check_defined("matmul", b_in);
  check_same_dtype("matmul", a_in, b_in);
  check_same_device("matmul", a_in, b_in);
  KVLAB_CHECK(a_in.dim() >= 2 && b_in.dim() >= 2, "matmul: ", mm_desc(a_in, b_in, ta, tb),
              ": both operands need at least 2 dims");
  const bool shared_b = b_in.dim() == 2 && a_in.dim() > 2;
  KVLAB_CHECK(shared_b || a_in.dim() == b_in.dim(), "matmul: ", mm_desc(a_in, b_in, ta, tb),
              ": ranks differ");
  KVLAB_CHECK(!(shared_b && ta), "matmul: ", mm_desc(a_in, b_in, ta, tb),
              ": a transposed batched operand needs a batched b");
  const Tensor a = a_in.contiguous(), b = b_in.contiguous();
  const int nd = a.dim();
  const int64_t M = ta ? a.size(-1) : a.size(-2), Ka = ta ? a.size(-2) : a.size(-1);
  const int64_t Kb = tb ? b.size(-1) : b.size(-2), N = tb ? b.size(-2) : b.size(-1);
  KVLAB_CHECK(Ka == Kb, "matmul: ", mm_desc(a_in, b_in, ta, tb), ": inner sizes differ (", Ka,
              " vs ", Kb, ")");
  Shape out_shape(a.sizes().begin(), a.sizes().end() - 2);
  if (!shared_b)
    for (int d = 0; d < nd - 2; ++d)
      KVLAB_CHECK(a.size(d) == b.size(d), "matmul: ", mm_desc(a_in, b_in, ta, tb),
                  ": batch dims differ");
  out_shape.push_back(M);
  out_shape.push_back(N);
  const Device dev = a.device();
  Tensor out = Tensor::empty(out_shape, a.dtype(), dev);
  const int64_t batch = shape_numel(Shape(a.sizes().begin(), a.sizes().end() - 2));
  dispatch_float(a.dtype(), "matmul", [&](auto tag) {
    using T = decltype(tag);
    const int64_t lda = a.size(-1), ldb = b.size(-1);
    if (shared_b)  // fold the batch into the rows of a
      product<T>(precision, false, tb, batch * M, N, Ka, a, lda, 0, b, ldb, 0, T(0), out, N, 0, 1);
    else
      product<T>(precision, ta, tb, M, N, Ka, a, lda, M * Ka, b, ldb, Ka * N, T(0), out, N, M * N,
                 batch);
  });
  return out;
}

// (..., C) -> (N, C) view of a contiguous copy.
Tensor flatten_rows(const Tensor& t) {
  const Tensor c = t.contiguous();
  const int64_t C = c.size(-1);
  return c.as_strided({shape_numel(Shape(c.sizes().begin(), c.sizes().end() - 1)), C}, {C, 1},
                      c.offset());
}

struct MatmulNode : Node {
  Tensor a, b;
  bool ta, tb;
  MatmulPrecision precision;  // of the forward, for the backward products
  const char* name() const override { return "matmul"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    Tensor ga, gb;
    const bool shared_b = b.dim() == 2 && a.dim() > 2;
    if (inputs[0].defined())
      ga = ta ? matmul_raw(b, g, tb, true, precision) : matmul_raw(g, b, false, !tb, precision);
    if (inputs[1].defined()) {
      if (shared_b) {
        const Tensor af = flatten_rows(a), gf = flatten_rows(g);
        gb = tb ? matmul_raw(gf, af, true, false, precision)
                : matmul_raw(af, gf, true, false, precision);
      } else {
        gb = tb ? matmul_raw(g, a, true, ta, precision) : matmul_raw(a, g, !ta, false, precision);
      }
    }
    return {ga, gb};
  }
  void release() override {
    a = Tensor();
    b = Tensor();
  }
};

struct LinearNode : Node {
  Tensor x, w;  // x as (N, in)
  Shape x_shape;
  MatmulPrecision precision;  // of the forward, for the backward products
  const char* name() const override { return "linear"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    const Tensor gf = flatten_rows(g);  // (N, out)
    const int64_t N = x.size(0), in = x.size(1), out = w.size(0);
    const Device dev = x.device();
    Tensor dx, dw, db;
    dispatch_float(x.dtype(), "linear", [&](auto tag) {
      using T = decltype(tag);
      if (inputs[0].defined()) {
        dx = Tensor::empty(x_shape, x.dtype(), dev);  // (N, in) = g (N, out) @ w (out, in)
        product<T>(precision, false, false, N, in, out, gf, out, 0, w, in, 0, T(0), dx, in, 0, 1);
      }
      if (inputs[1].defined()) {
        dw = Tensor::empty(w.sizes(), w.dtype(), dev);  // (out, in) = g^T (out, N) @ x (N, in)
        product<T>(precision, true, false, out, in, N, gf, out, 0, x, in, 0, T(0), dw, in, 0, 1);
      }
    });
    if (inputs.size() > 2 && inputs[2].defined()) db = sum_to(gf, {w.size(0)});
    return {dx, dw, db};
  }
  void release() override {
    x = Tensor();
    w = Tensor();
  }
};

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  Tensor out = matmul_raw(a, b, trans_a, trans_b, g_precision);
  if (needs_grad({&a, &b})) {
    auto node = std::make_shared<MatmulNode>();
    node->a = a.contiguous().detach();
    node->b = b.contiguous().detach();
    node->ta = trans_a;
    node->tb = trans_b;
    node->precision = g_precision;
    record(out, node, {&a, &b});
  }
  return out;
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias) {
  check_defined("linear", x);
  check_defined("linear", w);
  check_same_dtype("linear", x, w);
  check_same_device("linear", x, w);
  KVLAB_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1), "linear: input ",
              x.shape_str(), " does not match weight ", w.shape_str(), " (out, in)");
  if (bias.defined()) {
    check_same_dtype("linear", x, bias);
    check_same_device("linear", x, bias);
    KVLAB_CHECK(bias.dim() == 1 && bias.size(0) == w.size(0), "linear: bias ", bias.shape_str(),
                " does not match weight ", w.shape_str());
  }
  const Tensor xf = flatten_rows(x), wc = w.contiguous();
  const int64_t N = xf.size(0), in = w.size(1), out_f = w.size(0);
  Shape out_shape = x.sizes();
  out_shape.back() = out_f;
  const Device dev = x.device();
  Tensor out = Tensor::empty(out_shape, x.dtype(), dev);
  if (bias.defined())  // start from the bias in every row, then accumulate the product
    out.as_strided({N, out_f}, {out_f, 1}, 0)
        .copy_from(bias.as_strided({N, out_f}, {0, bias.stride(0)}, bias.offset()));
  dispatch_float(x.dtype(), "linear", [&](auto tag) {
    using T = decltype(tag);
    product<T>(g_precision, false, true, N, out_f, in, xf, in, 0, wc, in, 0,
               bias.defined() ? T(1) : T(0), out, out_f, 0, 1);
  });
  if (needs_grad({&x, &w, &bias})) {
    auto node = std::make_shared<LinearNode>();
    node->x = xf.detach();
    node->w = wc.detach();
    node->x_shape = x.sizes();
    node->precision = g_precision;
    record(out, node, {&x, &w, &bias});
  }
  return out;
}

}  // namespace kvlab
