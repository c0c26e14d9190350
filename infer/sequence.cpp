#include "infer/sequence.h"

#include <algorithm>

#include "platform/random.h"

namespace kvlab {

const char* stop_reason_name(StopReason r) {
  switch (r) {
    case StopReason::MaxNewTokens:
      return "max_new_tokens";
    case StopReason::StopString:
      return "stop_string";
    case StopReason::ContextLimit:
      return "context_limit";
    case StopReason::EndOfGeneration:
      return "end_of_generation";
  }
  return "?";
}

Sequence::Sequence(std::span<const int32_t> prompt, const SamplingOptions& sampling,
                   uint64_t stream, const std::vector<std::string>& stops, int64_t max_new,
                   std::span<const int32_t> ends)
    : tokens(prompt.begin(), prompt.end()),
      prompt_len(static_cast<int64_t>(prompt.size())),
      max_new_tokens(max_new),
      sampler(sampling, hash64(sampling.seed, stream)),
      stop(stops),
      eog(ends) {}

bool Sequence::made_eog() const {
  return made > 0 && std::binary_search(eog.begin(), eog.end(), tokens.back());
}

int32_t Sequence::sample(std::span<const float> logits) {
  const int32_t token = sampler.sample(logits);
  tokens.push_back(token);
  ++made;
  return token;
}

std::string Sequence::release_last(const Tokenizer& tokenizer) {
  if (made_eog()) return "";
  // push() may return a view of the piece itself: copied out while the piece lives.
  const std::string piece = utf8.push(tokenizer.decode_one(tokens.back()));
  return std::string(stop.push(piece));
}

std::string Sequence::flush() {
  const std::string rest = utf8.finish();
  std::string out(stop.push(rest));  // copied before flush() may reuse the filter's buffer
  out += stop.flush();
  return out;
}

std::optional<StopReason> Sequence::stop_reason(int64_t block_size) const {
  if (stop.stopped()) return StopReason::StopString;
  if (made_eog()) return StopReason::EndOfGeneration;
  if (made >= max_new_tokens) return StopReason::MaxNewTokens;
  if (context_full(block_size)) return StopReason::ContextLimit;
  return std::nullopt;
}

}  // namespace kvlab
