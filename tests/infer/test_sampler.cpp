#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "infer/sampler.h"
#include "platform/error.h"

namespace kvlab {
namespace {

std::vector<float> log_probs(const std::vector<double>& p) {
  std::vector<float> l;
  for (double x : p) l.push_back(static_cast<float>(std::log(x)));
  return l;
}

std::vector<float> random_logits(uint64_t seed, size_t V = 37) {
  Generator g(seed);
  std::vector<float> l(V);
  for (auto& x : l) x = static_cast<float>(2.0 * g.normal());
  return l;
}

std::set<size_t> support(const std::vector<double>& p) {
  std::set<size_t> s;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] > 0) s.insert(i);
  return s;
}

template <class F>
void expect_error(F f, const std::string& needle) {
  try {
    f();
    FAIL() << "no error, expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Sampler, ValidationNamesTheSetting) {
  auto make = [](double t, int64_t k, double p) {
    SamplingOptions o;
    o.temperature = t;
    o.top_k = k;
    o.top_p = p;
    return [o] { Sampler s(o, 0); };
  };
  expect_error(make(-0.5, 0, 1.0), "temperature must be >= 0, got -0.5");
  expect_error(make(NAN, 0, 1.0), "temperature");
  expect_error(make(1.0, -1, 1.0), "top-k must be >= 0");
  expect_error(make(1.0, -1, 1.0), "got -1");
  expect_error(make(1.0, 0, 0.0), "top-p must be in (0, 1], got 0");
  expect_error(make(1.0, 0, 1.5), "top-p must be in (0, 1], got 1.5");
  expect_error(make(1.0, 0, -0.1), "top-p");
  EXPECT_NO_THROW(make(0.0, 0, 1.0)());
  EXPECT_NO_THROW(make(1.0, 5, 0.01)());
}

// Greedy or sampled, a NaN or infinite logit anywhere is an error naming the token: argmax
// used to take token 0 from all-NaN logits, and the softmax skipped a NaN below the maximum.
TEST(Sampler, NonFiniteLogitsAreAnError) {
  for (double t : {0.0, 1.0}) {
    SamplingOptions o;
    o.temperature = t;
    for (float bad : {NAN, INFINITY, -INFINITY}) {
      std::vector<float> l = random_logits(5);
      l[7] = bad;
      SCOPED_TRACE(::testing::Message() << "temperature " << t << ", logit " << bad);
      Sampler s(o, 1);
      expect_error([&] { s.sample(l); }, "the logit of token 7 is");
      expect_error([&] { s.distribution(l); }, "not finite");
    }
  }
}

TEST(Sampler, SameSeedSameTokensAndSeedsMatter) {
  SamplingOptions o;
  o.temperature = 1.3;
  o.top_k = 20;
  o.top_p = 0.95;
  auto draw = [&](uint64_t seed) {
    Sampler s(o, seed);
    std::vector<int32_t> out;
    for (uint64_t i = 0; i < 200; ++i) out.push_back(s.sample(random_logits(i)));
    return out;
  };
  EXPECT_EQ(draw(42), draw(42));
  EXPECT_NE(draw(42), draw(43));
}

TEST(Sampler, TopKOneAndTemperatureZeroAreGreedy) {
  SamplingOptions k1;
  k1.temperature = 1.7;
  k1.top_k = 1;
  SamplingOptions t0;
  t0.temperature = 0;
  Sampler a(k1, 1), b(t0, 2);
  for (uint64_t i = 0; i < 100; ++i) {
    const auto l = random_logits(100 + i);
    const int32_t g = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    EXPECT_EQ(a.sample(l), g);
    EXPECT_EQ(b.sample(l), g);
  }
  // Ties go to the lowest id.
  EXPECT_EQ(argmax(std::vector<float>{1, 3, 3, 2}), 1);
}

TEST(Sampler, TopKKeepsTheKMostProbable) {
  SamplingOptions o;
  o.top_k = 3;
  Sampler s(o, 0);
  const auto d = s.distribution(log_probs({0.05, 0.3, 0.1, 0.25, 0.2, 0.1}));
  EXPECT_EQ(support(d), (std::set<size_t>{1, 3, 4}));
  EXPECT_NEAR(d[1], 0.3 / 0.75, 1e-6);
  EXPECT_NEAR(d[4], 0.2 / 0.75, 1e-6);
  for (int i = 0; i < 300; ++i)
    EXPECT_TRUE(support(d).count(
        static_cast<size_t>(s.sample(log_probs({0.05, 0.3, 0.1, 0.25, 0.2, 0.1})))));
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  // Sorted: 0.4 (id 1), 0.25 (id 3), 0.2 (id 0), 0.1 (id 4), 0.05 (id 2).
  const std::vector<double> p{0.2, 0.4, 0.05, 0.25, 0.1};
  auto kept = [&](double top_p) {
    SamplingOptions o;
    o.top_p = top_p;
    Sampler s(o, 0);
    return support(s.distribution(log_probs(p)));
  };
  EXPECT_EQ(kept(0.3), (std::set<size_t>{1}));         // 0.4 >= 0.3
  EXPECT_EQ(kept(0.4), (std::set<size_t>{1}));         // exactly reached
  EXPECT_EQ(kept(0.41), (std::set<size_t>{1, 3}));     // 0.65
  EXPECT_EQ(kept(0.65), (std::set<size_t>{1, 3}));     // exactly reached
  EXPECT_EQ(kept(0.66), (std::set<size_t>{1, 3, 0}));  // 0.85
  EXPECT_EQ(kept(0.9), (std::set<size_t>{1, 3, 0, 4}));
  EXPECT_EQ(kept(0.999), (std::set<size_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(kept(1.0), (std::set<size_t>{0, 1, 2, 3, 4}));
  // Renormalised over the kept set.
  SamplingOptions o;
  o.top_p = 0.6;
  Sampler s(o, 9);
  const auto d = s.distribution(log_probs(p));
  EXPECT_NEAR(d[1], 0.4 / 0.65, 1e-6);
  EXPECT_NEAR(d[3], 0.25 / 0.65, 1e-6);
  // Draws follow it: only ids 1 and 3, in about a 0.615 : 0.385 ratio.
  int ones = 0;
  const int n = 4000;
  for (int i = 0; i < n; ++i) {
    const int32_t t = s.sample(log_probs(p));
    ASSERT_TRUE(t == 1 || t == 3) << t;
    ones += t == 1;
  }
  EXPECT_NEAR(static_cast<double>(ones) / n, 0.4 / 0.65, 0.03);
}

TEST(Sampler, TemperatureSharpensAndFlattens) {
  const std::vector<double> p{0.1, 0.6, 0.3};
  SamplingOptions cold, hot;
  cold.temperature = 0.5;
  hot.temperature = 2.0;
  const auto dc = Sampler(cold, 0).distribution(log_probs(p));
  const auto dh = Sampler(hot, 0).distribution(log_probs(p));
  // p^(1/T), renormalised.
  const double zc = 0.01 + 0.36 + 0.09;
  EXPECT_NEAR(dc[1], 0.36 / zc, 1e-6);
  const double zh = std::sqrt(0.1) + std::sqrt(0.6) + std::sqrt(0.3);
  EXPECT_NEAR(dh[0], std::sqrt(0.1) / zh, 1e-6);
}

}  // namespace
}  // namespace kvlab
