#include "autograd/backend/allocator.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

#include "platform/error.h"

namespace kvlab {

const char* device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

#ifndef KVLAB_WITH_CUDA
bool cuda_built() { return false; }
void check_device_available(Device d) {
  KVLAB_CHECK(
      d == Device::CPU,
      "kvlab was built without CUDA support (rebuild with -DKVLAB_CUDA=ON on a machine with nvcc)");
}
#endif

void* CachingAllocator::allocate(size_t nbytes) {
  const size_t size = cached_block_size(nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.requests;
  auto it = free_.find(size);
  void* p = nullptr;
  if (it != free_.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
    stats_.bytes_cached -= size;
  } else {
    ++stats_.raw_allocs;
    p = raw_alloc_(size);
    if (p == nullptr && stats_.bytes_cached > 0) {  // give the cache back, then try again
      for (auto& [sz, blocks] : free_)
        for (void* b : blocks) raw_free_(b);
      free_.clear();
      stats_.bytes_cached = 0;
      p = raw_alloc_(size);
    }
    KVLAB_CHECK(p != nullptr, name_, " allocator: out of memory allocating ", nbytes, " bytes (",
                stats_.bytes_in_use, " bytes in use)");
  }
  stats_.bytes_in_use += size;
  if (stats_.bytes_in_use > stats_.peak_bytes_in_use)
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
  return p;
}

void CachingAllocator::deallocate(void* ptr, size_t nbytes) {
  if (ptr == nullptr) return;
  const size_t size = cached_block_size(nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_in_use -= size;
  stats_.bytes_cached += size;
  free_[size].push_back(ptr);
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingAllocator::release_cached() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [size, blocks] : free_)
    for (void* p : blocks) raw_free_(p);
  free_.clear();
  stats_.bytes_cached = 0;
}

void CachingAllocator::fill_cached(unsigned char byte) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [size, blocks] : free_)
    for (void* p : blocks) raw_fill_(p, byte, size);
}

namespace {
// Host blocks are 64-byte aligned (AVX-512 friendly). A block of 2 MiB or more starts on a
// 2 MiB boundary and asks for transparent huge pages over its whole 2 MiB pages: a kernel that
// streams through megabytes (a decode step's packed weights) then misses the TLB on one page
// in 512 and its hardware prefetch runs across 4 KiB boundaries (docs/bench-log/code-figures.md
// has the measurement). Where the system has no
// transparent huge pages the advice fails and the block stays as it is.
constexpr size_t kHugePage = size_t{2} << 20;
void* cpu_raw_alloc(size_t n) {
  if (n < kHugePage) return std::aligned_alloc(64, n);
  void* p = std::aligned_alloc(kHugePage, (n + kHugePage - 1) / kHugePage * kHugePage);
  if (p != nullptr) madvise(p, n / kHugePage * kHugePage, MADV_HUGEPAGE);
  return p;
}
void cpu_raw_free(void* p) { std::free(p); }
void cpu_raw_fill(void* p, unsigned char byte, size_t n) { std::memset(p, byte, n); }
}  // namespace

#ifndef KVLAB_WITH_CUDA
Allocator& allocator_for(Device d) {
  check_device_available(d);
  static CachingAllocator cpu("cpu", cpu_raw_alloc, cpu_raw_free, cpu_raw_fill);
  return cpu;
}
#else
Allocator& cuda_allocator();  // autograd/backend/cuda/runtime.cu
Allocator& allocator_for(Device d) {
  static CachingAllocator cpu("cpu", cpu_raw_alloc, cpu_raw_free, cpu_raw_fill);
  if (d == Device::CPU) return cpu;
  check_device_available(d);
  return cuda_allocator();
}
#endif

}  // namespace kvlab
