#pragma once
// AdamW with decoupled weight decay on 2-D weights only, and the global gradient norm used
// for clipping (applied inside the update, so gradients are never rescaled in a separate pass).
#include "autograd/backend/kernel_types.h"
#include "nn/module.h"

namespace kvlab {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

// The kernel's settings for update number `step` (1-based) of one parameter tensor: weight
// decay only for 2-D weights, bias corrections 1 - beta^step.
AdamWStep adamw_step(const AdamWConfig& cfg, int64_t step, double lr, double grad_scale,
                          int param_dim);
// The one device every parameter lives on (CPU when there are none): an optimizer's step is
// one kernel call there. Throws kvlab::Error naming a parameter on another.
Device device_of(const NamedTensors& params);

class AdamW {
 public:
  AdamW(NamedTensors params, const AdamWConfig& cfg);
  // One update with learning rate `lr`; gradients are multiplied by `grad_scale` first
  // (the clipping factor). Parameters without a gradient are skipped.
  void step(double lr, double grad_scale = 1.0);
  int64_t step_count() const { return step_; }
  void set_step_count(int64_t s) { step_ = s; }
  // First and second moments, named like the parameters (for checkpoints).
  const NamedTensors& exp_avg() const { return m_; }
  const NamedTensors& exp_avg_sq() const { return v_; }
  const NamedTensors& params() const { return params_; }
  const AdamWConfig& config() const { return cfg_; }

 private:
  NamedTensors params_, m_, v_;
  AdamWConfig cfg_;
  int64_t step_ = 0;
};

// sqrt of the sum of squared gradients of all parameters (those with a gradient).
double global_grad_norm(const NamedTensors& params);
// PyTorch's clip_grad_norm_ factor: min(1, max_norm / (norm + 1e-6)); 1 when max_norm <= 0.
double clip_factor(double norm, double max_norm);

}  // namespace kvlab
