#pragma once
// The connections of kvlab serve: httplib's server, with the waiting taken off its worker
// threads. httplib 0.11's own deadlines are per read (a client sending a byte every few seconds
// holds a worker for ever) and its keep-alive wait holds a worker too, so a few hundred idle
// connections stall every request. Here one gate thread watches every connection that is not
// mid-request (epoll): a worker takes one only once its request line and headers have all
// arrived, answers it, and hands it back to the gate to wait for the next. Each phase has a
// deadline:
//   headers      a connection's request line and headers arrive within header_timeout_s of its
//                first byte (of its accept, for a new one); else 408 and closed
//   keep-alive   between requests a connection may idle keep_alive_timeout_s; then closed
//   body         a body arrives at min_body_rate bytes/s or faster, after header_timeout_s of
//                grace; else the read fails (httplib answers 400) and the connection closes
//   writes       a write waits at most write_timeout_s for the client to take bytes (a client
//                that stopped reading); then it fails: a stream's call is cancelled
// A complete request that finds every worker busy is answered 503 with Retry-After at once, as
// is a connection beyond max_waiting.
#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace kvlab {

struct ConnectionOptions {
  int64_t max_connections = 128;  // requests read, handled and answered at once (a thread each)
  int64_t max_waiting = 4096;     // connections the gate watches (idle or sending headers)
  int64_t max_keep_alive_requests = 1000;
  double header_timeout_s = 5;
  double keep_alive_timeout_s = 5;
  double min_body_rate = 16384;  // bytes per second
  double write_timeout_s = 10;
  // A connection's send buffer (SO_SNDBUF; 0: the kernel's, which grows to megabytes): what a
  // client that stopped reading may leave unread before writes wait.
  int64_t send_buffer_bytes = 0;
};

// Counts since the start, and the connections now in each state.
struct ConnectionStats {
  int64_t active = 0;           // held by a worker (a request read, handled or answered)
  int64_t waiting = 0;          // watched by the gate
  int64_t refused_busy = 0;     // answered 503: every worker busy, or too many waiting
  int64_t header_timeouts = 0;  // answered 408: headers too slow
  int64_t idle_closed = 0;      // keep-alive connections closed for idling
  int64_t body_timeouts = 0;    // bodies slower than min_body_rate
  int64_t write_timeouts = 0;   // writes the client did not take within write_timeout_s
};

class HttpServer : public httplib::Server {
 public:
  // Throws kvlab::Error naming a bad option.
  explicit HttpServer(ConnectionOptions options);
  ~HttpServer() override;

  // httplib 0.11 listens with a backlog of 5: a burst of clients overflows it and connections
  // are dropped. Listening again on the bound socket raises the backlog (Linux allows it).
  void raise_backlog();
  ConnectionStats stats() const;
  // From a handler: the connection closes once this response is written (a refused request
  // whose body was not read).
  static void close_after_response();
  // From a handler or its content provider: the connection of the request this worker thread
  // serves. Its writes wait at most write_timeout_s; it lives until the response is written.
  static httplib::Stream& current_stream();

  struct Gate;

 private:
  // Called by httplib's accept loop for each new connection (its task queue runs it inline):
  // the connection goes to the gate.
  bool process_and_close_socket(socket_t sock) override;
  // A worker: reads, handles and answers one request whose headers are `head`; true when the
  // connection may carry another.
  bool serve_one(socket_t sock, std::string head, bool last);

  ConnectionOptions options_;
  std::unique_ptr<Gate> gate_;
};

// Appends `data` framed as one chunk of a chunked body (RFC 9112, 7.1); nothing for no data.
void append_http_chunk(std::string& out, std::string_view data);
// Writes to `sock` what it takes now, without waiting: the bytes written (0: its buffer is
// full), or -1 when the connection failed (the client left).
int64_t send_now(socket_t sock, std::string_view data);
// Writes all of `data`; false when the connection failed (or did not take it in time).
bool write_all(httplib::Stream& strm, std::string_view data);

}  // namespace kvlab
