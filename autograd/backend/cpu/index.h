#pragma once
// Index arithmetic shared by the strided kernels.
#include <cstdint>
#include <vector>

namespace kvlab::cpu {

// Element offset of row r of a strided view, a row being the last dim: r is decomposed over
// dims 0 .. nd-2 of `sizes` (row-major) and weighted by `strides`.
inline int64_t row_offset(int64_t r, const std::vector<int64_t>& sizes,
                          const std::vector<int64_t>& strides) {
  int64_t off = 0;
  for (int d = static_cast<int>(sizes.size()) - 2; d >= 0; --d) {
    off += (r % sizes[d]) * strides[d];
    r /= sizes[d];
  }
  return off;
}

}  // namespace kvlab::cpu
