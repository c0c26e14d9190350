// platform/blas_core.cpp: OpenBLAS runs kernels made for the CPU's widest vectors, never
// narrower ones (its SSE3 fallback) on a CPU with AVX2 or AVX-512, and the kernels kvlab named
// are the ones it runs, so that nothing notes wider ones.
#include <cblas.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <string>

#include "platform/blas_core.h"

namespace kvlab {
namespace {

TEST(BlasCore, OpenBlasRunsTheKernelsOfTheCpusWidestVectors) {
  const char* named = kvlab_blas_core_named();
  if (named == nullptr && std::getenv("OPENBLAS_CORETYPE") != nullptr) {
    GTEST_SKIP() << "OPENBLAS_CORETYPE was set before kvlab started";
  }
  const std::string core = openblas_get_corename();
  if (named != nullptr) {
    EXPECT_EQ(core, named);
  }
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512cd");
  std::set<std::string> expected;
  if (avx512) {
    expected = {"SkylakeX", "Cooperlake", "SapphireRapids"};
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    expected = {"Haswell", "Zen"};
  } else {
    GTEST_SKIP() << "neither AVX2 nor AVX-512: any OpenBLAS core will do";
  }
  EXPECT_TRUE(expected.contains(core)) << "OpenBLAS runs its " << core << " kernels";
  EXPECT_EQ(kvlab_blas_core_wider(), nullptr) << "a note would offer " << kvlab_blas_core_wider();
}

}  // namespace
}  // namespace kvlab
