// kvlab convert: a checkpoint's model with fewer KV heads (nn/kv_convert.h), written as a
// weights-only checkpoint that generate, inspect and train --init-from read.
#include <cstdio>
#include <filesystem>

#include "apps/cli.h"
#include "checkpoints/model_io.h"
#include "nn/kv_convert.h"

namespace kvlab {

namespace {

struct ConvertArgs {
  std::string ckpt, out;
  int64_t n_kv_head = 0;
  std::string method;
  uint64_t seed = 0;
  bool seed_given = false;
};

void run_convert(const ConvertArgs& a) {
  KVLAB_USAGE_CHECK(!a.ckpt.empty(), "convert: --ckpt is empty");
  KVLAB_USAGE_CHECK(!a.out.empty(), "convert: --out is empty");
  KVLAB_USAGE_CHECK(a.n_kv_head >= 1, "--n-kv-head must be >= 1, got ", a.n_kv_head);
  KVLAB_USAGE_CHECK(!same_file(a.ckpt, a.out), "--out ", a.out,
                    " is the checkpoint --ckpt reads; write the conversion to another file");
  const KVHeadInit init = parse_kv_head_init(a.method);  // CLI11 admits only the three names
  KVLAB_USAGE_CHECK(!a.seed_given || init == KVHeadInit::Random,
                    "--seed draws the new heads of --method random; --method ", a.method,
                    " draws nothing");
  const LoadedModel src = load_model(a.ckpt);
  const GPTConfig& from = src.model->config();
  const int64_t n = from.n_kv_head, k = a.n_kv_head;
  KVLAB_USAGE_CHECK(k <= n, "--n-kv-head ", k, " is more than the n_kv_head of ", a.ckpt, ", ", n,
                    " (a conversion merges KV heads; it cannot split them)");
  KVLAB_USAGE_CHECK(n % k == 0, "--n-kv-head ", k, " does not divide the n_kv_head of ", a.ckpt,
                    ", ", n, " (each new KV head covers n_kv_head / K whole heads: try a divisor)");
  const std::string source_hash = file_content_hash(a.ckpt);
  const std::unique_ptr<GPT> dst = convert_kv_heads(*src.model, k, init, a.seed);

  // Weights only: the optimizer's moments and the training state belong to the source's run.
  Checkpoint c;
  put_gpt_config(c.config, dst->config());
  c.config["converted_from"] = source_hash;
  c.config["convert_method"] = kv_head_init_name(init);
  c.config["converted_from_n_kv_head"] = n;
  if (init == KVHeadInit::Random) c.config["convert_seed"] = static_cast<int64_t>(a.seed);
  put_tokenizer(c, src.tokenizer);
  c.model = to_arrays(dst->named_parameters());
  save_checkpoint(a.out, c);
  std::printf(
      "converted %s (n_kv_head %lld, %lld parameters) to %s (n_kv_head %lld, %lld "
      "parameters) by %s\n",
      a.ckpt.c_str(), static_cast<long long>(n),
      static_cast<long long>(src.model->num_parameters()), a.out.c_str(), static_cast<long long>(k),
      static_cast<long long>(dst->num_parameters()), a.method.c_str());
}

}  // namespace

void add_convert_command(CLI::App& root) {
  auto args = std::make_shared<ConvertArgs>();
  CLI::App* cmd = root.add_subcommand(
      "convert",
      "Merge a checkpoint's KV heads into fewer (MHA -> GQA/MQA, or fewer GQA groups) and write "
      "the weights as a new checkpoint, to generate from or to uptrain with train --init-from");
  cmd->add_option("--ckpt", args->ckpt, "Checkpoint (.h5) or GGUF model file to convert")
      ->required();
  cmd->add_option("--n-kv-head", args->n_kv_head,
                  "KV heads of the result: a divisor of the checkpoint's n_kv_head (equal to it, "
                  "mean and first copy the model)")
      ->required()
      ->check(integer_of<int64_t>());
  cmd->add_option("--method", args->method,
                  "How new KV head j (covering source heads j*N/K .. (j+1)*N/K-1) gets its "
                  "k_proj/v_proj rows: mean (of its heads'), first (its first head's) or random "
                  "(fresh N(0, 0.02) weights, zero biases)")
      ->required()
      ->check(CLI::IsMember({"mean", "first", "random"}));
  cmd->add_option("--out", args->out,
                  "Checkpoint to write: the converted weights, the source's config with the new "
                  "n_kv_head and /config provenance (converted_from: the source's content hash, "
                  "convert_method, converted_from_n_kv_head), its tokenizer; no optimizer or "
                  "training state")
      ->required();
  CLI::Option* seed = add_number(cmd, "--seed", args->seed, "Seed of --method random's draws");
  cmd->callback([args, seed] {
    args->seed_given = seed->count() > 0;
    run_convert(*args);
  });
}

}  // namespace kvlab
