#include "autograd/backend/allocator.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <vector>

#include "autograd/error.h"

namespace kvlab {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::I32: return "i32";
    case DType::BF16: return "bf16";
  }
  return "?";
}

const char* device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

#ifndef KVLAB_WITH_CUDA
bool cuda_built() { return false; }
void check_device_available(Device d) {
  KVLAB_CHECK(d == Device::CPU, "kvlab was built without CUDA support (rebuild with -DKVLAB_CUDA=ON on a machine with nvcc)");
}
#endif

namespace {

// Caching host allocator: 64-byte aligned blocks (AVX-512 friendly), rounded up to a size
// class; freed blocks go to a per-size free list instead of back to the system.
class CachingCpuAllocator final : public Allocator {
 public:
  ~CachingCpuAllocator() override { release_cached(); }

  void* allocate(size_t nbytes) override {
    const size_t size = round_up(nbytes);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.requests;
    stats_.bytes_in_use += size;
    if (stats_.bytes_in_use > stats_.peak_bytes_in_use) stats_.peak_bytes_in_use = stats_.bytes_in_use;
    auto it = free_.find(size);
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      stats_.bytes_cached -= size;
      return p;
    }
    ++stats_.raw_allocs;
    void* p = std::aligned_alloc(64, size);
    if (p == nullptr) {
      stats_.bytes_in_use -= size;
      KVLAB_CHECK(false, "cpu allocator: out of memory allocating ", nbytes, " bytes");
    }
    return p;
  }

  void deallocate(void* ptr, size_t nbytes) override {
    if (ptr == nullptr) return;
    const size_t size = round_up(nbytes);
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_in_use -= size;
    stats_.bytes_cached += size;
    free_[size].push_back(ptr);
  }

  AllocatorStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  void release_cached() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, blocks] : free_)
      for (void* p : blocks) std::free(p);
    free_.clear();
    stats_.bytes_cached = 0;
  }

 private:
  // Size classes: multiples of 64 bytes up to 4 KiB, then quarter powers of two, so a block
  // is at most 25% larger than asked and reuse across nearby sizes is likely.
  static size_t round_up(size_t n) {
    if (n == 0) n = 1;
    if (n <= 4096) return (n + 63) / 64 * 64;
    size_t p = 4096;
    while (p < n) p <<= 1;
    const size_t q = p / 8;  // four steps between p/2 and p
    return (n + q - 1) / q * q;
  }

  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;
  AllocatorStats stats_;
};

}  // namespace

#ifndef KVLAB_WITH_CUDA
Allocator& allocator_for(Device d) {
  check_device_available(d);
  static CachingCpuAllocator cpu;
  return cpu;
}
#else
Allocator& cuda_allocator();  // autograd/backend/cuda/
Allocator& allocator_for(Device d) {
  static CachingCpuAllocator cpu;
  if (d == Device::CPU) return cpu;
  check_device_available(d);
  return cuda_allocator();
}
#endif

}  // namespace kvlab
