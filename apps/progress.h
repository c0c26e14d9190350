#pragma once
// A one-line progress bar on stderr: step i of n, rate, ETA and a free-form status. Redrawn
// in place on a terminal; on a pipe or file it prints a plain line at most every few seconds.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

namespace kvlab {

class ProgressBar {
 public:
  ProgressBar(std::string label, int64_t total, std::string unit = "it")
      : label_(std::move(label)), unit_(std::move(unit)), total_(total), tty_(isatty(2) != 0),
        start_(Clock::now()), last_(start_ - std::chrono::hours(1)) {}

  // `done` units finished; `status` is appended (e.g. "loss 1.234 | 21.3k tok/s").
  void update(int64_t done, const std::string& status, bool force = false) {
    const auto now = Clock::now();
    const double since = std::chrono::duration<double>(now - last_).count();
    if (!force && since < (tty_ ? 0.1 : 5.0) && done < total_) return;
    last_ = now;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0;
    const double eta = rate > 0 ? static_cast<double>(total_ - done) / rate : 0;
    const int width = 24;
    const int filled = total_ > 0 ? static_cast<int>(width * done / total_) : width;
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(static_cast<size_t>(width), '.');
    std::fprintf(stderr, "%s%s [%s] %lld/%lld | %.1f %s/s | %s elapsed, ETA %s | %s%s",
                 tty_ ? "\r\033[K" : "", label_.c_str(), bar.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total_), rate,
                 unit_.c_str(), clock(elapsed).c_str(), clock(eta).c_str(), status.c_str(),
                 tty_ ? "" : "\n");
    std::fflush(stderr);
  }
  void finish() {
    if (tty_) std::fputc('\n', stderr);
  }
  static std::string clock(double s) {
    char buf[32];
    const long t = static_cast<long>(s + 0.5);
    if (t >= 3600) std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else std::snprintf(buf, sizeof buf, "%ld:%02ld", t / 60, t % 60);
    return buf;
  }

 private:
  using Clock = std::chrono::steady_clock;
  std::string label_, unit_;
  int64_t total_;
  bool tty_;
  Clock::time_point start_, last_;
};

}  // namespace kvlab
