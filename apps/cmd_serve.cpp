// kvlab serve: a checkpoint behind the OpenAI completions and chat API (serve/server.h).
#include <pthread.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "apps/cli.h"
#include "apps/train_flags.h"
#include "checkpoints/model_io.h"
#include "data/chat_template.h"
#include "serve/server.h"

namespace kvlab {

namespace {

struct ServeArgs {
  std::string ckpt;
  std::string model_name;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string kv_dtype = "f32";
  std::string weight_dtype = "f32";
  bool int8_products = false;
  int64_t kv_block_size = 16;
  std::string kv_memory;
  int64_t max_seqs = 64;
  int64_t max_batch_tokens = 512;
  int64_t max_tokens = 0;
  std::string max_body = "1MiB";
  int64_t max_connections = 128;
  int64_t max_waiting_connections = 4096;
  double header_timeout_s = 5;
  double keep_alive_timeout_s = 5;
  std::string min_body_rate = "16KiB";
  double write_timeout_s = 10;
  std::string send_buffer;  // empty: the kernel's
  int64_t max_request_tokens = 0;
  std::string api_key;
  double stream_interval_ms = 0;
  std::string chat_template;  // a file; empty: the model's own
};

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

// The flags as the server's options, each checked before the model loads (a usage error names
// the flag); the model's name and the KV pool, which take the model, are set once it has.
ServeOptions serve_options(const ServeArgs& a) {
  KVLAB_USAGE_CHECK(a.port >= 0 && a.port <= 65535, "--port must be in [0, 65535], got ", a.port);
  KVLAB_USAGE_CHECK(a.max_seqs >= 1, "--max-seqs must be >= 1, got ", a.max_seqs);
  KVLAB_USAGE_CHECK(a.max_batch_tokens >= a.max_seqs, "--max-batch-tokens (", a.max_batch_tokens,
                    ") must be at least --max-seqs (", a.max_seqs,
                    "): every running sequence decodes one token a step");
  KVLAB_USAGE_CHECK(a.max_tokens >= 0, "--max-tokens must be >= 0, got ", a.max_tokens);
  KVLAB_USAGE_CHECK(a.max_connections >= 1, "--max-connections must be >= 1, got ",
                    a.max_connections);
  KVLAB_USAGE_CHECK(a.stream_interval_ms >= 0, "--stream-interval must be >= 0 ms, got ",
                    a.stream_interval_ms);
  const int64_t max_body = parse_bytes(a.max_body, "--max-body");
  KVLAB_USAGE_CHECK(max_body >= 1, "--max-body must be at least 1 byte");
  KVLAB_USAGE_CHECK(a.max_waiting_connections >= 1, "--max-waiting-connections must be >= 1, got ",
                    a.max_waiting_connections);
  KVLAB_USAGE_CHECK(a.header_timeout_s > 0, "--header-timeout must be > 0 s, got ",
                    a.header_timeout_s);
  KVLAB_USAGE_CHECK(a.keep_alive_timeout_s > 0, "--keep-alive-timeout must be > 0 s, got ",
                    a.keep_alive_timeout_s);
  KVLAB_USAGE_CHECK(a.write_timeout_s > 0, "--write-timeout must be > 0 s, got ",
                    a.write_timeout_s);
  const int64_t min_body_rate = parse_bytes(a.min_body_rate, "--min-body-rate");
  KVLAB_USAGE_CHECK(min_body_rate >= 1, "--min-body-rate must be at least 1 byte/s");
  KVLAB_USAGE_CHECK(a.max_request_tokens >= 0, "--max-request-tokens must be >= 0, got ",
                    a.max_request_tokens);
  ServeOptions o;
  o.host = a.host;
  o.port = a.port;
  o.scheduler.max_seqs = a.max_seqs;
  o.scheduler.max_batch_tokens = a.max_batch_tokens;
  o.limits.max_tokens = a.max_tokens;
  o.limits.max_request_tokens = a.max_request_tokens;
  o.max_body_bytes = static_cast<size_t>(max_body);
  o.max_connections = a.max_connections;
  o.max_waiting_connections = a.max_waiting_connections;
  o.header_timeout_s = a.header_timeout_s;
  o.keep_alive_timeout_s = a.keep_alive_timeout_s;
  o.min_body_rate = static_cast<double>(min_body_rate);
  o.write_timeout_s = a.write_timeout_s;
  o.send_buffer_bytes = a.send_buffer.empty() ? 0 : parse_bytes(a.send_buffer, "--send-buffer");
  o.api_key = a.api_key;
  if (o.api_key.empty())
    if (const char* env = std::getenv("KVLAB_API_KEY")) o.api_key = env;
  o.stream_interval_s = a.stream_interval_ms / 1e3;
  return o;
}

// SIGINT and SIGTERM, taken by one thread (sigwait) that stops the server. Blocked before any
// thread starts, so that every thread inherits the mask; a write to a client that left fails
// instead of killing the process.
class StopSignals {
 public:
  StopSignals() {
    std::signal(SIGPIPE, SIG_IGN);
    sigemptyset(&signals_);
    sigaddset(&signals_, SIGINT);
    sigaddset(&signals_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &signals_, nullptr);
  }
  void watch(Server& server) {
    watcher_ = std::thread([this, &server] {
      int sig = 0;
      sigwait(&signals_, &sig);
      if (done_) return;  // woken by join: the server stopped, or is gone
      if (sig != 0)
        std::fprintf(stderr, "kvlab: %s: stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
      server.stop();
    });
  }
  // Ends the watcher; before the server it watches is destroyed.
  void join() {
    if (!watcher_.joinable()) return;
    done_ = true;
    pthread_kill(watcher_.native_handle(), SIGTERM);  // wakes it if no signal stopped the server
    watcher_.join();
  }
  ~StopSignals() { join(); }

 private:
  sigset_t signals_;
  std::atomic<bool> done_{false};
  std::thread watcher_;
};

void print_serving(const ServeArgs& a, const ServeOptions& o, int port, Engine& engine,
                   const GPTConfig& mc) {
  const std::string attention =
      mc.mla() ? detail::cat("MLA rank ", mc.kv_lora_rank, " + ", mc.rope_head_dim)
               : detail::cat("n_kv_head ", mc.n_kv_head);
  std::fprintf(stderr,
               "kvlab: serving %s on http://%s:%d (%s, %s matrices%s, context %lld, up to %lld "
               "sequences; POST /v1/completions /v1/chat/completions, GET /v1/models /health "
               "/metrics)\n",
               o.model_name.c_str(), a.host.c_str(), port, attention.c_str(),
               a.weight_dtype.c_str(),
               engine.decode_step().multiplies_in_integers() ? " in integer products" : "",
               static_cast<long long>(mc.block_size), static_cast<long long>(a.max_seqs));
  if (o.chat_template.empty()) {
    std::fprintf(stderr, "kvlab: note: no chat template (the model has none, and no "
                         "--chat-template): /v1/chat/completions answers 400\n");
  } else {
    try {
      ChatTemplate check(o.chat_template);
    } catch (const Error& e) {
      std::fprintf(stderr, "kvlab: warning: /v1/chat/completions answers 400: %s\n", e.what());
    }
  }
  if (o.api_key.empty() && !is_loopback(a.host))
    std::fprintf(stderr,
                 "kvlab: warning: serving on %s without an API key: anyone who can reach it may "
                 "use it (--api-key or KVLAB_API_KEY)\n",
                 a.host.c_str());
}

void run_serve(const ServeArgs& a) {
  ServeOptions o = serve_options(a);
  StopSignals stop_signals;
  LoadedModel loaded = load_model(a.ckpt);
  GPT& model = *loaded.model;
  o.model_name =
      a.model_name.empty() ? std::filesystem::path(a.ckpt).stem().string() : a.model_name;
  const KVCacheFlags kv{.layout = "paged", .block_size = a.kv_block_size, .memory = a.kv_memory};
  o.scheduler.cache = *parse_kv_cache(kv, model.config().block_size, Device::CPU);
  o.chat_template = chat_template_source(a.chat_template, loaded.tokenizer);
  model.round_matrices(parse_weight_dtype(a.weight_dtype));
  Engine engine(model, loaded.tokenizer, parse_storage_dtype(a.kv_dtype), std::nullopt);
  engine.decode_step().int8_products = a.int8_products;
  Server server(engine, o);
  const int port = server.bind();
  stop_signals.watch(server);
  print_serving(a, o, port, engine, model.config());
  server.run();
  stop_signals.join();
  std::fprintf(stderr, "kvlab: server stopped\n");
}

}  // namespace

void add_serve_command(CLI::App& root) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* cmd = root.add_subcommand(
      "serve",
      "Serve a checkpoint over HTTP with the OpenAI completions and chat API (POST "
      "/v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics): continuous "
      "batching over a paged KV cache (CPU)");
  cmd->add_option("--ckpt", args->ckpt,
                  "Checkpoint (.h5) written by kvlab train, or a GGUF model file")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option(
      "--model-name", args->model_name,
      "The model's id in the API (default: the model file's name without its extension)");
  cmd->add_option("--host", args->host, "Address to listen on (loopback by default)")
      ->capture_default_str();
  add_number(cmd, "--port", args->port, "Port to listen on; 0 picks a free one (printed)");
  add_kv_dtype_flag(cmd, args->kv_dtype);
  add_weight_dtype_flag(cmd, args->weight_dtype, args->int8_products);
  add_number(cmd, "--kv-block-size", args->kv_block_size,
             "Positions per KV cache block (a power of two, at most the context)");
  cmd->add_option("--kv-memory", args->kv_memory,
                  "The KV pool's size, e.g. 64MiB (default: room for --max-seqs sequences of "
                  "the whole context)");
  add_number(cmd, "--max-seqs", args->max_seqs, "Sequences admitted at once (a choice is one)");
  add_number(cmd, "--max-batch-tokens", args->max_batch_tokens,
             "Positions one step computes: a decode is 1, a prefill chunk its length");
  add_number(cmd, "--max-tokens", args->max_tokens,
             "The largest max_tokens a request may ask (0: the model's context)");
  cmd->add_option("--max-body", args->max_body, "Largest request body (a size, e.g. 1MiB)")
      ->capture_default_str();
  add_number(cmd, "--max-connections", args->max_connections,
             "Requests read, handled and answered at once (a thread each); a request beyond "
             "them is answered 503 with Retry-After: 1. Idle connections and ones still sending "
             "their headers hold no thread");
  add_number(cmd, "--max-waiting-connections", args->max_waiting_connections,
             "Idle connections (and ones still sending their headers) kept at once; a new one "
             "beyond them is answered 503");
  add_number(cmd, "--header-timeout", args->header_timeout_s,
             "Seconds a request line and headers may take from their first byte (from the "
             "connection's start for a new one); then 408 and closed. Also a body's grace");
  add_number(cmd, "--keep-alive-timeout", args->keep_alive_timeout_s,
             "Seconds an idle kept-alive connection is kept between requests");
  cmd->add_option("--min-body-rate", args->min_body_rate,
                  "Bytes per second a request body must arrive at, after --header-timeout "
                  "seconds of grace; a slower one fails (400) and its connection closes")
      ->capture_default_str();
  add_number(cmd, "--write-timeout", args->write_timeout_s,
             "Seconds a write may wait for the client to take bytes; then the connection is "
             "cut, and a stream's sequences are aborted (their KV blocks freed)");
  cmd->add_option("--send-buffer", args->send_buffer,
                  "A connection's send buffer, e.g. 256KiB (default: the kernel's, which grows "
                  "to megabytes): what a client that stops reading may leave unread before "
                  "--write-timeout starts to run");
  add_number(cmd, "--max-request-tokens", args->max_request_tokens,
             "The most KV positions one request may hold: n * (prompt tokens + max_tokens), "
             "over its prompts; more is a 400 (0: half the KV pool, or one context where that is "
             "more)");
  cmd->add_option("--api-key", args->api_key,
                  "Require 'Authorization: Bearer KEY' on every endpoint but /health (401 "
                  "otherwise); default: the KVLAB_API_KEY environment variable, else none");
  add_number(cmd, "--stream-interval", args->stream_interval_ms,
             "Milliseconds a stream gathers tokens before it sends them (its first at once); "
             "0 sends each as it is made. A few ms spare the model's steps the cost of a send "
             "per token where the server's cores all compute");
  add_chat_template_flag(cmd, args->chat_template);
  cmd->callback([args] { run_serve(*args); });
}

}  // namespace kvlab
