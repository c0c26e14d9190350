#pragma once
// Memory for tensors. Every Storage takes its bytes from the allocator of its device.
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "autograd/backend/device.h"

namespace kvlab {

struct AllocatorStats {
  uint64_t requests = 0;    // allocate() calls
  uint64_t raw_allocs = 0;  // calls that reached the system allocator (cache misses)
  size_t bytes_in_use = 0;  // handed out and not yet returned
  size_t bytes_cached = 0;  // returned and kept for reuse
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
  // Fills every cached (free) block with `byte`. Tests use it so that an output a kernel
  // forgets to write is visible: 0xFF bytes are NaN in f32 and f64.
  virtual void fill_cached(unsigned char byte) = 0;
};

// Size class of a cached block: multiples of 64 bytes up to 4 KiB, then quarter powers of two,
// so a block is at most 25% larger than asked and reuse across nearby sizes is likely.
inline size_t cached_block_size(size_t n) {
  if (n == 0) n = 1;
  if (n <= 4096) return (n + 63) / 64 * 64;
  size_t p = 4096;
  while (p < n) p <<= 1;
  const size_t q = p / 8;  // four steps between p/2 and p
  return (n + q - 1) / q * q;
}

// Keeps freed blocks in per-size free lists over a device's raw allocation functions, so a loop
// whose shapes repeat (a training step, a decode step) reaches the system only on its first
// pass. When the raw allocator fails it gives the cache back and tries once more.
class CachingAllocator final : public Allocator {
 public:
  using RawAlloc = void* (*)(size_t nbytes);  // null when out of memory
  using RawFree = void (*)(void* ptr);
  using RawFill = void (*)(void* ptr, unsigned char byte, size_t nbytes);
  CachingAllocator(const char* name, RawAlloc raw_alloc, RawFree raw_free, RawFill raw_fill)
      : name_(name), raw_alloc_(raw_alloc), raw_free_(raw_free), raw_fill_(raw_fill) {}
  ~CachingAllocator() override { release_cached(); }
  void* allocate(size_t nbytes) override;
  void deallocate(void* ptr, size_t nbytes) override;
  AllocatorStats stats() const override;
  void release_cached() override;
  void fill_cached(unsigned char byte) override;

 private:
  const char* name_;
  RawAlloc raw_alloc_;
  RawFree raw_free_;
  RawFill raw_fill_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;
  AllocatorStats stats_;
};

// The allocator of a device. The CPU one caches freed blocks by size, so a loop whose shapes
// repeat (a training step, a decode step) reaches the system allocator only on its first pass.
Allocator& allocator_for(Device d);

}  // namespace kvlab
