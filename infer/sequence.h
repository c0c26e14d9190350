#pragma once
// One generated sequence, as the Engine's rows and the Scheduler's requests both keep it: its
// tokens (the prompt, then every token made), its sampler, its stop-string filter, and the
// rules that end it, in their order.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"
#include "infer/sampler.h"
#include "infer/stop_filter.h"

namespace kvlab {

enum class StopReason { MaxNewTokens, StopString, ContextLimit, EndOfGeneration };
// "max_new_tokens", "stop_string", "context_limit", "end_of_generation"
const char* stop_reason_name(StopReason r);

struct Sequence {
  // Its sampler draws the stream hash64(sampling.seed, stream). `stops` (none empty) and `eog`
  // (ascending: the tokens that end it, a tokenizer's TokenControls::eog) must outlive the
  // sequence.
  Sequence(std::span<const int32_t> prompt, const SamplingOptions& sampling, uint64_t stream,
           const std::vector<std::string>& stops, int64_t max_new,
           std::span<const int32_t> eog = {});

  // Draws the next token from logits (V) and appends it.
  int32_t sample(std::span<const float> logits);
  // The text the last token made releases: none while it may begin a stop string, or while
  // it ends inside a UTF-8 character (a bpe or byte token may hold part of one), and none of
  // an end-of-generation token's.
  std::string release_last(const Tokenizer& tokenizer);
  // The text still held back, released because the sequence ends for another reason.
  std::string flush();

  // Why the sequence ends after the token it just made, or none while it goes on. The rules,
  // in order: its text reached a stop string, the token ends a generation, it made
  // max_new_tokens, its context is full.
  std::optional<StopReason> stop_reason(int64_t block_size) const;
  // The window holds block_size positions before the token to feed next: feeding it would
  // need a position past the context.
  bool context_full(int64_t block_size) const { return window_len() - 1 >= block_size; }

  int64_t window_len() const { return static_cast<int64_t>(tokens.size()) - window_start; }
  // The tokens the model is conditioned on: positions 0 .. of its current window.
  std::span<const int32_t> window() const {
    return {tokens.data() + window_start, static_cast<size_t>(window_len())};
  }

  std::vector<int32_t> tokens;  // the prompt, then every token made
  int64_t prompt_len = 0;
  int64_t made = 0;
  int64_t max_new_tokens = 0;
  int64_t window_start = 0;  // tokens index at position 0 of the model's current window
  Sampler sampler;
  Utf8StreamDecoder utf8;  // before the stop filter, which then sees whole characters
  StopStringFilter stop;
  std::span<const int32_t> eog;

 private:
  bool made_eog() const;
};

}  // namespace kvlab
