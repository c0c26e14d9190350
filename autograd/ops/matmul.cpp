#include "autograd/ops/common.h"
#include "autograd/ops/ops.h"

namespace kvlab {

using namespace ops_detail;

namespace {

std::string mm_desc(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  return detail::cat(a.shape_str(), ta ? "^T" : "", " @ ", b.shape_str(), tb ? "^T" : "");
}

// op(a) @ op(b) without recording. a (..., M, K) or (..., K, M); b (..., K, N), (..., N, K), or
// a 2-D matrix shared by every leading index of a (then a must not be transposed).
Tensor matmul_raw(const Tensor& a_in, const Tensor& b_in, bool ta, bool tb) {
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
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* pc = out.data<T>();
    const int64_t lda = a.size(-1), ldb = b.size(-1);
    if (shared_b) {  // fold the batch into the rows of a
      KVLAB_KERNEL(dev, gemm<T>(false, tb, batch * M, N, Ka, T(1), pa, lda, pb, ldb, T(0), pc, N));
      return;
    }
    KVLAB_KERNEL(dev, gemm_batched<T>(ta, tb, M, N, Ka, T(1), pa, lda, M * Ka, pb, ldb, Ka * N,
                                      T(0), pc, N, M * N, batch));
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
  const char* name() const override { return "matmul"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    Tensor ga, gb;
    const bool shared_b = b.dim() == 2 && a.dim() > 2;
    if (inputs[0].defined()) ga = ta ? matmul_raw(b, g, tb, true) : matmul_raw(g, b, false, !tb);
    if (inputs[1].defined()) {
      if (shared_b) {
        const Tensor af = flatten_rows(a), gf = flatten_rows(g);
        gb = tb ? matmul_raw(gf, af, true, false) : matmul_raw(af, gf, true, false);
      } else {
        gb = tb ? matmul_raw(g, a, true, ta) : matmul_raw(a, g, !ta, false);
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
        KVLAB_KERNEL(dev, gemm<T>(false, false, N, in, out, T(1), gf.data<T>(), out, w.data<T>(),
                                  in, T(0), dx.data<T>(), in));
      }
      if (inputs[1].defined()) {
        dw = Tensor::empty(w.sizes(), w.dtype(), dev);  // (out, in) = g^T (out, N) @ x (N, in)
        KVLAB_KERNEL(dev, gemm<T>(true, false, out, in, N, T(1), gf.data<T>(), out, x.data<T>(), in,
                                  T(0), dw.data<T>(), in));
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
  Tensor out = matmul_raw(a, b, trans_a, trans_b);
  if (needs_grad({&a, &b})) {
    auto node = std::make_shared<MatmulNode>();
    node->a = a.contiguous().detach();
    node->b = b.contiguous().detach();
    node->ta = trans_a;
    node->tb = trans_b;
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
    KVLAB_KERNEL(dev, gemm<T>(false, true, N, out_f, in, T(1), xf.data<T>(), in, wc.data<T>(), in,
                              bias.defined() ? T(1) : T(0), out.data<T>(), out_f));
  });
  if (needs_grad({&x, &w, &bias})) {
    auto node = std::make_shared<LinearNode>();
    node->x = xf.detach();
    node->w = wc.detach();
    node->x_shape = x.sizes();
    record(out, node, {&x, &w, &bias});
  }
  return out;
}

}  // namespace kvlab
