#include "apps/train_progress.h"

#include <atomic>
#include <csignal>
#include <cstdio>

#include "apps/progress.h"
#include "train/comm.h"
#include "train/output_dir.h"

namespace kvlab {

namespace {
std::atomic<bool> g_stop{false};
std::atomic<int> g_signal{0};
// The first signal asks for a clean stop (checkpoint, then exit); the default action comes
// back at once, so a second one ends the process immediately.
extern "C" void on_stop_signal(int sig) {
  g_signal.store(sig);
  g_stop.store(true);
  std::signal(sig, SIG_DFL);
}
}  // namespace

std::string step_status(const StepRecord& r, double last_val, bool parallel,
                        std::optional<double> last_accuracy) {
  char loss[32] = "-";  // step 0 trained nothing: no training loss
  if (r.step > 0) std::snprintf(loss, sizeof loss, "%.4f", r.train_loss);
  char accuracy[32] = "";  // a task's answers recalled
  if (last_accuracy) std::snprintf(accuracy, sizeof accuracy, " acc %.3f", *last_accuracy);
  char status[200];
  int n = std::snprintf(status, sizeof status, "loss %s | val %.4f%s | %.1fk tok/s", loss,
                        last_val, accuracy, r.tokens_per_s / 1000.0);
  if (parallel && r.step > 0 && n > 0 && n < static_cast<int>(sizeof status))
    std::snprintf(status + n, sizeof status - static_cast<size_t>(n), " | comm %.0f%%",
                  r.step_s > 0 ? 100.0 * r.comm_s / r.step_s : 0.0);
  return status;
}

int stop_signal() {
  const int sig = g_signal.load();
  return sig > 0 ? sig : SIGINT;
}

void clear_checkpoint_temporaries(const std::filesystem::path& dir, const std::string& who) {
  for (const std::string& name : remove_checkpoint_temporaries(dir))
    std::fprintf(stderr, "%s: removed %s, a checkpoint that a killed run was writing\n",
                 who.c_str(), name.c_str());
}

BpeProgress bpe_progress_bar(const std::string& label) {
  std::shared_ptr<ProgressBar> bar;  // made at the first merge, when the total is known
  return [label, bar](int64_t done, int64_t total) mutable {
    if (!bar) bar = std::make_shared<ProgressBar>(label, total, "merges");
    bar->update(done, detail::cat(total - done, " to go"));
    if (done == total) bar->finish();
  };
}

bool train_with_progress(Trainer& trainer, const std::string& label, bool rank_owns_run) {
  // A Trainer without the MPI communicator under mpirun -np N would run N identical copies
  // writing the same files, unless each rank was given a run of its own (kvlab ablate's).
  KVLAB_CHECK(rank_owns_run || trainer.world_size() > 1 || launcher_world_size() <= 1, label,
              ": this command does not train data-parallel, but mpirun started ",
              launcher_world_size(),
              " ranks that would each run it and write the same files; "
              "run it without mpirun (or with -np 1)");
  g_stop.store(false);
  g_signal.store(0);
  const bool parallel = trainer.world_size() > 1;
  const bool rank0 = trainer.rank() == 0;
  const TrainConfig& cfg = trainer.config();
  ProgressBar bar(label, cfg.iters, "step", trainer.step());
  // Restores the handlers and ends the bar's line however run() ends (an error included, so
  // its message starts on a line of its own).
  struct Scope {
    ProgressBar& bar;
    bool rank0, parallel;
    // Ctrl-C, and SIGTERM or SIGHUP (a scheduler, a closed terminal), stop cleanly with a
    // checkpoint. Under mpirun, Ctrl-C makes mpirun kill the job (the last checkpoint stays
    // intact); SIGUSR1, which mpirun forwards to every rank, stops it cleanly instead.
    void (*previous)(int) = std::signal(SIGINT, on_stop_signal);
    void (*previous_term)(int) = std::signal(SIGTERM, on_stop_signal);
    void (*previous_hup)(int) = std::signal(SIGHUP, on_stop_signal);
    void (*previous_usr1)(int) = parallel ? std::signal(SIGUSR1, on_stop_signal) : SIG_DFL;
    ~Scope() {
      if (rank0) bar.finish();
      std::signal(SIGINT, previous);
      std::signal(SIGTERM, previous_term);
      std::signal(SIGHUP, previous_hup);
      if (parallel) std::signal(SIGUSR1, previous_usr1);
    }
  };
  double last_val = trainer.best_val_loss();
  std::optional<double> last_accuracy;
  bool done = false;
  {
    Scope scope{bar, rank0, parallel};
    done = trainer.run(
        [&](const StepRecord& r) {
          if (!rank0) return true;  // rank 0 alone prints
          if (r.val_loss) last_val = *r.val_loss;
          if (r.val_accuracy) last_accuracy = r.val_accuracy;
          bar.update(r.step, step_status(r, last_val, parallel, last_accuracy),
                     r.val_loss.has_value());
          return true;
        },
        &g_stop);
  }
  if (!done && rank0)
    std::fprintf(stderr, "%s: stopped at step %lld, checkpoint saved\n", label.c_str(),
                 static_cast<long long>(trainer.step()));
  return done;
}

}  // namespace kvlab
