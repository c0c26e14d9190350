#include "serve/server.h"

#include <httplib.h>
#include <omp.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "serve/connections.h"

namespace kvlab {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// A Prometheus histogram over fixed upper bounds (seconds).
struct Histogram {
  std::vector<double> bounds;
  std::vector<int64_t> counts = std::vector<int64_t>(bounds.size(), 0);
  double sum = 0;
  int64_t n = 0;

  void observe(double v) {
    for (size_t i = 0; i < bounds.size(); ++i)
      if (v <= bounds[i]) ++counts[i];
    sum += v;
    ++n;
  }
  void write(std::string& out, const char* name, const char* help) const {
    out += detail::cat("# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
    for (size_t i = 0; i < bounds.size(); ++i)
      out += detail::cat(name, "_bucket{le=\"", bounds[i], "\"} ", counts[i], "\n");
    out += detail::cat(name, "_bucket{le=\"+Inf\"} ", n, "\n", name, "_sum ", sum, "\n", name,
                       "_count ", n, "\n");
  }
};

void metric(std::string& out, const char* name, const char* type, const char* help,
            const std::string& samples) {
  out += detail::cat("# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n", samples);
}

std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }

void reply_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(dump(error_json(e)), "application/json");
}

// A random completion id, as OpenAI's "cmpl-..." (chat: "chatcmpl-...") ones.
std::string completion_id(bool chat) {
  static std::atomic<uint64_t> counter{std::random_device{}()};
  char buf[40];
  std::snprintf(buf, sizeof buf, "%s-%016llx", chat ? "chatcmpl" : "cmpl",
                static_cast<unsigned long long>(hash64(counter.fetch_add(1), 0x6b766c6162)));
  return buf;
}

ConnectionOptions connection_options(const ServeOptions& o) {
  ConnectionOptions c;
  c.max_connections = o.max_connections;
  c.max_waiting = o.max_waiting_connections;
  c.header_timeout_s = o.header_timeout_s;
  c.keep_alive_timeout_s = o.keep_alive_timeout_s;
  c.min_body_rate = o.min_body_rate;
  c.write_timeout_s = o.write_timeout_s;
  c.send_buffer_bytes = o.send_buffer_bytes;
  return c;
}

// Equal strings, in a time that depends on the key's length alone (not on where they differ).
bool same_key(std::string_view given, std::string_view key) {
  unsigned char diff = given.size() != key.size();
  for (size_t i = 0; i < key.size(); ++i)
    diff |= static_cast<unsigned char>((i < given.size() ? given[i] : 0) ^ key[i]);
  return diff == 0;
}

}  // namespace

// One HTTP completion request: its choices, each one scheduler request. The scheduler thread
// writes the choices and pieces under the server's mutex; the HTTP thread reads them there,
// and once done() the choices no longer change.
//
// A stream's writes to its client are one thread's at a time. Where the scheduler thread writes
// streams (ServeOptions::scheduler_writes_streams), the HTTP thread hands the stream to it
// (`direct`) whenever it has nothing left to write: the scheduler thread then writes each
// step's released pieces itself, one send() per stream per step, without waking a thread per
// stream (where the steps take every core, a woken thread takes the one a step's kernels need
// next). What the socket does not take at once, the end of the stream, a failed send, and the
// server stopping go back to the HTTP thread, which may wait on the client.
struct Call {
  struct Piece {  // what a stream sends next for one choice
    int64_t choice;
    std::string text;
    std::vector<TokenLogprob> logprobs;
    bool first;  // the choice's first piece: with echo it carries the prompt
    std::optional<StopReason> finished;
  };
  CompletionRequest req;
  std::string id;
  int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
  Clock::time_point arrival = Clock::now();
  std::vector<ChoiceState> choices;
  std::vector<std::optional<Clock::time_point>> first_token;
  std::deque<Piece> pieces;  // with stream
  std::optional<Clock::time_point> pending_since;  // when the oldest of pieces was made
  bool sent_first = false;  // a piece has been released to the stream
  bool ready = false;       // pieces are released: the stream may send them
  int64_t unfinished = 0;
  bool cancelled = false;   // its client went away
  std::string failure;      // set when it cannot finish (the server stops)
  std::vector<size_t> streamed;  // bytes of text each choice has streamed (its writer's)
  std::string chunk_tail;        // with stream: what every chunk ends with (chunk_tail())
  // With stream: the connection (set by its HTTP thread), and who writes to it.
  httplib::Stream* stream = nullptr;
  bool direct = false;       // the scheduler thread writes released pieces
  bool sending = false;      // the scheduler thread is writing now (outside the mutex)
  bool send_failed = false;  // its send failed: the client left
  std::string backlog;       // bytes the socket did not take, for the HTTP thread to write

  bool done() const { return unfinished == 0 || !failure.empty(); }
};

struct Server::Impl {
  Engine& engine;
  ServeOptions options;
  Scheduler scheduler;  // the scheduler thread's alone
  HttpServer http;

  std::mutex m;
  std::condition_variable work_cv;  // the scheduler thread waits for work
  std::condition_variable done_cv;  // HTTP threads wait for their calls
  bool stopping = false;
  bool listening = false;  // run() is in (or about to enter) httplib's listen loop
  int64_t open_streams = 0;  // streamed responses not yet ended
  // ServeOptions::scheduler_writes_streams as the scheduler thread, whose OpenMP threads run
  // the steps, decided it.
  bool scheduler_writes = false;
  std::vector<std::shared_ptr<Call>> incoming, cancels;

  // The scheduler thread's: which call and choice each scheduler request belongs to.
  struct Owner {
    std::shared_ptr<Call> call;
    int64_t choice;
  };
  std::unordered_map<RequestId, Owner> owners;
  std::vector<std::shared_ptr<Call>> held;  // streams with pieces not yet released
  // Released pieces of direct streams, for the scheduler thread to write after the step.
  std::vector<std::pair<std::shared_ptr<Call>, std::deque<Call::Piece>>> direct_sends;

  // Metrics, under m.
  int64_t running = 0, waiting = 0, preemptions = 0;
  BlockStats blocks;
  int64_t prompt_tokens = 0, tokens = 0, finished = 0, aborted = 0, rejected = 0, unauthorized = 0;
  std::deque<std::pair<Clock::time_point, int64_t>> recent;  // (time, tokens) of recent steps
  Histogram ttft{{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  Histogram tpot{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}};

  Impl(Engine& e, ServeOptions o)
      : engine(e),
        options(std::move(o)),
        scheduler(e, options.scheduler),
        http(connection_options(options)) {
    KVLAB_CHECK(options.max_body_bytes >= 1, "serve: max_body_bytes must be >= 1");
    KVLAB_CHECK(options.limits.max_request_tokens >= 0,
                "serve: max_request_tokens must be >= 0, got ", options.limits.max_request_tokens);
    // By default one request may hold half the pool, so that it cannot starve every other,
    // or one whole context where that is more (a pool of one or two sequences).
    if (options.limits.max_request_tokens == 0) {
      const int64_t pool = scheduler.block_stats().total * options.scheduler.cache.kv_block_size;
      options.limits.max_request_tokens =
          std::max<int64_t>(pool / 2, e.model().config().block_size);
    }
    load_chat_template();
    routes();
  }
  void load_chat_template() {
    const std::string& source = options.chat_template.empty()
                                    ? engine.tokenizer().controls().chat_template
                                    : options.chat_template;
    if (source.empty()) {
      no_template = "the model has no chat template (tokenizer.chat_template): start kvlab "
                    "serve with --chat-template FILE";
      return;
    }
    try {
      chat_template.emplace(source);
    } catch (const Error& err) {
      no_template = detail::cat("the chat template cannot be used: ", err.what(),
                                "; start kvlab serve with --chat-template FILE");
    }
  }

  void routes();
  void loop();
  // Hands a step's events to their calls; true when an HTTP thread has something to do (a
  // call ended, or a stream's pieces were released).
  bool dispatch(const std::vector<SchedulerEvent>& events);
  // The scheduler thread writes direct_sends (m held on entry and exit, released meanwhile);
  // true when an HTTP thread has something to do (a backlog, a failed send, a stream handed back).
  bool send_direct(std::unique_lock<std::mutex>& lk);
  // The model's chat template, parsed once (null: none, or outside kvlab's Jinja subset, which
  // no_template then says).
  std::optional<ChatTemplate> chat_template;
  std::string no_template;
  void completions(const httplib::Request& hreq, httplib::Response& res, bool chat);
  // A parsed request's call, queued for the scheduler; the response, or its stream.
  void answer(std::shared_ptr<Call> call, httplib::Response& res);
  bool stream_some(Call& call, httplib::DataSink& sink);
  // A stream's pieces as one chunk of its body: an event per choice.
  std::string events_chunk(Call& call, std::deque<Call::Piece> pieces);
  // A stream's last chunk: an error, or its usage; then [DONE].
  std::string end_chunk(const Call& call, bool stop, const std::string& failure);
  std::string metrics_text();

  // When a stream's response ends (written, failed, or the server stopping): its socket is
  // the scheduler thread's no longer, and the call ends if it has not.
  void end_stream(const std::shared_ptr<Call>& call) {
    std::unique_lock lk(m);
    call->direct = false;
    done_cv.wait(lk, [&] { return !call->sending; });
    --open_streams;
    if (open_streams == 0 && stopping) done_cv.notify_all();  // stop() waits for it
    if (call->done() || call->cancelled) return;
    call->cancelled = true;
    cancels.push_back(call);
    work_cv.notify_one();
  }
};

void Server::Impl::routes() {
  http.set_payload_max_length(options.max_body_bytes);
  // What the Keep-Alive header announces (the gate enforces them).
  http.set_keep_alive_max_count(1000);
  http.set_keep_alive_timeout(static_cast<time_t>(options.keep_alive_timeout_s));
  http.set_tcp_nodelay(true);
  // The key is checked before a body is read: a refused request costs its headers alone. Its
  // body, unread, would be taken for the next request: the connection closes.
  if (!options.api_key.empty())
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
      const std::string auth = req.get_header_value("Authorization");
      constexpr std::string_view kBearer = "Bearer ";
      if (auth.size() > kBearer.size() && auth.compare(0, kBearer.size(), kBearer) == 0 &&
          same_key(std::string_view(auth).substr(kBearer.size()), options.api_key))
        return httplib::Server::HandlerResponse::Unhandled;
      {
        std::lock_guard lk(m);
        ++unauthorized;
      }
      reply_error(
          res, ApiError(401,
                        auth.empty() ? "no API key: send the header 'Authorization: Bearer <key>'"
                                     : "the API key is not valid",
                        "", "invalid_request_error"));
      res.set_header("WWW-Authenticate", "Bearer");
      res.set_header("Connection", "close");
      HttpServer::close_after_response();
      return httplib::Server::HandlerResponse::Handled;
    });

  http.Post("/v1/completions",
            [this](const httplib::Request& q, httplib::Response& r) { completions(q, r, false); });
  http.Post("/v1/chat/completions",
            [this](const httplib::Request& q, httplib::Response& r) { completions(q, r, true); });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    const json model{{"id", options.model_name},
                     {"object", "model"},
                     {"created", 0},
                     {"owned_by", "kvlab"},
                     {"max_model_len", engine.model().config().block_size},
                     {"vocab_size", engine.tokenizer().vocab_size()}};
    res.set_content(dump({{"object", "list"}, {"data", json::array({model})}}), "application/json");
  });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    std::lock_guard lk(m);
    res.status = stopping ? 503 : 200;
    res.set_content(dump({{"status", stopping ? "stopping" : "ok"}}), "application/json");
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(), "text/plain; version=0.0.4");
  });
  // Errors httplib answers itself (no route, a body over the limit) get OpenAI's error object.
  http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 413)
      reply_error(res, ApiError(413, detail::cat("the request body is larger than the limit of ",
                                                 options.max_body_bytes, " bytes")));
    else if (res.status == 404)
      reply_error(res, ApiError(404, detail::cat("no route for ", req.method, " ", req.path),
                                "", "not_found_error"));
    else
      reply_error(res, ApiError(res.status, detail::cat("HTTP ", res.status)));
  });
  http.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        reply_error(res, ApiError(500, what, "", "server_error"));
      });
}

void Server::Impl::completions(const httplib::Request& hreq, httplib::Response& res, bool chat) {
  auto call = std::make_shared<Call>();
  const int64_t context = engine.model().config().block_size;
  try {
    call->req = chat ? parse_chat_request(hreq.body, options.limits, options.model_name,
                                          engine.tokenizer(), context,
                                          chat_template ? &*chat_template : nullptr, no_template)
                     : parse_completion_request(hreq.body, options.limits, options.model_name,
                                                engine.tokenizer(), context);
  } catch (const ApiError& e) {
    {
      std::lock_guard lk(m);
      ++rejected;
    }
    reply_error(res, e);
    return;
  }
  call->id = completion_id(chat);
  answer(std::move(call), res);
}

void Server::Impl::answer(std::shared_ptr<Call> call, httplib::Response& res) {
  const size_t n_choices = call->req.prompts.size() * static_cast<size_t>(call->req.n);
  call->choices.resize(n_choices);
  call->first_token.resize(n_choices);
  call->streamed.resize(n_choices, 0);
  call->unfinished = static_cast<int64_t>(n_choices);
  if (call->req.stream)
    call->chunk_tail = chunk_tail(call->id, options.model_name, call->created, call->req.chat);
  {
    std::lock_guard lk(m);
    if (stopping) {
      reply_error(res, ApiError(503, "the server is stopping", "", "server_error"));
      return;
    }
    incoming.push_back(call);
    work_cv.notify_one();
  }
  if (!call->req.stream) {
    std::unique_lock lk(m);
    done_cv.wait(lk, [&] { return call->done() || stopping; });
    if (!call->done() || !call->failure.empty()) {
      reply_error(
          res, ApiError(503, call->failure.empty() ? "the server is stopping" : call->failure, "",
                        "server_error"));
      return;
    }
    lk.unlock();
    res.set_content(
        dump(call->req.chat ? chat_completion_json(call->req, call->choices, call->id,
                                                   options.model_name, call->created)
                            : completion_json(call->req, call->choices, engine.tokenizer(),
                                              call->id, options.model_name, call->created)),
        "application/json");
    return;
  }
  res.set_header("Cache-Control", "no-cache");
  {
    std::lock_guard lk(m);
    ++open_streams;
  }
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, call](size_t, httplib::DataSink& sink) { return stream_some(*call, sink); },
      [this, call](bool) { end_stream(call); });  // httplib's releaser: always called once
}

bool Server::Impl::stream_some(Call& call, httplib::DataSink& sink) {
  std::deque<Call::Piece> pieces;
  std::string out;
  bool done, stop;
  std::string failure;
  {
    std::unique_lock lk(m);
    if (!call.stream) call.stream = &HttpServer::current_stream();
    // Nothing left to write: the scheduler thread writes what comes next.
    if (scheduler_writes && !call.ready && call.backlog.empty() && !call.send_failed)
      call.direct = true;
    // The timeout only lets httplib see a server shutting down between waits.
    if (!done_cv.wait_for(lk, std::chrono::milliseconds(200), [&] {
          return !call.sending && (call.ready || !call.backlog.empty() || call.send_failed ||
                                   call.done() || stopping);
        }))
      return true;
    call.direct = false;  // this thread writes now
    if (call.send_failed) return false;  // the client left
    out.swap(call.backlog);
    pieces.swap(call.pieces);
    call.ready = false;
    call.pending_since.reset();
    done = call.done();
    stop = stopping && !done;
    failure = call.failure;
  }
  out += events_chunk(call, std::move(pieces));
  if (done || stop) out += end_chunk(call, stop, failure);
  if (!write_all(*call.stream, out)) return false;  // the client left
  if (done || stop) sink.done();
  return true;
}

// Framed here rather than by httplib's sink, so that either thread writes the same bytes;
// httplib leaves text/event-stream uncompressed whatever the client accepts.
std::string Server::Impl::events_chunk(Call& call, std::deque<Call::Piece> pieces) {
  // Pieces of one choice sent together make one event: its text, its tokens' log-probabilities.
  std::deque<Call::Piece> merged;
  for (Call::Piece& p : pieces) {
    if (!merged.empty() && merged.back().choice == p.choice && !merged.back().finished) {
      Call::Piece& m = merged.back();
      m.text += p.text;
      m.logprobs.insert(m.logprobs.end(), p.logprobs.begin(), p.logprobs.end());
      m.finished = p.finished;
    } else {
      merged.push_back(std::move(p));
    }
  }
  const CompletionRequest& req = call.req;
  std::string events;
  for (Call::Piece& p : merged) {
    if (req.chat) {
      call.streamed[static_cast<size_t>(p.choice)] += p.text.size();
      append_chat_event(events, call.chunk_tail, p.choice, p.text, p.first, p.finished);
      continue;
    }
    const size_t b = static_cast<size_t>(p.choice / req.n);
    const bool echo = req.echo && p.first;
    std::string text = echo ? req.prompt_texts[b] + p.text : p.text;
    json lp = nullptr;
    if (req.logprobs >= 0) {
      const ChoiceState& c = call.choices[static_cast<size_t>(p.choice)];
      // The prompt's log-probabilities arrive with the first event and no longer change.
      std::vector<TokenLogprob> none;
      lp = logprobs_json(engine.tokenizer(), echo ? &req.prompts[b] : nullptr,
                         echo ? c.prompt_logprobs : none, p.logprobs,
                         call.streamed[static_cast<size_t>(p.choice)]);
    }
    call.streamed[static_cast<size_t>(p.choice)] += text.size();
    append_chunk_event(events, call.chunk_tail, p.choice, text, lp, p.finished);
  }
  std::string out;
  if (!events.empty()) append_http_chunk(out, events);
  return out;
}

std::string Server::Impl::end_chunk(const Call& call, bool stop, const std::string& failure) {
  std::string events;
  if (!failure.empty() || stop) {
    events += sse(error_json(
        ApiError(503, stop ? "the server is stopping" : failure, "", "server_error")));
  } else if (call.req.include_usage) {
    events += sse({{"id", call.id},
                   {"object", chunk_object(call.req.chat)},
                   {"created", call.created},
                   {"model", options.model_name},
                   {"choices", json::array()},
                   {"usage", usage_json(call.req, call.choices)}});
  }
  events += "data: [DONE]\n\n";
  std::string out;
  append_http_chunk(out, events);
  return out;
}

bool Server::Impl::send_direct(std::unique_lock<std::mutex>& lk) {
  if (direct_sends.empty()) return false;
  std::vector<std::pair<std::shared_ptr<Call>, std::deque<Call::Piece>>> sends;
  sends.swap(direct_sends);
  lk.unlock();
  // Each call is this thread's alone while `sending`: its HTTP thread waits.
  std::vector<std::string> left(sends.size());
  std::vector<char> failed(sends.size(), 0);
  for (size_t i = 0; i < sends.size(); ++i) {
    Call& call = *sends[i].first;
    try {
      std::string out = events_chunk(call, std::move(sends[i].second));
      const int64_t n = send_now(call.stream->socket(), out);
      if (n < 0)
        failed[i] = true;
      else
        left[i] = out.substr(static_cast<size_t>(n));
    } catch (const std::exception&) {  // its stream is cut; the others and the server go on
      failed[i] = true;
    }
  }
  lk.lock();
  bool wake = false;
  for (size_t i = 0; i < sends.size(); ++i) {
    Call& call = *sends[i].first;
    call.sending = false;
    call.send_failed = failed[i];
    call.backlog = std::move(left[i]);
    // What the socket did not take waits for the client on the HTTP thread.
    if (failed[i] || !call.backlog.empty()) call.direct = false;
    // Its HTTP thread (or the end of its response) waits for the send to end.
    if (!call.direct || stopping) wake = true;
  }
  return wake;
}

bool Server::Impl::dispatch(const std::vector<SchedulerEvent>& events) {
  const Clock::time_point now = Clock::now();
  int64_t made = 0;
  bool wake = false;
  for (const SchedulerEvent& e : events) {
    const auto it = owners.find(e.request);
    if (it == owners.end()) continue;  // an abort's event: the call already let it go
    Call& call = *it->second.call;
    const int64_t i = it->second.choice;
    ChoiceState& c = call.choices[static_cast<size_t>(i)];
    const bool first = !call.first_token[static_cast<size_t>(i)];  // its first event
    if (!e.prompt_logprobs.empty()) c.prompt_logprobs = e.prompt_logprobs;
    std::vector<TokenLogprob> lps;
    if (e.token >= 0) {
      ++made;
      c.tokens.push_back(e.token);
      if (e.logprob) {
        c.logprobs.push_back(*e.logprob);
        lps.push_back(*e.logprob);
      }
    }
    if (!call.first_token[static_cast<size_t>(i)]) {
      call.first_token[static_cast<size_t>(i)] = now;
      ttft.observe(seconds(call.arrival, now));
    }
    c.text += e.text;
    if (e.finished) {
      c.finished = true;
      c.reason = e.reason;
      --call.unfinished;
      ++finished;
      wake = true;
      if (c.tokens.size() > 1)
        tpot.observe(seconds(*call.first_token[static_cast<size_t>(i)], now) /
                     static_cast<double>(c.tokens.size() - 1));
    }
    // A stream sends what changes what the client sees (text, a token's log-probability,
    // the echoed prompt, the end).
    // A chat stream's first chunk carries the role, whatever its text.
    if (call.req.stream && (!e.text.empty() || !lps.empty() || e.finished ||
                            (first && (call.req.echo || call.req.chat)))) {
      if (call.pieces.empty()) {
        call.pending_since = now;
        held.push_back(it->second.call);
      }
      call.pieces.push_back({i, e.text, std::move(lps), first,
                             e.finished ? std::optional<StopReason>(e.reason) : std::nullopt});
    }
    if (e.finished) owners.erase(it);
  }
  // Streams whose pieces are due (stream_interval_s) are released; the rest wait for a later
  // step. A finished or failed call is always due.
  std::erase_if(held, [&](const std::shared_ptr<Call>& c) {
    if (c->pieces.empty()) return true;
    if (!c->done() && c->sent_first &&
        seconds(*c->pending_since, now) < options.stream_interval_s)
      return false;
    c->sent_first = true;
    if (c->direct && !c->done()) {
      direct_sends.emplace_back(c, std::move(c->pieces));
      c->sending = true;
      c->pieces.clear();
      c->pending_since.reset();
    } else {
      c->ready = true;  // its HTTP thread writes them (and the stream's end)
      wake = true;
    }
    return true;
  });
  tokens += made;
  recent.emplace_back(now, made);
  while (!recent.empty() && seconds(recent.front().first, now) > 10) recent.pop_front();
  return wake;
}

void Server::Impl::loop() {
  std::unique_lock lk(m);
  scheduler_writes =
      options.scheduler_writes_streams.value_or(omp_get_max_threads() >= omp_get_num_procs());
  for (;;) {
    work_cv.wait(lk, [&] {
      return stopping || !incoming.empty() || !cancels.empty() || !scheduler.idle();
    });
    if (stopping) break;
    std::vector<std::shared_ptr<Call>> in, out;
    in.swap(incoming);
    out.swap(cancels);
    lk.unlock();
    int64_t added_tokens = 0;
    // A call the scheduler refuses (or a step that throws) fails alone, with the reason; the
    // server goes on.
    std::vector<std::pair<std::shared_ptr<Call>, std::string>> failed;
    for (const auto& call : in) {
      const CompletionRequest& q = call->req;
      GenerateOptions g;
      g.max_new_tokens = q.max_tokens;
      g.sampling = q.sampling;
      g.stop = q.stop;
      g.ignore_eos = q.ignore_eos;
      RequestExtras x;
      x.top_logprobs = q.logprobs;
      x.prompt_logprobs = q.echo && q.logprobs >= 0;
      try {
        for (size_t b = 0; b < q.prompts.size(); ++b)
          for (int64_t s = 0; s < q.n; ++s) {
            x.sample = s;
            const RequestId id = scheduler.add(q.prompts[b], g, x);
            owners[id] = {call, static_cast<int64_t>(b) * q.n + s};
            added_tokens += static_cast<int64_t>(q.prompts[b].size());
          }
      } catch (const std::exception& e) {
        failed.emplace_back(call, e.what());
        out.push_back(call);  // its sequences already added are aborted below
      }
    }
    int64_t n_aborted = 0;
    for (const auto& call : out)
      for (auto it = owners.begin(); it != owners.end();)
        if (it->second.call == call) {
          scheduler.abort(it->first);
          ++n_aborted;
          it = owners.erase(it);
        } else {
          ++it;
        }
    std::vector<SchedulerEvent> events;
    try {
      if (!scheduler.idle()) events = scheduler.step();
    } catch (const std::exception& e) {
      for (const auto& [id, owner] : owners) {
        scheduler.abort(id);
        failed.emplace_back(owner.call, detail::cat("the model's step failed: ", e.what()));
      }
      owners.clear();
      events.clear();
    }
    lk.lock();
    prompt_tokens += added_tokens;
    aborted += n_aborted;
    for (const auto& call : out) {  // nothing of theirs is sent any more
      call->pieces.clear();
      std::erase(held, call);
    }
    for (const auto& [call, why] : failed) call->failure = why;
    bool wake = dispatch(events) || !failed.empty();
    wake = send_direct(lk) || wake;
    running = scheduler.admitted();
    waiting = scheduler.waiting();
    preemptions = scheduler.preemptions();
    blocks = scheduler.block_stats();
    if (wake) {
      // Woken after the unlock, an HTTP thread finds m free instead of blocking on it at once.
      lk.unlock();
      done_cv.notify_all();
      lk.lock();
    }
  }
  // Stopping: what is still running or queued ends here.
  for (auto& [id, owner] : owners) {
    scheduler.abort(id);
    owner.call->failure = "the server stopped before this completion ended";
  }
  for (auto& call : incoming) call->failure = "the server stopped before this completion began";
  owners.clear();
  incoming.clear();
  running = waiting = 0;
  blocks = scheduler.block_stats();
  done_cv.notify_all();
}

std::string Server::Impl::metrics_text() {
  std::lock_guard lk(m);
  std::string out;
  const int64_t bs = options.scheduler.cache.kv_block_size;
  metric(out, "kvlab_requests_running", "gauge",
         "Sequences the scheduler has admitted (prefilling or decoding); a choice is one.",
         detail::cat("kvlab_requests_running ", running, "\n"));
  metric(out, "kvlab_requests_waiting", "gauge", "Sequences queued for admission.",
         detail::cat("kvlab_requests_waiting ", waiting, "\n"));
  metric(
      out, "kvlab_kv_blocks", "gauge",
      "KV cache blocks by state: used (held by a sequence), cached (kept for prefix hits), free.",
      detail::cat("kvlab_kv_blocks{state=\"used\"} ", blocks.in_use, "\n",
                  "kvlab_kv_blocks{state=\"cached\"} ", blocks.cached, "\n",
                  "kvlab_kv_blocks{state=\"free\"} ", blocks.free, "\n"));
  metric(out, "kvlab_kv_block_size", "gauge", "Positions per KV cache block.",
         detail::cat("kvlab_kv_block_size ", bs, "\n"));
  metric(out, "kvlab_kv_utilisation", "gauge",
         "Positions stored over positions the blocks in use hold.",
         detail::cat("kvlab_kv_utilisation ",
                     blocks.in_use > 0 ? static_cast<double>(blocks.positions) /
                                             static_cast<double>(blocks.in_use * bs)
                                       : 0.0,
                     "\n"));
  metric(out, "kvlab_prompt_tokens_total", "counter", "Prompt tokens of every sequence admitted.",
         detail::cat("kvlab_prompt_tokens_total ", prompt_tokens, "\n"));
  metric(out, "kvlab_prefix_cache_hit_tokens_total", "counter",
         "Prompt positions taken from the prefix cache instead of prefilled.",
         detail::cat("kvlab_prefix_cache_hit_tokens_total ", blocks.prefix_hit_positions, "\n"));
  metric(out, "kvlab_prefix_cache_hit_rate", "gauge",
         "Prefix cache hit positions over prompt tokens, since the start.",
         detail::cat("kvlab_prefix_cache_hit_rate ",
                     prompt_tokens > 0 ? static_cast<double>(blocks.prefix_hit_positions) /
                                             static_cast<double>(prompt_tokens)
                                       : 0.0,
                     "\n"));
  metric(out, "kvlab_preemptions_total", "counter",
         "Sequences preempted (blocks freed, recomputed later) when the pool ran dry.",
         detail::cat("kvlab_preemptions_total ", preemptions, "\n"));
  metric(out, "kvlab_generation_tokens_total", "counter", "Tokens generated.",
         detail::cat("kvlab_generation_tokens_total ", tokens, "\n"));
  double rate = 0;
  if (recent.size() > 1) {
    int64_t sum = 0;
    for (size_t i = 1; i < recent.size(); ++i) sum += recent[i].second;
    const double span = seconds(recent.front().first, recent.back().first);
    rate = span > 0 ? static_cast<double>(sum) / span : 0.0;
  }
  metric(out, "kvlab_generation_tokens_per_second", "gauge",
         "Tokens generated per second over the last 10 seconds of steps.",
         detail::cat("kvlab_generation_tokens_per_second ", rate, "\n"));
  metric(out, "kvlab_sequences_total", "counter",
         "Sequences by how they ended: finished, aborted (their client left).",
         detail::cat("kvlab_sequences_total{outcome=\"finished\"} ", finished, "\n",
                     "kvlab_sequences_total{outcome=\"aborted\"} ", aborted, "\n"));
  metric(out, "kvlab_requests_rejected_total", "counter", "Requests answered with a 4xx.",
         detail::cat("kvlab_requests_rejected_total ", rejected, "\n"));
  metric(out, "kvlab_requests_unauthorized_total", "counter",
         "Requests answered 401: no API key, or not the server's.",
         detail::cat("kvlab_requests_unauthorized_total ", unauthorized, "\n"));
  const ConnectionStats c = http.stats();
  metric(out, "kvlab_connections", "gauge",
         "Connections by state: active (a request read, handled or answered), waiting (idle, "
         "or sending its headers).",
         detail::cat("kvlab_connections{state=\"active\"} ", c.active, "\n",
                     "kvlab_connections{state=\"waiting\"} ", c.waiting, "\n"));
  metric(out, "kvlab_connections_refused_total", "counter",
         "Requests the connection layer answered itself: 503 busy (every worker busy, or too "
         "many connections waiting), 408 (headers too slow).",
         detail::cat("kvlab_connections_refused_total{reason=\"busy\"} ", c.refused_busy, "\n",
                     "kvlab_connections_refused_total{reason=\"header_timeout\"} ",
                     c.header_timeouts, "\n"));
  metric(out, "kvlab_connections_cut_total", "counter",
         "Connections closed at a deadline: idle (keep-alive), slow_body (under the minimum "
         "rate), write_timeout (a client that stopped reading).",
         detail::cat("kvlab_connections_cut_total{reason=\"idle\"} ", c.idle_closed, "\n",
                     "kvlab_connections_cut_total{reason=\"slow_body\"} ", c.body_timeouts, "\n",
                     "kvlab_connections_cut_total{reason=\"write_timeout\"} ", c.write_timeouts,
                     "\n"));
  ttft.write(out, "kvlab_time_to_first_token_seconds",
             "Arrival of a request until its sequence's first token (or first event).");
  tpot.write(out, "kvlab_time_per_output_token_seconds",
             "A sequence's time from its first to its last token over the tokens in between.");
  return out;
}

Server::Server(Engine& engine, ServeOptions options)
    : impl_(std::make_unique<Impl>(engine, std::move(options))) {}

Server::~Server() { stop(); }

int Server::bind() {
  Impl& s = *impl_;
  errno = 0;
  const int port = s.options.port == 0 ? s.http.bind_to_any_port(s.options.host)
                                       : (s.http.bind_to_port(s.options.host, s.options.port)
                                              ? s.options.port
                                              : -1);
  KVLAB_CHECK(port > 0, "cannot listen on ", s.options.host, ":", s.options.port,
              errno != 0 ? detail::cat(": ", std::strerror(errno)) : std::string());
  s.http.raise_backlog();
  return port;
}

void Server::run() {
  Impl& s = *impl_;
  {
    std::lock_guard lk(s.m);
    if (s.stopping) return;
    s.listening = true;
  }
  std::thread scheduler_thread([&] { s.loop(); });
  std::exception_ptr error;
  try {
    s.http.listen_after_bind();  // its thread pool may fail to start
  } catch (...) {
    error = std::current_exception();
  }
  {
    std::lock_guard lk(s.m);
    s.listening = false;
  }
  stop();
  scheduler_thread.join();
  if (error) std::rethrow_exception(error);
}

void Server::stop() {
  Impl& s = *impl_;
  bool listening;
  {
    std::lock_guard lk(s.m);
    s.stopping = true;
    listening = s.listening;
  }
  s.work_cv.notify_all();
  s.done_cv.notify_all();
  // Woken, each stream writes its error event and [DONE]; once httplib stops, a stream ends at
  // its next write without them. A client that does not read is not waited for long.
  {
    std::unique_lock lk(s.m);
    s.done_cv.wait_for(lk, std::chrono::seconds(1), [&] { return s.open_streams == 0; });
  }
  // httplib's stop() does nothing until its listen loop runs: a stop that comes just after
  // run() began waits for it (a moment), or it would listen for ever.
  while (listening && !s.http.is_running()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::lock_guard lk(s.m);
    listening = s.listening;
  }
  s.http.stop();
}

}  // namespace kvlab
