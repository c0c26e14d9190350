// kvlab serve: a checkpoint behind the OpenAI completions API (apps/serve/server.h).
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "apps/cli.h"
#include "apps/serve/server.h"
#include "apps/train_flags.h"
#include "checkpoints/model_io.h"

namespace kvlab {

namespace {

struct ServeArgs {
  std::string ckpt;
  std::string model_name;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string kv_dtype = "f32";
  std::string weight_dtype = "f32";
  int64_t kv_block_size = 16;
  std::string kv_memory;
  int64_t max_seqs = 64;
  int64_t max_batch_tokens = 512;
  int64_t max_tokens = 0;
  std::string max_body = "1MiB";
  int64_t max_connections = 128;
  double stream_interval_ms = 0;
};

void run_serve(const ServeArgs& a) {
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

  // SIGINT and SIGTERM are taken by one thread (sigwait): blocked here, before any thread
  // starts, so that every thread inherits the mask. A write to a client that left fails
  // instead of killing the process.
  std::signal(SIGPIPE, SIG_IGN);
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  LoadedModel loaded = load_model(a.ckpt);
  GPT& model = *loaded.model;
  if (parse_storage_dtype(a.weight_dtype) == DType::BF16) model.round_matrices_to_bf16();
  const int64_t context = model.config().block_size;
  KVCacheFlags kv{.layout = "paged", .block_size = a.kv_block_size, .memory = a.kv_memory};
  Engine engine(model, loaded.tokenizer, parse_storage_dtype(a.kv_dtype), std::nullopt);

  ServeOptions o;
  o.host = a.host;
  o.port = a.port;
  o.model_name = a.model_name.empty() ? std::filesystem::path(a.ckpt).stem().string() : a.model_name;
  o.scheduler.max_seqs = a.max_seqs;
  o.scheduler.max_batch_tokens = a.max_batch_tokens;
  o.scheduler.cache = *parse_kv_cache(kv, context, Device::CPU);
  o.limits.max_tokens = a.max_tokens;
  o.max_body_bytes = static_cast<size_t>(max_body);
  o.max_connections = a.max_connections;
  o.stream_interval_s = a.stream_interval_ms / 1e3;
  Server server(engine, o);
  const int port = server.bind();

  std::thread watcher([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    if (sig != 0) std::fprintf(stderr, "kvlab: %s: stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    server.stop();
  });
  const GPTConfig& mc = model.config();
  const std::string attention =
      mc.mla() ? detail::cat("MLA rank ", mc.kv_lora_rank, " + ", mc.rope_head_dim)
               : detail::cat("n_kv_head ", mc.n_kv_head);
  std::fprintf(stderr,
               "kvlab: serving %s on http://%s:%d (%s, context %lld, up to %lld "
               "sequences; POST /v1/completions, GET /v1/models /health /metrics)\n",
               o.model_name.c_str(), a.host.c_str(), port, attention.c_str(),
               static_cast<long long>(context), static_cast<long long>(a.max_seqs));
  server.run();
  pthread_kill(watcher.native_handle(), SIGTERM);  // wakes it if no signal stopped the server
  watcher.join();
  std::fprintf(stderr, "kvlab: server stopped\n");
}

}  // namespace

void add_serve_command(CLI::App& root) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* cmd = root.add_subcommand(
      "serve",
      "Serve a checkpoint over HTTP with the OpenAI completions API (POST /v1/completions, "
      "GET /v1/models, /health, /metrics): continuous batching over a paged KV cache (CPU)");
  cmd->add_option("--ckpt", args->ckpt, "Checkpoint file (HDF5) written by kvlab train")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--model-name", args->model_name,
                  "The model's id in the API (default: the checkpoint's file name without .h5)");
  cmd->add_option("--host", args->host, "Address to listen on (loopback by default)")
      ->capture_default_str();
  add_number(cmd, "--port", args->port, "Port to listen on; 0 picks a free one (printed)");
  add_kv_dtype_flag(cmd, args->kv_dtype);
  add_weight_dtype_flag(cmd, args->weight_dtype);
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
             "Connections served at once (a thread each); more wait to be accepted");
  add_number(cmd, "--stream-interval", args->stream_interval_ms,
             "Milliseconds a stream gathers tokens before it sends them (its first at once); "
             "0 sends each as it is made. A few ms spare the model's steps the cost of a send "
             "per token where the server's cores all compute");
  cmd->callback([args] { run_serve(*args); });
}

}  // namespace kvlab
