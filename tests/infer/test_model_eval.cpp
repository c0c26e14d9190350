// kvlab eval's measurements (infer/measure/model_eval.h): a model against itself differs by
// exactly nothing; a perturbed copy by what its loss says; loss by position is each position's
// own loss computed from its prefix; the recall probe tells a copying model from one that
// cannot copy; the bootstrap is seeded.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "autograd/graph.h"
#include "data/mqar.h"
#include "data/sampler.h"
#include "infer/measure/model_eval.h"
#include "infer_test_util.h"
#include "platform/random.h"

namespace kvlab {
namespace {

struct Windows {
  std::vector<int32_t> x, y;
};

// N windows of T + 1 random tokens: inputs and their next tokens.
Windows random_windows(int64_t N, int64_t T, int64_t V, uint64_t seed) {
  Generator gen(seed);
  Windows w;
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int32_t> row(static_cast<size_t>(T + 1));
    for (int32_t& t : row) t = static_cast<int32_t>(gen.below(static_cast<uint64_t>(V)));
    w.x.insert(w.x.end(), row.begin(), row.end() - 1);
    w.y.insert(w.y.end(), row.begin() + 1, row.end());
  }
  return w;
}

// An induction rule written by hand: at each position, the earlier position whose preceding
// tokens match the longest run ending here (the earliest among equals), and a logit of 10 on
// the token that followed it. In a repeated string it finds the first copy.
Tensor induction_logits(const Tensor& tokens, int64_t V) {
  const int64_t B = tokens.size(0), T = tokens.size(1);
  const std::vector<int32_t> ids = tokens.to_vector<int32_t>();
  auto id = [&](int64_t b, int64_t t) { return ids[static_cast<size_t>(b * T + t)]; };
  std::vector<float> out(static_cast<size_t>(B * T * V), 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      int64_t best = -1, best_run = 0;
      for (int64_t j = 0; j < t; ++j) {
        int64_t run = 0;
        while (run <= j && id(b, j - run) == id(b, t - run)) ++run;
        if (run > best_run) best = j, best_run = run;
      }
      if (best >= 0) out[static_cast<size_t>((b * T + t) * V + id(b, best + 1))] = 10;
    }
  return Tensor::from_vector(out, {B, T, V});
}

TEST(ModelEval, AModelAgainstItselfDiffersByExactlyNothing) {
  auto model = test::random_model(test::tiny_config(2, 16), 3);
  const int64_t T = 16, V = model->config().vocab_size;
  const Windows w = random_windows(12, T, V, 1);
  const std::vector<LogitsFn> models{logits_of(*model), logits_of(*model)};
  const auto scores = score_windows(models, w.x, w.y, T, V, 5);
  EXPECT_EQ(scores[0].token_loss, scores[1].token_loss);
  EXPECT_EQ(scores[1].kl, 0.0);
  EXPECT_EQ(scores[1].top1, 1.0);
  const PairedInterval d =
      paired_bootstrap(window_means(scores[0].token_loss, T), window_means(scores[1].token_loss, T));
  EXPECT_EQ(d.mean, 0.0);
  EXPECT_EQ(d.lo, 0.0);
  EXPECT_EQ(d.hi, 0.0);
  EXPECT_FALSE(d.excludes_zero());
}

TEST(ModelEval, APerturbedCopyDiffersByItsLoss) {
  const GPTConfig c = test::tiny_config(2, 16);
  auto a = test::random_model(c, 3), b = test::random_model(c, 3);
  b->wte.weight.data<float>()[5] += 0.5f;  // one weight of token 0's embedding
  const int64_t T = 16, V = c.vocab_size;
  const Windows w = random_windows(40, T, V, 2);
  const std::vector<LogitsFn> models{logits_of(*a), logits_of(*b)};
  const auto scores = score_windows(models, w.x, w.y, T, V);
  const double la = mean_of(scores[0].token_loss), lb = mean_of(scores[1].token_loss);
  const PairedInterval d =
      paired_bootstrap(window_means(scores[0].token_loss, T), window_means(scores[1].token_loss, T));
  ASSERT_NE(la, lb);
  EXPECT_NEAR(d.mean, lb - la, 1e-12);  // windows of equal length: the mean of the means
  EXPECT_EQ(d.mean > 0, lb > la);
  EXPECT_LE(d.lo, d.mean);
  EXPECT_GE(d.hi, d.mean);
  EXPECT_GT(scores[1].kl, 0.0);
  EXPECT_LT(scores[1].top1, 1.0);
}

// The cross-entropy of one position's logits, computed directly in double.
double direct_loss(const float* logits, int64_t V, int32_t target) {
  double sum = 0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(double(logits[v]));
  return std::log(sum) - logits[target];
}

// Position t's mean loss is the mean over the windows of each window's loss at t, computed
// directly from one forward of the window; and that equals the model run on the prefix
// 0..t alone up to f32 rounding (other product shapes round otherwise: 2.4e-6 seen here on
// losses near 2-5 of these large random weights).
TEST(ModelEval, LossByPositionIsEachPrefixsOwnLoss) {
  auto model = test::random_model(test::tiny_config(4, 16), 9);
  const int64_t T = 16, V = model->config().vocab_size, N = 3;
  const Windows w = random_windows(N, T, V, 4);
  const std::vector<LogitsFn> models{logits_of(*model)};
  const std::vector<double> by_position =
      position_means(score_windows(models, w.x, w.y, T, V, N)[0].token_loss, T);
  NoGradGuard no_grad;
  const std::vector<float> full =
      model->forward(Tensor::from_vector(w.x, {N, T})).contiguous().to_vector<float>();
  for (int64_t t = 0; t < T; ++t) {
    double direct = 0;
    for (int64_t n = 0; n < N; ++n)
      direct += direct_loss(full.data() + (n * T + t) * V, V, w.y[static_cast<size_t>(n * T + t)]);
    EXPECT_NEAR(by_position[static_cast<size_t>(t)], direct / N, 1e-9) << "position " << t + 1;
    const std::vector<int32_t> prefix(w.x.begin(), w.x.begin() + t + 1);  // window 0's
    const std::vector<float> alone =
        model->forward(Tensor::from_vector(prefix, {1, t + 1})).contiguous().to_vector<float>();
    EXPECT_NEAR(direct_loss(alone.data() + t * V, V, w.y[static_cast<size_t>(t)]),
                direct_loss(full.data() + t * V, V, w.y[static_cast<size_t>(t)]), 1e-5)
        << "position " << t + 1;
  }
}

TEST(ModelEval, PositionBucketsAreLogSpacedAndTheIclScoreSignsAContextUser) {
  std::vector<double> falling(100), flat(100, 2.0);
  for (size_t t = 0; t < falling.size(); ++t) falling[t] = 3.0 - 0.01 * static_cast<double>(t);
  const auto buckets = position_buckets(falling);
  ASSERT_EQ(buckets.size(), 7u);  // 1, 2-3, 4-7, 8-15, 16-31, 32-63, 64-100
  EXPECT_EQ(buckets[1].first, 2);
  EXPECT_EQ(buckets[1].last, 3);
  EXPECT_EQ(buckets.back().first, 64);
  EXPECT_EQ(buckets.back().last, 100);
  EXPECT_NEAR(buckets[1].loss, (falling[1] + falling[2]) / 2, 1e-12);
  EXPECT_LT(icl_score(falling), -0.7);  // ~0.95 late against ~0.10 early
  EXPECT_EQ(icl_score(flat), 0.0);
}

TEST(ModelEval, TheRecallProbeTellsACopierFromAModelThatCannotCopy) {
  const int64_t V = 64;
  const std::vector<int64_t> distances = recall_distances(64);
  ASSERT_EQ(distances, (std::vector<int64_t>{4, 8, 16, 32}));
  const auto copier = recall_probe([&](const Tensor& t) { return induction_logits(t, V); }, V,
                                   distances, 16);
  const auto uniform = recall_probe(
      [&](const Tensor& t) { return Tensor::zeros({t.size(0), t.size(1), V}); }, V, distances, 16);
  for (size_t i = 0; i < distances.size(); ++i) {
    SCOPED_TRACE(distances[i]);
    EXPECT_EQ(copier[i].accuracy, 1.0);
    EXPECT_LT(copier[i].loss, 0.01);  // 10 against V - 1 logits of 0: log(1 + 63 e^-10)
    EXPECT_NEAR(uniform[i].loss, std::log(double(V)), 1e-9);  // no information: log V
    EXPECT_LT(uniform[i].accuracy, 4.0 / V);  // argmax ties go to token 0: ~1/V of targets
    EXPECT_EQ(uniform[i].predictions, 16 * (distances[i] - 1));
  }
}

// A task's windows (MQAR) are scored on their answers alone: a model that looks each query up
// among the pairs gets every answer, one without information none (its argmax is the filler),
// the loss by window and position leaves the unscored positions out, and the paired test
// tells the two apart.
TEST(ModelEval, ATasksWindowsAreScoredOnTheirAnswersAlone) {
  MqarSettings s;
  s.val_examples = 64;
  const int64_t T = 32, V = 256, pairs = s.pairs;
  const Corpus c = mqar_corpus(s, T);
  std::vector<int32_t> x, y;
  const std::vector<int64_t> starts =
      fixed_windows(static_cast<int64_t>(c.val.size()), static_cast<int>(T), 40, 1234, T + 1);
  fill_windows(c.val, starts, static_cast<int>(T), x, y, &c.val_targets);
  // The lookup: at a query (a key after the pairs), 10 on the value beside its pair.
  const LogitsFn lookup = [&](const Tensor& tokens) {
    const std::vector<int32_t> ids = tokens.to_vector<int32_t>();
    std::vector<float> out(ids.size() * V, 0.0f);
    for (size_t w = 0; w < ids.size() / T; ++w)
      for (int64_t t = 2 * pairs; t < T; ++t)
        for (int64_t j = 0; j < 2 * pairs; j += 2)
          if (ids[w * T + t] != 0 && ids[w * T + j] == ids[w * T + t])
            out[(w * T + t) * V + ids[w * T + j + 1]] = 10;
    return Tensor::from_vector(out, {tokens.size(0), tokens.size(1), V});
  };
  const LogitsFn blank = [&](const Tensor& t) { return Tensor::zeros({t.size(0), t.size(1), V}); };
  const std::vector<LogitsFn> models{lookup, blank};
  const auto scores = score_windows(models, x, y, T, V, 8);
  EXPECT_EQ(scores[0].right, 1.0);
  EXPECT_EQ(scores[1].right, 0.0);
  EXPECT_EQ(scores[1].top1, 0.0);  // the blank model's argmax (0) is never the lookup's
  size_t scored = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    EXPECT_EQ(std::isnan(scores[0].token_loss[i]), y[i] < 0) << i;
    scored += y[i] >= 0 ? 1 : 0;
  }
  EXPECT_EQ(scored, 40u * static_cast<size_t>(pairs));
  const std::vector<double> blank_windows = window_means(scores[1].token_loss, T);
  for (const double l : blank_windows) EXPECT_NEAR(l, std::log(double(V)), 1e-9);
  EXPECT_NEAR(scored_mean(scores[1].token_loss), std::log(double(V)), 1e-9);
  // The pairs take positions 1..8 (1-based, 4 pairs): the buckets 1, 2-3 and 4-7 score nothing
  // and are left out; 8-15 holds the first query's answer (position 9). None is NaN.
  const auto buckets = position_buckets(position_means(scores[0].token_loss, T));
  ASSERT_FALSE(buckets.empty());
  EXPECT_EQ(buckets.front().first, 2 * pairs);
  for (const PositionBucket& b : buckets) EXPECT_FALSE(std::isnan(b.loss));
  EXPECT_FALSE(std::isnan(icl_score(position_means(scores[1].token_loss, T))));
  const PairedInterval d =
      paired_bootstrap(window_means(scores[0].token_loss, T), blank_windows, 500, 7);
  EXPECT_TRUE(d.excludes_zero());
  EXPECT_GT(d.mean, 5);
}

TEST(ModelEval, TheBootstrapIsSeeded) {
  Generator gen(1);
  std::vector<double> a(50), b(50);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = gen.normal();
    b[i] = a[i] + 0.1 + 0.3 * gen.normal();
  }
  const PairedInterval one = paired_bootstrap(a, b, 1000, 5), again = paired_bootstrap(a, b, 1000, 5);
  const PairedInterval other = paired_bootstrap(a, b, 1000, 6);
  EXPECT_EQ(one.lo, again.lo);
  EXPECT_EQ(one.hi, again.hi);
  EXPECT_EQ(one.mean, other.mean);
  EXPECT_NE(one.lo, other.lo);
  EXPECT_NEAR(one.lo, other.lo, 0.05);  // a little, not a lot
  EXPECT_NEAR(one.hi, other.hi, 0.05);
  EXPECT_TRUE(one.excludes_zero());
}

TEST(ModelEval, SampleDiversity) {
  const std::vector<std::vector<int32_t>> samples{{1, 2, 1, 2, 1, 2}, {3, 4, 5}};
  // bigrams: (1,2) (2,1) (1,2) (2,1) (1,2) and (3,4) (4,5): 4 distinct of 7, 3 repeated.
  EXPECT_NEAR(distinct_n(samples, 2), 4.0 / 7.0, 1e-12);
  EXPECT_NEAR(repeated_ngram_rate(samples, 2), 3.0 / 7.0, 1e-12);
  EXPECT_NEAR(distinct_n(samples, 1), 5.0 / 9.0, 1e-12);
  EXPECT_EQ(distinct_n(samples, 7), 0.0);  // no sample holds a 7-gram
}

}  // namespace
}  // namespace kvlab
