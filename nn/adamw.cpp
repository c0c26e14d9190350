#include "nn/adamw.h"

#include <cmath>

#include "autograd/backend/dispatch.h"

namespace kvlab {

AdamW::AdamW(NamedTensors params, const AdamWConfig& cfg) : params_(std::move(params)), cfg_(cfg) {
  for (auto& [name, p] : params_) {
    KVLAB_CHECK(p.dtype() == DType::F32 && p.is_contiguous(), "adamw: parameter ", name,
                " must be a contiguous f32 tensor");
    m_.emplace_back(name, Tensor::zeros(p.sizes(), DType::F32, p.device()));
    v_.emplace_back(name, Tensor::zeros(p.sizes(), DType::F32, p.device()));
  }
}

AdamWStep adamw_step(const AdamWConfig& cfg, int64_t step, double lr, double grad_scale,
                     int param_dim) {
  const double t = static_cast<double>(step);
  return {static_cast<float>(lr),
          static_cast<float>(cfg.beta1),
          static_cast<float>(cfg.beta2),
          static_cast<float>(cfg.eps),
          static_cast<float>(param_dim >= 2 ? cfg.weight_decay : 0.0),
          static_cast<float>(1.0 - std::pow(cfg.beta1, t)),
          static_cast<float>(1.0 - std::pow(cfg.beta2, t)),
          static_cast<float>(grad_scale)};
}

Device device_of(const NamedTensors& params) {
  const Device d = params.empty() ? Device::CPU : params.front().second.device();
  for (const auto& [name, p] : params)
    KVLAB_CHECK(p.device() == d, "optimizer: parameter ", name, " is on ",
                device_name(p.device()), ", the others on ", device_name(d));
  return d;
}

void AdamW::step(double lr, double grad_scale) {
  ++step_;
  const Device dev = device_of(params_);
  std::vector<Tensor> grads;  // keeps contiguous copies alive until the update ran
  std::vector<AdamWTensor> tensors;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i].second;
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    grads.push_back(g.contiguous());
    KVLAB_CHECK(grads.back().device() == dev, "adamw: gradient of ", params_[i].first, " is on ",
                device_name(grads.back().device()), ", the parameter on ", device_name(dev));
    m_[i].second.move_to(dev);  // the model may have moved after the optimizer was made
    v_[i].second.move_to(dev);
    tensors.push_back({p.data<float>(), grads.back().data<float>(), m_[i].second.data<float>(),
                       v_[i].second.data<float>(), p.numel(),
                       adamw_step(cfg_, step_, lr, grad_scale, p.dim())});
  }
  KVLAB_KERNEL(dev, adamw_update_many(tensors));
}

double global_grad_norm(const NamedTensors& params) {
  std::vector<Tensor> grads;
  std::vector<FloatSpan> spans;
  for (auto& [name, p] : params) {
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    grads.push_back(g.contiguous());
    spans.push_back({grads.back().data<float>(), grads.back().numel()});
  }
  return std::sqrt(KVLAB_KERNEL(device_of(params), sum_squares_many(spans)));
}

double clip_factor(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  const double f = max_norm / (norm + 1e-6);
  return f < 1.0 ? f : 1.0;
}

}  // namespace kvlab
