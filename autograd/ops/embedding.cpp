#include "autograd/ops/common.h"
#include "autograd/ops/ops.h"

namespace kvlab {

using namespace ops_detail;

namespace {
struct EmbeddingNode : Node {
  Tensor ids;  // (N) i32
  Shape w_shape;
  const char* name() const override { return "embedding"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    const Tensor gc = g.contiguous();
    Tensor dw = Tensor::zeros(w_shape, g.dtype(), g.device());
    dispatch_float(g.dtype(), "embedding", [&](auto tag) {
      using T = decltype(tag);
      KVLAB_KERNEL(g.device(),
                   embedding_backward<T>(dw.data<T>(), gc.data<T>(), ids.data<int32_t>(),
                                         ids.numel(), w_shape[0], w_shape[1]));
    });
    return {Tensor(), dw};
  }
  void release() override { ids = Tensor(); }
};
}  // namespace

Tensor embedding(const Tensor& ids, const Tensor& weight) {
  check_defined("embedding", ids);
  check_defined("embedding", weight);
  KVLAB_CHECK(ids.dtype() == DType::I32, "embedding: ids must be i32, got ",
              dtype_name(ids.dtype()), " ", ids.shape_str());
  KVLAB_CHECK(weight.dim() == 2, "embedding: weight ", weight.shape_str(), " must be (V, C)");
  check_same_device("embedding", ids, weight);
  const Tensor ic = ids.contiguous(), wc = weight.contiguous();
  const int64_t V = weight.size(0), C = weight.size(1), N = ids.numel();
  const Tensor host_ids = ic.to(Device::CPU);  // checked on the host: a small copy from a GPU
  const int32_t* pi = host_ids.data<int32_t>();
  for (int64_t i = 0; i < N; ++i)
    KVLAB_CHECK(pi[i] >= 0 && pi[i] < V, "embedding: id ", pi[i], " at position ", i,
                " is outside [0, ", V, ") for weight ", weight.shape_str());
  Shape shape = ids.sizes();
  shape.push_back(C);
  Tensor out = Tensor::empty(shape, weight.dtype(), weight.device());
  dispatch_float(weight.dtype(), "embedding", [&](auto tag) {
    using T = decltype(tag);
    KVLAB_KERNEL(weight.device(),
                 embedding_forward<T>(out.data<T>(), ic.data<int32_t>(), wc.data<T>(), N, C));
  });
  if (needs_grad({&weight})) {
    auto node = std::make_shared<EmbeddingNode>();
    node->ids = ic.detach();
    node->w_shape = weight.sizes();
    record(out, node, {&ids, &weight});
  }
  return out;
}

}  // namespace kvlab
