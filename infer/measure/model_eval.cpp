#include "infer/measure/model_eval.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "autograd/graph.h"
#include "data/sampler.h"
#include "infer/engine.h"
#include "platform/error.h"
#include "platform/random.h"

namespace kvlab {

LogitsFn logits_of(GPT& model) {
  return [&model](const Tensor& tokens) {
    const NoGradGuard no_grad;
    return model.forward(tokens).contiguous();
  };
}

namespace {

// log-softmax of one row of V logits into out, in double.
void log_softmax(const float* logits, int64_t V, std::vector<double>& out) {
  out.resize(static_cast<size_t>(V));
  const float mx = *std::max_element(logits, logits + V);
  double sum = 0;
  for (int64_t i = 0; i < V; ++i) sum += std::exp(double(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  for (int64_t i = 0; i < V; ++i) out[static_cast<size_t>(i)] = logits[i] - lse;
}

Tensor checked_logits(const LogitsFn& model, const Tensor& tokens, int64_t vocab) {
  Tensor logits = model(tokens);
  KVLAB_CHECK(logits.dim() == 3 && logits.size(0) == tokens.size(0) &&
                  logits.size(1) == tokens.size(1) && logits.size(2) == vocab &&
                  logits.dtype() == DType::F32 && logits.is_contiguous(),
              "eval: a model gave logits ", logits.shape_str(), " for tokens ",
              tokens.shape_str(), "; expected contiguous f32 (B, T, ", vocab, ")");
  return logits;
}

int64_t argmax(const float* row, int64_t V) { return std::max_element(row, row + V) - row; }

}  // namespace

std::vector<WindowScores> score_windows(std::span<const LogitsFn> models,
                                        std::span<const int32_t> x, std::span<const int32_t> y,
                                        int64_t T, int64_t vocab, int64_t batch,
                                        const std::function<void(int64_t)>& on_batch) {
  KVLAB_CHECK(!models.empty(), "eval: no model to score");
  KVLAB_CHECK(T >= 1 && x.size() == y.size() && !x.empty() &&
                  x.size() % static_cast<size_t>(T) == 0 && batch >= 1 && vocab >= 1,
              "eval: ", x.size(), " inputs and ", y.size(), " targets are not (N, T) windows of T = ",
              T);
  const int64_t N = static_cast<int64_t>(x.size()) / T, V = vocab;
  std::vector<WindowScores> out(models.size());
  for (WindowScores& s : out) s.token_loss.assign(x.size(), std::nan(""));
  int64_t scored = 0;
  std::vector<double> ref, lp;
  for (int64_t n0 = 0; n0 < N; n0 += batch) {
    const int64_t b = std::min(batch, N - n0);
    const Tensor tokens = Tensor::from_vector(
        std::vector<int32_t>(x.begin() + n0 * T, x.begin() + (n0 + b) * T), {b, T});
    std::vector<Tensor> logits;
    for (const LogitsFn& m : models) logits.push_back(checked_logits(m, tokens, V));
    for (int64_t r = 0; r < b * T; ++r) {
      const auto at = static_cast<size_t>(n0 * T + r);
      const int32_t target = y[at];
      if (target == -1) continue;  // a task's position that is not scored
      KVLAB_CHECK(target >= 0 && target < V, "eval: target token ", target,
                  " is outside the vocabulary of ", V);
      ++scored;
      const float* rl = logits[0].data<float>() + r * V;
      log_softmax(rl, V, ref);
      const int64_t ref_top = argmax(rl, V);
      out[0].token_loss[at] = -ref[static_cast<size_t>(target)];
      out[0].top1 += 1;
      out[0].right += ref_top == target ? 1 : 0;
      for (size_t i = 1; i < models.size(); ++i) {
        const float* ml = logits[i].data<float>() + r * V;
        log_softmax(ml, V, lp);
        double kl = 0;
        for (size_t v = 0; v < static_cast<size_t>(V); ++v) kl += std::exp(ref[v]) * (ref[v] - lp[v]);
        const int64_t top = argmax(ml, V);
        out[i].token_loss[at] = -lp[static_cast<size_t>(target)];
        out[i].kl += kl;
        out[i].top1 += top == ref_top ? 1 : 0;
        out[i].right += top == target ? 1 : 0;
      }
      for (size_t i = 0; i < models.size(); ++i)
        KVLAB_CHECK(std::isfinite(out[i].token_loss[at]), "eval: model ", i,
                    " gives a loss that is not finite at window ", n0 + r / T, " position ",
                    r % T);
    }
    if (on_batch) on_batch(n0 + b);
  }
  KVLAB_CHECK(scored > 0, "eval: the windows hold no scored target");
  for (WindowScores& s : out) {
    s.kl /= static_cast<double>(scored);
    s.top1 /= static_cast<double>(scored);
    s.right /= static_cast<double>(scored);
  }
  return out;
}

double mean_of(std::span<const double> v) {
  double sum = 0;
  for (double e : v) sum += e;
  return v.empty() ? 0 : sum / static_cast<double>(v.size());
}

double scored_mean(std::span<const double> v) {
  double sum = 0;
  size_t n = 0;
  for (double e : v)
    if (!std::isnan(e)) sum += e, ++n;
  return n == 0 ? std::nan("") : sum / static_cast<double>(n);
}

std::vector<double> window_means(std::span<const double> token_loss, int64_t T) {
  const size_t N = token_loss.size() / static_cast<size_t>(T);
  std::vector<double> out(N);
  for (size_t n = 0; n < N; ++n)
    out[n] = scored_mean(token_loss.subspan(n * static_cast<size_t>(T), static_cast<size_t>(T)));
  return out;
}

std::vector<double> position_means(std::span<const double> token_loss, int64_t T) {
  const auto t_count = static_cast<size_t>(T);
  const size_t N = token_loss.size() / t_count;
  std::vector<double> out(t_count, 0.0);
  std::vector<size_t> scored(t_count, 0);
  for (size_t n = 0; n < N; ++n)
    for (size_t t = 0; t < t_count; ++t)
      if (const double l = token_loss[n * t_count + t]; !std::isnan(l)) out[t] += l, ++scored[t];
  for (size_t t = 0; t < t_count; ++t)
    out[t] = scored[t] == 0 ? std::nan("") : out[t] / static_cast<double>(scored[t]);
  return out;
}

std::vector<PositionBucket> position_buckets(std::span<const double> position_loss) {
  const auto T = static_cast<int64_t>(position_loss.size());
  std::vector<PositionBucket> out;
  for (int64_t first = 1; first <= T; first *= 2) {
    PositionBucket b;
    b.first = first;
    b.last = std::min(2 * first - 1, T);
    b.loss = scored_mean(position_loss.subspan(static_cast<size_t>(b.first - 1),
                                               static_cast<size_t>(b.last - b.first + 1)));
    if (!std::isnan(b.loss)) out.push_back(b);
  }
  return out;
}

double icl_score(std::span<const double> all_positions) {
  std::vector<double> position_loss;
  for (const double l : all_positions)
    if (!std::isnan(l)) position_loss.push_back(l);
  const auto T = static_cast<int64_t>(position_loss.size());
  KVLAB_CHECK(T >= 1, "icl score: no positions");
  // Positions are 1-based here: [lo, hi] inclusive, at least one position each.
  auto range_mean = [&](int64_t lo, int64_t hi) {
    lo = std::clamp<int64_t>(lo, 1, T);
    hi = std::clamp<int64_t>(hi, lo, T);
    return mean_of(std::span<const double>(position_loss)
                       .subspan(static_cast<size_t>(lo - 1), static_cast<size_t>(hi - lo + 1)));
  };
  const double late = range_mean(T - T / 10, T);
  const double early = range_mean(static_cast<int64_t>(std::llround(0.08 * static_cast<double>(T))),
                                  static_cast<int64_t>(std::llround(0.12 * static_cast<double>(T))));
  return late - early;
}

PairedInterval paired_bootstrap(std::span<const double> a, std::span<const double> b,
                                int resamples, uint64_t seed) {
  KVLAB_CHECK(a.size() == b.size() && !a.empty(), "paired bootstrap: ", a.size(), " and ",
              b.size(), " samples are not pairs");
  KVLAB_CHECK(resamples >= 1, "paired bootstrap: resamples must be >= 1, got ", resamples);
  std::vector<double> d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = b[i] - a[i];
  PairedInterval out;
  out.mean = mean_of(d);
  Generator gen(seed);
  std::vector<double> means(static_cast<size_t>(resamples));
  for (double& m : means) {
    double sum = 0;
    for (size_t i = 0; i < d.size(); ++i) sum += d[gen.below(d.size())];
    m = sum / static_cast<double>(d.size());
  }
  std::sort(means.begin(), means.end());
  // Percentiles by the nearest rank: the 2.5th and 97.5th of the sorted means.
  auto pct = [&](double p) {
    const auto k = static_cast<size_t>(std::ceil(p * static_cast<double>(resamples)));
    return means[std::clamp<size_t>(k, 1, means.size()) - 1];
  };
  out.lo = pct(0.025);
  out.hi = pct(0.975);
  return out;
}

std::vector<int64_t> recall_distances(int64_t T) {
  std::vector<int64_t> out;
  for (int64_t L = 4; 2 * L <= T; L *= 2) out.push_back(L);
  return out;
}

std::vector<RecallPoint> recall_probe(const LogitsFn& model, int64_t vocab,
                                      std::span<const int64_t> distances, int sequences,
                                      uint64_t seed) {
  KVLAB_CHECK(sequences >= 1, "recall probe: sequences must be >= 1, got ", sequences);
  KVLAB_CHECK(vocab >= 2, "recall probe: a vocabulary of ", vocab, " holds no random string");
  Generator gen(seed);
  std::vector<RecallPoint> out;
  for (const int64_t L : distances) {
    KVLAB_CHECK(L >= 2, "recall probe: distance ", L, " leaves nothing to predict");
    // Each row: L random tokens, then the same L again.
    std::vector<int32_t> rows(static_cast<size_t>(sequences * 2 * L));
    for (int s = 0; s < sequences; ++s) {
      int32_t* row = rows.data() + static_cast<size_t>(s) * static_cast<size_t>(2 * L);
      for (int64_t t = 0; t < L; ++t) row[t] = static_cast<int32_t>(gen.below(static_cast<uint64_t>(vocab)));
      std::copy(row, row + L, row + L);
    }
    const Tensor logits =
        checked_logits(model, Tensor::from_vector(rows, {sequences, 2 * L}), vocab);
    RecallPoint p;
    p.distance = L;
    std::vector<double> lp;
    // Positions L .. 2L-2 of the second copy predict a token seen L positions back.
    for (int s = 0; s < sequences; ++s)
      for (int64_t t = L; t + 1 < 2 * L; ++t) {
        const size_t at = static_cast<size_t>(s) * static_cast<size_t>(2 * L) + static_cast<size_t>(t);
        const float* row = logits.data<float>() + static_cast<int64_t>(at) * vocab;
        const int32_t target = rows[at + 1];
        log_softmax(row, vocab, lp);
        p.loss -= lp[static_cast<size_t>(target)];
        p.accuracy += argmax(row, vocab) == target ? 1 : 0;
        ++p.predictions;
      }
    p.loss /= static_cast<double>(p.predictions);
    p.accuracy /= static_cast<double>(p.predictions);
    out.push_back(p);
  }
  return out;
}

double distinct_n(std::span<const std::vector<int32_t>> samples, int n) {
  KVLAB_CHECK(n >= 1, "distinct-n: n must be >= 1, got ", n);
  std::set<std::vector<int32_t>> seen;
  int64_t total = 0;
  for (const auto& s : samples)
    for (size_t i = 0; i + static_cast<size_t>(n) <= s.size(); ++i, ++total)
      seen.emplace(s.begin() + static_cast<std::ptrdiff_t>(i),
                   s.begin() + static_cast<std::ptrdiff_t>(i) + n);
  return total == 0 ? 0 : static_cast<double>(seen.size()) / static_cast<double>(total);
}

double repeated_ngram_rate(std::span<const std::vector<int32_t>> samples, int n) {
  KVLAB_CHECK(n >= 1, "repeated n-grams: n must be >= 1, got ", n);
  int64_t total = 0, repeated = 0;
  for (const auto& s : samples) {
    std::set<std::vector<int32_t>> seen;
    for (size_t i = 0; i + static_cast<size_t>(n) <= s.size(); ++i, ++total)
      if (!seen.emplace(s.begin() + static_cast<std::ptrdiff_t>(i),
                        s.begin() + static_cast<std::ptrdiff_t>(i) + n)
               .second)
        ++repeated;
  }
  return total == 0 ? 0 : static_cast<double>(repeated) / static_cast<double>(total);
}

namespace {

// The window starts evaluate_models scores: fixed random ones, or (count 0) the split tiled.
std::vector<int64_t> window_starts(int64_t n_tokens, int64_t T, const EvalOptions& o) {
  KVLAB_CHECK(n_tokens > T, "eval: the validation split's ", n_tokens,
              " tokens hold no window of ", T, " tokens and its targets");
  if (o.windows > 0)
    return fixed_windows(n_tokens, static_cast<int>(T), o.windows, o.seed, o.period);
  std::vector<int64_t> starts;
  for (int64_t s = 0; s + T + 1 <= n_tokens; s += o.period > 0 ? o.period : T) starts.push_back(s);
  return starts;
}

// The prompts sample_stats draws from: the first tokens (a quarter of the window, at most
// 16) of fixed windows, the same for every model; none without options.samples.
std::vector<std::vector<int32_t>> sample_prompts(const std::vector<int32_t>& ids, int64_t T,
                                                 const EvalOptions& o) {
  std::vector<std::vector<int32_t>> out;
  if (o.samples == 0) return out;
  const int64_t len = std::clamp<int64_t>(T / 4, 1, 16);
  for (const int64_t s : fixed_windows(static_cast<int64_t>(ids.size()), static_cast<int>(T),
                                       o.samples, o.seed + 1))
    out.emplace_back(ids.begin() + s, ids.begin() + s + len);
  return out;
}

// Bytes of text the targets spell, each token by its own bytes.
int64_t spelled_bytes(std::span<const int32_t> targets, const Tokenizer& tokenizer) {
  std::vector<int64_t> bytes(static_cast<size_t>(tokenizer.vocab_size()), -1);
  int64_t total = 0;
  for (const int32_t t : targets) {
    if (t < 0) continue;  // not scored
    int64_t& b = bytes.at(static_cast<size_t>(t));
    if (b < 0) b = static_cast<int64_t>(tokenizer.decode_one(t).size());
    total += b;
  }
  return total;
}

}  // namespace

EvalResult evaluate_models(std::span<GPT* const> gpts, std::span<const std::string> names,
                           const std::vector<int32_t>& ids, const Tokenizer& tokenizer,
                           const EvalOptions& o,
                           const std::function<void(int64_t, int64_t)>& on_progress) {
  KVLAB_CHECK(gpts.size() == names.size() && !gpts.empty(), "eval: ", gpts.size(),
              " models and ", names.size(), " names");
  KVLAB_CHECK(o.window >= 2, "eval: the window must be >= 2 tokens, got ", o.window);
  KVLAB_CHECK(o.windows >= 0 && o.samples >= 0, "eval: windows and samples must be >= 0, got ",
              o.windows, " and ", o.samples);
  const int64_t vocab = gpts.front()->config().vocab_size;
  std::vector<LogitsFn> models;
  for (GPT* g : gpts) {
    KVLAB_CHECK(g->config().vocab_size == vocab, "eval: the models' vocabularies differ (",
                vocab, " and ", g->config().vocab_size, " tokens)");
    models.push_back(logits_of(*g));
  }
  EvalResult r;
  r.window = o.window;
  const int64_t T = o.window;
  const std::vector<int64_t> starts = window_starts(static_cast<int64_t>(ids.size()), T, o);
  r.windows = static_cast<int64_t>(starts.size());
  std::vector<int32_t> x, y;
  fill_windows(ids, starts, static_cast<int>(T), x, y, o.targets);
  r.predictions = std::count_if(y.begin(), y.end(), [](int32_t t) { return t >= 0; });
  r.target_bytes = spelled_bytes(y, tokenizer);
  const std::vector<int64_t> distances = recall_distances(T);
  const int64_t total = r.windows + static_cast<int64_t>(models.size() * distances.size());

  // Phase 1: every model on the same windows.
  const std::vector<WindowScores> scores = score_windows(
      models, x, y, T, vocab, o.batch, [&](int64_t done) {
        if (on_progress) on_progress(done, total);
      });
  // Phase 2: what each model's per-token losses say, its recall of a repeated string and
  // its samples.
  const std::vector<std::vector<int32_t>> prompts = sample_prompts(ids, T, o);
  SampleOptions sampling = o.sampling;  // a sample stays inside the window's context
  if (!prompts.empty())
    sampling.max_new_tokens = std::min<int64_t>(
        sampling.max_new_tokens, T - static_cast<int64_t>(prompts.front().size()));
  for (size_t i = 0; i < models.size(); ++i) {
    ModelQuality q;
    q.name = names[i];
    q.loss = scored_mean(scores[i].token_loss);
    if (o.targets != nullptr) q.accuracy = scores[i].right;
    q.bits_per_byte = q.loss * static_cast<double>(r.predictions) /
                      (std::log(2.0) * static_cast<double>(std::max<int64_t>(r.target_bytes, 1)));
    q.kl = scores[i].kl;
    q.top1 = scores[i].top1;
    q.window_loss = window_means(scores[i].token_loss, T);
    q.position_loss = position_means(scores[i].token_loss, T);
    q.buckets = position_buckets(q.position_loss);
    q.icl = icl_score(q.position_loss);
    q.recall = recall_probe(models[i], vocab, distances, o.recall_sequences);
    if (!prompts.empty()) q.samples = sample_stats(*gpts[i], tokenizer, prompts, sampling);
    if (on_progress)
      on_progress(r.windows + static_cast<int64_t>((i + 1) * distances.size()), total);
    r.models.push_back(std::move(q));
  }
  // Phase 3: every pair, paired over the windows.
  for (size_t a = 0; a < models.size(); ++a)
    for (size_t b = a + 1; b < models.size(); ++b)
      r.pairs.push_back({a, b,
                         paired_bootstrap(r.models[a].window_loss, r.models[b].window_loss,
                                          o.resamples, o.bootstrap_seed)});
  return r;
}

SampleStats sample_stats(GPT& model, const Tokenizer& tokenizer,
                         const std::vector<std::vector<int32_t>>& prompts,
                         const SampleOptions& o) {
  Engine engine(model, tokenizer);
  GenerateOptions g;
  g.max_new_tokens = o.max_new_tokens;
  g.sampling.temperature = o.temperature;
  g.sampling.seed = o.seed;
  g.stop = o.stop;
  const GenerationResult out = engine.generate_ids(prompts, g);
  SampleStats s;
  std::vector<std::vector<int32_t>> samples;
  for (const RowResult& row : out.rows) {
    samples.push_back(row.tokens);
    s.mean_bytes += static_cast<double>(row.text.size());
    s.stopped += row.stop_reason == StopReason::StopString ? 1 : 0;
  }
  s.samples = static_cast<int64_t>(samples.size());
  for (int n = 1; n <= 3; ++n) s.distinct[n - 1] = distinct_n(samples, n);
  s.repeated3 = repeated_ngram_rate(samples, 3);
  s.mean_bytes /= static_cast<double>(std::max<int64_t>(s.samples, 1));
  s.stopped /= static_cast<double>(std::max<int64_t>(s.samples, 1));
  return s;
}

nlohmann::json eval_json(const EvalResult& r) {
  using nlohmann::json;
  json models = json::array();
  for (const ModelQuality& q : r.models) {
    json buckets = json::array(), recall = json::array();
    for (const PositionBucket& b : q.buckets)
      buckets.push_back({{"first", b.first}, {"last", b.last}, {"loss", b.loss}});
    for (const RecallPoint& p : q.recall)
      recall.push_back({{"distance", p.distance},
                        {"loss", p.loss},
                        {"accuracy", p.accuracy},
                        {"predictions", p.predictions}});
    json samples = nullptr;
    if (q.samples)
      samples = {{"samples", q.samples->samples},
                 {"distinct_1", q.samples->distinct[0]},
                 {"distinct_2", q.samples->distinct[1]},
                 {"distinct_3", q.samples->distinct[2]},
                 {"repeated_3grams", q.samples->repeated3},
                 {"mean_bytes", q.samples->mean_bytes},
                 {"stopped", q.samples->stopped}};
    models.push_back({{"name", q.name},
                      {"loss", q.loss},
                      {"accuracy", q.accuracy ? json(*q.accuracy) : json()},
                      {"bits_per_byte", q.bits_per_byte},
                      {"icl_score", q.icl},
                      {"kl_vs_first", q.kl},
                      {"top1_vs_first", q.top1},
                      {"loss_by_position", q.position_loss},
                      {"position_buckets", buckets},
                      {"recall", recall},
                      {"samples", samples}});
  }
  json pairs = json::array();
  for (const PairedComparison& p : r.pairs)
    pairs.push_back({{"a", r.models[p.a].name},
                     {"b", r.models[p.b].name},
                     {"mean_diff", p.diff.mean},
                     {"ci95", {p.diff.lo, p.diff.hi}},
                     {"distinguishable", p.diff.excludes_zero()}});
  return {{"windows", r.windows},
          {"window", r.window},
          {"predictions", r.predictions},
          {"target_bytes", r.target_bytes},
          {"models", models},
          {"pairs", pairs}};
}

}  // namespace kvlab
