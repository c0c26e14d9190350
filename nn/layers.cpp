#include "nn/layers.h"

#include "autograd/ops/ops.h"

namespace kvlab {

// The matrices are left uninitialised: the model draws them (GPT's seeded constructor) or loads
// them, and a real-size model's would take seconds to zero only to be overwritten.
Linear::Linear(int64_t in, int64_t out, bool with_bias) {
  weight = register_parameter("weight", Tensor::empty({out, in}));
  if (with_bias) bias = register_parameter("bias", Tensor::zeros({out}));
}

Tensor Linear::forward(const Tensor& x) const { return linear(x, weight, bias); }

Embedding::Embedding(int64_t num, int64_t dim) {
  weight = register_parameter("weight", Tensor::empty({num, dim}));
}

Tensor Embedding::forward(const Tensor& ids) const { return embedding(ids, weight); }

LayerNorm::LayerNorm(int64_t dim, double eps_, bool rms_, bool with_bias) : eps(eps_), rms(rms_) {
  weight = register_parameter("weight", Tensor::full({dim}, 1.0));
  if (with_bias && !rms) bias = register_parameter("bias", Tensor::zeros({dim}));
}

Tensor LayerNorm::forward(const Tensor& x) const {
  return rms ? rms_norm(x, weight, eps) : layer_norm(x, weight, bias, eps);
}

MLP::MLP(int64_t n_embd, int64_t hidden, bool swiglu, bool bias)
    : c_fc(n_embd, hidden, bias), c_proj(hidden, n_embd, bias) {
  register_module("c_fc", c_fc);
  if (swiglu) {
    c_up = std::make_unique<Linear>(n_embd, hidden, bias);
    register_module("c_up", *c_up);
  }
  register_module("c_proj", c_proj);
}

Tensor MLP::forward(const Tensor& x) const {
  return c_proj.forward(c_up ? swiglu(c_fc.forward(x), c_up->forward(x))
                             : gelu(c_fc.forward(x)));
}

}  // namespace kvlab
