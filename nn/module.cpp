#include "nn/module.h"

#include <unordered_set>

#include "autograd/ops/ops.h"

namespace kvlab {

Tensor& Module::register_parameter(const std::string& name, Tensor t) {
  t.set_requires_grad(true);
  params_.emplace_back(name, std::move(t));
  return params_.back().second;
}

void Module::register_module(const std::string& name, Module& child) {
  children_.emplace_back(name, &child);
}

void Module::collect(const std::string& prefix, NamedTensors& out) const {
  for (const auto& [name, t] : params_) out.emplace_back(prefix + name, t);
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", out);
}

NamedTensors Module::named_parameters() const {
  NamedTensors all, unique;
  collect("", all);
  std::unordered_set<const TensorImpl*> seen;
  for (auto& [name, t] : all)
    if (seen.insert(t.impl()).second) unique.emplace_back(name, t);
  return unique;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [name, t] : named_parameters()) out.push_back(t);
  return out;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (auto& [name, t] : named_parameters()) n += t.numel();
  return n;
}

void Module::zero_grad() {
  for (auto& [name, t] : named_parameters()) {
    Tensor p = t;
    p.zero_grad();
  }
}

void Module::to(Device device) {
  for (auto& [name, t] : named_parameters()) {
    Tensor p = t;
    p.move_to(device);
  }
}

Device Module::device() const {
  const NamedTensors params = named_parameters();
  return params.empty() ? Device::CPU : params.front().second.device();
}

void Module::set_training(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->set_training(on);
}

void normal_(Tensor& t, Generator& gen, double std) {
  dispatch_float(t.dtype(), "normal_", [&](auto tag) {
    using T = decltype(tag);
    KVLAB_CHECK(t.is_contiguous(), "normal_: tensor ", t.shape_str(), " must be contiguous");
    T* p = t.data<T>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<T>(gen.normal() * std);
  });
}

}  // namespace kvlab
