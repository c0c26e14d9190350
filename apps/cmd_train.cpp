// kvlab train: one GPT on a corpus, with a progress bar, a JSONL log and checkpoints. Under
// `mpirun -np N` it trains data-parallel over N ranks (train/comm.h): rank 0 prints, logs
// and writes the checkpoints.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>

#include "apps/cli.h"
#include "apps/progress.h"
#include "apps/train_flags.h"
#include "apps/train_progress.h"
#include "checkpoints/model_io.h"
#include "train/comm.h"
#include "train/output_dir.h"

namespace kvlab {

namespace {

struct TrainArgs {
  TrainFlags flags;
  std::string out = "out/train";
  bool resume = false;
  std::string init_from;
  double comm_timeout = 120;
  int64_t zero = 0;
};

// Whether the run in `out` is resumed, after the usage errors of what the folder holds: a
// fresh run refuses another run's checkpoints; --resume needs last.h5, or no checkpoint at all
// (then it starts from scratch). A log.jsonl without checkpoints, of a run stopped before its
// first, is started over. `rank0` prints what is done.
bool resume_from(const std::filesystem::path& out, bool resume, bool rank0) {
  namespace fs = std::filesystem;
  const fs::path last = out / "last.h5";
  KVLAB_USAGE_CHECK(resume || !fs::exists(last), "output folder ", out.string(),
                    " already holds a run (", last.string(),
                    "); pass --resume to continue it or choose another --out");
  if (fs::exists(last)) return true;
  std::string found;  // what a run that never saved last.h5 (it diverged) left behind
  for (const char* name : {"best.h5", "final.h5"})
    if (fs::exists(out / name)) found += detail::cat(found.empty() ? "" : ", ", name);
  KVLAB_USAGE_CHECK(found.empty(), "output folder ", out.string(), " holds an earlier run's ",
                    found,
                    " but no last.h5 to resume from (a new run would write over them); "
                    "remove them or choose another --out");
  if (rank0 && fs::exists(out / "log.jsonl"))
    std::fprintf(stderr,
                 "kvlab train: %s holds the log.jsonl of a run that saved no checkpoint; "
                 "starting over\n",
                 out.string().c_str());
  else if (rank0 && resume)
    std::fprintf(stderr, "kvlab train: --resume: %s holds no checkpoint; starting from scratch\n",
                 out.string().c_str());
  return false;
}

// The training config of the flags. With --init-from FILE, or --resume of a run that began
// with it (its last.h5 records init_from), the model's shape and tokenizer are the file's.
TrainConfig train_config(const TrainArgs& a) {
  namespace fs = std::filesystem;
  TrainFlags flags = a.flags;
  KVLAB_USAGE_CHECK(a.init_from.empty() || !a.resume,
                    "--init-from starts a new run from a checkpoint's weights and --resume "
                    "continues the run in --out: give one of them");
  std::string what = "--init-from", from = a.init_from;
  const fs::path last = fs::path(a.out) / "last.h5";
  if (a.resume && fs::exists(last)) {
    what = "--resume";
    from = last.string();
  }
  if (!from.empty()) {
    const Checkpoint c = load_model_file(from, gpt_load_options(from, false));
    if (what == "--init-from" || c.config.count("init_from") > 0)
      take_model_from(flags, get_gpt_config(c.config, from), c.tokenizer_kind, what, from);
  }
  return finish_train_flags(flags);
}

// The run's shape and where it starts, on rank 0.
void print_start(const TrainArgs& a, const TrainConfig& cfg, Trainer& trainer,
                 Communicator& comm, bool resume) {
  const std::string start = resume                ? "resumed"
                            : a.init_from.empty() ? "from scratch"
                                                  : "from the weights of " + a.init_from;
  std::fprintf(stderr,
               "kvlab train: %lld parameters, n_head %lld, n_kv_head %lld, vocab %d, "
               "%zu train / %zu val tokens, %s\n",
               static_cast<long long>(trainer.model().num_parameters()),
               static_cast<long long>(cfg.model.n_head),
               static_cast<long long>(cfg.model.n_kv_head),
               trainer.corpus().tokenizer.vocab_size(), trainer.corpus().train.size(),
               trainer.corpus().val.size(), start.c_str());
  if (const std::string note = blas_kernels_note(); !note.empty())
    std::fprintf(stderr, "kvlab train: note: %s\n", note.c_str());
  if (comm.world_size() > 1)
    std::fprintf(stderr,
                 "kvlab train: data parallel over %d %s ranks, batch %lld per rank "
                 "(%lld sequences per step)%s\n",
                 comm.world_size(), comm.backend().c_str(), static_cast<long long>(cfg.batch_size),
                 static_cast<long long>(cfg.batch_size * cfg.grad_accum * comm.world_size()),
                 cfg.zero == 1 ? ", ZeRO-1 (AdamW moments sharded)" : "");
}

// Returns the exit code: 0 when every step is done, 128 + the signal when one stopped it.
int run_train(const TrainArgs& a) {
  KVLAB_USAGE_CHECK(!a.out.empty(), "train: no output folder (--out is empty)");
  TrainConfig cfg = train_config(a);
  cfg.out_dir = a.out;
  cfg.zero = a.zero;
  // The deadline is a steady_clock time in nanoseconds, which 1e10 s would overflow.
  KVLAB_USAGE_CHECK(a.comm_timeout > 0 && a.comm_timeout <= 1e9,
                    "--comm-timeout must be a number of seconds in (0, 1e9], got ", a.comm_timeout);
  // Without mpirun this is the local communicator and MPI is never initialised.
  const std::shared_ptr<Communicator> comm = world_communicator(a.comm_timeout);
  const int world = comm->world_size();
  const bool rank0 = comm->rank() == 0;
  if (rank0) cfg.tokenizer_progress = bpe_progress_bar("bpe");
  try {
    // Rank 0 alone writes the folder, so it alone holds it, for the whole run, and before
    // anything in it is looked at: a run holding it may be changing it.
    std::optional<OutputDirLock> hold;
    if (rank0) {
      hold.emplace(a.out, "train");
      clear_checkpoint_temporaries(a.out, "kvlab train");
    }
    const bool resume = resume_from(a.out, a.resume, rank0);
    Trainer trainer(cfg, comm);
    if (resume)
      trainer.resume(std::filesystem::path(a.out) / "last.h5");
    else if (!a.init_from.empty())
      trainer.init_from(a.init_from);
    if (rank0) print_start(a, cfg, trainer, *comm, resume);
    const bool done = train_with_progress(trainer, "train");
    if (rank0) {
      std::printf("%s at step %lld: %s; checkpoints in %s\n", done ? "finished" : "interrupted",
                  static_cast<long long>(trainer.step()),
                  best_val_text(trainer.best_val_loss(), val_tokens_per_byte(trainer.corpus())).c_str(), a.out.c_str());
      if (!done)
        std::printf(a.init_from.empty()
                        ? "resume with the same command plus --resume\n"
                        : "resume with the same command, --resume in place of --init-from\n");
    }
    // Interrupted is not finished: a script or scheduler must see it (SIGINT gives 130).
    return done ? 0 : 128 + stop_signal();
  } catch (const UsageError&) {
    throw;  // what the folder holds: every rank finds the same and exits on its own
  } catch (...) {
    // Another rank may be waiting for this one in a collective: end the whole job at exit.
    if (world > 1) comm->fail();
    throw;
  }
}

}  // namespace

void add_train_command(CLI::App& root) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* cmd = root.add_subcommand(
      "train", "Train one GPT on a text corpus (data-parallel under mpirun -np N)");
  add_train_flags(cmd, args->flags, true);
  cmd->add_option("--out", args->out, "Output folder: log.jsonl, last.h5, best.h5, final.h5")
      ->capture_default_str();
  cmd->add_flag("--resume", args->resume,
                "Continue the run in --out from its last.h5 (none there: start from scratch); "
                "a run begun with --init-from takes its model's shape from last.h5 again");
  cmd->add_option("--init-from", args->init_from,
                  "Start a new run (step 0, a new AdamW and schedule) from the weights of this "
                  "checkpoint (or GGUF model file), e.g. one kvlab convert wrote. The model's "
                  "shape and the tokenizer are the checkpoint's: a shape flag or --tokenizer "
                  "given with another value is refused, and the corpus must give the same "
                  "vocabulary. Dropout and the "
                  "training flags apply as usual; /config records init_from and its hash. Not "
                  "with --resume");
  add_number(cmd, "--comm-timeout", args->comm_timeout,
             "Under mpirun: seconds a rank waits in a collective before the job fails with "
             "an error naming the ranks that did not arrive; at most 1e9");
  cmd->add_option("--zero", args->zero,
                  "Under mpirun: 1 shards the AdamW moments over the ranks (ZeRO stage 1); "
                  "same weights as 0")
      ->check(integer_of<int64_t>())
      ->check(CLI::IsMember({0, 1}))
      ->capture_default_str();
  cmd->callback([args] {
    if (const int rc = run_train(*args); rc != 0) {
      // Everything is saved and the trainer is gone; the exit code is all that is left.
      std::fflush(stdout);
      std::fflush(stderr);
      std::exit(rc);
    }
  });
}

}  // namespace kvlab
