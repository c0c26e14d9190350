#include "autograd/ops/common.h"
#include "autograd/ops/ops.h"

namespace kvlab {

using namespace ops_detail;

namespace {

struct LayerNormNode : Node {
  Tensor x, w, mean, rstd;  // x (N, C); mean (N, undefined for RMSNorm), rstd (N)
  Shape x_shape;
  bool has_bias = true;
  const char* name() const override { return mean.defined() ? "layer_norm" : "rms_norm"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    const Tensor gc = g.contiguous();
    const int64_t C = w.size(0), N = x.numel() / C;
    const Device dev = x.device();
    Tensor dx = Tensor::empty(x_shape, x.dtype(), dev);
    Tensor dw = Tensor::empty({C}, x.dtype(), dev);
    Tensor db = has_bias ? Tensor::empty({C}, x.dtype(), dev) : Tensor();
    dispatch_float(x.dtype(), name(), [&](auto tag) {
      using T = decltype(tag);
      KVLAB_KERNEL(dev, layernorm_backward<T>(dx.data<T>(), dw.data<T>(),
                                              has_bias ? db.data<T>() : nullptr, gc.data<T>(),
                                              x.data<T>(), w.data<T>(),
                                              mean.defined() ? mean.data<T>() : nullptr,
                                              rstd.data<T>(), N, C));
    });
    return {dx, dw, db};
  }
  void release() override { x = w = mean = rstd = Tensor(); }
};

// LayerNorm (centred) or RMSNorm over the last dim; `bias` may be undefined (no bias).
Tensor normalise(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias,
                 double eps, bool centred) {
  check_defined(op, x);
  check_defined(op, weight);
  check_same_dtype(op, x, weight);
  check_same_device(op, x, weight);
  KVLAB_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), op,
              ": input ", x.shape_str(), " with weight ", weight.shape_str(),
              ": the last dim must match");
  if (bias.defined()) {
    check_same_dtype(op, x, bias);
    check_same_device(op, x, bias);
    KVLAB_CHECK(bias.dim() == 1 && bias.size(0) == x.size(-1), op, ": input ", x.shape_str(),
                " with bias ", bias.shape_str(), ": the last dim must match");
  }
  KVLAB_CHECK(eps > 0, op, ": eps must be positive, got ", eps);
  const Tensor xc = x.contiguous(), wc = weight.contiguous();
  const Tensor bc = bias.defined() ? bias.contiguous() : Tensor();
  const int64_t C = x.size(-1), N = C ? x.numel() / C : 0;
  const Device dev = x.device();
  Tensor out = Tensor::empty(x.sizes(), x.dtype(), dev);
  Tensor mean = centred ? Tensor::empty({N}, x.dtype(), dev) : Tensor();
  Tensor rstd = Tensor::empty({N}, x.dtype(), dev);
  dispatch_float(x.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    KVLAB_KERNEL(dev, layernorm_forward<T>(out.data<T>(), centred ? mean.data<T>() : nullptr,
                                           rstd.data<T>(), xc.data<T>(), wc.data<T>(),
                                           bc.defined() ? bc.data<T>() : nullptr, N, C, eps));
  });
  if (needs_grad({&x, &weight, &bias})) {
    auto node = std::make_shared<LayerNormNode>();
    node->x = xc.detach();
    node->w = wc.detach();
    node->mean = mean;
    node->rstd = rstd;
    node->x_shape = x.sizes();
    node->has_bias = bias.defined();
    record(out, node, {&x, &weight, &bias});
  }
  return out;
}

struct SoftmaxNode : Node {
  Tensor y;
  const char* name() const override { return "softmax"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    const Tensor gc = g.contiguous();
    const int64_t C = y.size(-1), N = C ? y.numel() / C : 0;
    Tensor dx = Tensor::empty(y.sizes(), y.dtype(), y.device());
    dispatch_float(y.dtype(), "softmax", [&](auto tag) {
      using T = decltype(tag);
      KVLAB_KERNEL(y.device(), softmax_backward<T>(dx.data<T>(), gc.data<T>(), y.data<T>(), N, C));
    });
    return {dx};
  }
  void release() override { y = Tensor(); }
};

}  // namespace

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  return normalise("layer_norm", x, weight, bias, eps, true);
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  return normalise("rms_norm", x, weight, Tensor(), eps, false);
}

Tensor softmax(const Tensor& x) {
  check_defined("softmax", x);
  KVLAB_CHECK(x.dim() >= 1 && x.size(-1) > 0, "softmax: input ", x.shape_str(),
              " needs a non-empty last dim");
  const Tensor xc = x.contiguous();
  const int64_t C = x.size(-1), N = x.numel() / C;
  Tensor out = Tensor::empty(x.sizes(), x.dtype(), x.device());
  dispatch_float(x.dtype(), "softmax", [&](auto tag) {
    using T = decltype(tag);
    KVLAB_KERNEL(x.device(), softmax_forward<T>(out.data<T>(), xc.data<T>(), N, C));
  });
  if (needs_grad({&x})) {
    auto node = std::make_shared<SoftmaxNode>();
    node->y = out.detach();
    record(out, node, {&x});
  }
  return out;
}

}  // namespace kvlab
