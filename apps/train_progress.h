#pragma once
// Runs a Trainer with a progress bar on stderr and stops cleanly (checkpoint written) on
// Ctrl-C. Returns true when every step is done.
#include "train/trainer.h"

namespace kvlab {

bool train_with_progress(Trainer& trainer, const std::string& label);

// The signal (SIGINT, or SIGUSR1 under mpirun) that stopped the last train_with_progress; 0 when
// none did. Commands exit with 128 + it, the shell's convention for a process a signal ended.
int stop_signal();

}  // namespace kvlab
