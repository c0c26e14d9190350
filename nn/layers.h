#pragma once
// Building blocks of the GPT: Linear, Embedding, LayerNorm (or RMSNorm) and the MLP.
#include <memory>

#include "nn/module.h"

namespace kvlab {

class Linear : public Module {
 public:
  // weight (out, in) as torch.nn.Linear stores it, uninitialised until drawn or loaded; bias
  // (out) zero, undefined without one.
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

// LayerNorm, or with `rms` RMSNorm (no centring and never a bias); `bias` false drops
// LayerNorm's bias. weight starts at 1.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, bool rms = false, bool bias = true);
  Tensor forward(const Tensor& x) const;
  Tensor weight, bias;  // (dim); bias undefined for RMSNorm or without a bias
  double eps;
  bool rms;
};

// c_proj(gelu(c_fc(x))), or with `swiglu` c_proj(silu(c_fc(x)) * c_up(x)) (c_fc the gate).
class MLP : public Module {
 public:
  MLP(int64_t n_embd, int64_t hidden, bool swiglu = false, bool bias = true);
  Tensor forward(const Tensor& x) const;
  Linear c_fc;
  std::unique_ptr<Linear> c_up;  // only with swiglu
  Linear c_proj;
};

}  // namespace kvlab
