#pragma once
// Plain argument types of the kernel interface, shared by every backend (cpu/, cuda/): the
// ops fill them in once and hand them to whichever backend holds the tensors.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "autograd/backend/device.h"

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

// K and V of a paged KV cache: a pool of blocks of block_len positions, each row reaching its
// own through a block table. Position p of row b lies in block table[b * width + p / block_len]
// at offset p % block_len: KV head g's keys of a block are block_len rows, so the kernels read
// them block by block through the table, never copying a row's keys to one place. Read with
// the operand's HeadView, whose sh and st step heads and positions within a block (its sb is
// not used). block_len is a power of two.
struct KVBlocks {
  const int32_t* table;  // (B, width) block ids, host memory
  int64_t width;         // table entries per row: a row holds up to width * block_len positions
  int64_t block_len;     // positions per block
  int64_t block_stride;  // elements from one block of the pool to the next
};

struct AttentionShape {
  int64_t B, NH, NKV, T, S, HS;
  const int64_t* kv_lengths;  // (B) valid keys per row, host memory, or null for S everywhere
  double scale;               // usually 1/sqrt(HS)
  double dropout;             // on the attention probabilities
  uint64_t seed;
  // Null: K and V are (B, NKV, S, HS) operands. Otherwise their blocks, reached through these
  // tables (forward without dropout only, on the CPU; kv_lengths then set).
  const KVBlocks* kv_blocks = nullptr;
  // K and V's storage when it is a quantised KV cache's (fp8, int8 or int4, forward on the CPU
  // only): their last dim then counts kv_row_bytes(kv_dtype, HS) bytes. fp8 reads kv_scales:
  // the layer's (2 NKV) scales, every KV head's keys', then its values'.
  DType kv_dtype = DType::F32;
  const float* kv_scales = nullptr;
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
