#pragma once
// The OpenAI completions API as kvlab serves it: a request body parsed and checked field by
// field, and the response and stream-chunk objects. Pure functions of their inputs, so that
// the format is tested without a socket.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/chat_template.h"
#include "data/tokenizer.h"
#include "infer/engine.h"
#include "infer/sampler.h"
#include "platform/error.h"

namespace kvlab {

// A request the server refuses: the HTTP status (4xx), and OpenAI's error object (message,
// type, param: the field at fault, or empty).
class ApiError : public Error {
 public:
  ApiError(int status, const std::string& message, std::string param = {},
           std::string type = "invalid_request_error")
      : Error(message), status(status), param(std::move(param)), type(std::move(type)) {}
  int status;
  std::string param;
  std::string type;
};

// {"error": {"message", "type", "param", "code"}}
nlohmann::json error_json(const ApiError& e);

// What one request may ask (the server's flags set them).
struct ApiLimits {
  int64_t max_tokens = 0;   // the most tokens a choice may ask for (0: the model's context)
  int64_t max_n = 16;       // choices per prompt
  int64_t max_prompts = 64; // prompts per request
  int64_t max_logprobs = 5;  // OpenAI's
  int64_t max_stops = 4;
  // The positions one request's choices may hold at once, over its prompts:
  // n * (prompt tokens + max_tokens) summed (0: no limit; the server's default is half its
  // KV pool or one context, whichever is more), so that one request cannot take the whole pool.
  int64_t max_request_tokens = 0;
};

struct CompletionRequest {
  std::string model;  // empty when the request names none
  // Each prompt as token ids (a string is encoded; a list of ids is taken as it is).
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> prompt_texts;  // each prompt decoded, for echo
  int64_t max_tokens = 16;  // OpenAI's default
  int64_t n = 1;
  SamplingOptions sampling;  // OpenAI's defaults: temperature 1, top_p 1; top_k off
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
  bool echo = false;
  int64_t logprobs = -1;  // the top alternatives per token; -1 when null
  bool ignore_eos = false;  // llama-server's: go on past the end-of-generation tokens
  bool chat = false;  // from /v1/chat/completions: answered as chat.completion objects
};

// Parses and checks a request body against the limits, the served model's name, its
// tokenizer and its context (block_size). A seed the request omits is drawn at random.
// Throws ApiError (400; 404 for a model other than the one served) naming the field.
CompletionRequest parse_completion_request(std::string_view body, const ApiLimits& limits,
                                           const std::string& model_name,
                                           const Tokenizer& tokenizer, int64_t block_size);

// A /v1/chat/completions body: its messages rendered by the model's chat template (null: the
// server has none, a 400 saying `no_template`) into one prompt, with special tokens read from
// the text; max_completion_tokens (or max_tokens) defaults to the rest of the context; the
// other fields as parse_completion_request takes them. logprobs, tools and response_format
// are refused but at their defaults. Throws ApiError (400 naming the field, 404 for the model).
CompletionRequest parse_chat_request(std::string_view body, const ApiLimits& limits,
                                     const std::string& model_name, const Tokenizer& tokenizer,
                                     int64_t block_size, const ChatTemplate* tmpl,
                                     const std::string& no_template);

// One choice as it accumulates: the text made (stop strings cut), its tokens and their
// log-probabilities when asked, and why it ended.
struct ChoiceState {
  std::string text;
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;         // one per token, when asked
  std::vector<TokenLogprob> prompt_logprobs;  // positions 1.. of the prompt, with echo
  bool finished = false;
  StopReason reason = StopReason::MaxNewTokens;
};

// "length" (max_tokens or the context) or "stop" (a stop string, an end-of-generation token).
const char* finish_reason_name(StopReason r);

// OpenAI's logprobs object over tokens of one choice, with text offsets from `offset`: the
// prompt's first token (leading_null: no log-probability) and prompt positions when echoed,
// then the tokens made.
nlohmann::json logprobs_json(const Tokenizer& tokenizer, const std::vector<int32_t>* prompt,
                             const std::vector<TokenLogprob>& prompt_logprobs,
                             const std::vector<TokenLogprob>& made, size_t offset);

// The whole response to a non-streamed request: choices in order (prompt b's sample i is
// choice b * n + i), and usage.
nlohmann::json completion_json(const CompletionRequest& req, const std::vector<ChoiceState>& choices,
                               const Tokenizer& tokenizer, const std::string& id,
                               const std::string& model, int64_t created);

// The whole response to a non-streamed chat request: each choice's message, and usage.
nlohmann::json chat_completion_json(const CompletionRequest& req,
                                    const std::vector<ChoiceState>& choices,
                                    const std::string& id, const std::string& model,
                                    int64_t created);

// One streamed chunk: choice `index` with a piece of text, its logprobs (null when not asked)
// and its finish reason (null until it ends).
nlohmann::json chunk_json(const std::string& id, const std::string& model, int64_t created,
                          int64_t index, const std::string& text, nlohmann::json logprobs,
                          std::optional<StopReason> finished);

// chunk_json's server-sent event ("data: " + its JSON + "\n\n"), the same bytes, appended to
// `out` without building the object: a stream at one token an event makes one per token.
// `tail` is chunk_tail(id, model, created, chat), the fields every chunk of a call shares.
const char* chunk_object(bool chat);  // "chat.completion.chunk" or "text_completion"
std::string chunk_tail(const std::string& id, const std::string& model, int64_t created,
                       bool chat = false);
void append_chunk_event(std::string& out, const std::string& tail, int64_t index,
                        const std::string& text, const nlohmann::json& logprobs,
                        std::optional<StopReason> finished);

// A chat stream's chunk: choice `index`'s delta (its first carries the role), and its finish
// reason (null until it ends).
void append_chat_event(std::string& out, const std::string& tail, int64_t index,
                       const std::string& text, bool first, std::optional<StopReason> finished);

// usage: the prompts' tokens (each once, whatever n), the tokens made over every choice.
nlohmann::json usage_json(const CompletionRequest& req, const std::vector<ChoiceState>& choices);

// A JSON text; invalid UTF-8 (a byte tokenizer may make it) is replaced, not an error.
std::string dump(const nlohmann::json& j);

}  // namespace kvlab
