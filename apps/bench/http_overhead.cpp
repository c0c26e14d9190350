// bench serve --http's streaming cost (http_bench.h): the same requests in process and
// streamed from an in-process server on loopback, in alternating rounds, read by one epoll
// client thread.
#include "apps/bench/http_bench.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <system_error>
#include <thread>

#include "platform/error.h"
#include "serve/server.h"

namespace kvlab {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

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

// What every round measures: the one request, and (when streams > 1) the many at once.
struct OverheadWork {
  std::vector<int32_t> prompt;
  std::vector<std::vector<int32_t>> many;
  GenerateOptions one, each_of_many;
};

// Each round's tokens/s, per side, and the HTTP / in-process ratios.
struct RoundRates {
  std::vector<double> local, sched, http, ratio, batched, batched_ratio;
  std::vector<double> many_sched, many_http, many_ratio, many_batched, many_batched_ratio;
};

// One round: the request by the engine in process, through the scheduler, then streamed over
// HTTP read per chunk and per kBatchedReadBytes; then the many streams through the scheduler
// and over HTTP, read both ways.
void overhead_round(Engine& local, Scheduler& scheduler, int port, const OverheadWork& w,
                    RoundRates& r) {
  const auto t0 = Clock::now();
  const GenerationResult res = local.generate_ids({w.prompt}, w.one);
  r.local.push_back(static_cast<double>(res.rows[0].tokens.size()) / seconds_since(t0));
  r.sched.push_back(scheduled_rate(scheduler, {w.prompt}, w.one));
  const int64_t tokens = w.one.max_new_tokens;
  r.http.push_back(streamed_rate(port, {w.prompt}, tokens, 0));
  r.ratio.push_back(r.http.back() / r.local.back());
  r.batched.push_back(streamed_rate(port, {w.prompt}, tokens, kBatchedReadBytes));
  r.batched_ratio.push_back(r.batched.back() / r.local.back());
  if (w.many.empty()) return;
  const int64_t many_tokens = w.each_of_many.max_new_tokens;
  r.many_sched.push_back(scheduled_rate(scheduler, w.many, w.each_of_many));
  r.many_http.push_back(streamed_rate(port, w.many, many_tokens, 0));
  r.many_ratio.push_back(r.many_http.back() / r.many_sched.back());
  r.many_batched.push_back(streamed_rate(port, w.many, many_tokens, kBatchedReadBytes));
  r.many_batched_ratio.push_back(r.many_batched.back() / r.many_sched.back());
}

json overhead_json(const OverheadWork& w, const RoundRates& r, int rounds,
                   double stream_interval_s) {
  json out{{"prompt_tokens", w.prompt.size()},
           {"stream_interval_ms", stream_interval_s * 1e3},
           {"new_tokens", w.one.max_new_tokens},
           {"rounds", rounds},
           {"in_process_tokens_per_s", median(r.local)},
           {"scheduler_tokens_per_s", median(r.sched)},
           {"http_tokens_per_s", median(r.http)},
           {"ratio", spread(r.ratio)},
           {"batched_reads_bytes", kBatchedReadBytes},
           {"http_batched_reads_tokens_per_s", median(r.batched)},
           {"batched_reads_ratio", spread(r.batched_ratio)}};
  if (!w.many.empty())
    out["many_streams"] = {{"streams", w.many.size()},
                           {"new_tokens", w.each_of_many.max_new_tokens},
                           {"scheduler_tokens_per_s", median(r.many_sched)},
                           {"http_tokens_per_s", median(r.many_http)},
                           {"ratio", spread(r.many_ratio)},
                           {"http_batched_reads_tokens_per_s", median(r.many_batched)},
                           {"batched_reads_ratio", spread(r.many_batched_ratio)}};
  return out;
}

}  // namespace

nlohmann::json http_overhead(GPT& model, const Tokenizer& tokenizer, int64_t prompt_tokens,
                             int64_t new_tokens, int rounds, double stream_interval_s,
                             int64_t streams) {
  const GPTConfig& c = model.config();
  KVLAB_CHECK(prompt_tokens >= 1 && new_tokens >= 1 && prompt_tokens + new_tokens <= c.block_size,
              "bench serve: a prompt of ", prompt_tokens, " and ", new_tokens,
              " new tokens must fit the context of ", c.block_size);
  KVLAB_CHECK(streams >= 1, "bench serve: --http-streams must be >= 1, got ", streams);
  OverheadWork w;
  w.prompt = bench_prompt(0, prompt_tokens, c.vocab_size);
  if (streams > 1)
    for (int64_t i = 0; i < streams; ++i)
      w.many.push_back(bench_prompt(i, prompt_tokens, c.vocab_size));
  w.one.max_new_tokens = new_tokens;
  w.one.sampling.temperature = 0;
  w.one.ignore_eos = true;  // the client sends ignore_eos too
  // Each of the many streams makes a quarter of the one stream's tokens: the rounds stay short.
  w.each_of_many = w.one;
  w.each_of_many.max_new_tokens = std::max<int64_t>(1, new_tokens / 4);

  Engine local(model, tokenizer);
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

  RoundRates rates;
  std::string failure;
  try {
    for (int r = 0; r < rounds; ++r) overhead_round(local, scheduler, port, w, rates);
  } catch (const Error& e) {
    failure = e.what();
  }
  server.stop();
  serving.join();
  KVLAB_CHECK(failure.empty(), failure);
  return overhead_json(w, rates, rounds, stream_interval_s);
}

}  // namespace kvlab
