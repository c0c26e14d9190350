#pragma once
// One call site for both backends: KVLAB_KERNEL(device, fn<T>(args...)) runs cpu::fn or
// cuda::fn, both declared once by the contract (backend/kernels.h). Without the CUDA backend
// only the CPU branch exists (the device was checked when the tensors were made).
#include "autograd/backend/kernels.h"
#ifdef KVLAB_WITH_CUDA
#define KVLAB_KERNEL(device, ...) \
  ((device) == ::kvlab::Device::CUDA ? ::kvlab::cuda::__VA_ARGS__ : ::kvlab::cpu::__VA_ARGS__)
#else
#define KVLAB_KERNEL(device, ...) ((void)(device), ::kvlab::cpu::__VA_ARGS__)
#endif
