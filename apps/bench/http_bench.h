#pragma once
// kvlab bench serve over HTTP: the serving workload replayed against kvlab serve with real
// clients (one connection per request, streamed), and the cost of HTTP on one stream.
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "infer/engine.h"
#include "infer/measure/bench.h"

namespace kvlab {

// What a server's GET /v1/models says of the model it serves.
struct ServedModel {
  std::string id;
  int64_t context = 0;
  int64_t vocab_size = 0;
};
// url: "http://host:port". Throws kvlab::Error naming the URL when it does not answer.
ServedModel served_model(const std::string& url);
// From the body of GET /v1/models: its first model, with the context and vocabulary kvlab serve
// gives (max_model_len, vocab_size) or llama-server does (meta.n_ctx, meta.n_vocab). Throws
// kvlab::Error naming the URL when it has neither.
ServedModel served_model(const nlohmann::json& models, const std::string& url);

// An OpenAI completions event stream (server-sent events), read as its bytes arrive:
// on_text(choice) for each chunk that carries a choice's text (a token, or tokens sent
// together), the usage chunk's completion_tokens, an error event's message.
class CompletionEvents {
 public:
  explicit CompletionEvents(std::function<void(int64_t choice)> on_text)
      : on_text_(std::move(on_text)) {}
  // Throws kvlab::Error on an event that should be JSON and is not.
  void feed(std::string_view bytes);
  int64_t completion_tokens() const { return made_; }  // -1 until a usage chunk came
  const std::string& error() const { return error_; }

 private:
  std::function<void(int64_t)> on_text_;
  std::string buffer_;
  int64_t made_ = -1;
  std::string error_;
};

// The body of an HTTP/1.1 response with chunked transfer coding, decoded as its bytes arrive:
// on_data(bytes) for each piece of a chunk's data. Throws kvlab::Error on a malformed chunk (a
// size line that is not hex, data without its CRLF) or bytes after the last chunk.
class ChunkedBody {
 public:
  explicit ChunkedBody(std::function<void(std::string_view)> on_data)
      : on_data_(std::move(on_data)) {}
  void feed(std::string_view bytes);
  bool ended() const { return phase_ == Phase::kEnded; }  // the last (empty) chunk came

 private:
  enum class Phase { kSize, kData, kDataEnd, kTrailer, kEnded };
  std::function<void(std::string_view)> on_data_;
  Phase phase_ = Phase::kSize;
  std::string line_;   // the size line or trailer line read so far
  size_t left_ = 0;    // the current chunk's data bytes still to come
};

// The body of one streamed completion request of prompt's token ids: greedy, max_tokens,
// ignore_eos, usage in the stream.
nlohmann::json completion_body(const std::string& model, const std::vector<int32_t>& prompt,
                               int64_t max_tokens, int64_t n = 1);

// The requests at the timeline's arrivals, each a streamed completion of its prompt's token
// ids (greedy, max_tokens its output length, ignore_eos), on a thread of its own:
// serve_summary's figures with the first and last tokens' arrival times at the client, and
// from the server's /metrics (kvlab's names; 0 from a server without them), sampled as it
// runs, peak_sequences and preemptions. Throws kvlab::Error when a request's usage is not the
// tokens it asked for.
nlohmann::json replay_over_http(const std::string& url, const std::string& model,
                                const std::vector<KVRequest>& reqs, ServeTimeline t);

// http_overhead's second reads take batches of this many bytes: the server's side alone.
inline constexpr int kBatchedReadBytes = 16 * 1024;

// One greedy request of `prompt_tokens` + `new_tokens`, made `rounds` times by the engine in
// process (Engine::generate, as kvlab generate) and streamed over HTTP from an in-process
// server on loopback (ServeOptions::stream_interval_s), alternately. Tokens/s of each (start
// to last token) and each round's HTTP / in-process ratio: {in_process_tokens_per_s,
// http_tokens_per_s, ratio {median, min, max}, rounds}. Each round streams the request once
// more with its socket read per batched_reads_bytes rather than per chunk
// (http_batched_reads_tokens_per_s, batched_reads_ratio): on a machine whose cores all run
// the model, what the server's side costs without the client's wake-ups.
// With streams > 1 each round also streams that many requests at once (distinct prompts, a
// quarter of new_tokens each) and runs the same requests through the server's scheduler in
// process: "many_streams" {streams, new_tokens, scheduler_tokens_per_s, http_tokens_per_s,
// ratio, http_batched_reads_tokens_per_s, batched_reads_ratio}, over HTTP against the
// scheduler. One client thread reads all the streams of a round, as an event-loop client does
// (epoll; vLLM's benchmark reads its streams from one asyncio loop).
nlohmann::json http_overhead(GPT& model, const Tokenizer& tokenizer, int64_t prompt_tokens,
                             int64_t new_tokens, int rounds, double stream_interval_s,
                             int64_t streams);

}  // namespace kvlab
