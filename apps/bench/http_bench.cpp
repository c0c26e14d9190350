#include "apps/bench/http_bench.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string_view>
#include <system_error>
#include <thread>

#include "serve/server.h"
#include "platform/error.h"

namespace kvlab {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;


httplib::Client client_for(const std::string& url) {
  httplib::Client c(url);
  c.set_read_timeout(600, 0);
  c.set_connection_timeout(10, 0);
  return c;
}

// A sample of the server's /metrics (0 when absent).
double metric(httplib::Client& c, const std::string& name) {
  const auto r = c.Get("/metrics");
  if (!r || r->status != 200) return 0;
  std::istringstream in(r->body);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  return 0;
}

// The "index" of a text chunk's one choice (kvlab's chunks carry a choice each), or 0.
int64_t choice_index(std::string_view chunk) {
  const size_t at = chunk.find("\"index\":");
  if (at == std::string_view::npos) return 0;
  int64_t index = 0;
  const char* p = chunk.data() + at + 8;
  std::from_chars(p, chunk.data() + chunk.size(), index);
  return index;
}

// Streams one completion; calls on_text with the choice of each chunk that carries one.
// Returns the tokens made (the usage chunk's count), or throws kvlab::Error.
int64_t stream_completion(const std::string& url, const json& body,
                          const std::function<void(int64_t choice)>& on_text) {
  httplib::Client c = client_for(url);
  CompletionEvents events(on_text);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    events.feed(std::string_view(data, n));
    return true;
  };
  const auto res = c.send(req);
  KVLAB_CHECK(res, "bench serve: ", url, " did not answer: ", httplib::to_string(res.error()));
  KVLAB_CHECK(res->status == 200, "bench serve: ", url, " answered ", res->status, ": ",
              res->body.substr(0, 200));
  KVLAB_CHECK(events.error().empty(), "bench serve: ", url, ": ", events.error());
  KVLAB_CHECK(events.completion_tokens() >= 0, "bench serve: ", url, " sent no usage");
  return events.completion_tokens();
}

json completion_body(const std::string& model, const std::vector<int32_t>& prompt,
                     int64_t max_tokens, int64_t n = 1) {
  return {{"model", model},
          {"prompt", prompt},
          {"max_tokens", max_tokens},
          {"n", n},
          {"temperature", 0},
          // The figures count max_tokens a request: a server that stops at its end-of-text
          // token is asked not to (vLLM's and llama-server's field; kvlab serve has no such
          // stop), and each request's usage is checked against it.
          {"ignore_eos", true},
          {"stream", true},
          {"stream_options", {{"include_usage", true}}}};
}

// Stream i's prompt of n tokens; the streams' prompts differ from their first token, so that
// no stream reads another's blocks from the prefix cache.
std::vector<int32_t> bench_prompt(int64_t i, int64_t n, int64_t vocab_size) {
  std::vector<int32_t> p;
  for (int64_t j = 0; j < n; ++j)
    p.push_back(static_cast<int32_t>((j * 7 + 3 + i * 13) % vocab_size));
  return p;
}

// Tokens/s of the prompts through the scheduler, all added at once, to the last token.
double scheduled_rate(Scheduler& scheduler, const std::vector<std::vector<int32_t>>& prompts,
                      const GenerateOptions& g) {
  const auto t0 = Clock::now();
  for (const auto& p : prompts) scheduler.add(p, g);
  int64_t n = 0;
  while (!scheduler.idle())
    for (const SchedulerEvent& e : scheduler.step()) n += e.token >= 0;
  return static_cast<double>(n) / seconds_since(t0);
}

// A file descriptor, closed with its owner.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// One streamed completion of streamed_rate's: its request written whole on connecting, then
// its response taken as the bytes arrive (status line and headers, then the chunked body's
// events).
class LoopbackStream {
 public:
  LoopbackStream(int port, const json& body, int read_low_water) : sock_(connect_to(port)) {
    if (read_low_water > 0)
      ::setsockopt(sock_.fd, SOL_SOCKET, SO_RCVLOWAT, &read_low_water, sizeof read_low_water);
    const std::string b = body.dump();
    const std::string req = detail::cat(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:", port,
        "\r\nContent-Type: application/json\r\nContent-Length: ", b.size(),
        "\r\nConnection: close\r\n\r\n", b);
    for (size_t sent = 0; sent < req.size();) {
      const ssize_t n = ::send(sock_.fd, req.data() + sent, req.size() - sent, MSG_NOSIGNAL);
      KVLAB_CHECK(n > 0 || errno == EINTR, "bench serve: sending a request to 127.0.0.1:",
                  port, ": ", std::strerror(errno));
      sent += n > 0 ? static_cast<size_t>(n) : 0;
    }
    ::fcntl(sock_.fd, F_SETFL, ::fcntl(sock_.fd, F_GETFL) | O_NONBLOCK);
  }
  int fd() const { return sock_.fd; }

  void take(std::string_view bytes) {
    if (status_ == 0) {  // still in the status line and headers
      head_.append(bytes);
      const size_t end = head_.find("\r\n\r\n");
      if (end == std::string::npos) return;
      KVLAB_CHECK(head_.starts_with("HTTP/1.") && head_.size() > 12,
                  "bench serve: a response that is not HTTP: ", head_.substr(0, 40));
      status_ = std::atoi(head_.c_str() + 9);
      KVLAB_CHECK(status_ >= 100, "bench serve: a response without a status: ",
                  head_.substr(0, 40));
      std::string lower = head_.substr(0, end);
      std::transform(lower.begin(), lower.end(), lower.begin(),
                     [](unsigned char c) { return std::tolower(c); });
      KVLAB_CHECK(status_ != 200 || lower.find("transfer-encoding: chunked") != std::string::npos,
                  "bench serve: a stream's response is not chunked");
      bytes = std::string_view(head_).substr(end + 4);
    }
    if (status_ == 200)
      body_.feed(bytes);
    else if (refused_.size() < 200)
      refused_.append(bytes.substr(0, 200));
  }

  // The connection closed: the tokens the usage chunk counts. Throws kvlab::Error when the
  // response was not a whole, successful stream.
  int64_t finish() const {
    KVLAB_CHECK(status_ != 0, "bench serve: a stream closed before its headers ended");
    KVLAB_CHECK(status_ == 200, "bench serve: a stream answered ", status_, ": ", refused_);
    KVLAB_CHECK(body_.ended(), "bench serve: a stream ended before its last chunk");
    KVLAB_CHECK(events_.error().empty(), "bench serve: ", events_.error());
    KVLAB_CHECK(events_.completion_tokens() >= 0, "bench serve: a stream sent no usage");
    return events_.completion_tokens();
  }

 private:
  static int connect_to(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    KVLAB_CHECK(fd >= 0, "bench serve: socket: ", std::strerror(errno));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
      const int err = errno;
      ::close(fd);
      KVLAB_CHECK(false, "bench serve: cannot connect to 127.0.0.1:", port, ": ",
                  std::strerror(err));
    }
    return fd;
  }

  Fd sock_;
  int status_ = 0;
  std::string head_, refused_;
  CompletionEvents events_{[](int64_t) {}};
  ChunkedBody body_{[this](std::string_view data) { events_.feed(data); }};
};

// Tokens/s of the prompts streamed at once from the server on 127.0.0.1:port, to the last
// token. One thread reads them all, as an event-loop client (vLLM's benchmark, asyncio) does:
// it waits on every socket at once (epoll) and reads each as its bytes arrive, so a chunk is
// read when it comes, and the chunks one scheduler step sends take one wake-up, not one per
// stream. read_low_water > 0: a socket is read only once that many bytes wait (SO_RCVLOWAT) or
// it closes; the server still sends every chunk, but the client's wake-ups no longer take time
// from a server on the same cores. The requests ask `Connection: close`, so that the last bytes
// arrive with the close rather than wait below the mark.
double streamed_rate(int port, const std::vector<std::vector<int32_t>>& prompts, int64_t tokens,
                     int read_low_water) {
  const auto t0 = Clock::now();
  const Fd ep(::epoll_create1(EPOLL_CLOEXEC));
  KVLAB_CHECK(ep.fd >= 0, "bench serve: epoll_create1: ", std::strerror(errno));
  std::vector<std::unique_ptr<LoopbackStream>> streams;
  for (const auto& p : prompts) {
    streams.push_back(std::make_unique<LoopbackStream>(
        port, completion_body("bench", p, tokens), read_low_water));
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = streams.back().get();
    KVLAB_CHECK(::epoll_ctl(ep.fd, EPOLL_CTL_ADD, streams.back()->fd(), &ev) == 0,
                "bench serve: epoll_ctl: ", std::strerror(errno));
  }
  int64_t made = 0;
  std::vector<epoll_event> ready(64);
  std::vector<char> buf(64 << 10);
  for (size_t open = streams.size(); open > 0;) {
    const int n = ::epoll_wait(ep.fd, ready.data(), static_cast<int>(ready.size()), 600'000);
    KVLAB_CHECK(n > 0 || (n < 0 && errno == EINTR), "bench serve: no bytes from 127.0.0.1:",
                port, " for 600 s", n < 0 ? std::strerror(errno) : "");
    for (int i = 0; i < n; ++i) {
      auto& s = *static_cast<LoopbackStream*>(ready[i].data.ptr);
      const ssize_t got = ::recv(s.fd(), buf.data(), buf.size(), 0);
      if (got > 0) {
        s.take(std::string_view(buf.data(), static_cast<size_t>(got)));
      } else if (got == 0) {  // closed: the stream's end (a closed socket stays readable)
        made += s.finish();
        ::epoll_ctl(ep.fd, EPOLL_CTL_DEL, s.fd(), nullptr);
        --open;
      } else {
        KVLAB_CHECK(errno == EAGAIN || errno == EINTR, "bench serve: reading a stream: ",
                    std::strerror(errno));
      }
    }
  }
  return static_cast<double>(made) / seconds_since(t0);
}

}  // namespace

void CompletionEvents::feed(std::string_view bytes) {
  buffer_.append(bytes);
  size_t start = 0;
  for (size_t end; (end = buffer_.find("\n\n", start)) != std::string::npos; start = end + 2) {
    const std::string_view event(buffer_.data() + start, end - start);
    if (!event.starts_with("data: ") || event == "data: [DONE]") continue;
    const std::string_view body = event.substr(6);
    // The client shares the machine with the server it measures: a text chunk is read for its
    // choice index alone, and only the usage and error events are parsed whole.
    if (body.find("\"usage\"") == std::string_view::npos &&
        body.find("\"error\"") == std::string_view::npos) {
      on_text_(choice_index(body));
      continue;
    }
    const json j = json::parse(body, nullptr, false);
    KVLAB_CHECK(!j.is_discarded(), "bench serve: an event that is not JSON: ",
                body.substr(0, 200));
    if (j.contains("error"))
      error_ = j["error"].is_object() ? j["error"].value("message", "error") : j["error"].dump();
    if (j.contains("usage") && j["usage"].is_object())
      made_ = j["usage"]["completion_tokens"].get<int64_t>();
    // kvlab serve's usage chunk has no choices (OpenAI's shape); llama-server's carries the
    // finish_reason with empty text. A choice counts as a token only where it has text.
    if (j.contains("choices") && !j["choices"].empty()) {
      const json& c = j["choices"][0];
      if (c.contains("text") && c["text"].is_string() && !c["text"].get<std::string>().empty())
        on_text_(c.value("index", int64_t{0}));
    }
  }
  buffer_.erase(0, start);
}

void ChunkedBody::feed(std::string_view bytes) {
  while (!bytes.empty()) {
    KVLAB_CHECK(phase_ != Phase::kEnded, "bytes after a chunked body's last chunk");
    if (phase_ == Phase::kData) {
      const size_t n = std::min(left_, bytes.size());
      on_data_(bytes.substr(0, n));
      bytes.remove_prefix(n);
      left_ -= n;
      if (left_ == 0) phase_ = Phase::kDataEnd;
      continue;
    }
    // A line: a chunk's size, the CRLF that ends its data, or the trailer.
    const size_t eol = bytes.find('\n');
    const size_t take = eol == std::string_view::npos ? bytes.size() : eol + 1;
    line_.append(bytes.substr(0, take));
    bytes.remove_prefix(take);
    KVLAB_CHECK(line_.size() <= 1024, "a chunked body's line of over 1 KiB");
    if (eol == std::string_view::npos) continue;
    KVLAB_CHECK(line_.ends_with("\r\n"), "a chunked body's line without its CRLF");
    const std::string_view line = std::string_view(line_).substr(0, line_.size() - 2);
    if (phase_ == Phase::kSize) {
      const std::string_view digits = line.substr(0, line.find(';'));  // no extensions
      const char* last = digits.data() + digits.size();
      const auto [end, ec] = std::from_chars(digits.data(), last, left_, 16);
      KVLAB_CHECK(!digits.empty() && ec == std::errc() && end == last,
                  "a chunk size line that is not hex: '", line.substr(0, 40), "'");
      phase_ = left_ == 0 ? Phase::kTrailer : Phase::kData;
    } else if (phase_ == Phase::kDataEnd) {
      KVLAB_CHECK(line.empty(), "a chunk's data longer than its size");
      phase_ = Phase::kSize;
    } else if (line.empty()) {  // the trailer's end
      phase_ = Phase::kEnded;
    }
    line_.clear();
  }
}

ServedModel served_model(const nlohmann::json& models, const std::string& url) {
  KVLAB_CHECK(models.is_object() && models.contains("data") && models["data"].is_array() &&
                  !models["data"].empty(),
              url, "/v1/models lists no model");
  const json& m = models["data"][0];
  KVLAB_CHECK(m.contains("id") && m["id"].is_string(), url, "/v1/models: its model has no id");
  // kvlab serve (and vLLM) give max_model_len; llama-server gives its context and vocabulary
  // under "meta" (n_ctx: a sequence's context, n_vocab).
  const json none = json::object();
  const json& meta = m.contains("meta") && m["meta"].is_object() ? m["meta"] : none;
  auto number = [&](const char* name, const char* meta_name) -> int64_t {
    if (m.contains(name) && m[name].is_number_integer()) return m[name].get<int64_t>();
    if (meta.contains(meta_name) && meta[meta_name].is_number_integer())
      return meta[meta_name].get<int64_t>();
    return 0;
  };
  const ServedModel out{m["id"].get<std::string>(), number("max_model_len", "n_ctx"),
                        number("vocab_size", "n_vocab")};
  KVLAB_CHECK(out.context > 0 && out.vocab_size > 0, url,
              "/v1/models gives neither max_model_len and vocab_size (kvlab serve) nor "
              "meta.n_ctx and meta.n_vocab (llama-server) for ",
              out.id, ": the workload needs the context and the vocabulary");
  return out;
}

ServedModel served_model(const std::string& url) {
  httplib::Client c = client_for(url);
  const auto r = c.Get("/v1/models");
  KVLAB_CHECK(r, "cannot reach ", url, ": ", httplib::to_string(r.error()));
  KVLAB_CHECK(r->status == 200, url, "/v1/models answered ", r->status);
  return served_model(json::parse(r->body, nullptr, false), url);
}

nlohmann::json replay_over_http(const std::string& url, const std::string& model,
                                const std::vector<KVRequest>& reqs, ServeTimeline t) {
  httplib::Client metrics = client_for(url);
  const double preempted_before = metric(metrics, "kvlab_preemptions_total");
  std::atomic<bool> running{true};
  int64_t peak = 0, samples = 0;
  double utilisation = 0;  // summed over the samples taken while sequences ran
  std::thread sampler([&] {
    while (running) {
      const auto r = static_cast<int64_t>(metric(metrics, "kvlab_requests_running"));
      peak = std::max(peak, r);
      if (r > 0) {
        utilisation += metric(metrics, "kvlab_kv_utilisation");
        ++samples;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  std::mutex m;
  std::string failure;
  const auto t0 = Clock::now();
  std::vector<std::thread> clients;
  for (size_t i = 0; i < reqs.size(); ++i) {
    std::this_thread::sleep_until(t0 + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(t.arrival[i])));
    clients.emplace_back([&, i] {
      try {
        const int64_t asked = reqs[i].output_tokens * reqs[i].samples;
        const int64_t made = stream_completion(url,
                          completion_body(model, reqs[i].prompt, reqs[i].output_tokens,
                                          reqs[i].samples),
                          [&](int64_t choice) {
                            const double now = seconds_since(t0);
                            std::lock_guard lk(m);
                            t.token(i, choice, now);
                          });
        KVLAB_CHECK(made == asked, "bench serve: ", url, " made ", made, " tokens of the ",
                    asked, " asked (max_tokens ", reqs[i].output_tokens, ", n ",
                    reqs[i].samples, "): the figures would count tokens it did not make");
      } catch (const std::exception& e) {  // a malformed chunk's JSON, too
        std::lock_guard lk(m);
        if (failure.empty()) failure = e.what();
      }
    });
  }
  for (std::thread& c : clients) c.join();
  const double duration = seconds_since(t0);
  running = false;
  sampler.join();
  KVLAB_CHECK(failure.empty(), failure);
  json out = serve_summary(t, reqs, duration, peak);
  out["preemptions"] =
      static_cast<int64_t>(metric(metrics, "kvlab_preemptions_total") - preempted_before);
  out["kv_utilisation"] = samples > 0 ? utilisation / static_cast<double>(samples) : 0.0;
  return out;
}

nlohmann::json http_overhead(GPT& model, const Tokenizer& tokenizer, int64_t prompt_tokens,
                             int64_t new_tokens, int rounds, double stream_interval_s,
                             int64_t streams) {
  const GPTConfig& c = model.config();
  KVLAB_CHECK(prompt_tokens >= 1 && new_tokens >= 1 && prompt_tokens + new_tokens <= c.block_size,
              "bench serve: a prompt of ", prompt_tokens, " and ", new_tokens,
              " new tokens must fit the context of ", c.block_size);
  KVLAB_CHECK(streams >= 1, "bench serve: --http-streams must be >= 1, got ", streams);
  const std::vector<int32_t> prompt = bench_prompt(0, prompt_tokens, c.vocab_size);
  std::vector<std::vector<int32_t>> many;
  if (streams > 1)
    for (int64_t i = 0; i < streams; ++i)
      many.push_back(bench_prompt(i, prompt_tokens, c.vocab_size));
  // Each of the many streams makes a quarter of the one stream's tokens: the rounds stay short.
  const int64_t many_tokens = std::max<int64_t>(1, new_tokens / 4);
  Engine local(model, tokenizer);
  GenerateOptions g;
  g.max_new_tokens = new_tokens;
  g.sampling.temperature = 0;
  GenerateOptions g_many = g;
  g_many.max_new_tokens = many_tokens;

  // The server's path without HTTP: the same requests through a scheduler in process.
  Engine scheduled(model, tokenizer);
  SchedulerOptions sched;
  sched.max_seqs = streams;
  sched.max_batch_tokens = std::max<int64_t>(512, prompt_tokens);
  Scheduler scheduler(scheduled, sched);

  Engine served(model, tokenizer);
  ServeOptions so;
  so.port = 0;
  so.model_name = "bench";
  so.scheduler = sched;
  so.max_connections = std::max<int64_t>(so.max_connections, streams + 8);
  so.stream_interval_s = stream_interval_s;
  Server server(served, so);
  const int port = server.bind();
  std::thread serving([&] { server.run(); });

  std::vector<double> local_rate, sched_rate, http_rate, ratio, batched_rate, batched_ratio;
  std::vector<double> many_sched, many_http, many_ratio, many_batched, many_batched_ratio;
  std::string failure;
  try {
    for (int r = 0; r < rounds; ++r) {
      auto t0 = Clock::now();
      const GenerationResult res = local.generate_ids({prompt}, g);
      local_rate.push_back(static_cast<double>(res.rows[0].tokens.size()) / seconds_since(t0));
      sched_rate.push_back(scheduled_rate(scheduler, {prompt}, g));
      http_rate.push_back(streamed_rate(port, {prompt}, new_tokens, 0));
      ratio.push_back(http_rate.back() / local_rate.back());
      batched_rate.push_back(streamed_rate(port, {prompt}, new_tokens, kBatchedReadBytes));
      batched_ratio.push_back(batched_rate.back() / local_rate.back());
      if (many.empty()) continue;
      many_sched.push_back(scheduled_rate(scheduler, many, g_many));
      many_http.push_back(streamed_rate(port, many, many_tokens, 0));
      many_ratio.push_back(many_http.back() / many_sched.back());
      many_batched.push_back(streamed_rate(port, many, many_tokens, kBatchedReadBytes));
      many_batched_ratio.push_back(many_batched.back() / many_sched.back());
    }
  } catch (const Error& e) {
    failure = e.what();
  }
  server.stop();
  serving.join();
  KVLAB_CHECK(failure.empty(), failure);
  json out{{"prompt_tokens", prompt_tokens},
           {"stream_interval_ms", stream_interval_s * 1e3},
           {"new_tokens", new_tokens},
           {"rounds", rounds},
           {"in_process_tokens_per_s", median(local_rate)},
           {"scheduler_tokens_per_s", median(sched_rate)},
           {"http_tokens_per_s", median(http_rate)},
           {"ratio", spread(ratio)},
           {"batched_reads_bytes", kBatchedReadBytes},
           {"http_batched_reads_tokens_per_s", median(batched_rate)},
           {"batched_reads_ratio", spread(batched_ratio)}};
  if (!many.empty())
    out["many_streams"] = {{"streams", streams},
                           {"new_tokens", many_tokens},
                           {"scheduler_tokens_per_s", median(many_sched)},
                           {"http_tokens_per_s", median(many_http)},
                           {"ratio", spread(many_ratio)},
                           {"http_batched_reads_tokens_per_s", median(many_batched)},
                           {"batched_reads_ratio", spread(many_batched_ratio)}};
  return out;
}

}  // namespace kvlab
