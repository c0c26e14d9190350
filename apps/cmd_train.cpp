// kvlab train: one GPT on a corpus, with a progress bar, a JSONL log and checkpoints.
#include <csignal>
#include <cstdio>
#include <filesystem>

#include "apps/cli.h"
#include "apps/progress.h"
#include "apps/train_flags.h"
#include "apps/train_progress.h"

namespace kvlab {

namespace {

struct TrainArgs {
  TrainFlags flags;
  std::string out = "out/train";
  bool resume = false;
};

void run_train(const TrainArgs& a) {
  TrainConfig cfg = finish_train_flags(a.flags);
  cfg.out_dir = a.out;
  namespace fs = std::filesystem;
  const fs::path last = fs::path(a.out) / "last.h5";
  KVLAB_USAGE_CHECK(a.resume || !fs::exists(last), "output folder ", a.out,
                    " already holds a run (", last.string(),
                    "); pass --resume to continue it or choose another --out");
  KVLAB_USAGE_CHECK(!a.resume || fs::exists(last), "--resume: no checkpoint ", last.string(),
                    " to resume from");
  Trainer trainer(cfg);
  if (a.resume) trainer.resume(last);
  std::fprintf(stderr, "kvlab train: %lld parameters, n_head %lld, n_kv_head %lld, vocab %d, "
               "%zu train / %zu val tokens, %s\n",
               static_cast<long long>(trainer.model().num_parameters()),
               static_cast<long long>(cfg.model.n_head), static_cast<long long>(cfg.model.n_kv_head),
               trainer.corpus().tokenizer.vocab_size(), trainer.corpus().train.size(),
               trainer.corpus().val.size(), a.resume ? "resumed" : "from scratch");
  const bool done = train_with_progress(trainer, "train");
  std::printf("%s at step %lld: best val loss %.4f; checkpoints in %s\n",
              done ? "finished" : "interrupted", static_cast<long long>(trainer.step()),
              trainer.best_val_loss(), a.out.c_str());
  if (!done) std::printf("resume with the same command plus --resume\n");
}

}  // namespace

void add_train_command(CLI::App& root) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* cmd = root.add_subcommand("train", "Train one GPT on a text corpus");
  add_train_flags(cmd, args->flags, true);
  cmd->add_option("--out", args->out, "Output folder: log.jsonl, last.h5, best.h5, final.h5")
      ->capture_default_str();
  cmd->add_flag("--resume", args->resume, "Continue the run in --out from its last.h5");
  cmd->callback([args] { run_train(*args); });
}

}  // namespace kvlab
