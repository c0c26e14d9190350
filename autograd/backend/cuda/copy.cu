// Strided copies with dtype conversion on the device.
#include <cuda_bf16.h>

#include "autograd/backend/cuda/common.cuh"
#include "autograd/backend/cuda/runtime.h"
#include "autograd/backend/kernels.h"

namespace kvlab::cuda {

Indexer make_indexer(const char* op, const std::vector<int64_t>& sizes,
                     const std::vector<int64_t>& strides0, const std::vector<int64_t>& strides1) {
  KVLAB_CHECK(sizes.size() <= static_cast<size_t>(kMaxDims), op, ": ", sizes.size(),
              " dims; the CUDA backend handles at most ", kMaxDims);
  Indexer ix{};
  ix.nd = static_cast<int>(sizes.size());
  for (int d = 0; d < ix.nd; ++d) {
    ix.sizes[d] = sizes[d];
    ix.strides[0][d] = strides0[d];
    ix.strides[1][d] = strides1[d];
  }
  return ix;
}

namespace {

// Same-dtype copies move raw bits of the element's width.
template <class Bits>
__global__ void copy_bits_kernel(Bits* dst, const Bits* src, Indexer ix, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t d, s;
    ix.offsets(i, d, s);
    dst[d] = src[s];
  }
}

__device__ double load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::F32:
      return static_cast<const float*>(p)[i];
    case DType::F64:
      return static_cast<const double*>(p)[i];
    case DType::I32:
      return static_cast<const int32_t*>(p)[i];
    case DType::BF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::FP8:  // quantised KV-cache storage: its bytes, copied as they are
    case DType::INT8:
    case DType::INT4:
      return static_cast<const uint8_t*>(p)[i];
  }
  return 0;
}

__device__ void store(void* p, DType t, int64_t i, double v) {
  switch (t) {
    case DType::F32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case DType::F64:
      static_cast<double*>(p)[i] = v;
      break;
    case DType::I32:
      static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
      break;
    case DType::BF16:  // round to nearest even, as the CPU conversion does
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(static_cast<float>(v));
      break;
    case DType::FP8:
    case DType::INT8:
    case DType::INT4:
      static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v);
      break;
  }
}

__global__ void convert_kernel(void* dst, DType dt, const void* src, DType st, Indexer ix,
                               int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t d, s;
    ix.offsets(i, d, s);
    store(dst, dt, d, load(src, st, s));
  }
}

}  // namespace

void strided_copy(void* dst, DType dst_type, const Strides& dst_strides, const void* src,
                  DType src_type, const Strides& src_strides, const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  if (n == 0) return;
  if (dst_type == src_type && both_contiguous(sizes, dst_strides, src_strides)) {
    memcpy_on_device(dst, src, static_cast<size_t>(n) * dtype_size(dst_type));
    return;
  }
  const Indexer ix = make_indexer("copy", sizes, dst_strides, src_strides);
  const unsigned blocks = blocks_for(n);
  if (dst_type == src_type) {
    switch (dtype_size(dst_type)) {
      case 2:
        copy_bits_kernel<<<blocks, kThreads, 0, stream()>>>(
            static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), ix, n);
        break;
      case 4:
        copy_bits_kernel<<<blocks, kThreads, 0, stream()>>>(
            static_cast<uint32_t*>(dst), static_cast<const uint32_t*>(src), ix, n);
        break;
      default:
        copy_bits_kernel<<<blocks, kThreads, 0, stream()>>>(
            static_cast<uint64_t*>(dst), static_cast<const uint64_t*>(src), ix, n);
        break;
    }
  } else {
    convert_kernel<<<blocks, kThreads, 0, stream()>>>(dst, dst_type, src, src_type, ix, n);
  }
  KVLAB_LAUNCH_CHECK();
}

}  // namespace kvlab::cuda
