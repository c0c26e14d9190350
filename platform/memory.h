#pragma once
// The machine's physical memory, for the checks that refuse work far past it up front
// (a model, a corpus, a batch) instead of growing until the system kills the process.
#include <unistd.h>

namespace kvlab {

// Bytes of physical memory, or 0 where the system does not say.
inline double host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
}

}  // namespace kvlab
