#pragma once
// kvlab serve: the OpenAI completions and chat completions API over HTTP (cpp-httplib), a thin layer over the
// scheduler. One thread runs the scheduler: it takes the requests the HTTP threads queue,
// steps, and hands each step's events to the calls they belong to; an HTTP thread waits on
// its call and writes the response, or streams it as server-sent events (on few cores the
// scheduler thread writes a stream's chunks itself). A call whose client
// went away (a failed write) has its sequences aborted, which frees their blocks.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "infer/engine.h"
#include "infer/scheduler.h"
#include "serve/openai.h"

namespace kvlab {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (bind() says which)
  std::string model_name = "kvlab";
  // The chat template of /v1/chat/completions (data/chat_template.h); empty: the model's own
  // (Tokenizer::controls().chat_template), and where it has none the endpoint answers 400.
  std::string chat_template;
  SchedulerOptions scheduler;
  ApiLimits limits;
  size_t max_body_bytes = 1 << 20;
  // Requests read, handled and answered at once (a thread each); a request beyond them is
  // answered 503 with Retry-After. Idle connections and ones still sending their headers wait
  // apart (serve/connections.h), up to max_waiting_connections.
  int64_t max_connections = 128;
  int64_t max_waiting_connections = 4096;
  // Deadlines (serve/connections.h): request line and headers within header_timeout_s of
  // their first byte (408 after); an idle kept-alive connection closed after
  // keep_alive_timeout_s; a body at min_body_rate bytes/s or faster (after header_timeout_s);
  // a write the client does not take within write_timeout_s fails, and a stream's sequences
  // are then aborted.
  double header_timeout_s = 5;
  double keep_alive_timeout_s = 5;
  double min_body_rate = 16384;
  double write_timeout_s = 10;
  // A connection's send buffer (0: the kernel's, which grows to megabytes): what a client that
  // stopped reading may leave unread before the write deadline starts to run.
  int64_t send_buffer_bytes = 0;
  // When not empty, every endpoint but /health requires "Authorization: Bearer <api_key>".
  std::string api_key;
  // A stream sends its first piece at once, then what has accumulated once its oldest
  // unsent piece is this old (and at the end): 0 sends every token as it is made. Each send
  // costs a send() and wakes the client, which on a machine whose cores all compute take their
  // time from the model's steps; a few milliseconds cut that cost by the tokens each send then
  // carries.
  double stream_interval_s = 0;
  // Who writes a stream's chunks while it has nothing unsent: the scheduler thread, a send per
  // stream per step (true), or the stream's HTTP thread, woken per chunk (false). Unset: the
  // scheduler thread where the model's threads take every core (a thread woken per chunk would
  // take one from the next step), the HTTP threads where a core is left free (they send there
  // while the step runs).
  std::optional<bool> scheduler_writes_streams;
};

class Server {
 public:
  // Borrows the engine (CPU, paged cache) for its life. Throws kvlab::Error naming a bad
  // option.
  Server(Engine& engine, ServeOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds host:port; returns the port. Throws kvlab::Error naming the address.
  int bind();
  // Serves until stop(); then aborts what is still running and returns.
  void run();
  // Any thread, any number of times.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlab
