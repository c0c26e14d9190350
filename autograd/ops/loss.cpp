#include "autograd/ops/common.h"
#include "autograd/ops/ops.h"

namespace kvlab {

using namespace ops_detail;

namespace {
struct CrossEntropyNode : Node {
  Tensor logits, targets, lse;  // logits (N, V), targets (N), lse (N)
  Shape logits_shape;
  int32_t ignore_index;
  int64_t count;
  const char* name() const override { return "cross_entropy"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    const int64_t V = logits.size(-1), N = logits.numel() / V;
    Tensor dl = Tensor::empty(logits_shape, logits.dtype(), logits.device());
    dispatch_float(logits.dtype(), "cross_entropy", [&](auto tag) {
      using T = decltype(tag);
      KVLAB_KERNEL(logits.device(),
                   cross_entropy_backward<T>(dl.data<T>(), logits.data<T>(), lse.data<T>(),
                                             targets.data<int32_t>(), N, V, ignore_index,
                                             g.data<T>(), count));
    });
    return {dl, Tensor()};
  }
  void release() override { logits = targets = lse = Tensor(); }
};
}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int32_t ignore_index) {
  check_defined("cross_entropy", logits);
  check_defined("cross_entropy", targets);
  KVLAB_CHECK(targets.dtype() == DType::I32, "cross_entropy: targets must be i32, got ",
              dtype_name(targets.dtype()));
  KVLAB_CHECK(logits.dim() >= 1 && logits.size(-1) > 0, "cross_entropy: logits ",
              logits.shape_str(), " need a non-empty last (vocab) dim");
  const Shape lead(logits.sizes().begin(), logits.sizes().end() - 1);
  KVLAB_CHECK(targets.sizes() == lead, "cross_entropy: logits ", logits.shape_str(),
              " and targets ", targets.shape_str(), " do not match (expected targets ",
              shape_str(lead), ")");
  check_same_device("cross_entropy", logits, targets);
  const Tensor lc = logits.contiguous(), tc = targets.contiguous();
  const int64_t V = logits.size(-1), N = lc.numel() / V;
  const Tensor host_targets = tc.to(Device::CPU);  // checked and counted on the host
  const int32_t* pt = host_targets.data<int32_t>();
  int64_t count = 0;
  for (int64_t i = 0; i < N; ++i) {
    KVLAB_CHECK(pt[i] == ignore_index || (pt[i] >= 0 && pt[i] < V), "cross_entropy: target ", pt[i],
                " at position ", i, " is outside [0, ", V, ")");
    count += pt[i] != ignore_index;
  }
  const Device dev = logits.device();
  Tensor lse = Tensor::empty({N}, logits.dtype(), dev);
  Tensor out = Tensor::empty({}, logits.dtype(), dev);
  dispatch_float(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    KVLAB_KERNEL(dev, cross_entropy_forward<T>(out.data<T>(), lse.data<T>(), lc.data<T>(),
                                               tc.data<int32_t>(), N, V, ignore_index, count));
  });
  if (needs_grad({&logits})) {
    auto node = std::make_shared<CrossEntropyNode>();
    node->logits = lc.detach();
    node->targets = tc.detach();
    node->lse = lse;
    node->logits_shape = logits.sizes();
    node->ignore_index = ignore_index;
    node->count = count;
    record(out, node, {&logits, &targets});
  }
  return out;
}

}  // namespace kvlab
