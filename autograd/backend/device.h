#pragma once
// Element types and devices: the vocabulary shared by backends and tensors.
#include <cstddef>
#include <cstdint>

#include "platform/formats.h"

namespace kvlab {

// DType (a tensor's element type: platform/formats.h) is the table's subset of formats with the
// kTensorElement role. f32 is the working type, f64 serves gradient checks and references, i32
// holds token ids, bf16 is storage: the GPU backend's rounded GEMM operands, and KV caches. FP8,
// INT8 and INT4 are KV-cache storage only, on the CPU: a tensor of them holds bytes (dtype_size
// 1), each (position, KV head) row of head_size values in kv_row_bytes(dtype, head_size) of
// them, the row's scales included (platform/kv_rows.h).
enum class Device : uint8_t { CPU, CUDA };

const char* device_name(Device d);

// True when this build carries the CUDA backend.
bool cuda_built();
// Throws kvlab::Error when `d` cannot be used in this build or on this machine.
void check_device_available(Device d);

}  // namespace kvlab
