// kvlab bench kv-memory: the paged cache against contiguous allocation at one KV memory.
#include "apps/bench/bench_common.h"

#include <cstdio>

#include "apps/cli.h"
#include "platform/atomic_file.h"

namespace kvlab::bench_cli {

namespace {

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
  r["checkpoint"] = a.ckpt;
  write_json(a, r);
}

}  // namespace

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
      cmd->add_option("--ckpt", args->ckpt,
                      "Checkpoint (.h5) or GGUF model file to measure (default: random weights)");
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

}  // namespace kvlab::bench_cli
