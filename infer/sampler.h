#pragma once
// Next-token sampling from a row of logits: greedy, temperature, top-k and top-p (nucleus),
// seeded by kvlab::Generator so that the same seed gives the same tokens.
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "platform/random.h"

namespace kvlab {

struct SamplingOptions {
  // 0 means greedy (argmax); otherwise logits are divided by it before the softmax.
  double temperature = 1.0;
  // Keep the k most probable tokens; 0 keeps all. top_k = 1 is greedy.
  int64_t top_k = 0;
  // Keep the smallest set of most probable tokens whose cumulative probability is >= top_p
  // (over the distribution after temperature and top-k, sorted by decreasing probability,
  // ties by token id); 1 keeps all.
  double top_p = 1.0;
  uint64_t seed = 0;

  bool greedy() const { return temperature == 0.0 || top_k == 1; }
  // Throws kvlab::Error naming the setting: temperature < 0, top_k < 0, top_p outside (0, 1].
  void validate() const;
};

class Sampler {
 public:
  // The generator starts from `stream_seed` (the engine derives one per batch row from
  // options.seed, so rows draw independent streams).
  Sampler(const SamplingOptions& options, uint64_t stream_seed);

  // Token id drawn from logits (V). Greedy picks the lowest id among equal maxima.
  int32_t sample(std::span<const float> logits);
  // The distribution sample() draws from: probabilities (V) after temperature, top-k and
  // top-p, renormalised; filtered tokens are exactly 0. Greedy gives a one-hot vector.
  std::vector<double> distribution(std::span<const float> logits);

  const SamplingOptions& options() const { return options_; }

 private:
  // Fills probs_ (V) with the filtered, unnormalised distribution; returns its sum.
  double filtered(std::span<const float> logits);

  SamplingOptions options_;
  Generator gen_;
  std::vector<double> probs_;   // (V) reused across calls: no per-token allocation
  std::vector<int32_t> order_;  // (V) token ids sorted by decreasing probability
};

int32_t argmax(std::span<const float> logits);

// A token's log-probability under the model: the log-softmax of its logits, before
// temperature, top-k and top-p (what the OpenAI completions API's logprobs report).
struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // the most probable tokens, most probable first
};
// token's log-probability under logits (V), with the `top` most probable tokens (ties by id).
TokenLogprob token_logprob(std::span<const float> logits, int32_t token, int64_t top);

}  // namespace kvlab
