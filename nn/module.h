#pragma once
// Module: named parameters following the module tree, as a PyTorch state_dict names them
// (`blocks.0.attn.q_proj.weight`).
#include <string>
#include <utility>
#include <vector>

#include "autograd/tensor.h"
#include "platform/random.h"

namespace kvlab {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Every parameter once, in registration order (a tied tensor appears under its first name).
  NamedTensors named_parameters() const;
  std::vector<Tensor> parameters() const;
  int64_t num_parameters() const;
  void zero_grad();
  // Moves every parameter to `device` in place; device() is where they live (CPU when none).
  void to(Device device);
  Device device() const;
  // Training mode turns dropout on.
  void set_training(bool on);
  bool training() const { return training_; }

 protected:
  Tensor& register_parameter(const std::string& name, Tensor t);
  void register_module(const std::string& name, Module& child);

 private:
  void collect(const std::string& prefix, NamedTensors& out) const;
  std::vector<std::pair<std::string, Tensor>> params_;
  std::vector<std::pair<std::string, Module*>> children_;
  bool training_ = true;
};

// Fills `t` with N(0, std) draws from `gen` (f32 or f64 tensors).
void normal_(Tensor& t, Generator& gen, double std);

}  // namespace kvlab
