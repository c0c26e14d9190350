// kvlab bench generate: decode speed with and without the KV cache, time per token against
// position, and the cache's memory for several n_kv_head settings.
#include "apps/bench/bench_common.h"

#include <cstdio>
#include <functional>

#include "apps/cli.h"
#include "apps/progress.h"
#include "infer/kv_cache.h"
#include "platform/atomic_file.h"

namespace kvlab::bench_cli {

namespace {

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
  const json out{{"generate", gen},
                 {"cache_report", report},
                 {"decode_by_kv_heads", speed},
                 {"checkpoint", a.ckpt}};
  write_json(a, out);
}

}  // namespace

void add_generate_command(CLI::App* bench, const std::shared_ptr<BenchArgs>& args) {
  CLI::App* gen = bench->add_subcommand(
      "generate",
      "Decode speed with and without the KV cache, and cache memory against the formula");
  CLI::Option* ckpt =
      gen->add_option("--ckpt", args->ckpt,
                      "Checkpoint (.h5) or GGUF model file to measure (default: random weights)");
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
}

}  // namespace kvlab::bench_cli
