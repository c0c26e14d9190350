#pragma once
// Building blocks of the GPT: Linear, Embedding, LayerNorm and the MLP.
#include "nn/module.h"

namespace kvlab {

class Linear : public Module {
 public:
  // weight (out, in) as torch.nn.Linear stores it; bias (out).
  Linear(int64_t in, int64_t out, bool bias = true);
  Tensor forward(const Tensor& x) const;  // (..., in) -> (..., out)
  Tensor weight, bias;
};

class Embedding : public Module {
 public:
  Embedding(int64_t num, int64_t dim);
  Tensor forward(const Tensor& ids) const;  // (...) i32 -> (..., dim)
  Tensor weight;  // (num, dim)
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5);
  Tensor forward(const Tensor& x) const;
  Tensor weight, bias;  // (dim)
  double eps;
};

class MLP : public Module {
 public:
  MLP(int64_t n_embd, int64_t hidden);
  Tensor forward(const Tensor& x) const;  // c_proj(gelu(c_fc(x)))
  Linear c_fc, c_proj;
};

}  // namespace kvlab
