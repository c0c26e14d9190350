#include "apps/train_progress.h"

#include <atomic>
#include <csignal>
#include <cstdio>

#include "apps/progress.h"

namespace kvlab {

namespace {
std::atomic<bool> g_stop{false};
extern "C" void on_sigint(int) { g_stop.store(true); }
}  // namespace

bool train_with_progress(Trainer& trainer, const std::string& label) {
  g_stop.store(false);
  auto previous = std::signal(SIGINT, on_sigint);
  const TrainConfig& cfg = trainer.config();
  ProgressBar bar(label, cfg.iters, "step");
  double last_val = trainer.best_val_loss();
  const bool done = trainer.run(
      [&](const StepRecord& r) {
        if (r.val_loss) last_val = *r.val_loss;
        char status[160];
        std::snprintf(status, sizeof status, "loss %.4f | val %.4f | %.1fk tok/s", r.train_loss,
                      last_val, r.tokens_per_s / 1000.0);
        bar.update(r.step, status, r.val_loss.has_value());
        return true;
      },
      &g_stop);
  bar.finish();
  std::signal(SIGINT, previous);
  if (!done) std::fprintf(stderr, "%s: stopped at step %lld, checkpoint saved\n", label.c_str(),
                          static_cast<long long>(trainer.step()));
  return done;
}

}  // namespace kvlab
