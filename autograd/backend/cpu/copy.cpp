#include <cstring>

#include "autograd/backend/cpu/index.h"
#include "autograd/backend/kernels.h"
#include "platform/error.h"
#include "platform/parallel.h"
#include "platform/scalar_codecs.h"

namespace kvlab::cpu {

namespace {

double load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F64: return static_cast<const double*>(p)[i];
    case DType::I32: return static_cast<const int32_t*>(p)[i];
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::FP8:  // quantised KV-cache storage: its bytes, copied as they are
    case DType::INT8:
    case DType::INT4: return static_cast<const uint8_t*>(p)[i];
  }
  return 0;
}

void store(void* p, DType t, int64_t i, double v) {
  switch (t) {
    case DType::F32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::F64: static_cast<double*>(p)[i] = v; break;
    case DType::I32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::BF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(static_cast<float>(v)); break;
    case DType::FP8:
    case DType::INT8:
    case DType::INT4: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
  }
}

}  // namespace

void strided_copy(void* dst, DType dst_type, const Strides& dst_strides, const void* src,
                  DType src_type, const Strides& src_strides, const std::vector<int64_t>& sizes) {
  const int nd = static_cast<int>(sizes.size());
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  if (n == 0) return;
  if (dst_type == src_type && both_contiguous(sizes, dst_strides, src_strides)) {
    std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(dst_type));
    return;
  }
  // Walk the index space row by row over the last dim.
  const int64_t inner = nd ? sizes[nd - 1] : 1;
  const int64_t ds = nd ? dst_strides[nd - 1] : 0, ss = nd ? src_strides[nd - 1] : 0;
  const int64_t rows = n / inner;
  parallel_range(rows, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t doff = row_offset(r, sizes, dst_strides);
      const int64_t soff = row_offset(r, sizes, src_strides);
      if (dst_type == DType::F32 && src_type == DType::F32) {
        float* o = static_cast<float*>(dst) + doff;
        const float* s = static_cast<const float*>(src) + soff;
        for (int64_t j = 0; j < inner; ++j) o[j * ds] = s[j * ss];
      } else if (dst_type == DType::BF16 && src_type == DType::F32) {  // a bf16 KV cache's store
        uint16_t* o = static_cast<uint16_t*>(dst) + doff;
        const float* s = static_cast<const float*>(src) + soff;
        for (int64_t j = 0; j < inner; ++j) o[j * ds] = f32_to_bf16(s[j * ss]);
      } else {
        for (int64_t j = 0; j < inner; ++j)
          store(dst, dst_type, doff + j * ds, load(src, src_type, soff + j * ss));
      }
    }
  });
}

}  // namespace kvlab::cpu
