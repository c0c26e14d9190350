#include "infer/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "platform/error.h"

namespace kvlab {

namespace {
// Rounding slack on the top-p threshold: probabilities come from f32 logits, so a set whose
// exact cumulative probability equals p may sum to p - 1e-8 here.
constexpr double kTopPSlack = 1e-6;

// A NaN or infinite logit means the model's weights or activations are broken: no token can be
// chosen from it (argmax would quietly take token 0, the softmax a NaN mass).
void check_finite(std::span<const float> logits) {
  KVLAB_CHECK(!logits.empty(), "sampler: empty logits");
  for (size_t i = 0; i < logits.size(); ++i)
    KVLAB_CHECK(std::isfinite(logits[i]), "sampler: the logit of token ", i, " is ", logits[i],
                ": the model's weights or activations are not finite");
}
}  // namespace

void SamplingOptions::validate() const {
  KVLAB_CHECK(std::isfinite(temperature) && temperature >= 0, "temperature must be >= 0, got ",
              temperature);
  KVLAB_CHECK(top_k >= 0, "top-k must be >= 0 (0 keeps every token), got ", top_k);
  KVLAB_CHECK(std::isfinite(top_p) && top_p > 0 && top_p <= 1, "top-p must be in (0, 1], got ",
              top_p);
}

int32_t argmax(std::span<const float> logits) {
  check_finite(logits);
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  return static_cast<int32_t>(best);
}

TokenLogprob token_logprob(std::span<const float> logits, int32_t token, int64_t top) {
  check_finite(logits);
  const float m = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (const float l : logits) sum += std::exp(static_cast<double>(l - m));
  const double log_z = static_cast<double>(m) + std::log(sum);
  auto lp = [&](size_t i) { return static_cast<float>(logits[i] - log_z); };
  TokenLogprob out{token, lp(static_cast<size_t>(token)), {}};
  const size_t k = std::min(logits.size(), static_cast<size_t>(std::max<int64_t>(top, 0)));
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(),
                    [&](int32_t a, int32_t b) {
                      return logits[static_cast<size_t>(a)] != logits[static_cast<size_t>(b)]
                                 ? logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)]
                                 : a < b;
                    });
  for (size_t i = 0; i < k; ++i) out.top.emplace_back(ids[i], lp(static_cast<size_t>(ids[i])));
  return out;
}

Sampler::Sampler(const SamplingOptions& options, uint64_t stream_seed)
    : options_(options), gen_(stream_seed) {
  options_.validate();
}

double Sampler::filtered(std::span<const float> logits) {
  check_finite(logits);
  const size_t V = logits.size();
  probs_.resize(V);
  const double inv_t = 1.0 / options_.temperature;
  double mx = -INFINITY;
  for (float l : logits) mx = std::max(mx, static_cast<double>(l));
  double total = 0;
  for (size_t i = 0; i < V; ++i) {
    probs_[i] = std::exp((static_cast<double>(logits[i]) - mx) * inv_t);
    total += probs_[i];
  }
  const size_t k = options_.top_k > 0 ? std::min(V, static_cast<size_t>(options_.top_k)) : V;
  if (k == V && options_.top_p >= 1.0) return total;
  order_.resize(V);
  for (size_t i = 0; i < V; ++i) order_[i] = static_cast<int32_t>(i);
  auto by_prob = [&](int32_t a, int32_t b) {
    return probs_[static_cast<size_t>(a)] > probs_[static_cast<size_t>(b)] ||
           (probs_[static_cast<size_t>(a)] == probs_[static_cast<size_t>(b)] && a < b);
  };
  std::sort(order_.begin(), order_.end(), by_prob);
  // Keep the top k, then of those the shortest prefix whose mass reaches top_p.
  double kept_total = 0;
  for (size_t i = 0; i < k; ++i) kept_total += probs_[static_cast<size_t>(order_[i])];
  size_t keep = k;
  if (options_.top_p < 1.0) {
    const double target = options_.top_p * kept_total * (1.0 - kTopPSlack);
    double cum = 0;
    for (size_t i = 0; i < k; ++i) {
      cum += probs_[static_cast<size_t>(order_[i])];
      if (cum >= target) {
        keep = i + 1;
        break;
      }
    }
  }
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) sum += probs_[static_cast<size_t>(order_[i])];
  for (size_t i = keep; i < V; ++i) probs_[static_cast<size_t>(order_[i])] = 0;
  return sum;
}

int32_t Sampler::sample(std::span<const float> logits) {
  if (options_.greedy()) return argmax(logits);
  const double total = filtered(logits);
  const double u = gen_.uniform() * total;
  double cum = 0;
  int32_t last = 0;
  for (size_t i = 0; i < probs_.size(); ++i) {
    if (probs_[i] <= 0) continue;
    last = static_cast<int32_t>(i);
    cum += probs_[i];
    if (u < cum) return last;
  }
  return last;  // u rounded up to the total: the last kept token
}

std::vector<double> Sampler::distribution(std::span<const float> logits) {
  if (options_.greedy()) {
    std::vector<double> out(logits.size(), 0.0);
    out[static_cast<size_t>(argmax(logits))] = 1.0;
    return out;
  }
  const double total = filtered(logits);
  std::vector<double> out(probs_);
  for (double& p : out) p /= total;
  return out;
}

}  // namespace kvlab
