#pragma once
// The sweep's training phase: every run trained (or reused, or resumed) in its own folder,
// by one process in plan order, or by the ranks of an MPI job (mpirun, srun), each taking the
// next unclaimed run, longest first, as it becomes free. A run's folder is written only by the
// process holding its lock (OutputDirLock), which is how a rank claims it; on a shared file
// system the ranks may be on several machines.
#include <vector>

#include "apps/ablate/ablate.h"
#include "train/comm.h"
#include "train/trainer.h"

namespace kvlab {

// Throws Interrupted on Ctrl-C with the runs done so far kept, and kvlab::Error for a run
// folder trained with another config. With `comm` of several ranks every rank must call it;
// rank 0 returns once every run has finished (it measures them next), the others once no run
// is left to claim. Each rank writes <run>/.claim (rank, host, pid, first step) before it
// trains a run: rank 0 reads the sweep's figures from them, and a rerun names the rank that
// left a run unfinished. stats: on rank 0 the whole sweep's; elsewhere the rank's own.
// ranks_per_run > 1 (dividing the ranks): each run is trained data-parallel by a group of that
// many consecutive ranks, the group's first rank claiming; the runs' batch_size is then each
// rank's (plan_ablation divides the sweep's by it).
void train_runs(const std::vector<TrainConfig>& runs, AblateStats& stats,
                Communicator* comm = nullptr, int ranks_per_run = 1);

}  // namespace kvlab
