#include "platform/blas_core.h"

#include <cblas.h>

#include <cstdlib>
#include <string_view>

// OpenBLAS picks its kernels in its library's constructor, from a table of CPU models, and falls
// back to its SSE3 (Prescott) kernels for a model it does not know: Debian 12's OpenBLAS 0.3.21
// does so on Intel's Emerald Rapids, where sgemm and training then run several times slower
// (docs/bench-log/code-figures.md). kvlab's own constructor runs after
// OpenBLAS's and before anything uses it: where OpenBLAS has fallen back, and the user has not
// named kernels, it names those for the CPU's widest vectors in OPENBLAS_CORETYPE (the variable
// OpenBLAS reads) and has OpenBLAS pick again.

// OpenBLAS's own pick, exported by its DYNAMIC_ARCH builds (Debian's): weak, so that a build
// without them links and keeps its kernels.
extern "C" void gotoblas_dynamic_init() __attribute__((weak));
extern "C" void gotoblas_dynamic_quit() __attribute__((weak));

namespace {

const char* named = nullptr;

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512cd");
}

// The kernels of the CPU's widest vectors where `core` is narrower, else nullptr.
const char* wider_core(std::string_view core) {
  if (has_avx512()) {
    if (core != "SkylakeX" && core != "Cooperlake" && core != "SapphireRapids")
      return __builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX";
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    if (core != "Haswell" && core != "Zen") return "Haswell";
  }
  return nullptr;
}

[[gnu::constructor]] void name_blas_core() {
  if (gotoblas_dynamic_init == nullptr || gotoblas_dynamic_quit == nullptr ||
      std::getenv("OPENBLAS_CORETYPE") != nullptr)
    return;
  const char* want = wider_core(openblas_get_corename());
  if (want == nullptr || setenv("OPENBLAS_CORETYPE", want, 0) != 0) return;
  gotoblas_dynamic_quit();
  gotoblas_dynamic_init();
  named = want;
}

}  // namespace

extern "C" const char* kvlab_blas_core_named() { return named; }

extern "C" const char* kvlab_blas_core_wider() { return wider_core(openblas_get_corename()); }

namespace kvlab {

const char* blas_config() { return openblas_get_config(); }

const char* blas_kernels() { return openblas_get_corename(); }

}  // namespace kvlab
