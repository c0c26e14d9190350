#pragma once
// Runs a Trainer with a progress bar on stderr and stops cleanly (checkpoint written) on
// Ctrl-C, SIGTERM or SIGHUP. Returns true when every step is done. Under mpirun a trainer of
// one rank is refused unless rank_owns_run (each rank trains runs of its own: kvlab ablate).
#include <filesystem>
#include <optional>
#include <string>

#include "train/trainer.h"

namespace kvlab {

bool train_with_progress(Trainer& trainer, const std::string& label, bool rank_owns_run = false);

// A bar for learning a bpe vocabulary ("bpe ... 900/1791 merges ... | 891 to go"):
// TrainConfig::tokenizer_progress and kvlab tokenizer train.
BpeProgress bpe_progress_bar(const std::string& label);

// The bar's text after step r: "loss 2.1234 | val 2.2000 | 25.1k tok/s" (the loss "-" at step
// 0, which trained nothing), where val is the latest val loss (with " acc 0.950", a task's latest
// answer accuracy, where given), plus " | comm 12%" when `parallel`.
std::string step_status(const StepRecord& r, double last_val, bool parallel,
                        std::optional<double> last_accuracy = std::nullopt);

// The signal that stopped the last train_with_progress that returned false: the one this
// process received (SIGINT, SIGTERM, SIGHUP, or SIGUSR1 under mpirun), or SIGINT when another
// rank's stop ended it. Commands exit with 128 + it, the shell's convention for a process a
// signal ended.
int stop_signal();

// Removes the checkpoint temporaries a killed run left in `dir` (remove_checkpoint_temporaries;
// the caller holds the folder's lock) and says on stderr, after `who: `, what went.
void clear_checkpoint_temporaries(const std::filesystem::path& dir, const std::string& who);

// A command that a signal stopped after saving its work: main prints the message and exits
// with 128 + signal().
class Interrupted : public Error {
 public:
  Interrupted(const std::string& msg, int sig) : Error(msg), signal_(sig) {}
  int signal() const { return signal_; }

 private:
  int signal_;
};

}  // namespace kvlab
