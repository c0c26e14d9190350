#pragma once
// Checks shared by the ops (internal to autograd/ops).
#include "autograd/backend/dispatch.h"
#include "autograd/graph.h"
#include "autograd/tensor.h"

namespace kvlab::ops_detail {

inline void check_defined(const char* op, const Tensor& t) {
  KVLAB_CHECK(t.defined(), op, ": undefined tensor argument");
}

inline void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  KVLAB_CHECK(a.device() == b.device(), op, ": tensors on different devices: ", a.shape_str(),
              " on ", device_name(a.device()), ", ", b.shape_str(), " on ",
              device_name(b.device()));
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
