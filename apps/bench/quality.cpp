// kvlab bench kv-quality and weight-quality: what each KV cache dtype, and each matrix dtype,
// costs a model on windows of its corpus.
#include "apps/bench/bench_common.h"

#include <cstdio>

#include "apps/cli.h"
#include "checkpoints/model_io.h"
#include "infer/measure/kv_quality.h"
#include "platform/atomic_file.h"

namespace kvlab::bench_cli {

namespace {

json kv_quality_json(const std::vector<KVQuality>& q) {
  json out = json::array();
  for (const KVQuality& r : q)
    out.push_back({{"dtype", dtype_name(r.dtype)},
                   {"bytes_per_token", r.bytes_per_token},
                   {"loss", r.loss},
                   {"delta_loss", r.delta_loss},
                   {"kl", r.kl},
                   {"top1", r.top1},
                   {"positions", r.positions}});
  return out;
}

void run_bench_kv_quality(BenchArgs& a) {
  check_json_path(a);
  KVLAB_USAGE_CHECK(a.windows >= 1, "--windows must be >= 1, got ", a.windows);
  const std::vector<DType> dtypes = parse_kv_dtypes(a.kv_dtypes);
  LoadedModel loaded = load_model(a.ckpt);
  GPT& model = *loaded.model;
  std::string data;
  const ValidationSplit val = checkpoint_validation_split(loaded, a.data, &data);
  std::fprintf(stderr, "kvlab bench kv-quality: %d windows of %lld tokens, %zu cache dtypes\n",
               a.windows, static_cast<long long>(model.config().block_size), dtypes.size());
  const std::vector<KVQuality> q = kv_cache_quality_on(model, val, dtypes, a.windows);
  const GPTConfig& c = model.config();
  std::printf(
      "\nKV cache quality of %s (%lld layers, %lld heads, n_kv_head %lld, head size %lld) on "
      "%lld validation positions of %s, each dtype against the f32 cache:\n%-6s%12s%10s%10s%12s"
      "%12s%10s\n",
      a.ckpt.c_str(), static_cast<long long>(c.n_layer), static_cast<long long>(c.n_head),
      static_cast<long long>(c.n_kv_head), static_cast<long long>(c.head_size()),
      static_cast<long long>(q.front().positions), data.c_str(), "dtype", "bytes/token",
      "vs f32", "loss", "delta", "mean KL", "top-1");
  const double f32_bytes = static_cast<double>(kv_bytes_per_token(c, DType::F32));
  for (const KVQuality& r : q)
    std::printf("%-6s%12lld%10.3f%10.4f%+12.5f%12.2e%10.4f\n", dtype_name(r.dtype),
                static_cast<long long>(r.bytes_per_token),
                static_cast<double>(r.bytes_per_token) / f32_bytes, r.loss, r.delta_loss, r.kl,
                r.top1);
  const json out{{"checkpoint", a.ckpt},   {"data", data},
                 {"windows", a.windows},   {"block_size", c.block_size},
                 {"n_kv_head", c.n_kv_head}, {"quality", kv_quality_json(q)}};
  write_json(a, out);
}

void run_bench_weight_quality(BenchArgs& a) {
  check_json_path(a);
  KVLAB_USAGE_CHECK(a.windows >= 1, "--windows must be >= 1, got ", a.windows);
  const std::vector<WeightDtype> dtypes = parse_weight_dtypes(a.weight_dtypes);
  LoadedModel loaded = load_model(a.ckpt);
  const GPT& model = *loaded.model;
  std::string data;
  const ValidationSplit val = checkpoint_validation_split(loaded, a.data, &data);
  std::fprintf(stderr, "kvlab bench weight-quality: %d windows of %lld tokens, %zu weight dtypes\n",
               a.windows, static_cast<long long>(model.config().block_size), dtypes.size());
  const std::vector<WeightQuality> q =
      weight_quality_on(model, val, dtypes, a.windows, a.int8_products);
  const GPTConfig& c = model.config();
  const int64_t f32_bytes = DecodeStep(*loaded.model).weight_bytes();
  std::printf(
      "\nWeight dtype quality of %s (%lld layers, n_embd %lld, n_kv_head %lld) on %lld "
      "validation positions of %s, each against the f32 model (f32 cache); decode reads %s of "
      "weights at f32:\n%-10s%14s%10s%10s%12s%12s%10s\n",
      a.ckpt.c_str(), static_cast<long long>(c.n_layer), static_cast<long long>(c.n_embd),
      static_cast<long long>(c.n_kv_head), static_cast<long long>(q.front().positions),
      data.c_str(), mib(static_cast<double>(f32_bytes)).c_str(), "dtype", "decode bytes", "vs f32",
      "loss", "delta", "mean KL", "top-1");
  json rows = json::array();
  for (const WeightQuality& r : q) {
    const std::string name = std::string(weight_dtype_name(r.dtype)) + (r.int8_products ? "+int8" : "");
    std::printf("%-10s%14s%10.3f%10.4f%+12.5f%12.2e%10.4f\n", name.c_str(),
                mib(static_cast<double>(r.decode_weight_bytes)).c_str(),
                static_cast<double>(r.decode_weight_bytes) / static_cast<double>(f32_bytes), r.loss,
                r.delta_loss, r.kl, r.top1);
    rows.push_back({{"dtype", weight_dtype_name(r.dtype)},
                    {"int8_products", r.int8_products},
                    {"decode_weight_bytes", r.decode_weight_bytes},
                    {"loss", r.loss},
                    {"delta_loss", r.delta_loss},
                    {"kl", r.kl},
                    {"top1", r.top1},
                    {"positions", r.positions}});
  }
  const json out{{"checkpoint", a.ckpt},        {"data", data},
                 {"windows", a.windows},        {"block_size", c.block_size},
                 {"n_kv_head", c.n_kv_head},    {"f32_decode_weight_bytes", f32_bytes},
                 {"quality", rows}};
  write_json(a, out);
}

// kv-quality's options (--ckpt, --data, --windows, --json) on cmd.
void add_quality_options(CLI::App* cmd, BenchArgs& args) {
  cmd->add_option("--ckpt", args.ckpt, "Checkpoint (.h5) or GGUF model file to evaluate")
      ->required();
  cmd->add_option("--data", args.data,
                  "Corpus whose validation split is evaluated (default: the checkpoint's "
                  "training corpus, split as it was)");
  add_number(cmd, "--windows", args.windows,
             "Validation windows of block_size tokens, drawn at fixed places");
  add_json_flag(cmd, args.json_path);
}

}  // namespace

void add_weight_quality_command(CLI::App* bench, const std::shared_ptr<BenchArgs>& args) {
  CLI::App* cmd = bench->add_subcommand(
      "weight-quality",
      "What each --weight-dtype costs a trained model: validation loss, KL divergence and top-1 "
      "agreement against its f32 matrices, and the bytes a decode step reads");
  add_quality_options(cmd, *args);
  cmd->add_option("--weight-dtypes", args->weight_dtypes,
                  "Matrix dtypes to evaluate, comma-separated (bf16, q8_0, q4_0; f32 is the "
                  "reference)")
      ->capture_default_str();
  cmd->add_flag("--int8-products", args->int8_products,
                "Score q8_0 and q4_0 with integer products, as generate and serve decode with "
                "--int8-products: each window position by position through the fused decode step");
  cmd->callback([args] { run_bench_weight_quality(*args); });
}

void add_kv_quality_command(CLI::App* bench, const std::shared_ptr<BenchArgs>& args) {
  CLI::App* cmd = bench->add_subcommand(
      "kv-quality",
      "What each KV cache dtype costs a trained model: validation loss, KL divergence and top-1 "
      "agreement against the f32 cache, and bytes per token");
  add_quality_options(cmd, *args);
  cmd->add_option("--kv-dtypes", args->kv_dtypes,
                  "Cache dtypes to evaluate, comma-separated (f32, bf16, fp8, int8, int4)")
      ->capture_default_str();
  cmd->callback([args] { run_bench_kv_quality(*args); });
}

}  // namespace kvlab::bench_cli
