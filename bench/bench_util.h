#pragma once
// Small helpers shared by the benchmarks under bench/: a median timer, a plain-text table,
// machine information and JSON output. Header-only; nothing here knows about the engine.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "platform/blas_core.h"
#include "platform/cpu.h"

namespace kvlab::bench {

using Json = nlohmann::json;

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Keeps the compiler from discarding a computed value.
template <class T>
inline void keep(const T& v) {
  asm volatile("" : : "g"(&v) : "memory");
}

struct Timing {
  double median_s = 0;  // per call
  double min_s = 0;     // per call, fastest sample
  int samples = 0;      // timed samples (each of `inner` calls)
  int inner = 1;        // calls per sample
  Json json() const {
    return {{"median_s", median_s}, {"min_s", min_s}, {"samples", samples}, {"inner", inner}};
  }
};

struct TimerOptions {
  int reps = 11;               // timed samples; the median is reported
  int warmup = 2;              // untimed calls first (caches, allocator, thread pool)
  double min_sample_s = 2e-3;  // short calls are repeated within a sample up to this long
};

// Times several callables with their samples interleaved (f0, f1, ..., f0, f1, ...), so that
// a ratio of two medians compares the same stretches of a noisy machine. Each callable first
// runs `warmup` times untimed; then a sample runs it `inner` times, `inner` chosen once so that
// a sample lasts at least min_sample_s. Returns per-call times, one Timing per callable.
inline std::vector<Timing> time_interleaved(const std::vector<std::function<void()>>& fs,
                                            const TimerOptions& opt = {}) {
  const size_t n = fs.size();
  const int reps = std::max(opt.reps, 1);
  std::vector<int> inner(n, 1);
  for (size_t i = 0; i < n; ++i) {
    for (int w = 0; w < opt.warmup; ++w) fs[i]();
    const double t0 = now_s();
    fs[i]();
    const double one = std::max(now_s() - t0, 1e-9);
    inner[i] = std::clamp(static_cast<int>(std::ceil(opt.min_sample_s / one)), 1, 1 << 20);
  }
  std::vector<std::vector<double>> s(n);
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < n; ++i) {
      const double t0 = now_s();
      for (int k = 0; k < inner[i]; ++k) fs[i]();
      s[i].push_back((now_s() - t0) / inner[i]);
    }
  std::vector<Timing> out(n);
  for (size_t i = 0; i < n; ++i) {
    std::sort(s[i].begin(), s[i].end());
    const size_t m = s[i].size();
    out[i].median_s = m % 2 ? s[i][m / 2] : 0.5 * (s[i][m / 2 - 1] + s[i][m / 2]);
    out[i].min_s = s[i].front();
    out[i].samples = static_cast<int>(m);
    out[i].inner = inner[i];
  }
  return out;
}

// The median per-call time of one callable (see time_interleaved).
template <class F>
Timing time_median(F&& f, const TimerOptions& opt = {}) {
  return time_interleaved({std::function<void()>(std::forward<F>(f))}, opt)[0];
}

// Fixed-precision number formatting for table cells.
inline std::string fmt(double v, int precision = 2) {
  if (!std::isfinite(v)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", precision, v);
  return buf;
}

// A plain-text table: a title, a header row, then rows of cells; columns are right-aligned
// except the first.
class Table {
 public:
  Table(std::string title, std::vector<std::string> header)
      : title_(std::move(title)), header_(std::move(header)) {}
  void add_row(std::vector<std::string> row) {
    row.resize(header_.size());
    rows_.push_back(std::move(row));
  }
  void print(std::ostream& os = std::cout) const {
    std::vector<size_t> w(header_.size());
    for (size_t c = 0; c < header_.size(); ++c) {
      w[c] = header_[c].size();
      for (const auto& r : rows_) w[c] = std::max(w[c], r[c].size());
    }
    auto line = [&](const std::vector<std::string>& r) {
      for (size_t c = 0; c < r.size(); ++c) {
        const std::string pad(w[c] - r[c].size(), ' ');
        os << (c ? "  " : "") << (c ? pad + r[c] : r[c] + pad);
      }
      os << '\n';
    };
    os << '\n' << title_ << '\n';
    line(header_);
    size_t total = 0;
    for (size_t c = 0; c < w.size(); ++c) total += w[c] + (c ? 2 : 0);
    os << std::string(total, '-') << '\n';
    for (const auto& r : rows_) line(r);
    os.flush();
  }

 private:
  std::string title_;
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

inline std::string env_or(const char* name, const char* fallback = "(unset)") {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// Machine and thread setup, for the "machine" object of every benchmark's JSON.
inline Json machine_info() {
  Json env = Json::object();
  for (const char* name : {"OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "OMP_WAIT_POLICY",
                           "GOMP_SPINCOUNT", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE"})
    env[name] = env_or(name);
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  const std::time_t t = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  Json m = {{"cpu_model", host_cpu_model()},
            {"logical_cpus", std::thread::hardware_concurrency()},
            {"omp_max_threads", omp_get_max_threads()},
            {"openblas_config", kvlab::blas_config()},
            {"openblas_kernels", kvlab::blas_kernels()},
            {"env", env},
            {"hostname", host},
            {"date_utc", when}};
#if defined(__clang__)
  m["compiler"] = std::string("clang ") + __VERSION__;
#elif defined(__GNUC__)
  m["compiler"] = std::string("gcc ") + __VERSION__;
#endif
#ifdef NDEBUG
  m["ndebug"] = true;
#else
  m["ndebug"] = false;
#endif
  return m;
}

inline void print_machine(const Json& m, std::ostream& os = std::cout) {
  os << "cpu: " << m.value("cpu_model", "?") << ", " << m.value("logical_cpus", 0)
     << " logical CPUs, omp_get_max_threads() = " << m.value("omp_max_threads", 0) << '\n';
  os << "env:";
  for (const auto& [k, v] : m["env"].items()) os << ' ' << k << '=' << v.get<std::string>();
  os << '\n';
  if (!m.value("ndebug", true)) os << "warning: assertions are on (not a Release build)\n";
}

// Writes `j` to `path` (pretty-printed); returns false and says why on failure.
inline bool write_json(const std::string& path, const Json& j) {
  std::ofstream f(path);
  if (!f) {
    std::cerr << "cannot write " << path << '\n';
    return false;
  }
  f << j.dump(2) << '\n';
  return static_cast<bool>(f);
}

}  // namespace kvlab::bench
