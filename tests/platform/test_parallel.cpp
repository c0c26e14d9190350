// platform/parallel.h: the fused decode step's SpinBarrier. No thread may leave a crossing
// before every thread has arrived at it, and every write made before it must be seen after
// it, also when a waiter has spun long enough to fall back to yielding.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "platform/parallel.h"

namespace kvlab {
namespace {

// `threads` threads cross the barrier twice a round: before the first crossing each writes
// the round into its slot (one of them late: it sleeps `delay` first), after it each reads
// every slot; the second crossing keeps the next round's writes from racing those reads.
// Returns how many reads saw another round.
int stale_reads(cpu::SpinBarrier& barrier, int threads, int rounds,
                std::chrono::microseconds delay) {
  std::vector<int> slot(static_cast<size_t>(threads), -1);
  std::atomic<int> stale{0};
  auto body = [&](int t) {
    for (int r = 0; r < rounds; ++r) {
      if (r % threads == t) std::this_thread::sleep_for(delay);
      slot[static_cast<size_t>(t)] = r;
      barrier.wait();
      for (int s : slot) stale += s != r;
      barrier.wait();
    }
  };
  std::vector<std::thread> team;
  for (int t = 0; t < threads; ++t) team.emplace_back(body, t);
  for (auto& th : team) th.join();
  return stale.load();
}

TEST(SpinBarrier, NoThreadLeavesBeforeAllArrive) {
  cpu::SpinBarrier barrier;
  for (const int threads : {2, 3, 4}) {
    barrier.reset(threads);
    EXPECT_EQ(stale_reads(barrier, threads, 200, std::chrono::microseconds(0)), 0)
        << threads << " threads";
    // A late thread: the others wait past their spinning, into yielding.
    EXPECT_EQ(stale_reads(barrier, threads, 12, std::chrono::microseconds(2000)), 0)
        << threads << " threads, one late";
  }
}

}  // namespace
}  // namespace kvlab
