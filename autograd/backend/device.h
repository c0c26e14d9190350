#pragma once
// Element types and devices: the vocabulary shared by backends and tensors.
#include <cstddef>
#include <cstdint>

namespace kvlab {

// f32 is the working type, f64 serves gradient checks and references, i32 holds token ids,
// bf16 is storage: the GPU backend's rounded GEMM operands, and KV caches.
enum class DType : uint8_t { F32, F64, I32, BF16 };
enum class Device : uint8_t { CPU, CUDA };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::I32: return 4;
    case DType::BF16: return 2;
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
