// The kvlab bench subcommands' shared pieces (bench_common.h).
#include "apps/bench/bench_common.h"

#include <omp.h>

#include <filesystem>
#include <fstream>

#include "apps/ablate/ablate.h"
#include "apps/cli.h"
#include "platform/atomic_file.h"
#include "checkpoints/model_io.h"
#include "platform/blas_core.h"
#include "platform/cpu.h"

namespace kvlab::bench_cli {

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", bytes / (1024.0 * 1024.0));
  return buf;
}

void check_writable_file(const std::string& path) {
  std::error_code ec;
  KVLAB_USAGE_CHECK(!std::filesystem::is_directory(path, ec), "--json ", path, " is a directory");
  const bool existed = std::filesystem::exists(path, ec);
  KVLAB_USAGE_CHECK(std::ofstream(path, std::ios::app).good(), "--json ", path,
                    " cannot be written");
  if (!existed) std::filesystem::remove(path, ec);
}

std::pair<std::unique_ptr<GPT>, Tokenizer> bench_model(BenchArgs& a) {
  if (!a.ckpt.empty()) {
    LoadedModel loaded = load_model(a.ckpt);
    a.cfg = loaded.model->config();
    return {std::move(loaded.model), loaded.tokenizer};
  }
  if (!a.n_kv_head_given) a.cfg.n_kv_head = a.cfg.n_head;
  try {
    a.cfg.validate();
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  auto model = std::make_unique<GPT>(a.cfg, a.seed + 1);
  model->set_training(false);
  return {std::move(model), synthetic_tokenizer(a.cfg.vocab_size)};
}

void check_kv_heads(BenchArgs& a) {
  if (a.kv_heads.empty())
    for (int64_t d : {1, 2, 4, 8})
      if (a.cfg.n_head % d == 0) a.kv_heads.push_back(a.cfg.n_head / d);
  const std::string kv_problem = kv_heads_problem(a.kv_heads, a.cfg.n_head);
  KVLAB_USAGE_CHECK(kv_problem.empty(), "--kv-heads: ", kv_problem);
}

void check_json_path(const BenchArgs& a) {
  if (a.json_path.empty()) return;
  std::error_code ec;
  KVLAB_USAGE_CHECK(a.ckpt.empty() || !std::filesystem::equivalent(a.json_path, a.ckpt, ec),
                    "--json ", a.json_path, " is the checkpoint --ckpt reads");
  check_writable_file(a.json_path);
}

json machine_json() {
  return json{{"cpu", host_cpu_model()},
              {"threads", omp_get_max_threads()},
              {"openblas", kvlab::blas_config()},
              {"openblas_kernels", kvlab::blas_kernels()}};
}

CLI::Option* add_shape_flags(CLI::App* cmd, BenchArgs& a, CLI::Option* ckpt) {
  auto shape = [&](const char* name, int64_t& value, const char* help) {
    return cmd->add_option(name, value, help)->check(integer_of<int64_t>())->excludes(ckpt);
  };
  shape("--n-layer", a.cfg.n_layer, "Layers (random weights)")->capture_default_str();
  shape("--n-head", a.cfg.n_head, "Query heads (random weights)")->capture_default_str();
  CLI::Option* n_kv_head =
      shape("--n-kv-head", a.cfg.n_kv_head, "Key/value heads (random weights); default n-head");
  shape("--n-embd", a.cfg.n_embd, "Channels (random weights)")->capture_default_str();
  shape("--block-size", a.cfg.block_size, "Context length (random weights)")
      ->capture_default_str();
  shape("--vocab", a.cfg.vocab_size, "Vocabulary size (random weights)")->capture_default_str();
  static std::string arch = "gpt2";  // applied as parsed
  cmd->add_option("--arch", arch,
                  "Block of the random model: gpt2 (learned positions, LayerNorm, GELU, biases) "
                  "or llama (RoPE, RMSNorm, SwiGLU, no biases)")
      ->check(CLI::IsMember({"gpt2", "llama"}))
      ->excludes(ckpt)
      ->capture_default_str()
      ->each([&a](const std::string& v) {
        const bool llama = v == "llama";
        a.cfg.pos = llama ? "rope" : "learned";
        a.cfg.norm = llama ? "rmsnorm" : "layernorm";
        a.cfg.mlp = llama ? "swiglu" : "gelu";
        a.cfg.bias = !llama;
      });
  return n_kv_head;
}

void add_json_flag(CLI::App* cmd, std::string& path) {
  cmd->add_option("--json", path, "Write the results as JSON to this file")
      ->check(CLI::Validator(
          [](const std::string& p) { return p.empty() ? "the path is empty" : ""; }, "PATH"));
}

void write_json(const BenchArgs& a, json r) {
  if (a.json_path.empty()) return;
  r["machine"] = machine_json();
  write_file_atomic(a.json_path, r.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
  std::printf("\nwrote %s\n", a.json_path.c_str());
}

}  // namespace kvlab::bench_cli
