#pragma once
// Plain argument types of the kernel interface, shared by every backend (cpu/, cuda/): the
// ops fill them in once and hand them to whichever backend holds the tensors.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvlab {

using Strides = std::vector<int64_t>;

enum class BinaryOp { Add, Sub, Mul };

// True when a copy of `sizes` between these strides is one block of bytes: both operands
// contiguous in the same order (size-1 dims ignored). Both backends' copies start with it.
inline bool both_contiguous(const std::vector<int64_t>& sizes, const Strides& a, const Strides& b) {
  int64_t expect = 1;
  for (std::size_t d = sizes.size(); d-- > 0;) {
    if (sizes[d] != 1 && (a[d] != expect || b[d] != expect)) return false;
    expect *= sizes[d];
  }
  return true;
}

// A (B, H, L, HS) operand addressed by strides of its first three dims; HS is contiguous.
struct HeadView {
  int64_t sb, sh, st;
};

struct AttentionShape {
  int64_t B, NH, NKV, T, S, HS;
  const int64_t* kv_lengths;  // (B) valid keys per row, host memory, or null for S everywhere
  double scale;               // usually 1/sqrt(HS)
  double dropout;             // on the attention probabilities
  uint64_t seed;
};

struct AdamWStep {
  float lr, beta1, beta2, eps, weight_decay;
  float bias_correction1, bias_correction2;  // 1 - beta^t
  float grad_scale;                          // clipping factor applied to the gradient
};

// One tensor of a multi-tensor AdamW step: its buffers (n elements each) and its own step
// (weight decay differs between 2-D weights and the rest).
struct AdamWTensor {
  float* param;
  const float* grad;
  float* m;
  float* v;
  int64_t n;
  AdamWStep step;
};

// One buffer of a multi-tensor reduction.
struct FloatSpan {
  const float* data;
  int64_t n;
};

}  // namespace kvlab
