#pragma once
// What the kvlab bench subcommands share: their flags' values (BenchArgs), the model they
// measure, the checks of --json and --kv-heads, the machine's record, and the flags more than
// one of them takes. Each subcommand is one file beside this one; apps/cmd_bench.cpp joins
// them under `kvlab bench`.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "apps/train_flags.h"
#include "data/tokenizer.h"
#include "infer/measure/bench.h"
#include "nn/gpt.h"

namespace kvlab::bench_cli {

using nlohmann::json;

struct BenchArgs {
  std::string ckpt;
  GPTConfig cfg = [] {
    GPTConfig c;
    c.n_layer = 6;
    c.n_head = 8;
    c.n_kv_head = 0;  // without --n-kv-head: n_head
    c.n_embd = 256;
    c.block_size = 512;
    c.vocab_size = 65;
    return c;
  }();
  std::vector<int64_t> kv_heads;  // empty: NH, NH/2, NH/4, NH/8 where they divide NH
  std::vector<int64_t> new_tokens{64, 256, 512};
  int64_t prompt_tokens = 16;
  int64_t batch = 1;
  int runs = 3;
  bool skip_no_cache = false;
  bool op_by_op = false;
  bool int8_products = false;
  std::string device = "cpu", dtype = "f32", kv_dtype = "f32", weight_dtype = "f32";
  KVCacheFlags kv;
  uint64_t seed = 0;
  std::string json_path;
  bool n_kv_head_given = false;
  BenchKVMemoryOptions kv_memory;  // kv-memory's own settings
  BenchServeOptions serve;         // serve's own settings
  bool http = false;               // serve: also over HTTP, through an in-process kvlab serve
  std::string url;                 // serve: only over HTTP, against a running kvlab serve
  double stream_interval_ms = 0;   // serve --http: the server's
  int64_t http_streams = 32;       // serve --http: the many-streams measurement's streams
  // kv-quality's own settings
  std::string data;                                       // corpus (default: the checkpoint's)
  std::string kv_dtypes = "f32,bf16,fp8,int8,int4";
  int windows = 256;
  std::string weight_dtypes = "bf16,q8_0,q4_0";  // weight-quality's
};

std::string mib(double bytes);
// The JSON file is written after the whole benchmark: a path that cannot be written is found
// before it starts, not minutes later.
void check_writable_file(const std::string& path);
// The checkpoint's model, else one of random weights shaped by the flags (a.cfg becomes the
// model's configuration either way), and its tokenizer.
std::pair<std::unique_ptr<GPT>, Tokenizer> bench_model(BenchArgs& a);
// --kv-heads, by default NH, NH/2, NH/4, NH/8 where they divide NH.
void check_kv_heads(BenchArgs& a);
void check_json_path(const BenchArgs& a);
json machine_json();
// With --json: r with the machine's record, written atomically, and a line saying where.
void write_json(const BenchArgs& a, json r);
// The random model's shape flags (a checkpoint brings its own); returns --n-kv-head.
CLI::Option* add_shape_flags(CLI::App* cmd, BenchArgs& a, CLI::Option* ckpt);
void add_json_flag(CLI::App* cmd, std::string& path);

// The subcommands, each added to `bench` (generate, kv-quality and weight-quality share args).
void add_generate_command(CLI::App* bench, const std::shared_ptr<BenchArgs>& args);
void add_kv_memory_command(CLI::App* bench);
void add_serve_command(CLI::App* bench);
void add_kv_quality_command(CLI::App* bench, const std::shared_ptr<BenchArgs>& args);
void add_weight_quality_command(CLI::App* bench, const std::shared_ptr<BenchArgs>& args);

}  // namespace kvlab::bench_cli
