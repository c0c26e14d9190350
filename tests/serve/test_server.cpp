// kvlab serve on loopback: a real HTTP client (cpp-httplib's) against the real server, in
// process, over a tiny random model. Completions must equal the engine's with the same
// options and seed; log-probabilities must equal the model's log-softmax; bad requests get
// their 4xx and the server keeps answering; a client that leaves gives its blocks back.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <thread>

#include "apps/bench/http_bench.h"
#include "autograd/graph.h"
#include "infer/engine.h"
#include "serve/server.h"
#include "tests/error_of.h"
#include "tests/infer/infer_test_util.h"

namespace kvlab {
namespace {

using nlohmann::json;

Tokenizer with_controls(Tokenizer tok, TokenControls controls) {
  tok.set_controls(std::move(controls));
  return tok;
}

// A server over its own model and engine, running on a thread; the client is fresh per call.
class Running {
 public:
  // arch "mla": the MLA block (test::tiny_config), its latent rows in the scheduler's pool.
  // controls: the tokenizer's BOS and end tokens (none by default).
  explicit Running(ServeOptions o = {}, int64_t block_size = 16, const std::string& arch = "gpt2",
                   TokenControls controls = {})
      : model_(test::tiny_model(arch == "mla" ? 4 : 2, 11, block_size, arch)),
        tok_(with_controls(test::tiny_tokenizer(), std::move(controls))),
        engine_(*model_, tok_) {
    o.host = "127.0.0.1";
    o.port = 0;
    o.model_name = "tiny";
    server_ = std::make_unique<Server>(engine_, o);
    port_ = server_->bind();
    thread_ = std::thread([this] { server_->run(); });
  }
  ~Running() {
    server_->stop();
    thread_.join();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60, 0);
    return c;
  }
  httplib::Result post(const json& body) const {
    return client().Post("/v1/completions", body.dump(), "application/json");
  }
  int port() const { return port_; }
  void stop() { server_->stop(); }
  GPT& model() { return *model_; }
  const Tokenizer& tokenizer() const { return tok_; }
  // The reference: a separate engine over the same model (the server's is busy).
  GenerationResult generate(const std::vector<std::string>& prompts, const GenerateOptions& o) {
    Engine e(*model_, tok_);
    return e.generate(prompts, o);
  }
  // A metric's value from /metrics (the first sample whose line starts with `name`).
  double metric(const std::string& name) const {
    const auto r = client().Get("/metrics");
    EXPECT_TRUE(r) << "no /metrics";
    std::istringstream in(r->body);
    for (std::string line; std::getline(in, line);)
      if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
    ADD_FAILURE() << "no metric " << name;
    return -1;
  }

 private:
  std::unique_ptr<GPT> model_;
  Tokenizer tok_;
  Engine engine_;
  std::unique_ptr<Server> server_;
  int port_ = 0;
  std::thread thread_;
};

GenerateOptions sampled(int64_t max_new, uint64_t seed, int64_t n = 1) {
  GenerateOptions o;
  o.max_new_tokens = max_new;
  o.n = n;
  o.sampling.temperature = 0.9;
  o.sampling.top_k = 6;
  o.sampling.top_p = 0.95;
  o.sampling.seed = seed;
  return o;
}

json sampled_body(const std::string& prompt, int64_t max_tokens, uint64_t seed) {
  return {{"model", "tiny"}, {"prompt", prompt},  {"max_tokens", max_tokens}, {"temperature", 0.9},
          {"top_k", 6},      {"top_p", 0.95},     {"seed", seed}};
}

// The stream tests run with each writer of a stream's chunks (ServeOptions::
// scheduler_writes_streams): the scheduler thread, and the stream's HTTP thread.
ServeOptions written_by(bool scheduler, ServeOptions o = {}) {
  o.scheduler_writes_streams = scheduler;
  return o;
}
std::string writer_name(bool scheduler) {
  return scheduler ? "written by the scheduler thread" : "written by the HTTP thread";
}

// The data lines of a server-sent event stream: each chunk's JSON, and whether [DONE] ended it.
std::vector<json> events_of(const std::string& body, bool& done) {
  std::vector<json> out;
  done = false;
  std::istringstream in(body);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: ", 0) != 0) continue;
    EXPECT_FALSE(done) << "data after [DONE]";
    const std::string data = line.substr(6);
    if (data == "[DONE]")
      done = true;
    else
      out.push_back(json::parse(data));
  }
  return out;
}

// The first choice's text and finish_reason from a completion's body, whole or streamed
// (`done`: whether a stream ended with [DONE]; true for a whole body).
struct FirstChoice {
  std::string text, reason;
  bool done = true;
};
FirstChoice first_choice(const std::string& body, bool stream) {
  FirstChoice c;
  if (!stream) {
    const json j = json::parse(body);
    c.text = j["choices"][0]["text"];
    c.reason = j["choices"][0]["finish_reason"];
    return c;
  }
  for (const json& e : events_of(body, c.done)) {
    c.text += e["choices"][0]["text"].get<std::string>();
    if (!e["choices"][0]["finish_reason"].is_null()) c.reason = e["choices"][0]["finish_reason"];
  }
  return c;
}

// A real client's completion, whole and streamed, is the engine's, for GPT-2's block and MLA's.
TEST(Serve, CompletionEqualsTheEngineStreamedOrNot) {
  for (const std::string arch : {"gpt2", "mla"})
    for (const bool by_scheduler : {true, false}) {
      SCOPED_TRACE(arch + ", " + writer_name(by_scheduler));
      Running s(written_by(by_scheduler), 16, arch);
      const GenerationResult ref = s.generate({"abc a"}, sampled(9, 41));
      const auto r = s.post(sampled_body("abc a", 9, 41));
      ASSERT_TRUE(r);
      ASSERT_EQ(r->status, 200) << r->body;
      const json j = json::parse(r->body);
      EXPECT_EQ(j["object"], "text_completion");
      EXPECT_EQ(j["model"], "tiny");
      ASSERT_EQ(j["choices"].size(), 1u);
      EXPECT_EQ(j["choices"][0]["text"], ref.rows[0].text);
      EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
      EXPECT_EQ(j["usage"]["prompt_tokens"], 5);
      EXPECT_EQ(j["usage"]["completion_tokens"], 9);
      EXPECT_EQ(j["usage"]["total_tokens"], 14);

      json body = sampled_body("abc a", 9, 41);
      body["stream"] = true;
      body["stream_options"] = {{"include_usage", true}};
      // The pieces a stream's HTTP thread finds waiting go as one chunk, so a thread descheduled
      // on a busy host may send all nine tokens at once: each attempt must give the same text,
      // and one of three must come in pieces.
      size_t most_chunks = 0;
      for (int attempt = 0; attempt < 3 && most_chunks < 3; ++attempt) {
        const auto st = s.post(body);
        ASSERT_TRUE(st);
        ASSERT_EQ(st->status, 200) << st->body;
        EXPECT_EQ(st->get_header_value("Content-Type"), "text/event-stream");
        bool done = false;
        const std::vector<json> chunks = events_of(st->body, done);
        EXPECT_TRUE(done);
        std::string text;
        json last_choice, usage;
        for (const json& c : chunks) {
          if (c["choices"].empty()) {
            usage = c["usage"];
            continue;
          }
          text += c["choices"][0]["text"].get<std::string>();
          last_choice = c["choices"][0];
        }
        EXPECT_EQ(text, ref.rows[0].text);
        EXPECT_EQ(last_choice["finish_reason"], "length");
        EXPECT_EQ(usage["completion_tokens"], 9);
        most_chunks = std::max(most_chunks, chunks.size());
      }
      EXPECT_GE(most_chunks, 3u) << "the text came in one piece three times: not streamed";
    }
}

// With a stream interval, tokens made within it travel together: the same text, in fewer
// chunks than tokens (the tiny model makes its 15 tokens well within 200 ms).
TEST(Serve, AStreamIntervalGathersTokensIntoFewerChunks) {
  ServeOptions o;
  o.stream_interval_s = 0.2;
  Running s(o);
  const GenerationResult ref = s.generate({"abc"}, sampled(13, 2));
  json body = sampled_body("abc", 13, 2);
  body["stream"] = true;
  const auto r = s.post(body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  bool done = false;
  const std::vector<json> chunks = events_of(r->body, done);
  EXPECT_TRUE(done);
  std::string text;
  for (const json& c : chunks) text += c["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(text, ref.rows[0].text);
  EXPECT_LE(chunks.size(), 3u) << "the first token, then the rest together";
}

TEST(Serve, NSamplesAndPromptListsAreTheEnginesRows) {
  Running s;
  const GenerationResult ref = s.generate({"ab"}, sampled(7, 5, 2));
  json body = sampled_body("ab", 7, 5);
  body["n"] = 2;
  const auto r = s.post(body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  ASSERT_EQ(j["choices"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], ref.rows[static_cast<size_t>(i)].text) << "sample " << i;
  }
  EXPECT_NE(ref.rows[0].text, ref.rows[1].text) << "the samples should differ to test anything";
  EXPECT_EQ(j["usage"]["prompt_tokens"], 2);
  EXPECT_EQ(j["usage"]["completion_tokens"], 14);

  // Two prompts: choice b * n + i is prompt b's sample i; each prompt alone seeds from 0.
  body["prompt"] = {"ab", "j i"};
  const auto two = s.post(body);
  ASSERT_TRUE(two);
  ASSERT_EQ(two->status, 200) << two->body;
  const json t = json::parse(two->body);
  ASSERT_EQ(t["choices"].size(), 4u);
  const GenerationResult second = s.generate({"j i"}, sampled(7, 5, 2));
  EXPECT_EQ(t["choices"][1]["text"], ref.rows[1].text);
  EXPECT_EQ(t["choices"][2]["text"], second.rows[0].text);
  EXPECT_EQ(t["choices"][3]["text"], second.rows[1].text);
}

TEST(Serve, StopStringsEndTheChoiceAsTheEngineDoes) {
  Running s;
  const std::string free_text = s.generate({"hij"}, sampled(12, 9)).rows[0].text;
  ASSERT_GE(free_text.size(), 6u);
  const std::string stop = free_text.substr(3, 2);
  GenerateOptions o = sampled(12, 9);
  o.stop = {stop};
  const GenerationResult ref = s.generate({"hij"}, o);
  ASSERT_EQ(ref.rows[0].stop_reason, StopReason::StopString);
  for (const bool stream : {false, true}) {
    json body = sampled_body("hij", 12, 9);
    body["stop"] = {stop, "zz"};
    body["stream"] = stream;
    const auto r = s.post(body);
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const FirstChoice c = first_choice(r->body, stream);
    EXPECT_TRUE(c.done);
    EXPECT_EQ(c.text, ref.rows[0].text) << "stream " << stream;
    EXPECT_EQ(c.text.find(stop), std::string::npos);
    EXPECT_EQ(c.reason, "stop");
  }
}

// An end-of-generation token of the served tokenizer ends a choice with finish_reason "stop",
// its text not sent, whole or streamed; with llama-server's ignore_eos the choice goes on to
// max_tokens. A text prompt begins with BOS where the tokenizer asks for it.
TEST(Serve, AnEndOfGenerationTokenEndsTheChoiceUnlessIgnoreEos) {
  GenerateOptions greedy;
  greedy.max_new_tokens = 12;
  greedy.sampling.temperature = 0;
  const std::vector<int32_t> free = Running().generate({"hij"}, greedy).rows[0].tokens;
  size_t k = 1;
  while (k < free.size() && std::count(free.begin(), free.begin() + k, free[k]) > 0) ++k;
  ASSERT_LT(k, free.size()) << "the greedy sample repeats one token";
  Running s({}, 16, "gpt2", {.eos = free[k], .user_defined = {}, .eog = {free[k]}});
  for (const bool ignore : {false, true})
    for (const bool stream : {false, true}) {
      SCOPED_TRACE(testing::Message() << "ignore_eos " << ignore << ", stream " << stream);
      const json body = {{"prompt", "hij"},   {"max_tokens", 12}, {"temperature", 0},
                         {"ignore_eos", ignore}, {"stream", stream}};
      const auto r = s.post(body);
      ASSERT_TRUE(r);
      ASSERT_EQ(r->status, 200) << r->body;
      const FirstChoice c = first_choice(r->body, stream);
      EXPECT_TRUE(c.done);
      EXPECT_EQ(c.text, s.tokenizer().decode(ignore ? std::span<const int32_t>(free)
                                                     : std::span<const int32_t>(free.data(), k)));
      EXPECT_EQ(c.reason, ignore ? "length" : "stop");
    }
  // BOS: the prompt's ids begin with it (echo returns the prompt's text, BOS's included).
  Running b({}, 16, "gpt2", {.bos = 10, .add_bos = true, .user_defined = {}, .eog = {}});
  const auto r = b.post({{"prompt", "hij"}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 0}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["usage"]["prompt_tokens"], 4);
}

// A chat is its rendered prompt's completion: the messages through the chat template, then the
// same sampling as the engine's over that text, whole or streamed as chat.completion.chunk
// deltas whose first carries the role.
TEST(Serve, AChatIsItsRenderedPromptsCompletionStreamedOrNot) {
  ServeOptions o;
  o.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
                    "{% if add_generation_prompt %}j{% endif %}";
  Running s(o, 24);
  const json messages =
      json::array({{{"role", "user"}, {"content", "abc"}},
                   {{"role", "assistant"}, {"content", "de"}},
                   {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "fig"}}}}}});
  const std::string want = s.generate({"abc de fig j"}, sampled(6, 5)).rows[0].text;
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    json body = {{"model", "tiny"}, {"messages", messages}, {"max_tokens", 6}, {"temperature", 0.9},
                 {"top_k", 6},      {"top_p", 0.95},        {"seed", 5},      {"stream", stream}};
    const auto r = s.client().Post("/v1/chat/completions", body.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    if (!stream) {
      const json j = json::parse(r->body);
      EXPECT_EQ(j["object"], "chat.completion");
      EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
      EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
      EXPECT_EQ(j["choices"][0]["message"]["content"], want);
      EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
      EXPECT_EQ(j["usage"]["prompt_tokens"], 12);
      continue;
    }
    bool done = false;
    std::string text, role, reason;
    const std::vector<json> events = events_of(r->body, done);
    ASSERT_FALSE(events.empty());
    for (const json& e : events) {
      EXPECT_EQ(e["object"], "chat.completion.chunk");
      const json& c = e["choices"][0];
      if (c["delta"].contains("role")) role += c["delta"]["role"].get<std::string>();
      text += c["delta"].value("content", "");
      if (!c["finish_reason"].is_null()) reason = c["finish_reason"];
    }
    EXPECT_TRUE(events.front()["choices"][0]["delta"].contains("role"));
    EXPECT_TRUE(done);
    EXPECT_EQ(role, "assistant");
    EXPECT_EQ(text, want);
    EXPECT_EQ(reason, "length");
  }
}

// What a chat cannot be is a 400 naming `messages` (or the field), and the server goes on.
TEST(Serve, ChatsItCannotRenderGet400NamingTheField) {
  const auto refusal = [](const Running& s, const json& body) {
    const auto r = s.client().Post("/v1/chat/completions", body.dump(), "application/json");
    EXPECT_TRUE(r);
    if (!r) return json();
    EXPECT_EQ(r->status, 400) << r->body;
    return json::parse(r->body)["error"];
  };
  const json user = json::array({{{"role", "user"}, {"content", "abc"}}});
  Running none;  // the tiny tokenizer has no chat template
  json e = refusal(none, {{"messages", user}});
  EXPECT_EQ(e["param"], "messages");
  EXPECT_NE(e["message"].get<std::string>().find("--chat-template"), std::string::npos);

  ServeOptions o;
  o.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('users first') }}"
                    "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}";
  Running s(o, 16);
  e = refusal(s, {{"messages", {{{"role", "assistant"}, {"content", "ab"}}}}});
  EXPECT_EQ(e["param"], "messages");
  EXPECT_NE(e["message"].get<std::string>().find("users first"), std::string::npos);
  e = refusal(s, {{"messages", {{{"content", "ab"}}}}});
  EXPECT_NE(e["message"].get<std::string>().find("messages[0] has no string 'role'"),
            std::string::npos);
  EXPECT_EQ(refusal(s, {{"messages", json::array()}})["param"], "messages");
  EXPECT_EQ(
      refusal(s, {{"messages", {{{"role", "user"}, {"content", std::string(40, 'a')}}}}})["param"],
      "messages");
  EXPECT_EQ(refusal(s, {{"messages", user}, {"logprobs", true}})["param"], "logprobs");
  EXPECT_EQ(refusal(s, {{"messages", user}, {"tools", {{{"type", "function"}}}}})["param"],
            "tools");
  EXPECT_EQ(refusal(s, {{"messages", user}, {"max_completion_tokens", 0}})["param"],
            "max_completion_tokens");
  const auto ok = s.client().Post("/v1/chat/completions", json{{"messages", user}}.dump(),
                                  "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

// What evaluation harnesses ask for log-likelihoods: echo, logprobs and max_tokens 0 give
// the log-probability of every prompt token after the first under the model.
TEST(Serve, EchoedPromptLogprobsAreTheModelsLogSoftmax) {
  Running s;
  const std::string prompt = "abcjihgfed a";
  const auto r = s.post(json{{"model", "tiny"}, {"prompt", prompt}, {"max_tokens", 0},
                             {"echo", true},    {"logprobs", 3}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  const json& c = j["choices"][0];
  EXPECT_EQ(c["text"], prompt);
  EXPECT_EQ(j["usage"]["completion_tokens"], 0);
  const json& lp = c["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), prompt.size());
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());

  const std::vector<int32_t> ids = s.tokenizer().encode(prompt);
  Tensor logits;
  {
    NoGradGuard g;
    Tensor x = Tensor::empty({1, static_cast<int64_t>(ids.size())}, DType::I32);
    std::copy(ids.begin(), ids.end(), x.data<int32_t>());
    logits = s.model().forward(x).contiguous();
  }
  const int64_t V = s.tokenizer().vocab_size();
  for (size_t i = 1; i < ids.size(); ++i) {
    const float* row = logits.data<float>() + (i - 1) * static_cast<size_t>(V);
    double z = 0, m = row[0];
    for (int64_t v = 0; v < V; ++v) m = std::max<double>(m, row[v]);
    for (int64_t v = 0; v < V; ++v) z += std::exp(row[v] - m);
    auto logp = [&](int64_t v) { return row[v] - m - std::log(z); };
    EXPECT_NEAR(lp["token_logprobs"][i].get<double>(), logp(ids[i]), 1e-4) << "position " << i;
    EXPECT_EQ(lp["tokens"][i], s.tokenizer().decode_one(ids[i]));
    EXPECT_EQ(lp["text_offset"][i], i);
    // The 3 most probable tokens, with their log-probabilities.
    const json& top = lp["top_logprobs"][i];
    ASSERT_EQ(top.size(), 3u);
    std::vector<int64_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
    for (int k = 0; k < 3; ++k) {
      const std::string piece = s.tokenizer().decode_one(static_cast<int32_t>(order[k]));
      ASSERT_TRUE(top.contains(piece)) << "position " << i << " lacks top token '" << piece << "'";
      EXPECT_NEAR(top[piece].get<double>(), logp(order[k]), 1e-4);
    }
  }
  // Generated tokens' log-probabilities: the same as the sampled token's under the model
  // (greedy: the largest).
  const auto g = s.post(json{{"model", "tiny"}, {"prompt", "ab"}, {"max_tokens", 4},
                             {"temperature", 0}, {"logprobs", 1}});
  ASSERT_TRUE(g);
  ASSERT_EQ(g->status, 200) << g->body;
  const json gl = json::parse(g->body)["choices"][0]["logprobs"];
  ASSERT_EQ(gl["tokens"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const json& top = gl["top_logprobs"][i];
    ASSERT_EQ(top.size(), 1u);
    EXPECT_EQ(top.begin().key(), gl["tokens"][i]) << "greedy takes the most probable token";
    EXPECT_NEAR(top.begin().value().get<double>(), gl["token_logprobs"][i].get<double>(), 1e-6);
  }
}

// 64 clients at once, through a scheduler that admits 8 sequences at a time from a pool
// smaller than their sum (queueing and preemption): each gets its own completion, equal to
// the engine's for its prompt alone.
TEST(Serve, SixtyFourConcurrentClientsEachGetTheirOwnCompletion) {
  ServeOptions o;
  o.scheduler.max_seqs = 8;
  o.scheduler.max_batch_tokens = 24;
  o.scheduler.cache.kv_block_size = 4;
  o.scheduler.cache.pool_blocks = 12;
  Running s(o);
  constexpr int kClients = 64;
  std::vector<std::string> prompts;
  Generator gen(99);
  const std::string symbols = "abcdefghij ";
  for (int i = 0; i < kClients; ++i) {
    std::string p;
    const int len = 1 + static_cast<int>(gen.next_u64() % 8);
    for (int k = 0; k < len; ++k) p += symbols[gen.next_u64() % symbols.size()];
    prompts.push_back(p);
  }
  GenerateOptions greedy;
  greedy.max_new_tokens = 8;
  greedy.sampling.temperature = 0;
  std::vector<std::string> want;
  for (const std::string& p : prompts) want.push_back(s.generate({p}, greedy).rows[0].text);

  std::vector<std::string> got(kClients);
  std::vector<int> status(kClients, 0);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i)
    clients.emplace_back([&, i] {
      json body{{"model", "tiny"}, {"prompt", prompts[static_cast<size_t>(i)]},
                {"max_tokens", 8}, {"temperature", 0}, {"stream", i % 2 == 1}};
      const auto r = s.post(body);
      if (!r) {
        got[static_cast<size_t>(i)] = "no response: " + httplib::to_string(r.error());
        return;
      }
      status[static_cast<size_t>(i)] = r->status;
      if (i % 2 == 0) {
        got[static_cast<size_t>(i)] = json::parse(r->body)["choices"][0]["text"];
      } else {
        bool done = false;
        for (const json& c : events_of(r->body, done))
          got[static_cast<size_t>(i)] += c["choices"][0]["text"].get<std::string>();
      }
    });
  for (auto& t : clients) t.join();
  for (int i = 0; i < kClients; ++i) {
    EXPECT_EQ(status[static_cast<size_t>(i)], 200) << "client " << i;
    EXPECT_EQ(got[static_cast<size_t>(i)], want[static_cast<size_t>(i)]) << "client " << i;
  }
  EXPECT_GT(s.metric("kvlab_preemptions_total"), 0) << "the pool should have run dry";
  EXPECT_EQ(s.metric("kvlab_requests_running"), 0);
  EXPECT_EQ(s.metric("kvlab_kv_blocks{state=\"used\"}"), 0);
  EXPECT_EQ(s.metric("kvlab_generation_tokens_total"), kClients * 8);
}

TEST(Serve, BadRequestsGetTheir4xxAndTheServerKeepsAnswering) {
  ServeOptions o;
  o.max_body_bytes = 4096;
  Running s(o);
  const json ok{{"model", "tiny"}, {"prompt", "ab"}, {"max_tokens", 2}};
  auto with = [&](const char* key, json value) {
    json b = ok;
    b[key] = std::move(value);
    return b.dump();
  };
  struct Case {
    const char* name;
    std::string body;
    int status;
    const char* param;  // "" for none
  };
  const std::vector<Case> cases = {
      {"malformed JSON", "{\"prompt\": \"ab\",", 400, ""},
      {"not an object", "[1, 2]", 400, ""},
      {"no prompt", json{{"model", "tiny"}}.dump(), 400, "prompt"},
      {"prompt of the wrong type", with("prompt", 12), 400, "prompt"},
      {"empty prompt", with("prompt", ""), 400, "prompt"},
      {"empty prompt list", with("prompt", json::array()), 400, "prompt"},
      {"characters outside the vocabulary", with("prompt", "abZ"), 400, "prompt"},
      {"token id outside the vocabulary", with("prompt", json::array({1, 11})), 400, "prompt"},
      {"prompt beyond the context", with("prompt", std::string(17, 'a')), 400, "prompt"},
      {"max_tokens of the wrong type", with("max_tokens", "2"), 400, "max_tokens"},
      {"negative max_tokens", with("max_tokens", -1), 400, "max_tokens"},
      {"huge max_tokens", with("max_tokens", 1000000), 400, "max_tokens"},
      {"max_tokens 0 without echo", with("max_tokens", 0), 400, "max_tokens"},
      {"fractional max_tokens", with("max_tokens", 2.5), 400, "max_tokens"},
      {"unknown model", with("model", "gpt-4"), 404, "model"},
      {"negative temperature", with("temperature", -1), 400, "temperature"},
      {"top_p 0", with("top_p", 0), 400, "top_p"},
      {"n 0", with("n", 0), 400, "n"},
      {"too many logprobs", with("logprobs", 100), 400, "logprobs"},
      {"empty stop string", with("stop", ""), 400, "stop"},
      {"too many stop strings", with("stop", json::array({"a", "b", "c", "d", "e"})), 400, "stop"},
      {"stream not a boolean", with("stream", "yes"), 400, "stream"},
      {"best_of", with("best_of", 3), 400, "best_of"},
      {"logit_bias", with("logit_bias", json{{"1", 5}}), 400, "logit_bias"},
      {"body over the limit", with("prompt", std::string(5000, 'a')), 413, ""},
      {"nested a thousand deep (copying it would recurse)",
       "{\"prompt\": " + std::string(1000, '[') + std::string(1000, ']') + "}", 400, ""},
  };
  for (const Case& c : cases) {
    const auto r = s.client().Post("/v1/completions", c.body, "application/json");
    ASSERT_TRUE(r) << c.name << ": no response";
    EXPECT_EQ(r->status, c.status) << c.name << ": " << r->body;
    const json e = json::parse(r->body, nullptr, false);
    ASSERT_TRUE(e.is_object() && e.contains("error")) << c.name << ": " << r->body;
    EXPECT_FALSE(e["error"]["message"].get<std::string>().empty()) << c.name;
    if (*c.param != '\0') {
      EXPECT_EQ(e["error"]["param"], c.param) << c.name;
    }
  }
  const auto nowhere = s.client().Get("/v1/chat");
  ASSERT_TRUE(nowhere);
  EXPECT_EQ(nowhere->status, 404);
  EXPECT_TRUE(json::parse(nowhere->body).contains("error"));

  const auto health = s.client().Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  const auto good = s.post(ok);
  ASSERT_TRUE(good);
  EXPECT_EQ(good->status, 200) << good->body;
  EXPECT_EQ(s.metric("kvlab_requests_rejected_total"), static_cast<double>(cases.size() - 1))
      << "every case but the body over the limit reached the handler";
  const auto deep = s.client().Post(
      "/v1/completions", "{\"prompt\": " + std::string(1000, '[') + std::string(1000, ']') + "}",
      "application/json");
  ASSERT_TRUE(deep);
  EXPECT_NE(deep->body.find("nests deeper than 16 levels"), std::string::npos) << deep->body;
  const auto models = s.client().Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(json::parse(models->body)["data"][0]["id"], "tiny");
}

// A client that closes its connection mid-stream: the next write fails, the server aborts its
// sequence and the blocks return.
TEST(Serve, AClientLeavingMidStreamGivesItsBlocksBack) {
  for (const bool by_scheduler : {true, false}) {
    SCOPED_TRACE(writer_name(by_scheduler));
    Running s(written_by(by_scheduler), /*block_size=*/1024);
    json body{{"model", "tiny"}, {"prompt", "abc"}, {"max_tokens", 1000}, {"stream", true}};
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body = body.dump();
    req.set_header("Content-Type", "application/json");
    int chunks = 0;
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 2; };
    httplib::Client c = s.client();
    const auto r = c.send(req);
    EXPECT_EQ(chunks, 2) << "the stream should have begun";
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (s.metric("kvlab_sequences_total{outcome=\"aborted\"}") < 1 &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(s.metric("kvlab_sequences_total{outcome=\"aborted\"}"), 1);
    EXPECT_EQ(s.metric("kvlab_sequences_total{outcome=\"finished\"}"), 0)
        << "it should have been aborted before its 1000 tokens";
    EXPECT_EQ(s.metric("kvlab_requests_running"), 0);
    EXPECT_EQ(s.metric("kvlab_requests_waiting"), 0);
    EXPECT_EQ(s.metric("kvlab_kv_blocks{state=\"used\"}"), 0);
    // And it still serves.
    const auto again = s.post(json{{"model", "tiny"}, {"prompt", "ab"}, {"max_tokens", 3}});
    ASSERT_TRUE(again);
    EXPECT_EQ(again->status, 200);
  }
}

// bench serve's HTTP side: a small workload replayed by real clients at once; every request
// gets its whole output, the figures count every token, and the server drains.
TEST(Serve, AWorkloadReplayedOverHttpGetsEveryToken) {
  Running s({}, /*block_size=*/64);
  const ServedModel m = served_model(detail::cat("http://127.0.0.1:", s.port()));
  EXPECT_EQ(m.id, "tiny");
  EXPECT_EQ(m.context, 64);
  EXPECT_EQ(m.vocab_size, 11);
  const std::vector<KVRequest> reqs = make_kv_workload(
      {.requests = 12, .context = m.context, .vocab_size = m.vocab_size, .seed = 3});
  int64_t tokens = 0;
  for (const KVRequest& r : reqs) tokens += r.output_tokens;
  const json out = replay_over_http(detail::cat("http://127.0.0.1:", s.port()), m.id, reqs,
                                    ServeTimeline(poisson_arrivals(reqs.size(), 0, 3), 1));
  EXPECT_NEAR(out["output_tokens_per_s"].get<double>() * out["duration_s"].get<double>(),
              static_cast<double>(tokens), 1e-6 * static_cast<double>(tokens));
  EXPECT_GT(out["ttft_ms"]["p50"].get<double>(), 0);
  EXPECT_GE(out["peak_sequences"].get<int64_t>(), 0);
  EXPECT_EQ(s.metric("kvlab_generation_tokens_total"), static_cast<double>(tokens))
      << "the server made exactly the tokens asked";
  EXPECT_EQ(s.metric("kvlab_kv_blocks{state=\"used\"}"), 0);
}

// bench serve's client against another OpenAI-compatible server: llama-server's GET /v1/models
// (as it answers, trimmed) gives its context and vocabulary under "meta".
TEST(Serve, BenchClientReadsLlamaServersModelListing) {
  const json llama = json::parse(R"({"object":"list","data":[{"id":"m.gguf","object":"model",
      "owned_by":"llamacpp","meta":{"n_vocab":73,"n_ctx":1024,"n_ctx_train":2048}}]})");
  const ServedModel m = served_model(llama, "http://x");
  EXPECT_EQ(m.id, "m.gguf");
  EXPECT_EQ(m.context, 1024) << "a sequence's context, not the training one";
  EXPECT_EQ(m.vocab_size, 73);
  const json bare = json::parse(R"({"object":"list","data":[{"id":"m","object":"model"}]})");
  const std::string neither = error_of([&] { served_model(bare, "http://x"); });
  EXPECT_NE(neither.find("neither max_model_len"), std::string::npos) << neither;
  const std::string none = error_of([&] { served_model(json::parse(R"({"data":[]})"), "x"); });
  EXPECT_NE(none.find("lists no model"), std::string::npos) << none;
}

// Its stream reader counts a token per chunk with text: llama-server sends the finish_reason
// and the usage in one more chunk with empty text, kvlab serve the usage with no choices.
TEST(Serve, BenchClientCountsTextChunksNotTheUsageChunk) {
  auto count = [](const std::string& stream, size_t piece) {
    std::vector<int64_t> choices;
    CompletionEvents events([&](int64_t c) { choices.push_back(c); });
    for (size_t at = 0; at < stream.size(); at += piece)  // split anywhere, as TCP may
      events.feed(std::string_view(stream).substr(at, piece));
    return std::pair(choices, events.completion_tokens());
  };
  const std::string text = R"({"choices":[{"text":".","index":0,"finish_reason":null}]})";
  const std::string llama =
      "data: " + text + "\n\ndata: " + text +
      "\n\ndata: {\"choices\":[{\"text\":\"\",\"index\":0,\"finish_reason\":\"length\"}],"
      "\"usage\":{\"completion_tokens\":2,\"prompt_tokens\":4}}\n\ndata: [DONE]\n\n";
  const std::string kvlab =
      "data: " + text +
      "\n\ndata: {\"choices\":[{\"text\":\"a\",\"index\":1,\"finish_reason\":\"length\"}]}"
      "\n\ndata: {\"choices\":[],\"usage\":{\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
  for (const size_t piece : {size_t{1}, size_t{7}, kvlab.size() + llama.size()}) {
    EXPECT_EQ(count(llama, piece), std::pair(std::vector<int64_t>{0, 0}, int64_t{2})) << piece;
    EXPECT_EQ(count(kvlab, piece), std::pair(std::vector<int64_t>{0, 1}, int64_t{2})) << piece;
  }
  CompletionEvents failed([](int64_t) {});
  failed.feed("data: {\"error\":{\"message\":\"no room\"}}\n\n");
  EXPECT_EQ(failed.error(), "no room");
  EXPECT_EQ(failed.completion_tokens(), -1);
}

// Its chunked-body decoder gives the data whole however the bytes are split, ends at the empty
// chunk past any trailer, and refuses a malformed body.
TEST(Serve, BenchClientDecodesChunkedBodiesSplitAnywhere) {
  const std::string wire = "5\r\nhello\r\n1;ext=1\r\n \r\nA\r\n0123456789\r\n0\r\nX: y\r\n\r\n";
  for (const size_t piece : {size_t{1}, size_t{2}, size_t{5}, wire.size()}) {
    std::string body;
    ChunkedBody chunks([&](std::string_view d) { body.append(d); });
    for (size_t at = 0; at < wire.size(); at += piece) {
      EXPECT_FALSE(chunks.ended()) << piece;
      chunks.feed(std::string_view(wire).substr(at, piece));
    }
    EXPECT_EQ(body, "hello 0123456789") << piece;
    EXPECT_TRUE(chunks.ended()) << piece;
  }
  auto refusal = [](const std::string& bad) {
    ChunkedBody chunks([](std::string_view) {});
    return error_of([&] { chunks.feed(bad); });
  };
  EXPECT_NE(refusal("zz\r\nhi\r\n").find("not hex"), std::string::npos);
  EXPECT_NE(refusal("\r\n").find("not hex"), std::string::npos);
  EXPECT_NE(refusal("2\r\nhi!\r\n").find("longer than its size"), std::string::npos);
  EXPECT_NE(refusal("2\nhi\r\n").find("without its CRLF"), std::string::npos);
  EXPECT_NE(refusal("0\r\n\r\nmore").find("after"), std::string::npos);
}

// A raw loopback connection to the server: what a misbehaving client does with its socket.
class RawConnection {
 public:
  // rcvbuf > 0: the receive buffer's size, set before connecting (a small window fills fast).
  explicit RawConnection(int port, int rcvbuf = 0) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    EXPECT_GE(fd_, 0);
    if (rcvbuf > 0) ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    EXPECT_TRUE(connected_) << "connect";
  }
  ~RawConnection() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawConnection(RawConnection&& o) noexcept
      : fd_(std::exchange(o.fd_, -1)), connected_(o.connected_) {}

  void send(const std::string& s) const {
    EXPECT_EQ(::send(fd_, s.data(), s.size(), MSG_NOSIGNAL), static_cast<ssize_t>(s.size()));
  }
  // What arrives until the server closes the connection or `timeout_s` pass.
  std::string read_all(double timeout_s) const {
    std::string out;
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    char buf[4096];
    while (std::chrono::steady_clock::now() < until) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) {
        closed_ = true;
        break;
      }
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }
  bool closed() const { return closed_; }

 private:
  int fd_;
  bool connected_ = false;
  mutable bool closed_ = false;
};

std::string post_text(const json& body, const std::string& extra_headers = "") {
  const std::string b = body.dump();
  return "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" +
         extra_headers + "Content-Length: " + std::to_string(b.size()) + "\r\n\r\n" + b;
}

// Connections that send half a request line and wait hold no worker: with more of them than
// workers, a normal request is answered at once.
TEST(Serve, IdleHalfOpenConnectionsHoldNoWorker) {
  Running s;  // 128 workers
  std::vector<RawConnection> idle;
  for (int i = 0; i < 200; ++i) {
    idle.emplace_back(s.port());
    idle.back().send("POST /v1/compl");
  }
  const auto start = std::chrono::steady_clock::now();
  const auto r = s.post(json{{"model", "tiny"}, {"prompt", "ab"}, {"max_tokens", 3}});
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_LT(took, 1.0) << "a normal request waited behind idle connections";
  EXPECT_GE(s.metric("kvlab_connections{state=\"waiting\"}"), 200);
}

// A connection whose headers do not arrive within the header deadline is answered 408 and
// closed; one that never sends a byte is closed; a kept-alive one idles out.
TEST(Serve, SlowHeadersGet408AndSilentConnectionsClose) {
  ServeOptions o;
  o.header_timeout_s = 0.3;
  o.keep_alive_timeout_s = 0.3;
  Running s(o);
  RawConnection slow(s.port()), silent(s.port());
  slow.send("GET /v1/models HT");
  const std::string answer = slow.read_all(5);
  EXPECT_EQ(answer.rfind("HTTP/1.1 408", 0), 0u) << answer;
  EXPECT_TRUE(slow.closed());
  EXPECT_EQ(silent.read_all(5), "");
  EXPECT_TRUE(silent.closed());

  RawConnection kept(s.port());
  kept.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string health = kept.read_all(5);
  EXPECT_EQ(health.rfind("HTTP/1.1 200", 0), 0u) << health;
  EXPECT_TRUE(kept.closed()) << "an idle kept-alive connection should close";
  EXPECT_GE(s.metric("kvlab_connections_refused_total{reason=\"header_timeout\"}"), 2);
  EXPECT_GE(s.metric("kvlab_connections_cut_total{reason=\"idle\"}"), 1);
}

// A body slower than the minimum rate fails and its connection closes.
TEST(Serve, ABodyUnderTheMinimumRateIsCutOff) {
  ServeOptions o;
  o.header_timeout_s = 0.2;
  o.min_body_rate = 1000;
  Running s(o);
  RawConnection c(s.port());
  const std::string req = post_text(json{{"model", "tiny"}, {"prompt", "ab"}, {"max_tokens", 3}});
  const size_t head = req.find("\r\n\r\n") + 4;
  c.send(req.substr(0, head + 2));  // the headers and two bytes of the body, then nothing
  const std::string answer = c.read_all(5);
  EXPECT_TRUE(c.closed());
  EXPECT_EQ(answer.find("HTTP/1.1 200"), std::string::npos) << answer;
  EXPECT_EQ(s.metric("kvlab_connections_cut_total{reason=\"slow_body\"}"), 1);
}

// With every worker busy (two long streams), a request is answered 503 with Retry-After at
// once; once the streams end the server answers again.
TEST(Serve, RequestsBeyondTheWorkersGet503AtOnce) {
  ServeOptions o;
  o.max_connections = 2;
  Running s(o, /*block_size=*/1024);
  std::atomic<bool> release{false};
  std::atomic<int> streaming{0};
  std::vector<std::thread> streams;
  for (int i = 0; i < 2; ++i)
    streams.emplace_back([&] {
      httplib::Request req;
      req.method = "POST";
      req.path = "/v1/completions";
      req.body =
          json{{"model", "tiny"}, {"prompt", "abc"}, {"max_tokens", 1000}, {"stream", true}}.dump();
      req.set_header("Content-Type", "application/json");
      bool first = true;
      req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
        if (first) ++streaming;
        first = false;
        while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        return false;  // leave: the stream's sequence is aborted
      };
      httplib::Client c = s.client();
      c.send(req);
    });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (streaming < 2 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(streaming, 2);

  const auto start = std::chrono::steady_clock::now();
  const auto r = s.post(json{{"model", "tiny"}, {"prompt", "ab"}, {"max_tokens", 3}});
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503) << r->body;
  EXPECT_EQ(r->get_header_value("Retry-After"), "1");
  EXPECT_EQ(json::parse(r->body)["error"]["type"], "server_error");
  EXPECT_LT(took, 1.0) << "a refusal should come at once";

  release = true;
  for (std::thread& t : streams) t.join();
  // The streams' workers are free once their next write finds the client gone.
  int status = 0;
  std::string answer;
  while (std::chrono::steady_clock::now() < deadline) {
    const auto again = s.post(json{{"model", "tiny"}, {"prompt", "ab"}, {"max_tokens", 3}});
    ASSERT_TRUE(again);
    status = again->status;
    answer = again->body;
    if (status != 503) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(status, 200) << answer;
  EXPECT_GE(s.metric("kvlab_connections_refused_total{reason=\"busy\"}"), 1);
}

// A streaming client that stops reading (its window full) is cut off at the write deadline;
// its sequence is aborted and its blocks return to the pool.
TEST(Serve, AClientThatStopsReadingIsCutOffAndItsBlocksReturn) {
  for (const bool by_scheduler : {true, false}) {
    SCOPED_TRACE(writer_name(by_scheduler));
    ServeOptions o;
    o.write_timeout_s = 0.1;  // the tiny model makes the whole stream in under a second
    o.send_buffer_bytes = 16 << 10;
    Running s(written_by(by_scheduler, o), /*block_size=*/1024);
    RawConnection c(s.port(), /*rcvbuf=*/4096);
    c.send(post_text(json{{"model", "tiny"},
                          {"prompt", "abc"},
                          {"max_tokens", 1000},
                          {"n", 16},  // 16 chunks a step: the buffers fill within a few steps
                          {"logprobs", 5},
                          {"stream", true}}));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    auto cut = [&] { return s.metric("kvlab_connections_cut_total{reason=\"write_timeout\"}"); };
    while ((cut() < 1 || s.metric("kvlab_requests_running") > 0) &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(cut(), 1);
    const double aborted = s.metric("kvlab_sequences_total{outcome=\"aborted\"}");
    EXPECT_GE(aborted, 1) << "its sequences should have been cut off before their 1000 tokens";
    EXPECT_EQ(aborted + s.metric("kvlab_sequences_total{outcome=\"finished\"}"), 16);
    EXPECT_EQ(s.metric("kvlab_requests_running"), 0);
    EXPECT_EQ(s.metric("kvlab_kv_blocks{state=\"used\"}"), 0);
    c.read_all(10);
    EXPECT_TRUE(c.closed()) << "the server should have closed the connection";
  }
}

// The body of an HTTP/1.1 response with chunked transfer coding, its chunks joined; a malformed
// chunk (a size line that is not hex, a chunk without its CRLF) or a missing last chunk fails
// the test.
std::string dechunked_body(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  EXPECT_NE(at, std::string::npos) << "no end of headers";
  EXPECT_NE(response.find("Transfer-Encoding: chunked"), std::string::npos);
  std::string body;
  ChunkedBody chunks([&](std::string_view data) { body.append(data); });
  const std::string_view rest = std::string_view(response).substr(at + 4);
  const std::string error = error_of([&] { chunks.feed(rest); });
  EXPECT_EQ(error, "no error");
  EXPECT_TRUE(chunks.ended()) << "the stream ended before its last chunk";
  return body;
}

// A client that stops reading for a while fills the buffers and the stream's writes wait for
// it (within the write timeout); once it reads again every byte arrives, framed, in order, the
// text the whole completion's.
TEST(Serve, AStreamPausedByItsClientArrivesWholeWhenItReadsAgain) {
  for (const bool by_scheduler : {true, false}) {
    SCOPED_TRACE(writer_name(by_scheduler));
    ServeOptions o;
    o.write_timeout_s = 30;
    o.send_buffer_bytes = 16 << 10;
    Running s(written_by(by_scheduler, o), /*block_size=*/1024);
    json body{{"model", "tiny"}, {"prompt", "abc"}, {"max_tokens", 300},
              {"n", 4},          {"logprobs", 5},     {"temperature", 0}};
    const auto whole = s.post(body);
    ASSERT_TRUE(whole);
    ASSERT_EQ(whole->status, 200) << whole->body;
    const json expected = json::parse(whole->body)["choices"];
    body["stream"] = true;
    RawConnection c(s.port(), /*rcvbuf=*/4096);
    // Asking for gzip as well: httplib leaves event streams uncompressed.
    c.send(post_text(body, "Connection: close\r\nAccept-Encoding: gzip, deflate\r\n"));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // 4 x 300 chunks: buffers fill
    const std::string response = c.read_all(60);
    EXPECT_TRUE(c.closed());
    bool done = false;
    std::vector<std::string> texts(4);
    for (const json& e : events_of(dechunked_body(response), done))
      for (const json& choice : e["choices"])
        texts.at(choice["index"].get<size_t>()) += choice["text"].get<std::string>();
    EXPECT_TRUE(done);
    for (const json& choice : expected)
      EXPECT_EQ(texts.at(choice["index"].get<size_t>()), choice["text"].get<std::string>());
  }
}

// A server stopped mid-stream ends the stream with its error event and [DONE], the body framed
// whole: stop() lets each stream write its end before httplib stops, the stream's writes pass
// from the scheduler thread back to its HTTP thread, and nothing is written after the end.
TEST(Serve, AStreamCutByTheServerStoppingEndsWithItsErrorFramedWhole) {
  for (const bool by_scheduler : {true, false}) {
    SCOPED_TRACE(writer_name(by_scheduler));
    Running s(written_by(by_scheduler), /*block_size=*/1024);
    RawConnection c(s.port());
    c.send(post_text(json{{"model", "tiny"},
                          {"prompt", "abc"},
                          {"max_tokens", 1000},
                          {"n", 16},
                          {"logprobs", 5},
                          {"stream", true}},
                     "Connection: close\r\n"));
    std::string response;
    // Its first events: the stream has begun (and 16 x 1000 tokens take the tiny model a while).
    while (response.find("\"index\":") == std::string::npos) {
      const std::string more = c.read_all(0.05);
      ASSERT_FALSE(more.empty() && c.closed()) << "the stream ended before it began";
      response += more;
    }
    s.stop();
    response += c.read_all(30);
    EXPECT_TRUE(c.closed()) << "the server should have closed the connection";
    bool done = false;
    const std::vector<json> events = events_of(dechunked_body(response), done);
    EXPECT_TRUE(done);
    ASSERT_FALSE(events.empty());
    int finished = 0;
    for (const json& e : events)
      if (e.contains("choices"))
        for (const json& choice : e["choices"]) finished += !choice["finish_reason"].is_null();
    const json& last = events.back();
    if (finished < 16) {
      ASSERT_TRUE(last.contains("error")) << "a stream cut short ends with its error: " << last;
      EXPECT_EQ(last["error"]["type"], "server_error");
      EXPECT_NE(last["error"]["message"].get<std::string>().find("stop"), std::string::npos)
          << last;
    }
  }
}

// With an API key every endpoint but /health wants it: missing or wrong, 401 with OpenAI's
// error object; right, answered.
TEST(Serve, AnApiKeyGuardsEveryEndpointButHealth) {
  ServeOptions o;
  o.api_key = "sk-kvlab-secret";
  Running s(o);
  struct Endpoint {
    const char* method;
    const char* path;
  };
  const json body{{"model", "tiny"}, {"prompt", "ab"}, {"max_tokens", 2}};
  for (const Endpoint& e : {Endpoint{"GET", "/v1/models"}, Endpoint{"GET", "/metrics"},
                            Endpoint{"POST", "/v1/completions"}, Endpoint{"GET", "/v1/chat"}}) {
    for (const char* key :
         {"", "sk-kvlab-secre", "sk-kvlab-secretx", "sk-kvlab-public", "sk-kvlab-secret"}) {
      SCOPED_TRACE(detail::cat(e.method, " ", e.path, " key '", key, "'"));
      httplib::Client c = s.client();
      httplib::Headers h;
      if (*key != '\0') h.emplace("Authorization", detail::cat("Bearer ", key));
      const auto r = std::string(e.method) == "GET"
                         ? c.Get(e.path, h)
                         : c.Post(e.path, h, body.dump(), "application/json");
      ASSERT_TRUE(r);
      if (std::string(key) == "sk-kvlab-secret") {
        EXPECT_EQ(r->status, std::string(e.path) == "/v1/chat" ? 404 : 200) << r->body;
        continue;
      }
      EXPECT_EQ(r->status, 401) << r->body;
      const json err = json::parse(r->body, nullptr, false);
      ASSERT_TRUE(err.is_object() && err.contains("error")) << r->body;
      EXPECT_EQ(err["error"]["type"], "invalid_request_error");
      EXPECT_FALSE(err["error"]["message"].get<std::string>().empty());
    }
  }
  httplib::Client c = s.client();
  const auto basic = c.Get("/v1/models", {{"Authorization", "Basic sk-kvlab-secret"}});
  ASSERT_TRUE(basic);
  EXPECT_EQ(basic->status, 401);
  const auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

// OpenAI's ranges and the server's caps: each field out of range is a 400 naming it; the
// edges themselves are accepted.
TEST(Serve, OutOfRangeFieldsGet400NamingThem) {
  ServeOptions o;
  o.limits.max_request_tokens = 40;
  Running s(o);
  const json ok{{"model", "tiny"}, {"prompt", "ab"}, {"max_tokens", 2}};
  auto with = [&](const char* key, json value) {
    json b = ok;
    b[key] = std::move(value);
    return b;
  };
  const std::vector<std::pair<json, const char*>> refused = {
      {with("temperature", 1e308), "temperature"},
      {with("temperature", 2.01), "temperature"},
      {with("temperature", -0.5), "temperature"},
      {with("top_p", 1.5), "top_p"},
      {with("top_p", -1), "top_p"},
      {with("n", 17), "n"},
      {with("logprobs", 6), "logprobs"},
      {with("logprobs", -1), "logprobs"},
      {with("seed", -1), "seed"},
      {with("seed", 1.5), "seed"},
      {with("seed", 18446744073709551615ull), "seed"},
      {[&] {
         json b = with("n", 4);
         b["max_tokens"] = 9;  // 4 * (2 + 9) = 44 positions > 40
         return b;
       }(),
       "max_tokens"},
  };
  for (const auto& [body, param] : refused) {
    SCOPED_TRACE(body.dump());
    const auto r = s.post(body);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << r->body;
    const json e = json::parse(r->body);
    EXPECT_EQ(e["error"]["param"], param);
    EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  }
  for (const json& body : {with("temperature", 2), with("top_p", 1), with("logprobs", 5),
                           with("seed", 0), with("n", 4)}) {
    SCOPED_TRACE(body.dump());
    const auto r = s.post(body);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
  }
}

// A stream's chunks are written without building their object: the same bytes as dumping it.
TEST(Serve, ChunkEventsAreTheDumpedChunkObjects) {
  const std::string tail = chunk_tail("cmpl-0123", "tiny \"q\"", 1796442543);
  const json lp{{"tokens", {"a"}},
                {"token_logprobs", {-0.5}},
                {"top_logprobs", {{{"a", -0.5}}}},
                {"text_offset", {3}}};
  for (const std::string& text : {std::string(""), std::string("ab \"c\"\n\\"),
                                  std::string("\xff\xfe x"), std::string("\u00e9\t")})
    for (const json& l : {json(nullptr), lp})
      for (const auto fin : {std::optional<StopReason>(), std::optional(StopReason::StopString),
                             std::optional(StopReason::MaxNewTokens)}) {
        std::string out;
        append_chunk_event(out, tail, 7, text, l, fin);
        EXPECT_EQ(
            out,
            "data: " + dump(chunk_json("cmpl-0123", "tiny \"q\"", 1796442543, 7, text, l, fin)) +
                "\n\n");
      }
}

}  // namespace
}  // namespace kvlab
