// bench serve's HTTP client (http_bench.h): streamed completions read as their chunks arrive,
// and the workload replayed against any OpenAI-compatible server.
#include "apps/bench/http_bench.h"

#include <httplib.h>

#include <charconv>
#include <chrono>
#include <mutex>
#include <sstream>
#include <string_view>
#include <thread>

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

}  // namespace

json completion_body(const std::string& model, const std::vector<int32_t>& prompt,
                     int64_t max_tokens, int64_t n) {
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

}  // namespace kvlab
