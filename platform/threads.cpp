#include "platform/threads.h"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <vector>

namespace kvlab {

namespace {
//  With OMP_PROC_BIND (or OMP_PLACES) set, libgomp binds the first thread to the first place when
// it loads, and that binding outlives execv: the program would start on the first place's CPUs
// alone, every thread on one CPU (docs/bench-log/code-figures.md). So the process gets every
// place's CPUs back first; libgomp then binds
// afresh in the new program. Without places (no binding asked for) nothing was narrowed.
void unbind_from_first_place() {
  const int places = omp_get_num_places();
  if (places <= 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> ids;
  for (int p = 0; p < places; ++p) {
    ids.resize(static_cast<size_t>(omp_get_place_num_procs(p)));
    omp_get_place_proc_ids(p, ids.data());
    for (const int id : ids)
      if (id >= 0 && id < CPU_SETSIZE) CPU_SET(id, &set);
  }
  sched_setaffinity(0, sizeof(set), &set);  // on failure the program runs as before
}

}  // namespace

void apply_thread_wait_policy(char** argv) {
  if (std::getenv("GOMP_SPINCOUNT") != nullptr || std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("GOMP_SPINCOUNT", kDefaultSpinCount, 1);
  unbind_from_first_place();
  execv("/proc/self/exe", argv);  // returns only on failure: then run with the default policy
}

}  // namespace kvlab
