// kvlab bench generate: decode speed with and without the KV cache, time per token against
// position, and the cache's memory for several n_kv_head settings. kvlab bench kv-memory: the
// paged cache against contiguous allocation at one KV memory. kvlab bench serve: continuous
// against static batching of a request stream. Tables plus JSON.
#include <omp.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "apps/ablate/ablate.h"
#include "apps/cli.h"
#include "apps/progress.h"
#include "apps/report/report.h"
#include "apps/serve/http_bench.h"
#include "apps/serve/server.h"
#include "apps/train_flags.h"
#include "checkpoints/model_io.h"
#include "infer/kv_cache.h"
#include "infer/measure/bench.h"
#include "infer/measure/kv_quality.h"
#include "platform/atomic_file.h"
#include "platform/blas_core.h"
#include "platform/cpu.h"

namespace kvlab {

namespace {

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

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", bytes / (1024.0 * 1024.0));
  return buf;
}

void print_generate_table(const json& g) {
  const json& m = g["model"];
  std::printf(
      "\nkvlab bench generate: %lld layers, %lld heads, %lld kv heads, n_embd %lld, block %lld, "
      "vocab %lld (%.2fM parameters, %s f32; %s matrices%s, a decode step reads %s of "
      "weights)\n%d threads, prompt %lld tokens, greedy, batch %lld, median of %d runs after one "
      "warm-up\n\n",
      m["n_layer"].get<long long>(), m["n_head"].get<long long>(), m["n_kv_head"].get<long long>(),
      m["n_embd"].get<long long>(), m["block_size"].get<long long>(),
      m["vocab_size"].get<long long>(), m["parameters"].get<double>() / 1e6,
      mib(m["weight_bytes"].get<double>()).c_str(), g["weight_dtype"].get<std::string>().c_str(),
      g.value("int8_products", false) ? " in integer products" : "",
      mib(m["decode_weight_bytes"].get<double>()).c_str(), g["threads"].get<int>(),
      g["prompt_tokens"].get<long long>(), g["batch"].get<long long>(), g["runs"].get<int>());
  const json& rs = g["results"];
  auto row = [&](const char* label, auto cell) {
    std::printf("%-28s", label);
    for (const json& r : rs) std::printf("%18s", cell(r).c_str());
    std::printf("\n");
  };
  auto num = [](const json& j, const char* side, const char* key, const char* fmt) {
    if (!j.contains(side)) return std::string("-");
    char buf[48];
    std::snprintf(buf, sizeof buf, fmt, j[side][key].get<double>());
    return std::string(buf);
  };
  row("new tokens", [](const json& r) { return std::to_string(r["new_tokens"].get<long long>()); });
  row("cache on: tok/s", [&](const json& r) { return num(r, "cache", "tokens_per_s", "%.1f"); });
  row("cache off: tok/s",
      [&](const json& r) { return num(r, "no_cache", "tokens_per_s", "%.1f"); });
  row("speed-up (on / off)", [](const json& r) {
    if (!r.contains("speedup")) return std::string("-");
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2fx", r["speedup"].get<double>());
    return std::string(buf);
  });
  row("TTFT on / off (ms)", [&](const json& r) {
    return num(r, "cache", "ttft_ms", "%.2f") + " / " + num(r, "no_cache", "ttft_ms", "%.2f");
  });
  for (const char* side : {"cache", "no_cache"}) {
    const bool on = std::string(side) == "cache";
    if (!rs[0].contains(side)) continue;
    row(on ? "cache on: TPOT mean (ms)" : "cache off: TPOT mean (ms)",
        [&](const json& r) { return num(r, side, "tpot_mean_ms", "%.3f"); });
    row(on ? "cache on: TPOT p50 (ms)" : "cache off: TPOT p50 (ms)",
        [&](const json& r) { return num(r, side, "tpot_p50_ms", "%.3f"); });
    row(on ? "cache on: TPOT p99 (ms)" : "cache off: TPOT p99 (ms)",
        [&](const json& r) { return num(r, side, "tpot_p99_ms", "%.3f"); });
  }
  row("cache on: weights+KV GB/s",
      [&](const json& r) { return num(r, "cache", "read_GB_per_s", "%.1f"); });
  if (rs[0]["cache"].contains("read_bandwidth_GB_per_s")) {
    // The peak rate at which the same threads read a buffer of the step's size, this run.
    row("peak read GB/s (probe)",
        [&](const json& r) { return num(r, "cache", "read_bandwidth_GB_per_s", "%.1f"); });
    row("bandwidth ceiling: tok/s",
        [&](const json& r) { return num(r, "cache", "ceiling_tokens_per_s", "%.1f"); });
    row("cache on: of the ceiling",
        [&](const json& r) { return num(r, "cache", "fraction_of_ceiling", "%.3f"); });
  }
  row("KV cache positions",
      [](const json& r) { return std::to_string(r["cache"]["cache_positions"].get<long long>()); });
  row("KV cache bytes measured",
      [](const json& r) { return std::to_string(r["cache"]["cache_bytes"].get<long long>()); });
  row("KV cache bytes formula", [](const json& r) {
    return std::to_string(r["cache"]["cache_bytes_formula"].get<long long>());
  });

  const json& tp = g["time_vs_position"];
  std::printf("\ntime per token against position (%lld new tokens; ms):\n%-12s%14s%14s\n",
              tp["new_tokens"].get<long long>(), "position", "cache on", "cache off");
  const json& on = tp["cache"];
  const json& off = tp["no_cache"];
  for (size_t i = 0; i < on.size(); ++i) {
    std::printf("%-12lld%14.3f", on[i]["position"].get<long long>(), on[i]["ms"].get<double>());
    if (i < off.size()) std::printf("%14.3f", off[i]["ms"].get<double>());
    std::printf("\n");
  }
}

void print_cache_report(const json& rep, const json& speed, DType dtype, int64_t batch) {
  std::printf(
      "\nKV cache (%s) at batch %lld, S = block_size (2 * L * B * S * NKV rows of HS values and "
      "their scales), and decode speed with the cache (ceiling: batch tokens per time to read a "
      "step's bytes at this run's peak read rate):\n%-10s%16s%16s%8s%12s%10s%12s%12s%14s%12s\n",
      dtype_name(dtype), static_cast<long long>(batch), "n_kv_head",
      "measured B", "formula B", "equal", "vs MHA", "expected", "tok/s", "TPOT ms", "ceiling tok/s",
      "of ceiling");
  for (size_t i = 0; i < rep.size(); ++i) {
    const json& r = rep[i];
    std::printf("%-10lld%16lld%16lld%8s%12.4f%10.4f", r["n_kv_head"].get<long long>(),
                r["measured_bytes"].get<long long>(), r["formula_bytes"].get<long long>(),
                r["measured_bytes"] == r["formula_bytes"] ? "yes" : "NO",
                r["ratio_to_mha"].get<double>(), r["expected_ratio"].get<double>());
    if (i < speed.size()) {
      const json& d = speed[i];
      std::printf("%12.1f%12.3f", d["tokens_per_s"].get<double>(), d["tpot_mean_ms"].get<double>());
      if (d.contains("ceiling_tokens_per_s"))
        std::printf("%14.1f%12.3f", d["ceiling_tokens_per_s"].get<double>(),
                    d["fraction_of_ceiling"].get<double>());
    }
    std::printf("\n");
  }
}

// The JSON file is written after the whole benchmark: a path that cannot be written is found
// before it starts, not minutes later.
void check_writable_file(const std::string& path) {
  std::error_code ec;
  KVLAB_USAGE_CHECK(!std::filesystem::is_directory(path, ec), "--json ", path, " is a directory");
  const bool existed = std::filesystem::exists(path, ec);
  KVLAB_USAGE_CHECK(std::ofstream(path, std::ios::app).good(), "--json ", path,
                    " cannot be written");
  if (!existed) std::filesystem::remove(path, ec);
}

// The checkpoint's model, else one of random weights shaped by the flags (a.cfg becomes the
// model's configuration either way), and its tokenizer.
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

// --kv-heads, by default NH, NH/2, NH/4, NH/8 where they divide NH.
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

void run_bench_generate(BenchArgs& a) {
  check_json_path(a);
  const Device device = parse_device(a.device);
  const MatmulPrecisionGuard precision(parse_dtype(a.dtype, device));
  const DType kv_dtype = parse_storage_dtype(a.kv_dtype);
  KVLAB_USAGE_CHECK(a.runs >= 1, "--runs must be >= 1, got ", a.runs);
  KVLAB_USAGE_CHECK(a.prompt_tokens >= 1, "--prompt-tokens must be >= 1, got ", a.prompt_tokens);
  KVLAB_USAGE_CHECK(a.batch >= 1, "--batch must be >= 1, got ", a.batch);
  for (int64_t n : a.new_tokens)
    KVLAB_USAGE_CHECK(n >= 1, "--new-tokens values must be >= 1, got ", n);
  auto [model, tok] = bench_model(a);
  // The first new token comes from the prefill: timing decode needs room for a second.
  KVLAB_USAGE_CHECK(a.prompt_tokens + 2 <= a.cfg.block_size, "--prompt-tokens ", a.prompt_tokens,
                    " leaves room for fewer than 2 new tokens in block_size ", a.cfg.block_size,
                    ": no decode step to time");
  check_kv_heads(a);

  KVLAB_USAGE_CHECK(!a.op_by_op || device == Device::CPU,
                    "--op-by-op compares against the fused CPU decode step; it needs --device cpu");
  model->to(device);
  BenchGenerateOptions o;
  o.prompt_tokens = a.prompt_tokens;
  o.batch = a.batch;
  o.new_tokens = a.new_tokens;
  o.runs = a.runs;
  o.no_cache = !a.skip_no_cache;
  o.seed = a.seed;
  o.device = device;
  o.cache_dtype = kv_dtype;
  o.paged = parse_kv_cache(a.kv, a.cfg.block_size, device);
  // Each run feeds the same prompts: with prefix caching the later ones would skip prefill.
  if (o.paged) o.paged->prefix_caching = false;
  o.weight_dtype = parse_weight_dtype(a.weight_dtype);
  o.fused_decode = !a.op_by_op;
  o.int8_products = a.int8_products;
  // A bar for the setting being measured (a cache-off setting of a large model takes minutes),
  // replaced by its result line.
  TaskBars bars("kvlab bench: ", "tok");
  o.on_tokens = std::bind_front(&TaskBars::update, &bars);
  o.progress = [&](const std::string& line) { bars.line("kvlab bench: " + line); };
  const json gen = bench_generate(*model, tok, o);
  // The cache report and the speed by n_kv_head vary the model's KV heads: an MLA model's
  // are those of its GQA counterpart (the same shape with attn gqa).
  GPTConfig by_kv = a.cfg;
  if (by_kv.mla()) {
    by_kv.attn = "gqa";
    by_kv.kv_lora_rank = by_kv.rope_head_dim = 0;
  }
  const json report = kv_cache_report(by_kv, a.kv_heads, a.batch, kv_dtype);
  const json speed = bench_decode_by_kv_heads(by_kv, a.kv_heads, 256, o);
  print_generate_table(gen);
  print_cache_report(report, speed, kv_dtype, a.batch);
  if (!a.json_path.empty()) {
    const json out{{"generate", gen},
                   {"cache_report", report},
                   {"decode_by_kv_heads", speed},
                   {"checkpoint", a.ckpt},
                   {"machine", machine_json()}};
    write_file_atomic(a.json_path, out.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
    std::printf("\nwrote %s\n", a.json_path.c_str());
  }
}

void print_kv_memory(const json& r) {
  const json& m = r["model"];
  const json& w = r["workload"];
  std::printf(
      "\nkvlab bench kv-memory: %lld layers, %lld heads, n_embd %lld, context %lld; %s KV cache in "
      "blocks of %lld positions; KV memory %s for every n_kv_head\nworkload: %lld requests, %s\n",
      m["n_layer"].get<long long>(), m["n_head"].get<long long>(), m["n_embd"].get<long long>(),
      m["block_size"].get<long long>(), r["cache_dtype"].get<std::string>().c_str(),
      r["kv_block_size"].get<long long>(), mib(r["budget_bytes"].get<double>()).c_str(),
      w["requests"].get<long long>(), w["distribution"].get<std::string>().c_str());
  auto pct = [](const json& v) { return 100 * v.get<double>(); };
  std::printf("\n%-10s%-16s%22s%22s%16s%14s\n", "n_kv_head", "case", "utilisation paged",
              "contiguous", "peak seqs p/c", "preemptions");
  for (const json& e : r["memory"])
    for (const char* name : {"plain", "samples", "system_prompt"}) {
      const json& p = e[name]["paged"];
      const json& c = e[name]["contiguous"];
      const std::string label = std::string(name) == "samples"
                                    ? detail::cat("n = ", w["samples"].get<long long>())
                                : std::string(name) == "system_prompt"
                                    ? detail::cat("system ", w["system_prompt"].get<long long>())
                                    : std::string("one sample");
      char peaks[64];
      std::snprintf(peaks, sizeof peaks, "%lld / %lld (%.1fx)", p["peak_sequences"].get<long long>(),
                    c["peak_sequences"].get<long long>(),
                    p["peak_sequences"].get<double>() / c["peak_sequences"].get<double>());
      std::printf("%-10lld%-16s%15.1f%% (min %2.0f)%15.1f%% (min %2.0f)%20s%10lld\n",
                  e["n_kv_head"].get<long long>(), label.c_str(), pct(p["utilisation_mean"]),
                  pct(p["utilisation_min"]), pct(c["utilisation_mean"]),
                  pct(c["utilisation_min"]), peaks, p["preemptions"].get<long long>());
    }
  std::printf("\nprompt copies held with n = %lld (paged / contiguous); prefill positions of the "
              "system-prompt workload (prefix caching on / off):\n",
              w["samples"].get<long long>());
  for (const json& e : r["memory"]) {
    const json& sys = e["system_prompt"];
    std::printf("  n_kv_head %-4lld %.2f / %.2f   %lld / %lld (%.0f%% saved)\n",
                e["n_kv_head"].get<long long>(),
                e["samples"]["paged"]["prompt_copies"].get<double>(),
                e["samples"]["contiguous"]["prompt_copies"].get<double>(),
                sys["paged"]["prefill_positions"].get<long long>(),
                sys["paged_no_prefix_caching"]["prefill_positions"].get<long long>(),
                100.0 * (1.0 - sys["paged"]["prefill_positions"].get<double>() /
                                   sys["paged_no_prefix_caching"]["prefill_positions"].get<double>()));
  }
  std::printf("\nmeasured on the model (n_kv_head %lld, %d threads; medians of alternating rounds, "
              "[min, max]):\n",
              m["n_kv_head"].get<long long>(), r["threads"].get<int>());
  auto sp = [](const json& v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f [%.1f, %.1f]", v["median"].get<double>(),
                  v["min"].get<double>(), v["max"].get<double>());
    return std::string(buf);
  };
  for (const json& d : r["decode"])
    std::printf("  decode tok/s at batch %-3lld paged %s, contiguous %s; paged / contiguous "
                "per round %.3f [%.3f, %.3f]\n",
                d["batch"].get<long long>(), sp(d["paged_tokens_per_s"]).c_str(),
                sp(d["contiguous_tokens_per_s"]).c_str(), d["ratio"]["median"].get<double>(),
                d["ratio"]["min"].get<double>(), d["ratio"]["max"].get<double>());
  const json& pc = r["prefix_caching"];
  std::printf("  TTFT ms, system prompt %lld + user %lld tokens: prefix caching on %s, off %s "
              "(prefill positions %lld / %lld)\n",
              pc["system_prompt"].get<long long>(), pc["user_tokens"].get<long long>(),
              sp(pc["ttft_ms"]["on"]).c_str(), sp(pc["ttft_ms"]["off"]).c_str(),
              pc["prefill_positions"]["on"].get<long long>(),
              pc["prefill_positions"]["off"].get<long long>());
  const json& sm = r["samples"];
  std::printf("  %lld samples of a %lld-token prompt, %lld new tokens each: %s forked, %s as "
              "independent rows, %s contiguous\n",
              sm["samples"].get<long long>(), sm["prompt_tokens"].get<long long>(),
              sm["new_tokens"].get<long long>(), mib(sm["forked_bytes"].get<double>()).c_str(),
              mib(sm["independent_bytes"].get<double>()).c_str(),
              mib(sm["contiguous_bytes"].get<double>()).c_str());
}

void run_bench_kv_memory(BenchArgs& a) {
  check_json_path(a);
  BenchKVMemoryOptions& o = a.kv_memory;
  KVLAB_USAGE_CHECK(o.requests >= 1, "--requests must be >= 1, got ", o.requests);
  KVLAB_USAGE_CHECK(o.samples >= 1, "--samples must be >= 1, got ", o.samples);
  KVLAB_USAGE_CHECK(o.rounds >= 1, "--rounds must be >= 1, got ", o.rounds);
  auto [model, tok] = bench_model(a);
  check_kv_heads(a);
  o.kv_heads = a.kv_heads;
  o.seed = a.seed;
  o.cache_dtype = parse_storage_dtype(a.kv_dtype);
  const std::optional<PagedCacheOptions> paged =
      parse_kv_cache(a.kv, a.cfg.block_size, Device::CPU);
  KVLAB_USAGE_CHECK(paged.has_value(), "bench kv-memory compares the paged cache with the "
                                       "contiguous one: --cache does not apply");
  o.kv_block_size = paged->kv_block_size;
  o.budget_bytes = paged->pool_bytes;
  KVLAB_USAGE_CHECK(o.system_prompt >= 0 && o.system_prompt <= a.cfg.block_size - 2,
                    "--system-prompt must be 0 to block_size - 2 = ", a.cfg.block_size - 2,
                    " tokens, got ", o.system_prompt);
  o.decode_prompt = std::min<int64_t>(64, a.cfg.block_size / 4);
  o.decode_new_tokens = std::min<int64_t>(128, a.cfg.block_size - o.decode_prompt);
  o.progress = [](const std::string& line) {
    std::fprintf(stderr, "kvlab bench: %s\n", line.c_str());
  };
  json r = bench_kv_memory(*model, tok, o);
  print_kv_memory(r);
  if (!a.json_path.empty()) {
    r["checkpoint"] = a.ckpt;
    r["machine"] = machine_json();
    write_file_atomic(a.json_path, r.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
    std::printf("\nwrote %s\n", a.json_path.c_str());
  }
}

const char* const kServeHeader = "%-14s%-12s%10s%12s%22s%22s%20s%8s%8s%10s\n";

// One row of a served run: a side's figures.
void print_served_row(const json& run, const char* side, const char* label) {
  const json& x = run[side];
  const std::string rate = run["rate"].is_string()
                               ? run["rate"].get<std::string>()
                               : detail::cat(run["rate"].get<double>(), " req/s");
  char ttft[32], tpot[32], itl[32];
  std::snprintf(ttft, sizeof ttft, "%.1f / %.1f", x["ttft_ms"]["p50"].get<double>(),
                x["ttft_ms"]["p99"].get<double>());
  std::snprintf(tpot, sizeof tpot, "%.2f / %.2f", x["tpot_ms"]["p50"].get<double>(),
                x["tpot_ms"]["p99"].get<double>());
  std::snprintf(itl, sizeof itl, "%.2f / %.2f", x["itl_ms"]["p50"].get<double>(),
                x["itl_ms"]["p99"].get<double>());
  std::printf("%-14s%-12s%10.2f%12.0f%22s%22s%20s%8.3f%8lld%10s\n", rate.c_str(), label,
              x["requests_per_s"].get<double>(), x["output_tokens_per_s"].get<double>(), ttft,
              tpot, itl, x["kv_utilisation"].get<double>(), x["peak_sequences"].get<long long>(),
              x.contains("preemptions") ? std::to_string(x["preemptions"].get<long long>()).c_str()
                                        : "-");
}

// A ratio's median over rounds with its range: "0.912 (min 0.851, max 0.944)".
std::string spread_text(const json& spread) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f (min %.3f, max %.3f)", spread["median"].get<double>(),
                spread["min"].get<double>(), spread["max"].get<double>());
  return buf;
}

void print_serve(const json& r) {
  const json& m = r["model"];
  std::printf(
      "\nkvlab bench serve: %lld layers, %lld heads, %lld kv heads, n_embd %lld, context %lld; "
      "%lld requests, KV memory %s for both (static batches of up to %lld full-context rows; "
      "paged blocks of %lld, at most %lld tokens a step); %d threads, greedy\n\n",
      m["n_layer"].get<long long>(), m["n_head"].get<long long>(), m["n_kv_head"].get<long long>(),
      m["n_embd"].get<long long>(), m["block_size"].get<long long>(),
      r["requests"].get<long long>(), mib(r["budget_bytes"].get<double>()).c_str(),
      r["static_slots"].get<long long>(), r["kv_block_size"].get<long long>(),
      r["max_batch_tokens"].get<long long>(), r["threads"].get<int>());
  std::printf(kServeHeader, "arrivals", "batching", "req/s", "tok/s", "TTFT ms p50 / p99",
              "TPOT ms p50 / p99", "ITL ms p50 / p99", "KV use", "peak", "preempt");
  for (const json& run : r["runs"]) {
    print_served_row(run, "static_contiguous", "static");
    print_served_row(run, "continuous_paged", "continuous");
    if (run.contains("continuous_http")) print_served_row(run, "continuous_http", "HTTP");
    std::printf("%-14s%-12s%9.2fx\n", "", "ratio", run["throughput_ratio"].get<double>());
  }
  if (r.contains("http_overhead")) {
    const json& h = r["http_overhead"];
    std::printf("\none stream of %lld + %lld tokens, %lld rounds: in process %.1f tok/s "
                "(through the scheduler %.1f), over HTTP (stream interval %g ms) %.1f tok/s, "
                "HTTP / in process %s\n  the server's side alone (its socket read per %lld KiB, "
                "not per chunk): %s\n",
                h["prompt_tokens"].get<long long>(), h["new_tokens"].get<long long>(),
                h["rounds"].get<long long>(), h["in_process_tokens_per_s"].get<double>(),
                h["scheduler_tokens_per_s"].get<double>(), h["stream_interval_ms"].get<double>(),
                h["http_tokens_per_s"].get<double>(), spread_text(h["ratio"]).c_str(),
                h["batched_reads_bytes"].get<long long>() / 1024,
                spread_text(h["batched_reads_ratio"]).c_str());
    if (h.contains("many_streams")) {
      const json& s = h["many_streams"];
      std::printf("%lld streams at once, %lld + %lld tokens each: through the scheduler in "
                  "process %.1f tok/s, over HTTP (one client thread reading every stream) %.1f "
                  "tok/s, HTTP / in process %s\n  the server's side alone: %s\n",
                  s["streams"].get<long long>(), h["prompt_tokens"].get<long long>(),
                  s["new_tokens"].get<long long>(), s["scheduler_tokens_per_s"].get<double>(),
                  s["http_tokens_per_s"].get<double>(), spread_text(s["ratio"]).c_str(),
                  spread_text(s["batched_reads_ratio"]).c_str());
    }
  }
}

// bench serve --url: the workload against a running OpenAI-compatible server, over HTTP only.
void run_bench_serve_url(BenchArgs& a) {
  const BenchServeOptions& o = a.serve;
  const ServedModel m = served_model(a.url);
  const std::vector<KVRequest> reqs = make_kv_workload(
      {.requests = o.requests, .context = m.context, .samples = o.samples,
       .system_prompt = o.system_prompt, .shared_fraction = o.shared_fraction,
       .vocab_size = m.vocab_size, .seed = a.seed});
  json r{{"url", a.url}, {"model", m.id}, {"context", m.context}, {"requests", o.requests},
         {"runs", json::array()}};
  std::vector<double> rates = o.rates;
  if (rates.empty()) rates.push_back(0);
  for (const double rate : rates) {
    json run{{"rate", rate > 0 ? json(rate) : json("all at once")}};
    run["continuous_http"] = replay_over_http(
        a.url, m.id, reqs, ServeTimeline(poisson_arrivals(reqs.size(), rate, a.seed), o.samples));
    std::fprintf(stderr, "kvlab bench: %s done\n", run["rate"].dump().c_str());
    r["runs"].push_back(run);
  }
  std::printf("\nkvlab bench serve --url %s: model %s, context %lld, %lld requests, greedy, "
              "one streamed connection each\n\n",
              a.url.c_str(), m.id.c_str(), static_cast<long long>(m.context),
              static_cast<long long>(o.requests));
  std::printf(kServeHeader, "arrivals", "batching", "req/s", "tok/s", "TTFT ms p50 / p99",
              "TPOT ms p50 / p99", "ITL ms p50 / p99", "KV use", "peak", "preempt");
  for (const json& run : r["runs"]) print_served_row(run, "continuous_http", "HTTP");
  if (!a.json_path.empty()) {
    r["machine"] = machine_json();
    write_file_atomic(a.json_path, r.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
    std::printf("\nwrote %s\n", a.json_path.c_str());
  }
}

void run_bench_serve(BenchArgs& a) {
  check_json_path(a);
  BenchServeOptions& o = a.serve;
  KVLAB_USAGE_CHECK(o.requests >= 1, "--requests must be >= 1, got ", o.requests);
  KVLAB_USAGE_CHECK(o.samples >= 1, "--samples must be >= 1, got ", o.samples);
  KVLAB_USAGE_CHECK(o.shared_fraction >= 0 && o.shared_fraction <= 1,
                    "--shared-fraction must be in [0, 1], got ", o.shared_fraction);
  for (const double r : o.rates)
    KVLAB_USAGE_CHECK(std::isfinite(r) && r > 0, "--rates must be > 0 requests/s, got ", r);
  if (!a.url.empty()) {
    KVLAB_USAGE_CHECK(a.url.rfind("http://", 0) == 0, "--url must be http://HOST:PORT, got '",
                      a.url, "'");
    KVLAB_USAGE_CHECK(!a.http && a.ckpt.empty(), "--url replays against a running server: "
                                                 "--http and --ckpt do not apply");
    run_bench_serve_url(a);
    return;
  }
  KVLAB_USAGE_CHECK(o.max_batch_tokens >= 1, "--max-batch-tokens must be >= 1, got ",
                    o.max_batch_tokens);
  KVLAB_USAGE_CHECK(a.http_streams >= 1, "--http-streams must be >= 1, got ", a.http_streams);
  auto [model, tok] = bench_model(a);
  o.seed = a.seed;
  o.cache_dtype = parse_storage_dtype(a.kv_dtype);
  const std::optional<PagedCacheOptions> paged =
      parse_kv_cache(a.kv, a.cfg.block_size, Device::CPU);
  KVLAB_USAGE_CHECK(paged.has_value(), "bench serve compares continuous batching over the paged "
                                       "cache with static batching over contiguous ones: --cache "
                                       "does not apply");
  o.kv_block_size = paged->kv_block_size;
  o.budget_bytes = paged->pool_bytes;
  auto bars = std::make_shared<TaskBars>("kvlab bench: serving, ", "req");
  o.on_requests = [bars](const std::string& side, int64_t done, int64_t total) {
    bars->update(side, done, total);
  };
  o.progress = [bars](const std::string& line) { bars->line("kvlab bench: " + line); };
  if (a.http) {
    o.over_http = [&](const std::vector<KVRequest>& reqs, ServeTimeline t,
                      const SchedulerOptions& scheduler) {
      Engine engine(*model, tok, o.cache_dtype);
      ServeOptions so;
      so.port = 0;
      so.model_name = "bench";
      so.scheduler = scheduler;
      so.max_connections = o.requests + 8;  // every request may be in flight at once
      so.stream_interval_s = a.stream_interval_ms / 1e3;
      Server server(engine, so);
      const std::string url = detail::cat("http://127.0.0.1:", server.bind());
      std::thread serving([&] { server.run(); });
      json side;
      try {
        side = replay_over_http(url, "bench", reqs, std::move(t));
      } catch (...) {
        server.stop();
        serving.join();
        throw;
      }
      server.stop();
      serving.join();
      return side;
    };
  }
  json r = bench_serve(*model, tok, o);
  if (a.http) {
    const int64_t context = model->config().block_size;
    r["http_overhead"] = http_overhead(*model, tok, 16, std::min<int64_t>(1000, context - 16), 9,
                                       a.stream_interval_ms / 1e3, a.http_streams);
  }
  print_serve(r);
  if (!a.json_path.empty()) {
    r["checkpoint"] = a.ckpt;
    r["machine"] = machine_json();
    write_file_atomic(a.json_path, r.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
    std::printf("\nwrote %s\n", a.json_path.c_str());
  }
}

// The random model's shape flags (a checkpoint brings its own); returns --n-kv-head.
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

void add_kv_memory_command(CLI::App* bench) {
  auto args = std::make_shared<BenchArgs>();
  args->cfg.n_layer = 4;
  args->cfg.block_size = 1024;
  CLI::App* cmd = bench->add_subcommand(
      "kv-memory",
      "The paged KV cache against contiguous max-length allocation at the same KV memory: "
      "utilisation and resident sequences under a serving workload for each n_kv_head, prompt "
      "sharing, prefix caching, and decode speed");
  CLI::Option* ckpt =
      cmd->add_option("--ckpt", args->ckpt, "Checkpoint to measure (default: random weights)");
  CLI::Option* n_kv_head = add_shape_flags(cmd, *args, ckpt);
  cmd->add_option("--kv-heads", args->kv_heads,
                  "n_kv_head settings of the workload (default NH, NH/2, NH/4, NH/8)")
      ->check(integer_of<int64_t>())
      ->delimiter(',');
  add_number(cmd, "--kv-block-size", args->kv.block_size,
             "Positions per block of the paged cache: a power of two, at most the context");
  cmd->add_option("--kv-memory", args->kv.memory,
                  "The KV memory both layouts get, e.g. 64MiB (default: 16 full-context "
                  "sequences of the multi-head model)");
  add_number(cmd, "--requests", args->kv_memory.requests, "Requests of the workload");
  add_number(cmd, "--samples", args->kv_memory.samples,
             "Parallel samples per request in the sampling case");
  add_number(cmd, "--system-prompt", args->kv_memory.system_prompt,
             "Tokens of the shared system prompt case (default: a quarter of the context)");
  add_number(cmd, "--rounds", args->kv_memory.rounds,
             "Alternating rounds of each timed comparison (medians reported)");
  add_kv_dtype_flag(cmd, args->kv_dtype);
  add_number(cmd, "--seed", args->seed, "Seed of the workload, the random weights and prompts");
  add_json_flag(cmd, args->json_path);
  cmd->callback([args, n_kv_head] {
    args->n_kv_head_given = n_kv_head->count() > 0;
    run_bench_kv_memory(*args);
  });
}

void add_serve_command(CLI::App* bench) {
  auto args = std::make_shared<BenchArgs>();
  args->cfg.n_layer = 4;
  args->cfg.block_size = 1024;
  CLI::App* cmd = bench->add_subcommand(
      "serve",
      "A stream of requests served by continuous batching over the paged KV cache and by "
      "static batching over contiguous caches, at the same KV memory: throughput, TTFT, TPOT");
  CLI::Option* ckpt =
      cmd->add_option("--ckpt", args->ckpt, "Checkpoint to serve (default: random weights)");
  CLI::Option* n_kv_head = add_shape_flags(cmd, *args, ckpt);
  add_number(cmd, "--requests", args->serve.requests,
             "Requests of the workload (kv-memory's lengths, one sample each)");
  cmd->add_option("--rates", args->serve.rates,
                  "Poisson arrival rates in requests/s, one run each (default: every request "
                  "at once)")
      ->delimiter(',');
  add_number(cmd, "--max-batch-tokens", args->serve.max_batch_tokens,
             "Positions a continuous-batching step computes (decodes, then prefill chunks)");
  add_number(cmd, "--kv-block-size", args->kv.block_size,
             "Positions per block of the paged cache: a power of two, at most the context");
  cmd->add_option("--kv-memory", args->kv.memory,
                  "The KV memory both sides get, e.g. 64MiB (default: 16 full-context "
                  "sequences)");
  add_kv_dtype_flag(cmd, args->kv_dtype);
  add_number(cmd, "--seed", args->seed, "Seed of the workload and the random weights");
  cmd->add_flag("--http", args->http,
                detail::cat("Also serve the workload through kvlab serve on loopback, one "
                            "streamed HTTP connection per request, and measure one stream's "
                            "tokens/s over HTTP against in process, and --http-streams "
                            "streams at once against the same requests through the scheduler "
                            "in process (the streams read by one client thread that waits "
                            "on all their sockets and reads each chunk as it comes); each "
                            "also with sockets read per ",
                            kBatchedReadBytes / 1024,
                            " KiB instead of per chunk (the server's side alone, where the "
                            "client shares the machine's cores)"));
  cmd->add_option("--url", args->url,
                  "Replay the workload against a running server at this URL (http://HOST:PORT) "
                  "instead, over HTTP only: kvlab serve, or another OpenAI-compatible one "
                  "whose GET /v1/models gives the context and vocabulary (llama-server does) "
                  "and whose /v1/completions takes token ids, streams with usage and "
                  "honours ignore_eos");
  add_number(cmd, "--stream-interval", args->stream_interval_ms,
             "With --http: the server's --stream-interval (ms)");
  add_number(cmd, "--http-streams", args->http_streams,
             "With --http: the streams at once of the many-streams measurement (1: none)");
  add_number(cmd, "--samples", args->serve.samples,
             "Samples a request asks for (n): sequences that share its prompt");
  add_number(cmd, "--system-prompt", args->serve.system_prompt,
             "Tokens a shared prefix has: the prompts of --shared-fraction of the requests "
             "start with it, and the paged side's prefix cache holds it once");
  add_number(cmd, "--shared-fraction", args->serve.shared_fraction,
             "The fraction of requests whose prompts start with the --system-prompt prefix");
  add_json_flag(cmd, args->json_path);
  cmd->callback([args, n_kv_head] {
    args->n_kv_head_given = n_kv_head->count() > 0;
    run_bench_serve(*args);
  });
}

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
  const std::vector<int32_t> val = checkpoint_validation_ids(loaded, a.data, &data);
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
  if (!a.json_path.empty()) {
    const json out{{"checkpoint", a.ckpt},   {"data", data},
                   {"windows", a.windows},   {"block_size", c.block_size},
                   {"n_kv_head", c.n_kv_head}, {"quality", kv_quality_json(q)},
                   {"machine", machine_json()}};
    write_file_atomic(a.json_path, out.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
    std::printf("\nwrote %s\n", a.json_path.c_str());
  }
}

void run_bench_weight_quality(BenchArgs& a) {
  check_json_path(a);
  KVLAB_USAGE_CHECK(a.windows >= 1, "--windows must be >= 1, got ", a.windows);
  const std::vector<WeightDtype> dtypes = parse_weight_dtypes(a.weight_dtypes);
  LoadedModel loaded = load_model(a.ckpt);
  const GPT& model = *loaded.model;
  std::string data;
  const std::vector<int32_t> val = checkpoint_validation_ids(loaded, a.data, &data);
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
  if (!a.json_path.empty()) {
    const json out{{"checkpoint", a.ckpt},        {"data", data},
                   {"windows", a.windows},        {"block_size", c.block_size},
                   {"n_kv_head", c.n_kv_head},    {"f32_decode_weight_bytes", f32_bytes},
                   {"quality", rows},             {"machine", machine_json()}};
    write_file_atomic(a.json_path, out.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
    std::printf("\nwrote %s\n", a.json_path.c_str());
  }
}

// kv-quality's options (--ckpt, --data, --windows, --json) on cmd.
void add_quality_options(CLI::App* cmd, BenchArgs& args) {
  cmd->add_option("--ckpt", args.ckpt, "Checkpoint to evaluate")->required();
  cmd->add_option("--data", args.data,
                  "Corpus whose validation split is evaluated (default: the checkpoint's "
                  "training corpus, split as it was)");
  add_number(cmd, "--windows", args.windows,
             "Validation windows of block_size tokens, drawn at fixed places");
  add_json_flag(cmd, args.json_path);
}

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

}  // namespace

void add_bench_command(CLI::App& root) {
  CLI::App* bench = root.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  auto args = std::make_shared<BenchArgs>();
  CLI::App* gen = bench->add_subcommand(
      "generate",
      "Decode speed with and without the KV cache, and cache memory against the formula");
  CLI::Option* ckpt =
      gen->add_option("--ckpt", args->ckpt, "Checkpoint to measure (default: random weights)");
  CLI::Option* n_kv_head = add_shape_flags(gen, *args, ckpt);
  gen->add_option("--kv-heads", args->kv_heads,
                  "n_kv_head settings for the cache report and speed by NKV (default NH, NH/2, "
                  "NH/4, NH/8)")
      ->check(integer_of<int64_t>())
      ->delimiter(',');
  gen->add_option("--new-tokens", args->new_tokens,
                  "New token counts (capped at block_size - prompt tokens)")
      ->check(integer_of<int64_t>())
      ->delimiter(',')
      ->capture_default_str();
  add_number(gen, "--prompt-tokens", args->prompt_tokens, "Prompt length");
  add_number(gen, "--batch", args->batch,
             "Rows decoded together, each from its own random prompt; tok/s counts every "
             "row's tokens. The ceiling is memory's: a large batch may be bound by "
             "arithmetic first");
  add_number(gen, "--runs", args->runs, "Measured runs per setting (median)");
  gen->add_flag("--skip-no-cache", args->skip_no_cache, "Measure with the cache only");
  gen->add_flag("--op-by-op", args->op_by_op,
                "Decode on the CPU op by op instead of the fused step (its baseline)");
  add_device_flags(gen, args->device, args->dtype);
  add_kv_dtype_flag(gen, args->kv_dtype);
  add_kv_cache_flags(gen, args->kv);
  add_weight_dtype_flag(gen, args->weight_dtype, args->int8_products);
  add_number(gen, "--seed", args->seed, "Seed of the random weights and prompt");
  add_json_flag(gen, args->json_path);
  gen->callback([args, n_kv_head] {
    args->n_kv_head_given = n_kv_head->count() > 0;
    run_bench_generate(*args);
  });
  add_kv_memory_command(bench);
  add_serve_command(bench);
  add_kv_quality_command(bench, args);
  add_weight_quality_command(bench, args);
}

}  // namespace kvlab
