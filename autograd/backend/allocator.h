#pragma once
// Memory for tensors. Every Storage takes its bytes from the allocator of its device.
#include <cstddef>
#include <cstdint>

#include "autograd/backend/device.h"

namespace kvlab {

struct AllocatorStats {
  uint64_t requests = 0;     // allocate() calls
  uint64_t raw_allocs = 0;   // calls that reached the system allocator (cache misses)
  size_t bytes_in_use = 0;   // handed out and not yet returned
  size_t bytes_cached = 0;   // returned and kept for reuse
  size_t peak_bytes_in_use = 0;
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t nbytes) = 0;
  virtual void deallocate(void* ptr, size_t nbytes) = 0;
  virtual AllocatorStats stats() const = 0;
  // Gives every cached block back to the system.
  virtual void release_cached() = 0;
};

// The allocator of a device. The CPU one caches freed blocks by size, so a loop whose shapes
// repeat (a training step, a decode step) reaches the system allocator only on its first pass.
Allocator& allocator_for(Device d);

}  // namespace kvlab
