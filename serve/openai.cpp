#include "serve/openai.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

namespace kvlab {

using nlohmann::json;

nlohmann::json error_json(const ApiError& e) {
  return {{"error",
           {{"message", e.what()},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", nullptr}}}};
}

std::string dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw ApiError(400, message, param);
}

const json* field(const json& body, const char* name) {
  const auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

int64_t integer(const json& body, const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const json* v = field(body, name);
  if (v == nullptr) return fallback;
  // 3.0 is a number JSON writers may give for 3; 3.5 is not an integer.
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::abs(d) < 9e15)
      return integer(json{{name, static_cast<int64_t>(d)}}, name, fallback, lo, hi);
  }
  if (!v->is_number_integer())
    bad(name, detail::cat("'", name, "' must be an integer, got ", v->dump()));
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi))
    bad(name, detail::cat("'", name, "' must be at most ", hi, ", got ", v->dump()));
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi)
    bad(name, detail::cat("'", name, "' must be in [", lo, ", ", hi, "], got ", x));
  return x;
}

double number(const json& body, const char* name, double fallback) {
  const json* v = field(body, name);
  if (v == nullptr) return fallback;
  if (!v->is_number()) bad(name, detail::cat("'", name, "' must be a number, got ", v->dump()));
  return v->get<double>();
}

bool boolean(const json& body, const char* name) {
  const json* v = field(body, name);
  if (v == nullptr) return false;
  if (!v->is_boolean())
    bad(name, detail::cat("'", name, "' must be true or false, got ", v->dump()));
  return v->get<bool>();
}

// A field kvlab does not implement is refused unless it asks for the default: answering as
// if it were honoured would mislead.
void unsupported(const json& body, const char* name, const json& neutral) {
  const json* v = field(body, name);
  if (v != nullptr && *v != neutral)
    bad(name,
        detail::cat("'", name, "' is not supported by kvlab serve (only ", neutral.dump(), ")"));
}

std::vector<int32_t> token_ids(const json& list, const Tokenizer& tok, const std::string& what) {
  std::vector<int32_t> ids;
  for (const json& t : list) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= tok.vocab_size())
      bad("prompt", detail::cat(what, ": token ids must be integers in [0, ", tok.vocab_size(),
                                "), got ", t.dump()));
    ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return ids;
}

}  // namespace

namespace {

// The body as JSON: an object, nested no deeper than any field needs.
json parse_body(std::string_view body_text) {
  // Values nested deeper than any field needs are refused while parsing: copying or printing
  // one recurses, and a body of brackets could exhaust the stack.
  constexpr int kMaxDepth = 16;
  bool deep = false;
  const json body = json::parse(
      body_text,
      [&](int depth, json::parse_event_t, json&) {
        if (depth > kMaxDepth) deep = true;
        return !deep;
      },
      /*allow_exceptions=*/false);
  if (deep) bad("", detail::cat("the request body nests deeper than ", kMaxDepth, " levels"));
  if (body.is_discarded()) bad("", "the request body is not valid JSON");
  if (!body.is_object()) bad("", "the request body must be a JSON object");
  return body;
}

// Each prompt's token ids and its text.
void parse_prompts(const json& body, const ApiLimits& limits, const Tokenizer& tokenizer,
                   int64_t block_size, CompletionRequest& r) {
  // prompt: a string, a list of strings, a list of token ids, or a list of such lists.
  const json* p = field(body, "prompt");
  if (p == nullptr) bad("prompt", "'prompt' is required");
  std::vector<json> items;
  if (p->is_string() || (p->is_array() && !p->empty() && p->front().is_number()))
    items.push_back(*p);
  else if (p->is_array())
    items.assign(p->begin(), p->end());
  else
    bad("prompt", "'prompt' must be a string, a list of strings or a list of token ids");
  if (items.empty()) bad("prompt", "'prompt' is an empty list");
  if (static_cast<int64_t>(items.size()) > limits.max_prompts)
    bad("prompt",
        detail::cat("at most ", limits.max_prompts, " prompts per request, got ", items.size()));
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string what = items.size() > 1 ? detail::cat("prompt ", i) : std::string("prompt");
    std::vector<int32_t> ids;
    if (items[i].is_string()) {
      const std::string text = items[i].get<std::string>();
      if (text.empty()) bad("prompt", what + " is empty");
      try {
        ids = tokenizer.encode_prompt(text, what);
      } catch (const Error& e) {
        bad("prompt", e.what());
      }
    } else if (items[i].is_array()) {
      ids = token_ids(items[i], tokenizer, what);
    } else {
      bad("prompt", what + " must be a string or a list of token ids");
    }
    if (ids.empty()) bad("prompt", what + " is empty");
    if (static_cast<int64_t>(ids.size()) > block_size)
      bad("prompt", detail::cat(what, " has ", ids.size(),
                                " tokens, more than the model's context of ", block_size));
    r.prompt_texts.push_back(tokenizer.decode(ids));
    r.prompts.push_back(std::move(ids));
  }
}

// Temperature, top_p, top_k and the seed, in OpenAI's ranges.
void parse_sampling(const json& body, CompletionRequest& r) {
  r.sampling.temperature = number(body, "temperature", 1.0);
  r.sampling.top_p = number(body, "top_p", 1.0);
  const int64_t top_k = integer(body, "top_k", 0, -1, std::numeric_limits<int32_t>::max());
  r.sampling.top_k = top_k < 0 ? 0 : top_k;  // -1 (vLLM's "off") and 0 keep every token
  // OpenAI's ranges. NaN fails every comparison, so it is refused too.
  if (!(r.sampling.temperature >= 0 && r.sampling.temperature <= 2))
    bad("temperature",
        detail::cat("'temperature' must be in [0, 2], got ", r.sampling.temperature));
  if (!(r.sampling.top_p > 0 && r.sampling.top_p <= 1))
    bad("top_p", detail::cat("'top_p' must be in (0, 1], got ", r.sampling.top_p));
  if (field(body, "seed") != nullptr)
    r.sampling.seed =
        static_cast<uint64_t>(integer(body, "seed", 0, 0, std::numeric_limits<int64_t>::max()));
  else
    r.sampling.seed = std::random_device{}() * 0x9E3779B97F4A7C15ull + std::random_device{}();
}

void parse_stops(const json& body, const ApiLimits& limits, CompletionRequest& r) {
  if (const json* s = field(body, "stop")) {
    if (s->is_string()) {
      r.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      for (const json& x : *s) {
        if (!x.is_string()) bad("stop", "'stop' must be a string or a list of strings");
        r.stop.push_back(x.get<std::string>());
      }
    } else {
      bad("stop", "'stop' must be a string or a list of strings");
    }
    if (static_cast<int64_t>(r.stop.size()) > limits.max_stops)
      bad("stop", detail::cat("at most ", limits.max_stops, " stop strings, got ", r.stop.size()));
    for (const std::string& x : r.stop)
      if (x.empty()) bad("stop", "a stop string is empty");
  }
}

// One request may not take more of the pool than limits.max_request_tokens positions (a 400
// naming `max_tokens_key`, the field that asked).
void check_request_tokens(const ApiLimits& limits, const CompletionRequest& r,
                          const char* max_tokens_key) {
  if (limits.max_request_tokens > 0) {
    int64_t positions = 0;
    for (const auto& p : r.prompts)
      positions += r.n * (static_cast<int64_t>(p.size()) + r.max_tokens);
    if (positions > limits.max_request_tokens)
      bad(max_tokens_key,
          detail::cat("the request asks for ", positions,
                      " positions (n * (prompt tokens + max_tokens), over its prompts), more than "
                      "the limit of ",
                      limits.max_request_tokens, "; lower ", max_tokens_key, ", n or the prompts"));
  }
}

}  // namespace

namespace {

void check_model(const json& body, const std::string& model_name, CompletionRequest& r) {
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) bad("model", "'model' must be a string");
    r.model = m->get<std::string>();
    if (r.model != model_name)
      throw ApiError(404,
                     detail::cat("the model '", r.model, "' does not exist: this server serves '",
                                 model_name, "'"),
                     "model", "not_found_error");
  }
}

// What both endpoints share past the prompts: the choices' length and number, streaming,
// sampling, stop strings, and the positions the request may hold. A request without a length
// gets default_max_tokens(n).
void parse_generation(const json& body, const ApiLimits& limits, const char* max_tokens_key,
                      const std::function<int64_t(int64_t)>& default_max_tokens,
                      int64_t most_tokens, CompletionRequest& r) {
  r.n = integer(body, "n", 1, 1, limits.max_n);
  r.max_tokens = integer(body, max_tokens_key, default_max_tokens(r.n), 0, most_tokens);
  if (r.max_tokens == 0 && !r.echo)
    bad(max_tokens_key, detail::cat("'", max_tokens_key, "' must be >= 1",
                                    r.chat ? "" : " unless 'echo' is true"));
  r.stream = boolean(body, "stream");
  r.ignore_eos = boolean(body, "ignore_eos");
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) bad("stream_options", "'stream_options' must be an object");
    if (!r.stream) bad("stream_options", "'stream_options' needs 'stream': true");
    r.include_usage = boolean(*so, "include_usage");
  }
  parse_sampling(body, r);
  parse_stops(body, limits, r);
  check_request_tokens(limits, r, max_tokens_key);
  unsupported(body, "presence_penalty", 0);
  unsupported(body, "frequency_penalty", 0);
  unsupported(body, "logit_bias", json::object());
}

}  // namespace

CompletionRequest parse_completion_request(std::string_view body_text, const ApiLimits& limits,
                                           const std::string& model_name,
                                           const Tokenizer& tokenizer, int64_t block_size) {
  const json body = parse_body(body_text);
  CompletionRequest r;
  check_model(body, model_name, r);
  parse_prompts(body, limits, tokenizer, block_size, r);
  const int64_t max_tokens = limits.max_tokens > 0 ? limits.max_tokens : block_size;
  r.echo = boolean(body, "echo");
  r.logprobs = integer(body, "logprobs", -1, 0, limits.max_logprobs);
  parse_generation(
      body, limits, "max_tokens", [&](int64_t) { return std::min<int64_t>(16, max_tokens); },
      max_tokens, r);
  unsupported(body, "best_of", 1);
  unsupported(body, "suffix", "");
  return r;
}

CompletionRequest parse_chat_request(std::string_view body_text, const ApiLimits& limits,
                                     const std::string& model_name, const Tokenizer& tokenizer,
                                     int64_t block_size, const ChatTemplate* tmpl,
                                     const std::string& no_template) {
  const json body = parse_body(body_text);
  CompletionRequest r;
  r.chat = true;
  check_model(body, model_name, r);
  if (tmpl == nullptr) throw ApiError(400, no_template, "messages");
  const json* messages = field(body, "messages");
  if (messages == nullptr) bad("messages", "'messages' is required");
  ChatPrompt prompt;
  try {
    // The checked body read again keeping its keys' order (json sorts them): templates see a
    // message's keys as the client wrote them.
    prompt = chat_prompt(*tmpl, tokenizer,
                         nlohmann::ordered_json::parse(body_text).at("messages"));
  } catch (const std::exception& e) {  // the template's, the tokenizer's, or a length_error
    bad("messages", e.what());
  }
  if (prompt.ids.empty()) bad("messages", "the conversation renders as an empty prompt");
  const auto length = static_cast<int64_t>(prompt.ids.size());
  if (length >= block_size)
    bad("messages", detail::cat("the conversation is ", length,
                                " tokens, which leaves no room in the model's context of ",
                                block_size));
  r.prompt_texts.push_back(prompt.text);
  r.prompts.push_back(std::move(prompt.ids));
  // OpenAI's default is the rest of the context, here as much of it as the request's n
  // choices may hold (max_request_tokens); max_completion_tokens is max_tokens' newer name.
  const int64_t most = std::min(limits.max_tokens > 0 ? limits.max_tokens : block_size,
                                block_size - length);
  const auto fitting = [&](int64_t n) {
    if (limits.max_request_tokens <= 0) return most;
    return std::clamp<int64_t>(limits.max_request_tokens / n - length, 1, most);
  };
  const char* key = field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  parse_generation(body, limits, key, fitting, most, r);
  unsupported(body, "logprobs", false);
  unsupported(body, "tools", json::array());
  unsupported(body, "tool_choice", "none");
  unsupported(body, "response_format", json{{"type", "text"}});
  return r;
}

const char* finish_reason_name(StopReason r) {
  return r == StopReason::StopString || r == StopReason::EndOfGeneration ? "stop" : "length";
}

nlohmann::json logprobs_json(const Tokenizer& tokenizer, const std::vector<int32_t>* prompt,
                             const std::vector<TokenLogprob>& prompt_logprobs,
                             const std::vector<TokenLogprob>& made, size_t offset) {
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  auto add = [&](int32_t id, const TokenLogprob* lp) {
    const std::string piece = tokenizer.decode_one(id);
    tokens.push_back(piece);
    offsets.push_back(offset);
    offset += piece.size();
    if (lp == nullptr) {
      lps.push_back(nullptr);
      tops.push_back(nullptr);
      return;
    }
    lps.push_back(lp->logprob);
    json top = json::object();
    for (const auto& [t, l] : lp->top) top[tokenizer.decode_one(t)] = l;
    tops.push_back(top);
  };
  if (prompt != nullptr)
    for (size_t i = 0; i < prompt->size(); ++i)
      add((*prompt)[i], i == 0 || i > prompt_logprobs.size() ? nullptr : &prompt_logprobs[i - 1]);
  for (const TokenLogprob& lp : made) add(lp.token, &lp);
  return {{"tokens", tokens},
          {"token_logprobs", lps},
          {"top_logprobs", tops},
          {"text_offset", offsets}};
}

nlohmann::json usage_json(const CompletionRequest& req, const std::vector<ChoiceState>& choices) {
  int64_t prompt = 0, made = 0;
  for (const auto& p : req.prompts) prompt += static_cast<int64_t>(p.size());
  for (const ChoiceState& c : choices) made += static_cast<int64_t>(c.tokens.size());
  return {{"prompt_tokens", prompt}, {"completion_tokens", made}, {"total_tokens", prompt + made}};
}

nlohmann::json completion_json(const CompletionRequest& req,
                               const std::vector<ChoiceState>& choices, const Tokenizer& tokenizer,
                               const std::string& id, const std::string& model, int64_t created) {
  json out = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceState& c = choices[i];
    const size_t b = i / static_cast<size_t>(req.n);
    const std::string prefix = req.echo ? req.prompt_texts[b] : std::string();
    json lp = nullptr;
    if (req.logprobs >= 0)
      lp = logprobs_json(tokenizer, req.echo ? &req.prompts[b] : nullptr, c.prompt_logprobs,
                         c.logprobs, 0);
    out.push_back({{"index", i},
                   {"text", prefix + c.text},
                   {"logprobs", lp},
                   {"finish_reason", finish_reason_name(c.reason)}});
  }
  return {{"id", id},           {"object", "text_completion"},
          {"created", created}, {"model", model},
          {"choices", out},     {"usage", usage_json(req, choices)}};
}

nlohmann::json chat_completion_json(const CompletionRequest& req,
                                    const std::vector<ChoiceState>& choices,
                                    const std::string& id, const std::string& model,
                                    int64_t created) {
  json out = json::array();
  for (size_t i = 0; i < choices.size(); ++i)
    out.push_back({{"index", i},
                   {"message", {{"role", "assistant"}, {"content", choices[i].text}}},
                   {"logprobs", nullptr},
                   {"finish_reason", finish_reason_name(choices[i].reason)}});
  return {{"id", id},           {"object", "chat.completion"},
          {"created", created}, {"model", model},
          {"choices", out},     {"usage", usage_json(req, choices)}};
}

nlohmann::json chunk_json(const std::string& id, const std::string& model, int64_t created,
                          int64_t index, const std::string& text, nlohmann::json logprobs,
                          std::optional<StopReason> finished) {
  return {{"id", id},
          {"object", "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", json::array({{{"index", index},
                                    {"text", text},
                                    {"logprobs", std::move(logprobs)},
                                    {"finish_reason", finished ? json(finish_reason_name(*finished))
                                                               : json(nullptr)}}})}};
}

}  // namespace kvlab

namespace kvlab {

const char* chunk_object(bool chat) { return chat ? "chat.completion.chunk" : "text_completion"; }

std::string chunk_tail(const std::string& id, const std::string& model, int64_t created,
                       bool chat) {
  // The object's keys after "choices", in the order dump() writes them (sorted), without its
  // opening brace.
  const json j{{"created", created}, {"id", id}, {"model", model}, {"object", chunk_object(chat)}};
  return dump(j).substr(1);
}

void append_chat_event(std::string& out, const std::string& tail, int64_t index,
                       const std::string& text, bool first, std::optional<StopReason> finished) {
  out += "data: {\"choices\":[{\"delta\":{";
  if (first) out += "\"role\":\"assistant\"";
  if (first || !text.empty()) {
    if (first) out += ',';
    out += "\"content\":";
    out += dump(json(text));
  }
  out += "},\"finish_reason\":";
  out += finished ? detail::cat("\"", finish_reason_name(*finished), "\"") : std::string("null");
  out += ",\"index\":";
  out += std::to_string(index);
  out += ",\"logprobs\":null}],";
  out += tail;
  out += "\n\n";
}

void append_chunk_event(std::string& out, const std::string& tail, int64_t index,
                        const std::string& text, const nlohmann::json& logprobs,
                        std::optional<StopReason> finished) {
  out += "data: {\"choices\":[{\"finish_reason\":";
  out += finished ? detail::cat("\"", finish_reason_name(*finished), "\"") : std::string("null");
  out += ",\"index\":";
  out += std::to_string(index);
  out += ",\"logprobs\":";
  out += dump(logprobs);
  out += ",\"text\":";
  out += dump(json(text));
  out += "}],";
  out += tail;
  out += "\n\n";
}

}  // namespace kvlab
