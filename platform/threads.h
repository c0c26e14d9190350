#pragma once
// How long idle OpenMP threads spin before they sleep. libgomp's default (GOMP_SPINCOUNT
// 300000, some milliseconds) is right on an idle machine but ruinous on a busy one: a thread
// spinning at a barrier burns the time slice its partner needs, and every one of the hundreds
// of parallel regions in a training step then waits for the scheduler
// (docs/bench-log/code-figures.md).
// libgomp reads the setting once, when it loads, so the programs call this first thing in
// main(): when neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY is set, it sets GOMP_SPINCOUNT and
// re-executes the program (a user's own setting is always kept).
namespace kvlab {

constexpr const char* kDefaultSpinCount = "1000";

void apply_thread_wait_policy(char** argv);

}  // namespace kvlab
