#pragma once
// Runs a Trainer with a progress bar on stderr and stops cleanly (checkpoint written) on
// Ctrl-C. Returns true when every step is done.
#include "train/trainer.h"

namespace kvlab {

bool train_with_progress(Trainer& trainer, const std::string& label);

}  // namespace kvlab
