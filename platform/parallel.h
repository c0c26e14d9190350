#pragma once
// Splitting a loop over the OpenMP threads only when it is worth it. An inactive region
// (`omp parallel if(false)`) still costs microseconds to enter, which a decode step would pay
// on every one of its small ops, and OpenBLAS called inside one starts a nested team. So
// small loops run inline, outside any region.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <span>
#include <thread>
#include <utility>
#include <vector>

// In kvlab::cpu, the namespace of the CPU kernels, which call these unqualified: the threads
// are the host CPU's, whichever layer splits its work over them.
namespace kvlab::cpu {

// A barrier for the threads of one parallel region, several times cheaper to cross than
// libgomp's `omp barrier` (docs/bench-log/code-figures.md); the fused decode step crosses one
// four or five times a layer. The last thread to arrive resets the count and
// advances the generation, which the others spin on. Like libgomp under the spin count kvlab
// sets (threads.h), a waiter spins kSpins pauses; after that it yields its core at each further
// check, so that on a busy machine it does not burn the time slice of the thread it waits
// for. reset() sets the number of threads: call it while no thread waits (before the region,
// or under `omp single`).
class SpinBarrier {
 public:
  void reset(int threads) {
    threads_ = threads;
    count_.store(0, std::memory_order_relaxed);
  }
  void wait() {
    // The generation this thread saw at its last crossing: it cannot advance again before
    // this thread arrives.
    const unsigned generation = generation_.load(std::memory_order_relaxed);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < kSpins)
        relax();
      else
        std::this_thread::yield();
    }
  }

 private:
  static constexpr int kSpins = 1000;
  static void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<unsigned> generation_{0};
  int threads_ = 1;
};

// Below this many elements (or rows x columns) a kernel runs on the calling thread.
constexpr int64_t kParallelMin = 1 << 15;

// body(begin, end) over [0, n): one contiguous chunk per thread when work > kParallelMin,
// else one call on the calling thread. Chunks depend only on n and the thread count, so
// results are deterministic for a fixed thread count.
template <class F>
inline void parallel_range(int64_t n, int64_t work, F&& body) {
  // Inside a parallel region (the fused decode step) a nested one would only add its cost.
  if (work <= kParallelMin || n <= 1 || omp_get_max_threads() == 1 || omp_in_parallel()) {
    body(int64_t{0}, n);
    return;
  }
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    body(n * t / nt, n * (t + 1) / nt);
  }
}

// Part `part` of `parts` of [0, n): blocks of the same size, a multiple of `multiple` (a
// kernel's tile), so the last parts may be shorter or empty. Depends only on its arguments.
inline std::pair<int64_t, int64_t> split_range(int64_t n, int64_t part, int64_t parts,
                                               int64_t multiple) {
  const int64_t block = ((n + parts - 1) / parts + multiple - 1) / multiple * multiple;
  const int64_t lo = std::min(n, part * block);
  return {lo, std::min(n, lo + block)};
}

// parallel_range in blocks of a multiple of `multiple` (a kernel's tile): body(begin, end)
// over [0, n), one block per thread, as many threads as there are tiles, when work >
// kParallelMin; else one call on the calling thread.
template <class F>
inline void parallel_blocks(int64_t n, int64_t multiple, int64_t work, F&& body) {
  const int64_t tiles = (n + multiple - 1) / multiple;
  if (work <= kParallelMin || tiles <= 1 || omp_get_max_threads() == 1 || omp_in_parallel()) {
    body(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads( \
    static_cast <int>(std::min <int64_t>(omp_get_max_threads(), tiles)))
  {
    const auto [lo, hi] = split_range(n, omp_get_thread_num(), omp_get_num_threads(), multiple);
    body(lo, hi);
  }
}

// Sum over arrays t (lengths[t] elements each) of chunk_sum(t, begin, end), taken over fixed
// 4096-element chunks of every array: all chunks in parallel (one region for all the arrays),
// their partial sums added in order within each array and the arrays' sums in order, so the
// result is the same for any thread count.
template <class F>
inline double ordered_chunk_sum_many(std::span<const int64_t> lengths, F&& chunk_sum) {
  constexpr int64_t kChunk = 4096;
  std::vector<int64_t> first{0};  // array t's chunks are [first[t], first[t + 1])
  int64_t total = 0;
  for (const int64_t n : lengths) {
    first.push_back(first.back() + (n + kChunk - 1) / kChunk);
    total += n;
  }
  std::vector<double> partial(static_cast<size_t>(first.back()));
  parallel_range(first.back(), total, [&](int64_t c0, int64_t c1) {
    size_t t =
        static_cast<size_t>(std::upper_bound(first.begin(), first.end(), c0) - first.begin()) - 1;
    for (int64_t c = c0; c < c1; ++c) {
      while (c >= first[t + 1]) ++t;
      const int64_t i0 = (c - first[t]) * kChunk;
      partial[static_cast<size_t>(c)] = chunk_sum(t, i0, std::min(lengths[t], i0 + kChunk));
    }
  });
  double sum = 0;
  for (size_t t = 0; t < lengths.size(); ++t) {
    double s = 0;
    for (int64_t c = first[t]; c < first[t + 1]; ++c) s += partial[static_cast<size_t>(c)];
    sum += s;
  }
  return sum;
}

// The same over one array [0, n): chunk_sum(begin, end).
template <class F>
inline double ordered_chunk_sum(int64_t n, F&& chunk_sum) {
  return ordered_chunk_sum_many(std::span<const int64_t>(&n, 1),
                                [&](size_t, int64_t i0, int64_t i1) { return chunk_sum(i0, i1); });
}

}  // namespace kvlab::cpu
