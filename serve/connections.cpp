#include "serve/connections.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "platform/error.h"

namespace kvlab {

namespace {

using Clock = std::chrono::steady_clock;

Clock::duration span(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// Milliseconds to wait for `until`, at least 0 (and at most a day: poll takes an int).
int ms_until(Clock::time_point until) {
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(ms + 1, 0, 86'400'000));
}

// The most a request line and headers may take (httplib's own limit is 8 KiB a line).
constexpr size_t kMaxHead = 64 * 1024;
// How long a refused connection is drained before it is closed: closing a socket with unread
// bytes resets it, and the client may then lose the answer.
constexpr double kLingerS = 1;

// Set by close_after_response on the worker thread that serves the request.
thread_local bool t_close_after = false;
// The connection of the request the worker thread serves (serve_one's).
thread_local httplib::Stream* t_stream = nullptr;

// An answer the gate writes itself; the connection closes after it. The body is OpenAI's
// error object.
std::string fixed_response(int status, const char* reason, const char* type, const char* message,
                           bool retry) {
  const std::string body = detail::cat("{\"error\": {\"message\": \"", message, "\", \"type\": \"",
                                       type, "\", \"param\": null, \"code\": null}}");
  return detail::cat("HTTP/1.1 ", status, " ", reason, "\r\n", retry ? "Retry-After: 1\r\n" : "",
                     "Content-Type: application/json\r\nContent-Length: ", body.size(),
                     "\r\nConnection: close\r\n\r\n", body);
}

const std::string& busy_response() {
  static const std::string r = fixed_response(
      503, "Service Unavailable", "server_error",
      "the server is answering as many connections as it may; retry after a moment", true);
  return r;
}

const std::string& header_timeout_response() {
  static const std::string r =
      fixed_response(408, "Request Timeout", "invalid_request_error",
                     "the request line and headers did not arrive in time", false);
  return r;
}

const std::string& head_too_large_response() {
  static const std::string r =
      fixed_response(431, "Request Header Fields Too Large", "invalid_request_error",
                     "the request line and headers are larger than 64 KiB", false);
  return r;
}

void ip_and_port(socket_t sock, bool peer, std::string& ip, int& port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  const int rc = peer ? ::getpeername(sock, reinterpret_cast<sockaddr*>(&addr), &len)
                      : ::getsockname(sock, reinterpret_cast<sockaddr*>(&addr), &len);
  if (rc != 0) return;
  char buf[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &a->sin_addr, buf, sizeof buf);
    port = ntohs(a->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof buf);
    port = ntohs(a->sin6_port);
  }
  ip = buf;
}

// Waits until `sock` is ready for `events` or `until`; false at the deadline or on an error.
bool wait_ready(socket_t sock, short events, Clock::time_point until) {
  for (;;) {
    pollfd p{sock, events, 0};
    const int rc = ::poll(&p, 1, ms_until(until));
    if (rc > 0) return true;
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0 || Clock::now() >= until) return false;
  }
}

}  // namespace

struct HttpServer::Gate {
  HttpServer& server;
  const ConnectionOptions& o;

  std::atomic<int64_t> active{0}, waiting{0}, refused_busy{0}, header_timeouts{0}, idle_closed{0},
      body_timeouts{0}, write_timeouts{0};

  // A connection the gate watches: until its headers arrive, or while a refused one drains.
  struct Watched {
    Clock::time_point deadline;
    int64_t requests = 0;  // requests it has carried
    bool began = false;    // bytes of its next request have arrived
    bool closing = false;  // refused: drained until the client closes or kLingerS pass
  };
  std::mutex m;
  std::unordered_map<socket_t, Watched> watched;  // under m
  int epfd = -1;
  int wake = -1;  // an eventfd in epfd: a stop, or a deadline sooner than the gate's wait
  std::atomic<bool> stopping{false};
  std::thread thread;
  std::vector<char> scratch = std::vector<char>(kMaxHead);  // the gate thread's

  struct Job {
    socket_t sock;
    std::string head;
    int64_t requests;
  };
  std::deque<Job> jobs;        // under m
  std::vector<socket_t> busy;  // under m: the sockets workers hold
  std::condition_variable jobs_cv;
  std::vector<std::thread> workers;

  Gate(HttpServer& s, const ConnectionOptions& o) : server(s), o(o) {}

  void start();
  void shutdown();
  // A connection to watch: new (requests 0), or back from a worker after a request.
  void admit(socket_t sock, int64_t requests);
  void loop();
  void wake_gate() {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake, &one, sizeof one);
  }
  // Under m: milliseconds until the first deadline (at least 1), -1 with nothing watched.
  int wait_ms(Clock::time_point now) const;
  void work();
  // Under m: what a readable connection holds; hands it on, refuses it, or watches on.
  void examine(socket_t sock, Watched& w);
  // Under m: at its deadline, a connection is answered 408 (headers begun) or closed.
  void expire(socket_t sock, Watched& w, Clock::time_point now);
  // Under m: writes `response`, stops writing, and drains what the client still sends.
  void refuse(socket_t sock, Watched& w, const std::string& response);
  void forget(socket_t sock) {
    const auto it = watched.find(sock);
    if (it != watched.end() && !it->second.closing) --waiting;
    ::epoll_ctl(epfd, EPOLL_CTL_DEL, sock, nullptr);
    watched.erase(sock);
  }
  void close_now(socket_t sock) {
    forget(sock);
    ::close(sock);
  }
};

// A connection's socket while a worker holds it: the request's headers, already taken from
// the socket, are read first; then the body under its deadline; writes wait at most the write
// timeout. A write is tried before any wait, so a stream's chunk costs one send().
class GateStream final : public httplib::Stream {
 public:
  GateStream(socket_t sock, std::string head, const ConnectionOptions& o, HttpServer::Gate& gate)
      : sock_(sock), head_(std::move(head)), o_(o), gate_(gate) {}

  bool failed() const { return failed_; }

  bool is_readable() const override {
    return pos_ < head_.size() || wait_ready(sock_, POLLIN, body_deadline());
  }
  bool is_writable() const override { return !failed_; }

  ssize_t read(char* ptr, size_t size) override {
    if (pos_ < head_.size()) {
      const size_t n = std::min(size, head_.size() - pos_);
      std::memcpy(ptr, head_.data() + pos_, n);
      pos_ += n;
      return static_cast<ssize_t>(n);
    }
    for (;;) {
      const ssize_t n = ::recv(sock_, ptr, size, MSG_DONTWAIT);
      if (n >= 0) {
        body_bytes_ += static_cast<size_t>(n);
        return n;
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return fail();
      if (!wait_ready(sock_, POLLIN, body_deadline())) {
        ++gate_.body_timeouts;
        return fail();
      }
    }
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (failed_) return -1;
    const Clock::time_point until = Clock::now() + span(o_.write_timeout_s);
    for (;;) {
      const int64_t n = send_now(sock_, std::string_view(ptr, size));
      if (n < 0) return fail();
      if (n > 0 || size == 0) return n;
      if (!wait_ready(sock_, POLLOUT, until)) {
        ++gate_.write_timeouts;
        return fail();
      }
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip_and_port(sock_, true, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip_and_port(sock_, false, ip, port);
  }
  socket_t socket() const override { return sock_; }

 private:
  // The body's bytes so far may take header_timeout_s plus their size over min_body_rate.
  Clock::time_point body_deadline() const {
    return start_ +
           span(o_.header_timeout_s + static_cast<double>(body_bytes_ + 1) / o_.min_body_rate);
  }
  ssize_t fail() {
    failed_ = true;
    return -1;
  }

  socket_t sock_;
  std::string head_;
  size_t pos_ = 0;
  size_t body_bytes_ = 0;
  Clock::time_point start_ = Clock::now();
  bool failed_ = false;
  const ConnectionOptions& o_;
  HttpServer::Gate& gate_;
};

// httplib's accept loop hands each new connection to its task queue: this one passes it to
// the gate at once (process_and_close_socket, on the accept thread), and starts and stops the
// gate with the loop.
class GateQueue final : public httplib::TaskQueue {
 public:
  explicit GateQueue(HttpServer::Gate& gate) : gate_(gate) { gate_.start(); }
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override { gate_.shutdown(); }

 private:
  HttpServer::Gate& gate_;
};

void HttpServer::Gate::start() {
  stopping = false;
  epfd = ::epoll_create1(EPOLL_CLOEXEC);
  KVLAB_CHECK(epfd >= 0, "serve: epoll_create1: ", std::strerror(errno));
  wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  KVLAB_CHECK(wake >= 0, "serve: eventfd: ", std::strerror(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake;
  KVLAB_CHECK(::epoll_ctl(epfd, EPOLL_CTL_ADD, wake, &ev) == 0, "serve: epoll_ctl: ",
              std::strerror(errno));
  thread = std::thread([this] { loop(); });
  for (int64_t i = 0; i < o.max_connections; ++i) workers.emplace_back([this] { work(); });
}

void HttpServer::Gate::shutdown() {
  {
    std::lock_guard lk(m);
    stopping = true;
    // A worker waiting for a body returns at once; one writing keeps its write deadline.
    for (const socket_t sock : busy) ::shutdown(sock, SHUT_RD);
  }
  wake_gate();
  jobs_cv.notify_all();
  if (thread.joinable()) thread.join();
  for (std::thread& t : workers) t.join();
  workers.clear();
  std::lock_guard lk(m);
  for (const auto& [sock, w] : watched) ::close(sock);
  watched.clear();
  for (const Job& j : jobs) ::close(j.sock);
  jobs.clear();
  waiting = 0;
  if (epfd >= 0) ::close(epfd);
  if (wake >= 0) ::close(wake);
  epfd = wake = -1;
}

void HttpServer::Gate::admit(socket_t sock, int64_t requests) {
  std::lock_guard lk(m);
  if (stopping) {
    ::close(sock);
    return;
  }
  if (requests == 0 && o.send_buffer_bytes > 0) {
    const int bytes = static_cast<int>(std::min<int64_t>(o.send_buffer_bytes, INT32_MAX));
    ::setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
  }
  const Clock::time_point now = Clock::now();
  Watched& w = watched[sock];
  w = Watched{now + span(requests == 0 ? o.header_timeout_s : o.keep_alive_timeout_s), requests};
  ++waiting;
  // Edge-triggered: an event for each arrival of bytes, none for bytes already examined.
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;
  ev.data.fd = sock;
  if (::epoll_ctl(epfd, EPOLL_CTL_ADD, sock, &ev) != 0) {
    close_now(sock);
    return;
  }
  if (waiting > o.max_waiting) {
    ++refused_busy;
    refuse(sock, w, busy_response());
  }
  wake_gate();  // its deadline may come before the gate's wait ends
}

int HttpServer::Gate::wait_ms(Clock::time_point now) const {
  if (watched.empty()) return -1;
  Clock::time_point first = Clock::time_point::max();
  for (const auto& [sock, w] : watched) first = std::min(first, w.deadline);
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(first - now).count();
  return static_cast<int>(std::clamp<int64_t>(ms, 1, 60'000));
}

// Sleeps until a socket is readable, the first deadline passes, or wake_gate: no polling.
void HttpServer::Gate::loop() {
  std::vector<epoll_event> events(256);
  int timeout_ms = -1;
  while (!stopping) {
    const int n = ::epoll_wait(epfd, events.data(), static_cast<int>(events.size()), timeout_ms);
    std::lock_guard lk(m);
    for (int i = 0; i < n; ++i) {
      const socket_t sock = events[static_cast<size_t>(i)].data.fd;
      if (sock == wake) {
        uint64_t count;
        [[maybe_unused]] const ssize_t r = ::read(wake, &count, sizeof count);
        continue;
      }
      const auto it = watched.find(sock);
      if (it != watched.end()) examine(sock, it->second);
    }
    const Clock::time_point now = Clock::now();
    std::vector<socket_t> due;
    for (const auto& [sock, w] : watched)
      if (w.deadline <= now) due.push_back(sock);
    for (const socket_t sock : due) expire(sock, watched.at(sock), now);
    timeout_ms = wait_ms(now);
  }
}

void HttpServer::Gate::examine(socket_t sock, Watched& w) {
  if (w.closing) {  // drain until the client closes
    ssize_t n;
    while ((n = ::recv(sock, scratch.data(), scratch.size(), MSG_DONTWAIT)) > 0) {
    }
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) close_now(sock);
    return;
  }
  const ssize_t n = ::recv(sock, scratch.data(), scratch.size(), MSG_PEEK | MSG_DONTWAIT);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
    close_now(sock);  // the client closed (or reset) it
    return;
  }
  if (n < 0) return;
  if (!w.began) {
    w.began = true;
    // A kept-alive connection's next request has header_timeout_s from its first byte.
    if (w.requests > 0) w.deadline = Clock::now() + span(o.header_timeout_s);
  }
  const std::string_view peeked(scratch.data(), static_cast<size_t>(n));
  const size_t end = peeked.find("\r\n\r\n");
  if (end == std::string_view::npos) {
    if (static_cast<size_t>(n) == kMaxHead) refuse(sock, w, head_too_large_response());
    return;
  }
  // The headers are all here: the connection leaves the gate with them.
  std::string head(end + 4, '\0');
  size_t got = 0;
  while (got < head.size()) {
    const ssize_t r = ::recv(sock, head.data() + got, head.size() - got, MSG_DONTWAIT);
    if (r <= 0) {
      close_now(sock);
      return;
    }
    got += static_cast<size_t>(r);
  }
  if (active >= o.max_connections) {
    ++refused_busy;
    refuse(sock, w, busy_response());
    return;
  }
  const int64_t requests = w.requests;
  forget(sock);
  ++active;
  jobs.push_back({sock, std::move(head), requests});
  jobs_cv.notify_one();
}

void HttpServer::Gate::expire(socket_t sock, Watched& w, Clock::time_point now) {
  if (w.closing) {
    close_now(sock);
  } else if (w.began) {
    ++header_timeouts;
    refuse(sock, w, header_timeout_response());
  } else {
    // Nothing sent: a new connection that never spoke, or a kept-alive one idling out.
    if (w.requests == 0)
      ++header_timeouts;
    else
      ++idle_closed;
    close_now(sock);
  }
  (void)now;
}

void HttpServer::Gate::refuse(socket_t sock, Watched& w, const std::string& response) {
  // A fresh or idle socket takes a short answer at once; one that does not is not waited for.
  (void)::send(sock, response.data(), response.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  ::shutdown(sock, SHUT_WR);
  if (!w.closing) --waiting;
  w.closing = true;
  w.deadline = Clock::now() + span(kLingerS);
}

void HttpServer::Gate::work() {
  for (;;) {
    Job job;
    {
      std::unique_lock lk(m);
      jobs_cv.wait(lk, [&] { return stopping || !jobs.empty(); });
      if (jobs.empty()) return;
      job = std::move(jobs.front());
      jobs.pop_front();
      busy.push_back(job.sock);
    }
    const bool last = job.requests + 1 >= o.max_keep_alive_requests;
    bool again = false;
    try {
      again = server.serve_one(job.sock, std::move(job.head), last);
    } catch (...) {  // a handler's exception is httplib's to answer; this is a last guard
    }
    {
      std::lock_guard lk(m);
      std::erase(busy, job.sock);
    }
    --active;
    if (again && !stopping) {
      admit(job.sock, job.requests + 1);
    } else {
      ::shutdown(job.sock, SHUT_RDWR);
      ::close(job.sock);
    }
  }
}

HttpServer::HttpServer(ConnectionOptions options)
    : options_(options), gate_(std::make_unique<Gate>(*this, options_)) {
  const ConnectionOptions& o = options_;
  KVLAB_CHECK(o.max_connections >= 1, "serve: max_connections must be >= 1, got ",
              o.max_connections);
  KVLAB_CHECK(o.max_waiting >= 1, "serve: max_waiting must be >= 1, got ", o.max_waiting);
  KVLAB_CHECK(o.max_keep_alive_requests >= 1, "serve: max_keep_alive_requests must be >= 1");
  KVLAB_CHECK(o.header_timeout_s > 0 && o.keep_alive_timeout_s > 0 && o.write_timeout_s > 0,
              "serve: the header, keep-alive and write timeouts must be > 0");
  KVLAB_CHECK(o.min_body_rate > 0, "serve: min_body_rate must be > 0 bytes/s");
  KVLAB_CHECK(o.send_buffer_bytes >= 0, "serve: send_buffer_bytes must be >= 0");
  new_task_queue = [this] { return new GateQueue(*gate_); };
}

HttpServer::~HttpServer() = default;

void HttpServer::raise_backlog() { ::listen(svr_sock_, SOMAXCONN); }

ConnectionStats HttpServer::stats() const {
  const Gate& g = *gate_;
  return {g.active,      g.waiting,       g.refused_busy,  g.header_timeouts,
          g.idle_closed, g.body_timeouts, g.write_timeouts};
}

bool HttpServer::process_and_close_socket(socket_t sock) {
  gate_->admit(sock, 0);
  return true;
}

void HttpServer::close_after_response() { t_close_after = true; }

httplib::Stream& HttpServer::current_stream() {
  KVLAB_CHECK(t_stream != nullptr, "current_stream: this thread serves no request");
  return *t_stream;
}

bool HttpServer::serve_one(socket_t sock, std::string head, bool last) {
  GateStream strm(sock, std::move(head), options_, *gate_);
  bool closed = false;
  t_close_after = false;
  t_stream = &strm;
  struct Forget {
    ~Forget() { t_stream = nullptr; }
  } forget;
  const bool ok = process_request(strm, last, closed, nullptr);
  return ok && !closed && !last && !t_close_after && !strm.failed() && svr_sock_ != INVALID_SOCKET;
}

void append_http_chunk(std::string& out, std::string_view data) {
  if (data.empty()) return;  // an empty chunk would end the body
  char size[20];
  const int n = std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  out.append(size, static_cast<size_t>(n));
  out += data;
  out += "\r\n";
}

int64_t send_now(socket_t sock, std::string_view data) {
  for (;;) {
    const ssize_t n = ::send(sock, data.data(), data.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n >= 0) return n;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
  }
}

bool write_all(httplib::Stream& strm, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = strm.write(data.data(), data.size());
    if (n <= 0) return false;
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

}  // namespace kvlab
