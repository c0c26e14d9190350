// backend/allocator.cpp: the caching CPU allocator.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "autograd/backend/allocator.h"
#include "tests/autograd/gradcheck.h"

namespace {

using namespace kvlab;

AllocatorStats cpu_stats() { return allocator_for(Device::CPU).stats(); }

TEST(Allocator, RepeatingSizesStopReachingTheSystem) {
  const std::vector<Shape> shapes = {{7}, {100}, {3, 17}, {1000}, {64, 65}, {300, 1000}, {5}};
  auto step = [&]() {
    std::vector<Tensor> live;
    for (const Shape& s : shapes) live.push_back(Tensor::empty(s));
    for (const Shape& s : shapes) live.push_back(Tensor::zeros(s, DType::F64));
  };
  step();
  step();  // warm
  const AllocatorStats warm = cpu_stats();
  for (int i = 0; i < 10; ++i) step();
  const AllocatorStats after = cpu_stats();
  EXPECT_EQ(after.raw_allocs, warm.raw_allocs);
  EXPECT_EQ(after.requests, warm.requests + 10 * 2 * shapes.size());
}

TEST(Allocator, TrainingStepLoopStopsReachingTheSystem) {
  Generator gen(1);
  Tensor w = kvtest::param({16, 24}, gen, DType::F32), b = kvtest::param({16}, gen, DType::F32);
  Tensor ln_w = kvtest::param({16}, gen, DType::F32), ln_b = kvtest::param({16}, gen, DType::F32);
  Tensor x = kvtest::randn({2, 5, 24}, gen, DType::F32);
  Tensor targets = kvtest::random_ids({2, 5}, 16, gen);
  auto step = [&]() {
    for (Tensor* p : {&w, &b, &ln_w, &ln_b}) p->zero_grad();
    Tensor h = gelu(layer_norm(linear(x, w, b), ln_w, ln_b));
    cross_entropy(h, targets).backward();
  };
  step();
  step();
  step();
  const AllocatorStats warm = cpu_stats();
  for (int i = 0; i < 5; ++i) step();
  EXPECT_EQ(cpu_stats().raw_allocs, warm.raw_allocs);
}

TEST(Allocator, BytesInUseReturnToBaseline) {
  const AllocatorStats base = cpu_stats();
  {
    Tensor a = Tensor::empty({1000});
    Tensor b = Tensor::zeros({17, 33}, DType::F64);
    Tensor c = b.clone();
    Tensor v = transpose(c, 0, 1);  // a view holds no new bytes
    const AllocatorStats mid = cpu_stats();
    EXPECT_GE(mid.bytes_in_use, base.bytes_in_use + 4000 + 2 * 17 * 33 * 8);
    EXPECT_GE(mid.peak_bytes_in_use, mid.bytes_in_use);
    c = Tensor();  // v still holds the storage
    EXPECT_EQ(cpu_stats().bytes_in_use, mid.bytes_in_use);
  }
  const AllocatorStats end = cpu_stats();
  EXPECT_EQ(end.bytes_in_use, base.bytes_in_use);
  EXPECT_GE(end.bytes_cached, 4000u);  // freed blocks are kept for reuse
}

TEST(Allocator, SizeClassesAndAlignment) {
  for (int64_t n : {1, 63, 64, 65, 1000, 4096, 4097, 5000, 100000, 1 << 20, (1 << 20) + 1}) {
    const size_t before = cpu_stats().bytes_in_use;
    Tensor t = Tensor::empty({n}, DType::I32);
    const size_t nbytes = static_cast<size_t>(n) * 4;
    const size_t used = cpu_stats().bytes_in_use - before;
    EXPECT_GE(used, nbytes) << n;
    EXPECT_LE(used, std::max<size_t>(nbytes + 63, nbytes + nbytes / 4)) << n;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % 64, 0u) << n;
  }
  // An empty tensor still gets a valid (tiny) block.
  Tensor e = Tensor::empty({0});
  EXPECT_NE(e.storage()->data(), nullptr);
}

// The VmFlags of the mapping that holds address p (/proc/self/smaps), or "" when not found.
std::string vm_flags_at(const void* p) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream range(line);
    if (range >> std::hex >> lo >> dash >> hi && dash == '-') inside = lo <= at && at < hi;
    if (inside && line.starts_with("VmFlags:")) return line;
  }
  return "";
}

TEST(Allocator, LargeBlocksStartOnHugePagesAndAskForThem) {
  const Tensor small = Tensor::empty({100000});  // 400 KB: no change
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.raw_data()) % 64, 0u);
  const int64_t n = (5 << 20) / 4;  // 5 MiB of f32
  const Tensor big = Tensor::empty({n});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.raw_data()) % (2 << 20), 0u);
  if (!std::filesystem::exists("/sys/kernel/mm/transparent_hugepage/enabled"))
    GTEST_SKIP() << "this system has no transparent huge pages";
  const std::string flags = vm_flags_at(big.raw_data());
  ASSERT_FALSE(flags.empty()) << "no mapping in /proc/self/smaps holds the block";
  EXPECT_NE(flags.find(" hg"), std::string::npos) << flags;  // madvise(MADV_HUGEPAGE)
}

TEST(Allocator, ReleaseCachedReturnsBlocks) {
  Allocator& a = allocator_for(Device::CPU);
  { Tensor t = Tensor::empty({12345}); }
  EXPECT_GT(a.stats().bytes_cached, 0u);
  a.release_cached();
  EXPECT_EQ(a.stats().bytes_cached, 0u);
  const uint64_t raw = a.stats().raw_allocs;
  { Tensor t = Tensor::empty({12345}); }
  EXPECT_EQ(a.stats().raw_allocs, raw + 1);  // the cache was emptied: a fresh block
  { Tensor t = Tensor::empty({12345}); }
  EXPECT_EQ(a.stats().raw_allocs, raw + 1);  // and now reused
}

TEST(Allocator, FillCachedReachesTheNextUserOfABlock) {
  { Tensor t = Tensor::zeros({1000}); }  // its block goes back to the cache
  allocator_for(Device::CPU).fill_cached(0xFF);
  const Tensor reused = Tensor::empty({1000});
  for (float x : reused.to_vector<float>()) ASSERT_TRUE(std::isnan(x));
}

TEST(Allocator, CudaAllocatorUnavailableWithoutCuda) {
  if (cuda_built()) GTEST_SKIP() << "this build carries the CUDA backend";
  EXPECT_TRUE(
      kvtest::throws_with([] { allocator_for(Device::CUDA); }, {"built without CUDA support"}));
}

}  // namespace
