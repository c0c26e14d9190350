// The MQAR generator: its examples are what the task says (a checker that catches planted
// faults), the same for the same seed, and the sampler reads them one whole example a window.
#include <gtest/gtest.h>

#include <set>

#include "data/mqar.h"
#include "data/sampler.h"
#include "platform/error.h"

namespace kvlab {
namespace {

constexpr int64_t kLength = 33;  // block 32

MqarSettings settings() {
  MqarSettings s;
  s.vocab = 32;
  s.pairs = 4;
  return s;
}

TEST(Mqar, ExamplesAreCorrectByConstructionAndDeterministic) {
  for (const int pairs : {1, 4, 8}) {
    MqarSettings s = settings();
    s.pairs = pairs;
    const MqarStream a = make_mqar(s, kLength, 500, 3);
    EXPECT_NO_THROW(check_mqar(s, kLength, a)) << pairs << " pairs";
    const MqarStream b = make_mqar(s, kLength, 500, 3);
    EXPECT_EQ(a.ids, b.ids);
    EXPECT_EQ(a.targets, b.targets);
    EXPECT_NE(make_mqar(s, kLength, 500, 4).ids, a.ids);
    // Every example scores exactly its pairs' answers.
    int64_t scored = 0;
    for (const int32_t t : a.targets) scored += t >= 0 ? 1 : 0;
    EXPECT_EQ(scored, 500 * pairs);
  }
}

TEST(Mqar, QueriesReachEveryDistanceAndKeysVary) {
  const MqarSettings s = settings();
  const MqarStream m = make_mqar(s, kLength, 2000, 1);
  std::set<int64_t> query_offsets;
  std::set<int32_t> first_keys;
  for (size_t e = 0; e < 2000; ++e) {
    first_keys.insert(m.ids[e * kLength]);
    for (int64_t p = 2 * s.pairs; p < kLength; ++p)
      if (m.ids[e * kLength + static_cast<size_t>(p)] != 0) query_offsets.insert(p);
  }
  EXPECT_EQ(first_keys.size(), static_cast<size_t>(s.vocab / 2 - 1));  // keys 1..15
  EXPECT_EQ(query_offsets.size(), static_cast<size_t>((kLength - 2 * s.pairs) / 2));  // each slot
}

TEST(Mqar, TheCheckerFindsPlantedFaults) {
  const MqarSettings s = settings();
  const MqarStream good = make_mqar(s, kLength, 10, 5);
  const auto expect_fault = [&](auto plant, const char* what) {
    MqarStream bad = good;
    plant(bad);
    try {
      check_mqar(s, kLength, bad);
      ADD_FAILURE() << "not caught: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  // Example 3's first query: where is it?
  const size_t base = 3 * kLength;
  size_t q = base + 2 * s.pairs;
  while (good.ids[q] == 0) ++q;
  expect_fault([&](MqarStream& m) { m.targets[q + 1] ^= 1; }, "is not its value");
  expect_fault([&](MqarStream& m) { m.ids[base + 2] = m.ids[base]; }, "repeats");
  expect_fault([&](MqarStream& m) { m.ids[base + 1] = 3; }, "value 3 is not in");
  expect_fault([&](MqarStream& m) { m.targets[base + 2 * s.pairs] = 20; }, "is scored");
  expect_fault([&](MqarStream& m) { m.ids[q] = 0; m.targets[q + 1] = -1; }, "keys are queried");
  expect_fault([&](MqarStream& m) { m.ids.pop_back(); }, "whole examples");
}

TEST(Mqar, SettingsThatCannotHoldTheTaskAreRefused) {
  MqarSettings s = settings();
  EXPECT_THROW(make_mqar(s, 4 * s.pairs, 1, 0), Error);  // no room for the queries
  s.pairs = s.vocab / 2;                                  // more pairs than distinct keys
  EXPECT_THROW(s.validate(1000), Error);
  s = settings();
  s.vocab = 300;  // past the byte-level vocabulary
  EXPECT_THROW(s.validate(kLength), Error);
}

TEST(Mqar, TheCorpusWindowsAreWholeExamplesScoredOnTheAnswers) {
  const MqarSettings s = settings();
  const Corpus c = mqar_corpus(s, kLength - 1);
  ASSERT_EQ(c.example_tokens, kLength);
  ASSERT_EQ(c.train.size(), static_cast<size_t>(s.train_examples * kLength));
  EXPECT_NE(c.train, c.val);
  BatchSampler sampler(c.train, 16, static_cast<int>(kLength - 1), 9, &c.train_targets, kLength);
  std::vector<int32_t> x, y;
  for (int batch = 0; batch < 20; ++batch) {
    sampler.next(x, y);
    for (size_t w = 0; w < 16; ++w) {
      // A window is one example: its pairs first, every answer's key just before it.
      const int32_t* xs = x.data() + w * (kLength - 1);
      const int32_t* ys = y.data() + w * (kLength - 1);
      EXPECT_GE(xs[0], 1);
      EXPECT_LT(xs[0], s.vocab / 2);
      int answers = 0;
      for (int64_t t = 0; t < kLength - 1; ++t)
        if (ys[t] >= 0) {
          ++answers;
          EXPECT_GE(ys[t], s.vocab / 2);
          EXPECT_EQ(xs[t] == 0, false) << "an answer's input is its query's key";
        }
      EXPECT_EQ(answers, s.pairs);
    }
  }
  const std::vector<int64_t> starts =
      fixed_windows(static_cast<int64_t>(c.val.size()), static_cast<int>(kLength - 1), 50, 1234,
                    kLength);
  for (const int64_t st : starts) EXPECT_EQ(st % kLength, 0);
}

}  // namespace
}  // namespace kvlab
