#include "autograd/ops/common.h"
#include "autograd/ops/ops.h"

namespace kvlab {

using namespace ops_detail;

namespace {

struct ReshapeNode : Node {
  Shape in_shape;
  const char* name() const override { return "reshape"; }
  std::vector<Tensor> backward(const Tensor& g) override { return {reshape(g, in_shape)}; }
  void release() override {}
};

struct TransposeNode : Node {
  int d0, d1;
  const char* name() const override { return "transpose"; }
  std::vector<Tensor> backward(const Tensor& g) override { return {transpose(g, d0, d1)}; }
  void release() override {}
};

struct NarrowNode : Node {
  Shape in_shape;
  int dim;
  int64_t start;
  const char* name() const override { return "narrow"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    Tensor dx = Tensor::zeros(in_shape, g.dtype(), g.device());
    narrow(dx, dim, start, g.size(dim)).copy_from(g);
    return {dx};
  }
  void release() override {}
};

struct ConcatNode : Node {
  int dim;
  std::vector<int64_t> lengths;
  const char* name() const override { return "concat"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    std::vector<Tensor> grads;
    int64_t at = 0;
    for (int64_t len : lengths) {
      grads.push_back(narrow(g, dim, at, len).contiguous());
      at += len;
    }
    return grads;
  }
  void release() override {}
};

}  // namespace

Tensor reshape(const Tensor& x, const Shape& shape_in) {
  Shape shape = shape_in;
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      KVLAB_CHECK(infer < 0, "reshape: ", shape_str(shape_in), ": only one size may be -1");
      infer = static_cast<int>(i);
    } else {
      KVLAB_CHECK(shape[i] >= 0, "reshape: invalid size in ", shape_str(shape_in));
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    KVLAB_CHECK(known > 0 && x.numel() % known == 0, "reshape: cannot view ", x.shape_str(), " as ",
                shape_str(shape_in));
    shape[infer] = x.numel() / known;
  }
  KVLAB_CHECK(shape_numel(shape) == x.numel(), "reshape: ", x.shape_str(), " (", x.numel(),
              " elements) cannot become ", shape_str(shape_in));
  const Tensor c = x.contiguous();  // a view when x is contiguous, a copy otherwise
  Tensor out = c.as_strided(shape, contiguous_strides(shape), c.offset());
  if (needs_grad({&x})) {
    auto node = std::make_shared<ReshapeNode>();
    node->in_shape = x.sizes();
    record(out, node, {&x});
  }
  return out;
}

Tensor transpose(const Tensor& x, int dim0, int dim1) {
  const int a = wrap_dim("transpose", dim0, x.dim()), b = wrap_dim("transpose", dim1, x.dim());
  Shape sizes = x.sizes(), strides = x.strides();
  std::swap(sizes[a], sizes[b]);
  std::swap(strides[a], strides[b]);
  Tensor out = x.as_strided(sizes, strides, x.offset());
  if (needs_grad({&x})) {
    auto node = std::make_shared<TransposeNode>();
    node->d0 = a;
    node->d1 = b;
    record(out, node, {&x});
  }
  return out;
}

Tensor narrow(const Tensor& x, int dim, int64_t start, int64_t length) {
  const int d = wrap_dim("narrow", dim, x.dim());
  KVLAB_CHECK(start >= 0 && length >= 0 && start + length <= x.size(d), "narrow: [", start, ", ",
              start + length, ") is outside dim ", d, " of ", x.shape_str());
  Shape sizes = x.sizes();
  sizes[d] = length;
  Tensor out = x.as_strided(sizes, x.strides(), x.offset() + start * x.stride(d));
  if (needs_grad({&x})) {
    auto node = std::make_shared<NarrowNode>();
    node->in_shape = x.sizes();
    node->dim = d;
    node->start = start;
    record(out, node, {&x});
  }
  return out;
}

Tensor concat(const std::vector<Tensor>& xs, int dim) {
  KVLAB_CHECK(!xs.empty(), "concat: no tensors given");
  const int d = wrap_dim("concat", dim, xs[0].dim());
  Shape shape = xs[0].sizes();
  int64_t total = 0;
  for (const Tensor& t : xs) {
    check_same_dtype("concat", xs[0], t);
    check_same_device("concat", xs[0], t);
    bool ok = t.dim() == xs[0].dim();
    for (int i = 0; ok && i < t.dim(); ++i) ok = i == d || t.size(i) == shape[i];
    KVLAB_CHECK(ok, "concat: ", t.shape_str(), " does not match ", xs[0].shape_str(),
                " outside dim ", d);
    total += t.size(d);
  }
  shape[d] = total;
  Tensor out = Tensor::empty(shape, xs[0].dtype(), xs[0].device());
  int64_t at = 0;
  std::vector<int64_t> lengths;
  for (const Tensor& t : xs) {
    Tensor slot = out.as_strided(t.sizes(), out.strides(), at * out.stride(d));
    slot.copy_from(t);
    lengths.push_back(t.size(d));
    at += t.size(d);
  }
  bool grad = false;
  for (const Tensor& t : xs) grad = grad || needs_grad({&t});
  if (grad) {
    auto node = std::make_shared<ConcatNode>();
    node->dim = d;
    node->lengths = lengths;
    for (const Tensor& t : xs)
      node->inputs.push_back(t.requires_grad() || t.grad_fn() ? t : Tensor());
    out.set_grad_fn(node);
  }
  return out;
}

std::vector<Tensor> split(const Tensor& x, int64_t chunk, int dim) {
  KVLAB_CHECK(chunk > 0, "split: chunk size ", chunk, " must be positive");
  const int d = wrap_dim("split", dim, x.dim());
  std::vector<Tensor> parts;
  for (int64_t at = 0; at < x.size(d); at += chunk)
    parts.push_back(narrow(x, d, at, std::min(chunk, x.size(d) - at)));
  return parts;
}

}  // namespace kvlab
