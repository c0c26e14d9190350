#include "apps/serve/http_bench.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <charconv>
#include <sstream>
#include <string_view>
#include <system_error>
#include <thread>

#include "apps/serve/server.h"
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
// Returns the tokens made (the usage chunk's count), or throws kvlab::Error. With
// read_low_water > 0 the client is woken only once that many bytes wait (SO_RCVLOWAT) or the
// connection closes, instead of at every chunk: the server still sends every chunk, but the
// client's own wake-ups no longer take time from a server on the same cores. The request asks
// `Connection: close`, so that the last bytes arrive with the close rather than wait below the
// mark.
int64_t stream_completion(const std::string& url, const json& body,
                          const std::function<void(int64_t choice)>& on_text,
                          int read_low_water = 0) {
  httplib::Client c = client_for(url);
  if (read_low_water > 0)
    c.set_socket_options([read_low_water](socket_t sock) {
      ::setsockopt(sock, SOL_SOCKET, SO_RCVLOWAT, &read_low_water, sizeof read_low_water);
    });
  CompletionEvents events(on_text);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.set_header("Connection", "close");
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

// Tokens/s of the prompts streamed from url at once, each to a client of its own woken per
// read_low_water bytes (0: per chunk), to the last token.
double streamed_rate(const std::string& url, const std::vector<std::vector<int32_t>>& prompts,
                     int64_t tokens, int read_low_water) {
  auto one = [&](const std::vector<int32_t>& p) {
    return stream_completion(url, completion_body("bench", p, tokens), [](int64_t) {},
                             read_low_water);
  };
  const auto t0 = Clock::now();
  if (prompts.size() == 1)  // on this thread, as a client of one stream would
    return static_cast<double>(one(prompts[0])) / seconds_since(t0);
  int64_t made = 0;
  std::mutex m;
  std::string failure;
  std::vector<std::thread> clients;
  try {
    for (const auto& p : prompts)
      clients.emplace_back([&, &p = p] {
        try {
          const int64_t n = one(p);
          std::lock_guard lk(m);
          made += n;
        } catch (const std::exception& e) {
          std::lock_guard lk(m);
          if (failure.empty()) failure = e.what();
        }
      });
  } catch (const std::system_error& e) {  // out of threads: the started ones end first
    std::lock_guard lk(m);
    failure = detail::cat("bench serve: cannot start ", prompts.size(), " clients: ", e.what());
  }
  for (std::thread& t : clients) t.join();
  KVLAB_CHECK(failure.empty(), failure);
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
  const std::string url = detail::cat("http://127.0.0.1:", server.bind());
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
      http_rate.push_back(streamed_rate(url, {prompt}, new_tokens, 0));
      ratio.push_back(http_rate.back() / local_rate.back());
      batched_rate.push_back(streamed_rate(url, {prompt}, new_tokens, kBatchedReadBytes));
      batched_ratio.push_back(batched_rate.back() / local_rate.back());
      if (many.empty()) continue;
      many_sched.push_back(scheduled_rate(scheduler, many, g_many));
      many_http.push_back(streamed_rate(url, many, many_tokens, 0));
      many_ratio.push_back(many_http.back() / many_sched.back());
      many_batched.push_back(streamed_rate(url, many, many_tokens, kBatchedReadBytes));
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
