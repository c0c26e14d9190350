#include "autograd/ops/common.h"
#include "autograd/ops/ops.h"

namespace kvlab {

using namespace ops_detail;

namespace {
struct SumNode : Node {
  Shape shape;
  double factor;  // 1 for sum, 1/n for mean
  const char* name() const override { return factor == 1.0 ? "sum" : "mean"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    return {Tensor::full(shape, g.item() * factor, g.dtype(), g.device())};
  }
  void release() override {}
};

Tensor reduce_all(const char* name, const Tensor& x, bool is_mean) {
  check_defined(name, x);
  Tensor xc = x.contiguous();
  const int64_t n = x.numel();
  Tensor out = Tensor::empty({}, x.dtype(), x.device());
  dispatch_float(x.dtype(), name, [&](auto tag) {
    using T = decltype(tag);
    const T divisor = is_mean ? static_cast<T>(n) : T(1);
    KVLAB_KERNEL(x.device(), sum_all<T>(out.data<T>(), xc.data<T>(), n, divisor));
  });
  if (needs_grad({&x})) {
    auto node = std::make_shared<SumNode>();
    node->shape = x.sizes();
    node->factor = is_mean ? 1.0 / static_cast<double>(n) : 1.0;
    record(out, node, {&x});
  }
  return out;
}
}  // namespace

Tensor sum(const Tensor& x) { return reduce_all("sum", x, false); }

Tensor mean(const Tensor& x) {
  KVLAB_CHECK(x.numel() > 0, "mean: empty tensor ", x.shape_str());
  return reduce_all("mean", x, true);
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.sizes() == shape) return x;
  check_defined("sum_to", x);
  KVLAB_CHECK(shape.size() <= x.sizes().size(), "sum_to: cannot reduce ", x.shape_str(), " to ",
              shape_str(shape));
  Tensor xc = x.contiguous();
  Tensor out = Tensor::empty(shape, x.dtype(), x.device());
  dispatch_float(x.dtype(), "sum_to", [&](auto tag) {
    using T = decltype(tag);
    KVLAB_KERNEL(x.device(), sum_to<T>(out.data<T>(), shape, xc.data<T>(), x.sizes()));
  });
  return out;
}

}  // namespace kvlab
