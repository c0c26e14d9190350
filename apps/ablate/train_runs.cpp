#include "apps/ablate/train_runs.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <span>
#include <thread>

#include "apps/progress.h"
#include "apps/train_progress.h"
#include "checkpoints/checkpoint.h"
#include "nn/gpt.h"
#include "platform/atomic_file.h"
#include "train/output_dir.h"

namespace kvlab {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string run_label(const TrainConfig& c, size_t i, size_t n) {
  return detail::cat("run ", i + 1, "/", n, " ", c.model.mla() ? "mla" : "kv", "=",
                     c.model.mla() ? c.model.kv_lora_rank : c.model.n_kv_head, " seed=", c.seed);
}

// Whether the run finished earlier; a final checkpoint of another config is an error.
bool finished(const TrainConfig& c) {
  const fs::path final_ckpt = fs::path(c.out_dir) / "final.h5";
  if (!fs::exists(final_ckpt)) return false;
  const Checkpoint done = load_checkpoint(final_ckpt, false);
  const auto diffs = config_differences(done.config, c.to_attrs());
  if (!diffs.empty()) {
    std::string msg;
    for (const auto& d : diffs) msg += (msg.empty() ? "" : "; ") + d;
    KVLAB_CHECK(false, "ablate: ", final_ckpt.string(),
                " was trained with a different config (checkpoint vs now): ", msg,
                ". Use another --out, or delete that folder to retrain");
  }
  return true;
}

// Trains run c in its folder, whose lock the caller holds, resuming from last.h5, data-parallel
// over `group` (every rank of it calls this; its rank 0 holds the lock and alone touches the
// folder). on_start sees the step it starts from before the first step. Returns the steps
// trained.
int64_t train_run(const TrainConfig& c, const std::string& label, bool rank_owns_run,
                  const std::shared_ptr<Communicator>& group,
                  const std::function<void(int64_t)>& on_start = {}) {
  const fs::path dir = c.out_dir, last = dir / "last.h5";
  if (group->rank() == 0) {
    clear_checkpoint_temporaries(dir, label);
    if (!fs::exists(last) && fs::exists(dir / "log.jsonl"))
      std::fprintf(stderr, "%s: starting over (its log.jsonl is of a run that saved no checkpoint)\n",
                   label.c_str());
  }
  Trainer trainer(c, group);
  if (fs::exists(last)) {
    try {
      trainer.resume(last);
    } catch (const Error& e) {  // another config or corpus than the run in that folder
      KVLAB_CHECK(false, "ablate: ", e.what(), ". Use another --out, or delete ", dir.string(),
                  " to retrain");
    }
  }
  const int64_t from = trainer.step();
  if (on_start) on_start(from);
  const bool done = train_with_progress(trainer, label, rank_owns_run);
  if (!done)
    throw Interrupted(detail::cat("ablate: interrupted during ", label,
                                  "; rerun the same command to continue where it stopped"),
                      stop_signal());
  return trainer.step() - from;
}

void train_serially(const std::vector<TrainConfig>& runs, AblateStats& stats) {
  using Clock = std::chrono::steady_clock;
  double train_s = 0;
  int trained_runs = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    const TrainConfig& c = runs[i];
    const std::string label = run_label(c, i, runs.size());
    if (finished(c)) {
      ++stats.runs_reused;
      std::fprintf(stderr, "%s: finished earlier, reusing %s/final.h5\n", label.c_str(),
                   c.out_dir.c_str());
      continue;
    }
    const int runs_left = static_cast<int>(runs.size() - i);
    if (trained_runs > 0)
      std::fprintf(stderr, "sweep: %d of %zu runs left, ETA %s\n", runs_left, runs.size(),
                   ProgressBar::clock(train_s / trained_runs * runs_left).c_str());
    // The run's own folder too, which `kvlab train --out` could be given.
    const OutputDirLock run_hold(c.out_dir, "ablate");
    const auto t0 = Clock::now();
    stats.steps_trained += train_run(c, label, false, local_communicator(), [&](int64_t from) {
      if (from > 0) ++stats.runs_resumed;
    });
    train_s += std::chrono::duration<double>(Clock::now() - t0).count();
    ++trained_runs;
  }
}

// --- the ranks of an MPI job --------------------------------------------------------------

std::string host_name() {
  char host[256] = {};
  return ::gethostname(host, sizeof host - 1) == 0 ? host : "unknown";
}

fs::path claim_file(const TrainConfig& c) { return fs::path(c.out_dir) / ".claim"; }

json read_claim(const TrainConfig& c) {
  std::ifstream in(claim_file(c));
  json j = json::parse(in, nullptr, false);
  return j.is_object() ? j : json();
}

// Runs in the order ranks take them: the most work first (parameters x tokens), so that
// the long ones do not start last; the plan's order among equals.
std::vector<size_t> longest_first(const std::vector<TrainConfig>& runs) {
  std::vector<size_t> order(runs.size());
  std::iota(order.begin(), order.end(), 0);
  auto work = [&](size_t i) {
    const TrainConfig& c = runs[i];
    return static_cast<double>(count_parameters(c.model)) * static_cast<double>(c.iters) *
           static_cast<double>(c.batch_size * c.grad_accum * c.model.block_size);
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return work(a) > work(b); });
  return order;
}

// Trains run i holding its lock, with the ranks of `group`: the claim written first, naming
// this rank.
int64_t train_claimed(const TrainConfig& c, const std::string& label, Communicator& comm,
                      const std::shared_ptr<Communicator>& group) {
  if (const json earlier = read_claim(c); !earlier.is_null())
    std::fprintf(stderr, "%s: left unfinished by rank %d of %d (pid %d on %s); taking it over\n",
                 label.c_str(), earlier.value("rank", -1), earlier.value("ranks", 0),
                 earlier.value("pid", 0), earlier.value("host", std::string("?")).c_str());
  return train_run(c, label, true, group, [&](int64_t from) {
    const json claim{{"rank", comm.rank()},        {"ranks", comm.world_size()},
                     {"ranks_per_run", group->world_size()},
                     {"host", host_name()},        {"pid", static_cast<int>(::getpid())},
                     {"from_step", from}};
    write_file_atomic(claim_file(c), claim.dump() + "\n", "ablate: the run's claim");
  });
}

// The runs group `group`'s rank 0 hands its other ranks (-1: none left), and whether it
// trains them: each is trained by the whole group, data-parallel.
void announce_run(Communicator& group, int64_t i) {
  group.broadcast(std::as_writable_bytes(std::span<int64_t>(&i, 1)), 0, "the group's next run");
}
void follow_group(const std::vector<TrainConfig>& runs, Communicator& comm,
                  const std::shared_ptr<Communicator>& group) {
  for (;;) {
    int64_t i = -1;
    group->broadcast(std::as_writable_bytes(std::span<int64_t>(&i, 1)), 0, "the group's next run");
    if (i < 0) return;
    const TrainConfig& c = runs[static_cast<size_t>(i)];
    train_run(c, detail::cat("rank ", comm.rank(), ": ", run_label(c, i, runs.size())), true,
              group);
  }
}

void train_on_ranks(const std::vector<TrainConfig>& runs, AblateStats& stats, Communicator& comm,
                    int ranks_per_run) {
  const int rank = comm.rank();
  // Each run is trained by a group of ranks_per_run consecutive ranks; its rank 0 claims.
  const std::shared_ptr<Communicator> group =
      ranks_per_run == 1 ? local_communicator() : comm.split(rank / ranks_per_run, "the run groups");
  const bool claims = group->rank() == 0;
  // Phase 1: what finished before this sweep, seen by every rank before any trains.
  std::vector<bool> done(runs.size()), before(runs.size());
  for (size_t i = 0; i < runs.size(); ++i) done[i] = before[i] = finished(runs[i]);
  if (const auto reused = std::count(before.begin(), before.end(), true); rank == 0 && reused > 0)
    std::fprintf(stderr, "sweep: %lld of %zu runs finished earlier, reusing them\n",
                 static_cast<long long>(reused), runs.size());
  comm.barrier("the sweep's start");
  // Phase 2: each free rank (group) claims the next run nobody holds. Rank 0 stays until
  // every run is done (a run whose rank died is free again: its lock went with the process;
  // rank 0 takes it over alone, so only when runs are not data-parallel).
  if (!claims) return follow_group(runs, comm, group);
  const std::vector<size_t> order = longest_first(runs);
  for (bool waiting = false;; waiting = true) {
    bool held_elsewhere = false;
    for (const size_t i : order) {
      if (done[i] || (done[i] = finished(runs[i]))) continue;
      const auto hold = OutputDirLock::try_acquire(runs[i].out_dir, "ablate");
      if (!hold) {
        held_elsewhere = true;
        continue;
      }
      if ((done[i] = finished(runs[i]))) continue;  // finished between the look and the lock
      const std::string label =
          detail::cat("rank ", rank, "/", comm.world_size(), ": ", run_label(runs[i], i, runs.size()));
      KVLAB_CHECK(!waiting || group->world_size() == 1, "ablate: ", label,
                  " was left unfinished by the group that held it; rerun the sweep to train it");
      if (group->world_size() > 1) announce_run(*group, static_cast<int64_t>(i));
      stats.steps_trained += train_claimed(runs[i], label, comm, group);
      done[i] = true;
    }
    if (!waiting && group->world_size() > 1) announce_run(*group, -1);  // the group is done
    if (!held_elsewhere || rank != 0) break;
    if (!waiting) std::fprintf(stderr, "rank 0: waiting for the runs the other ranks hold\n");
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  if (rank != 0) return;
  // Phase 3: the sweep's figures, from every run's claim.
  stats = AblateStats{};
  for (size_t i = 0; i < runs.size(); ++i) {
    if (before[i]) {
      ++stats.runs_reused;
      continue;
    }
    const int64_t from = read_claim(runs[i]).value("from_step", int64_t{0});
    stats.runs_resumed += from > 0 ? 1 : 0;
    stats.steps_trained += runs[i].iters - from;
  }
}

}  // namespace

void train_runs(const std::vector<TrainConfig>& runs, AblateStats& stats, Communicator* comm,
                int ranks_per_run) {
  const int ranks = comm == nullptr ? 1 : comm->world_size();
  KVLAB_CHECK(ranks_per_run >= 1 && ranks % ranks_per_run == 0, "ablate: ", ranks_per_run,
              " ranks per run for ", ranks, " ranks");
  if (ranks == 1)
    train_serially(runs, stats);
  else
    train_on_ranks(runs, stats, *comm, ranks_per_run);
}

}  // namespace kvlab
