#pragma once
// The machine's CPU, as benchmark and ablation results record it.
#include <fstream>
#include <string>

namespace kvlab {

// The CPU's model name from /proc/cpuinfo ("model name"; "Model" on some ARM systems), or
// "unknown" where it gives none.
inline std::string host_cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("model name", 0) != 0 && line.rfind("Model", 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const auto start = line.find_first_not_of(" \t", colon + 1);
    return start == std::string::npos ? "unknown" : line.substr(start);
  }
  return "unknown";
}

}  // namespace kvlab
