#pragma once
// Element types and devices: the vocabulary shared by backends and tensors.
#include <cstddef>
#include <cstdint>

namespace kvlab {

// f32 is the working type, f64 serves gradient checks and references, i32 holds token ids,
// bf16 is storage: the GPU backend's rounded GEMM operands, and KV caches. FP8, INT8 and INT4
// are KV-cache storage only, on the CPU: a tensor of them holds bytes (dtype_size 1), each
// (position, KV head) row of head_size values in kv_row_bytes(dtype, head_size) of them, the
// row's scales included (backend/kv_format.h).
enum class DType : uint8_t { F32, F64, I32, BF16, FP8, INT8, INT4 };
enum class Device : uint8_t { CPU, CUDA };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::I32: return 4;
    case DType::BF16: return 2;
    case DType::FP8:
    case DType::INT8:
    case DType::INT4: return 1;
  }
  return 0;
}
const char* dtype_name(DType t);
const char* device_name(Device d);

// True when this build carries the CUDA backend.
bool cuda_built();
// Throws kvlab::Error when `d` cannot be used in this build or on this machine.
void check_device_available(Device d);

}  // namespace kvlab
