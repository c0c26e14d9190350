// kvlab bench serve: continuous against static batching of a request stream, in process and
// over HTTP (an in-process kvlab serve, or --url any OpenAI-compatible server).
#include "apps/bench/bench_common.h"

#include <cstdio>
#include <thread>

#include "apps/bench/http_bench.h"
#include "apps/cli.h"
#include "apps/progress.h"
#include "platform/atomic_file.h"
#include "serve/server.h"

namespace kvlab::bench_cli {

namespace {

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
  write_json(a, r);
}

// The workload's flags, whichever server replays it.
void check_workload(const BenchServeOptions& o) {
  KVLAB_USAGE_CHECK(o.requests >= 1, "--requests must be >= 1, got ", o.requests);
  KVLAB_USAGE_CHECK(o.samples >= 1, "--samples must be >= 1, got ", o.samples);
  KVLAB_USAGE_CHECK(o.shared_fraction >= 0 && o.shared_fraction <= 1,
                    "--shared-fraction must be in [0, 1], got ", o.shared_fraction);
  for (const double r : o.rates)
    KVLAB_USAGE_CHECK(std::isfinite(r) && r > 0, "--rates must be > 0 requests/s, got ", r);
}

// --http: each continuous run replayed over HTTP against an in-process kvlab serve of the
// same scheduler options, on loopback.
auto over_http(GPT& model, const Tokenizer& tok, const BenchArgs& a) {
  return [&model, &tok, &a](const std::vector<KVRequest>& reqs, ServeTimeline t,
                            const SchedulerOptions& scheduler) {
    Engine engine(model, tok, a.serve.cache_dtype);
    ServeOptions so;
    so.port = 0;
    so.model_name = "bench";
    so.scheduler = scheduler;
    so.max_connections = a.serve.requests + 8;  // every request may be in flight at once
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

void run_bench_serve(BenchArgs& a) {
  check_json_path(a);
  BenchServeOptions& o = a.serve;
  check_workload(o);
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
  if (a.http) o.over_http = over_http(*model, tok, a);
  json r = bench_serve(*model, tok, o);
  if (a.http) {
    const int64_t context = model->config().block_size;
    r["http_overhead"] = http_overhead(*model, tok, 16, std::min<int64_t>(1000, context - 16), 9,
                                       a.stream_interval_ms / 1e3, a.http_streams);
  }
  print_serve(r);
  r["checkpoint"] = a.ckpt;
  write_json(a, r);
}

}  // namespace

void add_serve_command(CLI::App* bench) {
  auto args = std::make_shared<BenchArgs>();
  args->cfg.n_layer = 4;
  args->cfg.block_size = 1024;
  CLI::App* cmd = bench->add_subcommand(
      "serve",
      "A stream of requests served by continuous batching over the paged KV cache and by "
      "static batching over contiguous caches, at the same KV memory: throughput, TTFT, TPOT");
  CLI::Option* ckpt =
      cmd->add_option("--ckpt", args->ckpt,
                      "Checkpoint (.h5) or GGUF model file to serve (default: random weights)");
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

}  // namespace kvlab::bench_cli
