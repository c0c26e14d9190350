#pragma once
// kvlab serve: the OpenAI completions API over HTTP (cpp-httplib), a thin layer over the
// scheduler. One thread runs the scheduler: it takes the requests the HTTP threads queue,
// steps, and hands each step's events to the calls they belong to; an HTTP thread waits on
// its call and writes the response, or streams it as server-sent events. A call whose client
// went away (a failed write) has its sequences aborted, which frees their blocks.
#include <cstdint>
#include <memory>
#include <string>

#include "apps/serve/openai.h"
#include "infer/engine.h"
#include "infer/scheduler.h"

namespace kvlab {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (bind() says which)
  std::string model_name = "kvlab";
  SchedulerOptions scheduler;
  ApiLimits limits;
  size_t max_body_bytes = 1 << 20;
  // Connections served at once (one thread each); more wait to be accepted.
  int64_t max_connections = 128;
  // A stream sends its first piece at once, then what has accumulated once its oldest
  // unsent piece is this old (and at the end): 0 sends every token as it is made. Each send
  // wakes an HTTP thread and its client, which on a machine whose cores all compute take
  // their time from the model's steps; a few milliseconds cut that cost by the tokens each
  // send then carries.
  double stream_interval_s = 0;
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
