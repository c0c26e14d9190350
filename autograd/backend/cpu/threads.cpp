#include "autograd/backend/cpu/threads.h"

#include <unistd.h>

#include <cstdlib>

namespace kvlab {

void apply_thread_wait_policy(char** argv) {
  if (std::getenv("GOMP_SPINCOUNT") != nullptr || std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("GOMP_SPINCOUNT", kDefaultSpinCount, 1);
  execv("/proc/self/exe", argv);  // returns only on failure: then run with the default policy
}

}  // namespace kvlab
