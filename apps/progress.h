#pragma once
// A one-line progress bar on stderr: step i of n, rate, ETA and a free-form status. Redrawn
// in place on a terminal; on a pipe or file it prints a plain line at most every few seconds
// (the first a few seconds in, unless forced: a short task leaves no line).
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

namespace kvlab {

class ProgressBar {
 public:
  // `first`: units done before this bar started (a resumed run); rate and ETA count only the
  // units done since.
  ProgressBar(std::string label, int64_t total, std::string unit = "it", int64_t first = 0)
      : label_(std::move(label)),
        unit_(std::move(unit)),
        total_(total),
        first_(first),
        tty_(isatty(2) != 0),
        start_(Clock::now()),
        last_(tty_ ? start_ - std::chrono::hours(1) : start_) {}

  struct Rate {
    double per_s = 0;  // units per second since the start
    double eta_s = 0;  // seconds left at that rate
  };
  static Rate rate(int64_t done, int64_t first, int64_t total, double elapsed_s) {
    Rate r;
    if (elapsed_s > 0 && done > first) r.per_s = static_cast<double>(done - first) / elapsed_s;
    if (r.per_s > 0) r.eta_s = static_cast<double>(total - done) / r.per_s;
    return r;
  }

  // `done` units finished; `status` is appended (e.g. "loss 1.234 | 21.3k tok/s").
  void update(int64_t done, const std::string& status, bool force = false) {
    const auto now = Clock::now();
    const double since = std::chrono::duration<double>(now - last_).count();
    if (!force && since < (tty_ ? 0.1 : 5.0) && done < total_) return;
    last_ = now;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const Rate r = rate(done, first_, total_, elapsed);
    char tail[768];
    std::snprintf(tail, sizeof tail, " %lld/%lld | %.1f %s/s | %s elapsed, ETA %s%s%s",
                  static_cast<long long>(done), static_cast<long long>(total_), r.per_s,
                  unit_.c_str(), clock(elapsed).c_str(), clock(r.eta_s).c_str(),
                  status.empty() ? "" : " | ", status.c_str());
    // The bar graphic gives way first on a narrow terminal, then the end of the line.
    const int columns = tty_ ? terminal_columns() : 0;
    const int room = columns - 1 - static_cast<int>(label_.size() + std::strlen(tail) + 3);
    const int width = columns > 0 ? std::min(24, room) : 24;
    std::string line = label_;
    if (width >= 5) {
      const int filled = total_ > 0 ? static_cast<int>(width * done / total_) : width;
      std::string bar(static_cast<size_t>(filled), '#');
      bar.resize(static_cast<size_t>(width), '.');
      line += " [" + bar + "]";
    }
    line += tail;
    if (tty_)
      std::fprintf(stderr, "\r\033[K%s", fit(line, columns).c_str());
    else
      std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  }
  // `line` cut to fewer than `columns` characters (a terminal's width; 0: unknown, kept whole),
  // never inside a UTF-8 character: a line that wraps cannot be redrawn in place.
  static std::string fit(std::string line, int columns) {
    if (columns <= 1 || line.size() < static_cast<size_t>(columns)) return line;
    size_t cut = static_cast<size_t>(columns) - 1;
    while (cut > 0 && (static_cast<unsigned char>(line[cut]) & 0xC0) == 0x80) --cut;
    line.resize(cut);
    return line;
  }
  void finish() {
    if (tty_) std::fputc('\n', stderr);
  }
  // Clears the bar's line on a terminal.
  void erase() {
    if (tty_) std::fputs("\r\033[K", stderr);
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
  static int terminal_columns() {
    winsize w{};
    return ioctl(STDERR_FILENO, TIOCGWINSZ, &w) == 0 ? w.ws_col : 0;
  }
  std::string label_, unit_;
  int64_t total_, first_;
  bool tty_;
  Clock::time_point start_, last_;
};

// One bar per task in turn (a benchmark's settings): a task's first update starts its bar, and
// a result line or the end takes the bar's place. A bar never shows its task as complete: the
// caller's line says that.
class TaskBars {
 public:
  TaskBars(std::string prefix, std::string unit)
      : prefix_(std::move(prefix)), unit_(std::move(unit)) {}
  TaskBars(const TaskBars&) = delete;
  TaskBars& operator=(const TaskBars&) = delete;
  ~TaskBars() { end(); }  // an error's message, too, starts on a line of its own

  void update(const std::string& task, int64_t done, int64_t total) {
    if (!bar_ || task != task_) {
      end();
      bar_ = std::make_unique<ProgressBar>(prefix_ + task, total, unit_);
      task_ = task;
    }
    if (done < total) bar_->update(done, "");
  }
  // `text` on a line of its own, in the place of the bar being drawn.
  void line(const std::string& text) {
    end();
    std::fprintf(stderr, "%s\n", text.c_str());
  }

 private:
  void end() {
    if (bar_) bar_->erase();
    bar_.reset();
  }
  std::string prefix_, unit_, task_;
  std::unique_ptr<ProgressBar> bar_;
};

}  // namespace kvlab
