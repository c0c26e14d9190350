#pragma once
// kvlab bench serve over HTTP: the serving workload replayed against kvlab serve with real
// clients (one connection per request, streamed), and the cost of HTTP on one stream.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
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

// The requests at the timeline's arrivals, each a streamed completion of its prompt's token
// ids (greedy, max_tokens its output length), on a thread of its own: serve_summary's figures
// with the first and last tokens' arrival times at the client, and from the server's
// /metrics, sampled as it runs, peak_sequences and preemptions.
nlohmann::json replay_over_http(const std::string& url, const std::string& model,
                                const std::vector<KVRequest>& reqs, ServeTimeline t);

// One greedy request of `prompt_tokens` + `new_tokens`, made `rounds` times by the engine in
// process (Engine::generate, as kvlab generate) and streamed over HTTP from an in-process
// server on loopback (ServeOptions::stream_interval_s), alternately. Tokens/s of each (start to last token) and each round's
// HTTP / in-process ratio: {in_process_tokens_per_s, http_tokens_per_s, ratio {median, min,
// max}, rounds}.
nlohmann::json http_overhead(GPT& model, const Tokenizer& tokenizer, int64_t prompt_tokens,
                             int64_t new_tokens, int rounds, double stream_interval_s);

}  // namespace kvlab
