#pragma once
// Checks shared by the ops (internal to autograd/ops).
#include "autograd/graph.h"
#include "autograd/tensor.h"

namespace kvlab::ops_detail {

inline void check_cpu(const char* op, const Tensor& t) {
  KVLAB_CHECK(t.defined(), op, ": undefined tensor argument");
  check_device_available(t.device());
  KVLAB_CHECK(t.device() == Device::CPU, op, ": ", device_name(t.device()),
              " tensors are not supported by this build's kernels");
}

inline void check_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  KVLAB_CHECK(a.dtype() == b.dtype(), op, ": dtypes differ: ", a.shape_str(), " ",
              dtype_name(a.dtype()), " vs ", b.shape_str(), " ", dtype_name(b.dtype()));
}

inline int wrap_dim(const char* op, int d, int nd) {
  const int i = d < 0 ? d + nd : d;
  KVLAB_CHECK(i >= 0 && i < nd, op, ": dim ", d, " out of range for rank ", nd);
  return i;
}

}  // namespace kvlab::ops_detail
