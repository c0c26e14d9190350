#pragma once
// Splitting a loop over the OpenMP threads only when it is worth it. An inactive region
// (`omp parallel if(false)`) still costs ~1-2 us to enter, which a decode step would pay on
// every one of its ~100 small ops, and OpenBLAS called inside one starts a nested team. So
// small loops run inline, outside any region.
#include <omp.h>

#include <cstdint>

namespace kvlab::cpu {

// Below this many elements (or rows x columns) a kernel runs on the calling thread.
constexpr int64_t kParallelMin = 1 << 15;

// body(begin, end) over [0, n): one contiguous chunk per thread when work > kParallelMin,
// else one call on the calling thread. Chunks depend only on n and the thread count, so
// results are deterministic for a fixed thread count.
template <class F>
inline void parallel_range(int64_t n, int64_t work, F&& body) {
  if (work <= kParallelMin || n <= 1 || omp_get_max_threads() == 1) {
    body(int64_t{0}, n);
    return;
  }
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    body(n * t / nt, n * (t + 1) / nt);
  }
}

}  // namespace kvlab::cpu
