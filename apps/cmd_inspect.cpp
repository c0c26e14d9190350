// kvlab inspect: what a checkpoint holds, without loading a model.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <variant>

#include "apps/cli.h"
#include "autograd/tensor.h"
#include "checkpoints/checkpoint.h"
#include "checkpoints/model_io.h"

namespace kvlab {

namespace {

struct InspectArgs {
  std::string ckpt;
  bool json = false;
};

// Why generate, bench and --resume would refuse the file's model, short of NaN and inf
// (listed per tensor), or "": its config is not a valid model, or describes another number of
// parameters than the tensors hold (one missing or extra).
std::string model_problem(const Checkpoint& c, const std::string& file, int64_t n_params) {
  try {
    const int64_t want = count_parameters(get_gpt_config(c.config, file));
    if (want != n_params)
      return detail::cat("the config describes ", want, " parameters, the tensors hold ", n_params);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Tokens in the file's vocabulary: get_tokenizer's, so that a bpe vocabulary (not one array)
// and one that does not hold together (-1) are counted as every command sees them.
int64_t tokenizer_size(const Checkpoint& c, const std::string& file) {
  try {
    return get_tokenizer(c, file).vocab_size();
  } catch (const Error&) {
    return -1;
  }
}

// The validation text's tokens per byte a run recorded (0: a file from before it was).
double tokens_per_byte(const Checkpoint& c) {
  const auto it = c.train_extra.find("val_tokens_per_byte");
  const double* v = it != c.train_extra.end() ? std::get_if<double>(&it->second) : nullptr;
  return v != nullptr && std::isfinite(*v) && *v > 0 ? *v : 0.0;
}

// What inspect reports of a checkpoint beyond its arrays.
struct Inspection {
  int64_t parameters = 0;
  std::string model_problem;                // why the model cannot load, or ""
  std::vector<std::string> state_problems;  // why --resume refuses the training state
};

void print_json(const InspectArgs& a, const Checkpoint& c, const Inspection& in) {
  nlohmann::json j;
  for (const auto& [k, v] : c.config) std::visit([&](const auto& x) { j["config"][k] = x; }, v);
  j["parameters"] = in.parameters;
  j["tokenizer"] = {{"kind", c.tokenizer_kind}, {"vocab_size", tokenizer_size(c, a.ckpt)}};
  for (const auto& [name, arr] : c.model)
    j["tensors"].push_back(
        {{"name", name}, {"shape", arr.shape}, {"non_finite", count_non_finite(arr)}});
  if (c.has_train_state)
    j["train"] = {{"iteration", c.iteration}, {"best_val_loss", c.best_val_loss}};
  if (c.has_train_state && tokens_per_byte(c) > 0 && std::isfinite(c.best_val_loss)) {
    j["train"]["val_tokens_per_byte"] = tokens_per_byte(c);
    j["train"]["best_val_bpb"] = bits_per_byte(c.best_val_loss, tokens_per_byte(c));
  }
  if (c.has_optimizer) j["optimizer_step"] = c.optimizer_step;
  if (!in.model_problem.empty()) j["model_problem"] = in.model_problem;
  if (!in.state_problems.empty()) j["training_state_problems"] = in.state_problems;
  // Paths in it are bytes, not always UTF-8: replace what is not, rather than fail.
  std::printf("%s\n", j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
}

void print_config(const Checkpoint& c) {
  int width = 14;  // the keys' column, wider for a longer key (converted_from_n_kv_head)
  for (const auto& entry : c.config) width = std::max(width, static_cast<int>(entry.first.size()));
  for (const auto& [k, v] : c.config) {
    std::printf("  %-*s ", width, k.c_str());
    std::visit([](const auto& x) {
      using X = std::decay_t<decltype(x)>;
      if constexpr (std::is_same_v<X, std::string>) std::printf("%s\n", x.c_str());
      else if constexpr (std::is_same_v<X, double>) std::printf("%g\n", x);
      else std::printf("%lld\n", static_cast<long long>(x));
    }, v);
  }
}

void print_text(const InspectArgs& a, const Checkpoint& c, const Inspection& in) {
  std::printf("checkpoint %s\n\nconfig:\n", a.ckpt.c_str());
  print_config(c);
  std::printf("\ntokenizer: %s, %lld symbols\nparameters: %lld in %zu tensors\n",
              c.tokenizer_kind.c_str(), static_cast<long long>(tokenizer_size(c, a.ckpt)),
              static_cast<long long>(in.parameters), c.model.size());
  bool any_non_finite = false;
  for (const auto& [name, arr] : c.model) {
    const int64_t bad = count_non_finite(arr);
    any_non_finite = any_non_finite || bad > 0;
    std::printf("  %-36s %-14s %zu%s\n", name.c_str(), shape_str(arr.shape).c_str(),
                arr.data.size(), bad > 0 ? detail::cat("  (", bad, " NaN or inf)").c_str() : "");
  }
  if (any_non_finite)
    std::printf("(tensors holding NaN or inf: generate, bench and --resume refuse this file)\n");
  if (!in.model_problem.empty())
    std::printf("(not a loadable model: %s; generate, bench and --resume refuse this file)\n",
                in.model_problem.c_str());
  if (c.has_train_state)
    std::printf("\ntraining state: iteration %lld, %s\n", static_cast<long long>(c.iteration),
                best_val_text(c.best_val_loss, tokens_per_byte(c)).c_str());
  if (c.has_optimizer)
    std::printf("optimizer: AdamW, step %lld\n", static_cast<long long>(c.optimizer_step));
  if (!in.state_problems.empty()) {
    std::printf("\ntraining state not usable (--resume refuses this file):\n");
    for (const std::string& p : in.state_problems) std::printf("  %s\n", p.c_str());
  }
}

void run_inspect(const InspectArgs& a) {
  // One load: a damaged training state is reported with the rest of the file (--resume refuses
  // such a file; generate and bench read only the model).
  LoadOptions options;
  options.report_training_state = true;
  const Checkpoint c = load_model_file(a.ckpt, options);
  Inspection in;
  if (!c.training_state_problem.empty()) in.state_problems.push_back(c.training_state_problem);
  for (const std::string& p : training_state_problems(c)) in.state_problems.push_back(p);
  for (const auto& [name, arr] : c.model) in.parameters += static_cast<int64_t>(arr.data.size());
  in.model_problem = model_problem(c, a.ckpt, in.parameters);
  if (a.json)
    print_json(a, c, in);
  else
    print_text(a, c, in);
}

}  // namespace

void add_inspect_command(CLI::App& root) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* cmd = root.add_subcommand("inspect", "Print a checkpoint's config, parameters and tensors");
  cmd->add_option("ckpt", args->ckpt, "Checkpoint (.h5) or GGUF model file")->required();
  cmd->add_flag("--json", args->json, "Print JSON instead of text");
  cmd->callback([args] { run_inspect(*args); });
}

}  // namespace kvlab
