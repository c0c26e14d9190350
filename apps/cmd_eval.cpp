// kvlab eval: several checkpoints scored on the same validation windows, so that their
// differences are paired (infer/measure/model_eval.h): loss and bits per byte, paired
// differences with bootstrap intervals, loss by context position, the in-context learning
// score, KL and top-1 agreement against the first checkpoint, and the recall probe.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>

#include "apps/cli.h"
#include "apps/progress.h"
#include "checkpoints/model_io.h"
#include "infer/measure/kv_quality.h"
#include "infer/measure/model_eval.h"
#include "platform/atomic_file.h"

namespace kvlab {

namespace {

struct EvalArgs {
  std::vector<std::string> ckpts;
  std::string corpus, json_path;
  EvalOptions options;
};

// The models, each checked against the first: one tokenizer (paired losses need one set of
// ids), and a context that holds the window.
std::vector<LoadedModel> load_models(const EvalArgs& a) {
  std::vector<LoadedModel> out;
  for (const std::string& path : a.ckpts) {
    out.push_back(load_model(path));
    const Tokenizer& first = out.front().tokenizer;
    const Tokenizer& t = out.back().tokenizer;
    KVLAB_USAGE_CHECK(t == first, "eval: ", path, "'s tokenizer (", t.kind_name(), ", ",
                      t.vocab_size(), " tokens) is not ", a.ckpts.front(), "'s (",
                      first.kind_name(), ", ", first.vocab_size(),
                      " tokens): a paired comparison scores every model on the same token ids");
  }
  return out;
}

int64_t checked_window(const EvalArgs& a, const std::vector<LoadedModel>& models) {
  int64_t smallest = models.front().model->config().block_size;
  for (const LoadedModel& m : models) smallest = std::min(smallest, m.model->config().block_size);
  const int64_t window = a.options.window > 0 ? a.options.window : smallest;
  for (size_t i = 0; i < models.size(); ++i)
    KVLAB_USAGE_CHECK(window <= models[i].model->config().block_size, "--window ", window,
                      " is longer than the context of ", a.ckpts[i], " (block_size ",
                      models[i].model->config().block_size, ")");
  KVLAB_USAGE_CHECK(window >= 2, "--window must be >= 2, got ", window);
  return window;
}

void print_result(const EvalResult& r, const std::string& corpus) {
  std::printf("\n%lld windows of %lld tokens of the validation split of %s (%lld predictions a "
              "model, %lld bytes of text); KL and top-1 against %s\n\n",
              static_cast<long long>(r.windows), static_cast<long long>(r.window), corpus.c_str(),
              static_cast<long long>(r.predictions), static_cast<long long>(r.target_bytes),
              r.models.front().name.c_str());
  // A task's windows: the loss is over its answers, and the accuracy is the share recalled.
  const bool task = r.models.front().accuracy.has_value();
  std::printf("%-28s %9s %10s %9s %10s %8s%s\n", "model", "loss", "bits/byte", "icl", "KL",
              "top-1", task ? "  answers" : "");
  for (const ModelQuality& q : r.models) {
    std::printf("%-28s %9.4f %10.4f %+9.4f %10.6f %8.4f", q.name.c_str(), q.loss,
                q.bits_per_byte, q.icl, q.kl, q.top1);
    if (task) std::printf(" %8.4f", q.accuracy.value_or(0));
    std::printf("\n");
  }
  if (!r.pairs.empty()) {
    std::printf("\npaired difference of the mean per-token loss (b - a), 95%% bootstrap interval "
                "over the windows:\n");
    for (const PairedComparison& p : r.pairs)
      std::printf("  %s - %s: %+.5f [%+.5f, %+.5f] %s\n", r.models[p.b].name.c_str(),
                  r.models[p.a].name.c_str(), p.diff.mean, p.diff.lo, p.diff.hi,
                  p.diff.excludes_zero() ? "distinguishable" : "not distinguishable");
  }
  std::printf("\nloss by context position:\n%-12s", "positions");
  for (const ModelQuality& q : r.models) std::printf(" %12.12s", q.name.c_str());
  for (size_t k = 0; k < r.models.front().buckets.size(); ++k) {
    const PositionBucket& b = r.models.front().buckets[k];
    std::printf("\n%-12s", detail::cat(b.first, "-", b.last).c_str());
    for (const ModelQuality& q : r.models) std::printf(" %12.4f", q.buckets[k].loss);
  }
  std::printf("\n\nrecall of a repeated random string, top-1 accuracy on its second copy:\n%-12s",
              "distance");
  for (const ModelQuality& q : r.models) std::printf(" %12.12s", q.name.c_str());
  for (size_t k = 0; k < r.models.front().recall.size(); ++k) {
    std::printf("\n%-12lld", static_cast<long long>(r.models.front().recall[k].distance));
    for (const ModelQuality& q : r.models) std::printf(" %12.4f", q.recall[k].accuracy);
  }
  std::printf("\n");
  if (!r.models.front().samples) return;
  std::printf("\n%lld samples a model at temperature 0.8, stopping at a blank line:\n%-28s %10s %10s "
              "%10s %11s %11s %8s\n",
              static_cast<long long>(r.models.front().samples->samples), "model", "distinct-1",
              "distinct-2", "distinct-3", "repeated-3", "mean bytes", "stopped");
  for (const ModelQuality& q : r.models)
    std::printf("%-28s %10.4f %10.4f %10.4f %11.4f %11.1f %8.2f\n", q.name.c_str(),
                q.samples->distinct[0], q.samples->distinct[1], q.samples->distinct[2],
                q.samples->repeated3, q.samples->mean_bytes, q.samples->stopped);
}

void run_eval(EvalArgs a) {
  std::vector<LoadedModel> loaded = load_models(a);
  a.options.window = checked_window(a, loaded);
  std::string corpus;
  // A task's checkpoint is scored on the task's answers (infer/measure/kv_quality.h).
  const ValidationSplit val =
      checkpoint_validation_split(loaded.front(), a.corpus, &corpus, "--corpus");
  if (!val.targets.empty()) a.options.targets = &val.targets;
  a.options.period = val.period;
  std::vector<GPT*> models;
  for (LoadedModel& m : loaded) models.push_back(m.model.get());
  std::optional<ProgressBar> bar;  // its total is known at the first report
  const EvalResult r = evaluate_models(models, a.ckpts, val.ids, loaded.front().tokenizer,
                                       a.options, [&](int64_t done, int64_t total) {
                                         if (!bar) bar.emplace("eval", total, "windows");
                                         bar->update(done, "");
                                       });
  if (bar) bar->erase();
  print_result(r, corpus);
  if (!a.json_path.empty()) {
    nlohmann::json j = eval_json(r);
    j["corpus"] = corpus;
    j["checkpoints"] = a.ckpts;
    write_file_atomic(a.json_path, j.dump(2) + "\n", "eval --json");
  }
}

}  // namespace

void add_eval_command(CLI::App& root) {
  auto args = std::make_shared<EvalArgs>();
  CLI::App* cmd = root.add_subcommand(
      "eval",
      "Score checkpoints on the same validation windows: loss and bits per byte, paired "
      "differences with bootstrap intervals, loss by context position, KL and top-1 against "
      "the first, and an in-context recall probe");
  cmd->add_option("--ckpt", args->ckpts,
                  "Checkpoints (.h5) or GGUF model files to compare, one tokenizer; the first is "
                  "the reference")
      ->required()
      ->expected(1, -1);
  cmd->add_option("--corpus", args->corpus,
                  "Text whose validation split is scored (default: the corpus the first "
                  "checkpoint records, split as it was trained; for a --task mqar checkpoint, "
                  "its task's validation examples, scored on their answers)");
  cmd->add_option("--windows", args->options.windows,
                  "Windows drawn from the split (seeded, the same for every model); 0 scores the "
                  "whole split as consecutive windows")
      ->check(integer_of<int>())
      ->capture_default_str();
  cmd->add_option("--window", args->options.window,
                  "Tokens a window (default: the smallest context of the checkpoints)")
      ->check(integer_of<int64_t>());
  cmd->add_option("--seed", args->options.seed, "Seed of the windows' starts")
      ->check(integer_of<uint64_t>())
      ->capture_default_str();
  cmd->add_option("--bootstrap", args->options.resamples,
                  "Bootstrap resamples of the windows for each paired interval")
      ->check(integer_of<int>())
      ->capture_default_str();
  cmd->add_option("--recall-sequences", args->options.recall_sequences,
                  "Random strings a distance in the recall probe")
      ->check(integer_of<int>())
      ->capture_default_str();
  args->options.samples = 8;
  cmd->add_option("--samples", args->options.samples,
                  "Prompts (the first tokens of fixed validation windows) each model samples a "
                  "continuation from at temperature 0.8, for distinct-n, repeated 3-grams and the "
                  "length before a blank line; 0: none")
      ->check(integer_of<int>())
      ->capture_default_str();
  cmd->add_option("--json", args->json_path, "Also write every figure to this JSON file");
  cmd->callback([args] {
    KVLAB_USAGE_CHECK(args->options.windows >= 0, "--windows must be >= 0, got ",
                      args->options.windows);
    KVLAB_USAGE_CHECK(args->options.samples >= 0, "--samples must be >= 0, got ",
                      args->options.samples);
    KVLAB_USAGE_CHECK(args->options.resamples >= 1, "--bootstrap must be >= 1, got ",
                      args->options.resamples);
    KVLAB_USAGE_CHECK(args->options.recall_sequences >= 1, "--recall-sequences must be >= 1, got ",
                      args->options.recall_sequences);
    run_eval(*args);
  });
}

}  // namespace kvlab
