#pragma once
// Generation quality of models that differ in one knob, measured on the same windows so that
// every difference is paired (kvlab eval): per-token losses, their paired difference with a
// bootstrap interval over windows, loss by context position and the in-context learning
// score (Olsson et al. 2022), KL and top-1 agreement against a reference model, an in-context
// recall probe (random tokens repeated twice), and the diversity of generated samples.
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "autograd/tensor.h"
#include "data/tokenizer.h"
#include "nn/gpt.h"

namespace kvlab {

// A model as the measurements see it: tokens (B, T) int32 -> logits (B, T, V) f32, contiguous,
// without gradients. Tests give hand-built ones; logits_of wraps a GPT.
using LogitsFn = std::function<Tensor(const Tensor& tokens)>;
LogitsFn logits_of(GPT& model);

// One model's scores on N windows of T positions.
struct WindowScores {
  // (N, T): next-token cross-entropy in nats; NaN where the target is -1 (not scored)
  std::vector<double> token_loss;
  double kl = 0;    // mean KL(p_reference || p_model) a scored position; 0 for the reference
  double top1 = 0;  // fraction of scored positions whose argmax is the reference's
  double right = 0;  // fraction of scored positions whose argmax is the target
};

// x and y (N, T) row-major, y the next tokens (data/sampler.h's fill_windows), or a task's
// targets with -1 where a position is not scored. models[0] is the reference the others' KL
// and top-1 agreement are taken against. Forwards `batch` windows at a time through every
// model; on_batch(windows done) after each batch. A scored position whose loss is not finite
// (a broken model) is an error naming it.
std::vector<WindowScores> score_windows(std::span<const LogitsFn> models,
                                        std::span<const int32_t> x, std::span<const int32_t> y,
                                        int64_t T, int64_t vocab, int64_t batch = 8,
                                        const std::function<void(int64_t)>& on_batch = {});

double mean_of(std::span<const double> v);
// The mean of the entries that are not NaN (the scored ones); NaN where none is.
double scored_mean(std::span<const double> v);
// Each window's mean loss (N), and each position's mean over the windows (T), over the scored
// positions (NaN where a window or a position has none).
std::vector<double> window_means(std::span<const double> token_loss, int64_t T);
std::vector<double> position_means(std::span<const double> token_loss, int64_t T);

// Positions 1..T (the first predicts from one token) in log-spaced buckets 1, 2-3, 4-7, ...,
// the last ending at T: each bucket's mean loss over its scored positions (a bucket without
// any is left out).
struct PositionBucket {
  int64_t first = 0, last = 0;  // 1-based positions, inclusive
  double loss = 0;
};
std::vector<PositionBucket> position_buckets(std::span<const double> position_loss);

// Olsson et al.'s in-context learning score scaled to a context of T: the mean loss over the
// last tenth of the positions minus the mean over positions 0.08T..0.12T (their token 500
// against token 50 of 512). Negative: later tokens are predicted better, from the context.
// Positions without a scored token (NaN: a task's) are left out first: the score is then over
// the scored positions in order.
double icl_score(std::span<const double> position_loss);

// The mean of b - a over paired samples (windows) and its percentile bootstrap interval:
// `resamples` draws of as many windows with replacement, from Generator(seed).
struct PairedInterval {
  double mean = 0, lo = 0, hi = 0;
  bool excludes_zero() const { return lo > 0 || hi < 0; }
};
PairedInterval paired_bootstrap(std::span<const double> a, std::span<const double> b,
                                int resamples = 2000, uint64_t seed = 7);

// In-context recall: `sequences` random token strings of length L (uniform over the vocab,
// from Generator(seed)) each followed by itself; scored on the second copy, where every
// target has been seen L positions back (L = the distance). Powers of two 4..T/2 by default.
struct RecallPoint {
  int64_t distance = 0;
  double loss = 0;      // mean cross-entropy of the second copy's predictable targets
  double accuracy = 0;  // fraction of them that are the argmax
  int64_t predictions = 0;
};
std::vector<int64_t> recall_distances(int64_t T);
std::vector<RecallPoint> recall_probe(const LogitsFn& model, int64_t vocab,
                                      std::span<const int64_t> distances, int sequences = 16,
                                      uint64_t seed = 99);

// Generated samples' diversity: the distinct n-grams over all n-grams of the samples
// (distinct-n), and the fraction of each sample's n-grams already seen earlier in the same
// sample (repetition), averaged over the samples weighted by n-grams.
double distinct_n(std::span<const std::vector<int32_t>> samples, int n);
double repeated_ngram_rate(std::span<const std::vector<int32_t>> samples, int n);

// Samples drawn from a model and what they look like: one sample a prompt at `temperature`
// (Generator streams from `seed`, the same for every model), up to max_new_tokens, stopping
// at any of `stop`.
struct SampleOptions {
  int64_t max_new_tokens = 64;
  double temperature = 0.8;
  uint64_t seed = 1;
  std::vector<std::string> stop = {"\n\n"};
};
struct SampleStats {
  int64_t samples = 0;
  double distinct[3] = {0, 0, 0};  // distinct-1, -2, -3 over the generated tokens
  double repeated3 = 0;            // repeated_ngram_rate of 3-grams
  double mean_bytes = 0;           // text before a stop string (or the token limit), in bytes
  double stopped = 0;              // fraction that met a stop string
};
SampleStats sample_stats(GPT& model, const Tokenizer& tokenizer,
                         const std::vector<std::vector<int32_t>>& prompts,
                         const SampleOptions& options);

// evaluate_models' settings: `windows` fixed windows of `window` tokens (0: the smallest
// context of the models) drawn from Generator(seed) over the split, or with windows 0 every
// whole window of the split, end to end.
struct EvalOptions {
  // A task's split (Corpus::val_targets and example_tokens; null and 0 for text): its windows
  // are whole examples, scored on the targets alone (the answers), so the loss, the paired
  // test and `accuracy` are the task's.
  const std::vector<int32_t>* targets = nullptr;
  int64_t period = 0;
  int windows = 256;
  int64_t window = 0;
  uint64_t seed = 1234;
  int resamples = 2000;
  uint64_t bootstrap_seed = 7;
  int recall_sequences = 16;
  int64_t batch = 8;
  int samples = 0;  // prompts sampled from for sample_stats (the first tokens of fixed windows)
  SampleOptions sampling;
};

struct ModelQuality {
  std::string name;
  double loss = 0;           // mean next-token cross-entropy, nats
  double bits_per_byte = 0;  // the same over the bytes of the targets' text
  double icl = 0;            // icl_score
  double kl = 0, top1 = 0;   // against the first model
  std::optional<double> accuracy;  // a task's: the share of its answers the argmax gets
  std::vector<double> window_loss, position_loss;
  std::vector<PositionBucket> buckets;
  std::vector<RecallPoint> recall;
  std::optional<SampleStats> samples;  // with EvalOptions::samples
};

// Model b against model a: the paired difference of their mean per-token losses (b - a).
struct PairedComparison {
  size_t a = 0, b = 0;
  PairedInterval diff;
};

struct EvalResult {
  int64_t windows = 0, window = 0;
  int64_t predictions = 0;   // per model
  int64_t target_bytes = 0;  // bytes of text the predicted tokens spell
  std::vector<ModelQuality> models;
  std::vector<PairedComparison> pairs;  // every pair a < b
};

// Every model (CPU, eval mode) scored on the same windows of `ids` (one tokenizer's ids,
// `tokenizer` spelling them for bits per byte), then the pairs compared, the recall probe run
// on each, and with options.samples each sampled from the same prompts.
// on_progress(done, total) counts windows scored by every model, then recall distances.
EvalResult evaluate_models(std::span<GPT* const> models, std::span<const std::string> names,
                           const std::vector<int32_t>& ids, const Tokenizer& tokenizer,
                           const EvalOptions& options,
                           const std::function<void(int64_t, int64_t)>& on_progress = {});

nlohmann::json eval_json(const EvalResult& r);

}  // namespace kvlab
