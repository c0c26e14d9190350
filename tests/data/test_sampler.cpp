#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <set>
#include <type_traits>

#include "data/sampler.h"
#include "tests/data/data_test_util.h"

namespace kvlab {
namespace {

using testing::error_message;
using ::testing::HasSubstr;

static_assert(!std::is_constructible_v<BatchSampler, std::vector<int32_t>&&, int, int, uint64_t>,
              "a sampler over a temporary would dangle");

std::vector<int32_t> iota_ids(size_t n) {
  std::vector<int32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  return ids;
}

std::vector<std::vector<int32_t>> draw(BatchSampler& s, int batches) {
  std::vector<std::vector<int32_t>> out;
  std::vector<int32_t> x, y;  // (B, T)
  for (int i = 0; i < batches; ++i) {
    s.next(x, y);
    out.push_back(x);
    out.push_back(y);
  }
  return out;
}

TEST(Sampler, SameSeedSameBatchesOtherSeedOthers) {
  const std::vector<int32_t> ids = iota_ids(1000);
  BatchSampler a(ids, 4, 8, 42), b(ids, 4, 8, 42), c(ids, 4, 8, 43);
  const auto batches_a = draw(a, 5);
  EXPECT_EQ(batches_a, draw(b, 5));
  EXPECT_NE(batches_a, draw(c, 5));
}

TEST(Sampler, WindowsAreContiguousAndTargetsShiftedByOne) {
  const int B = 3, T = 5;
  const std::vector<int32_t> ids = iota_ids(T + 3);  // three possible starts: 0, 1, 2
  BatchSampler s(ids, B, T, 1);
  std::vector<int32_t> x, y;  // (B, T)
  std::set<int32_t> starts;
  for (int i = 0; i < 100; ++i) {
    s.next(x, y);
    ASSERT_EQ(x.size(), size_t{B * T});
    ASSERT_EQ(y.size(), size_t{B * T});
    for (int b = 0; b < B; ++b) {
      const int32_t start = x[b * T];
      starts.insert(start);
      for (int t = 0; t < T; ++t) {
        ASSERT_EQ(x[b * T + t], start + t);
        ASSERT_EQ(y[b * T + t], start + t + 1);
      }
    }
  }
  EXPECT_EQ(starts, (std::set<int32_t>{0, 1, 2}));  // every start, up to the last, and no other
}

TEST(Sampler, RestoredStateReproducesTheContinuation) {
  const std::vector<int32_t> ids = iota_ids(500);
  BatchSampler s(ids, 2, 16, 9);
  draw(s, 3);
  const Generator::State saved = s.state();
  const auto continuation = draw(s, 4);

  BatchSampler resumed(ids, 2, 16, 12345);
  EXPECT_NE(draw(resumed, 4), continuation);
  resumed.set_state(saved);
  EXPECT_EQ(resumed.state(), saved);
  EXPECT_EQ(draw(resumed, 4), continuation);
}

TEST(Sampler, RejectsBadSizes) {
  const std::vector<int32_t> ids = iota_ids(8);
  EXPECT_NO_THROW(BatchSampler(ids, 1, 7, 0));
  EXPECT_THAT(error_message([&] { BatchSampler(ids, 1, 8, 0); }),
              HasSubstr("8 tokens are too few for block_size 8 (need at least 9)"));
  EXPECT_THAT(error_message([&] { BatchSampler(ids, 0, 4, 0); }), HasSubstr("batch_size"));
  EXPECT_THAT(error_message([&] { BatchSampler(ids, 2, 0, 0); }), HasSubstr("block_size"));
}

TEST(Sampler, FixedWindowsAreDeterministicAndInRange) {
  const int64_t n = 300;
  const int T = 32;
  const std::vector<int64_t> w = fixed_windows(n, T, 200);
  ASSERT_EQ(w.size(), 200u);
  EXPECT_EQ(fixed_windows(n, T, 200), w);
  EXPECT_EQ(fixed_windows(n, T, 200, 1234), w);  // the default seed
  EXPECT_NE(fixed_windows(n, T, 200, 99), w);
  for (const int64_t s : w) {
    ASSERT_GE(s, 0);
    ASSERT_LE(s, n - T - 1);
  }
  EXPECT_GT(std::set<int64_t>(w.begin(), w.end()).size(), 100u);  // spread out
  EXPECT_EQ(fixed_windows(T + 1, T, 5), std::vector<int64_t>(5, 0));
  EXPECT_TRUE(fixed_windows(n, T, 0).empty());
  EXPECT_THAT(error_message([&] { fixed_windows(T, T, 1); }), HasSubstr("too few"));
}

TEST(Sampler, FillWindowsGathersStarts) {
  const std::vector<int32_t> ids = iota_ids(50);
  const int T = 4;
  const std::vector<int64_t> starts = {0, 45, 17};
  std::vector<int32_t> x, y;  // (3, T)
  fill_windows(ids, starts, T, x, y);
  EXPECT_EQ(x, (std::vector<int32_t>{0, 1, 2, 3, 45, 46, 47, 48, 17, 18, 19, 20}));
  EXPECT_EQ(y, (std::vector<int32_t>{1, 2, 3, 4, 46, 47, 48, 49, 18, 19, 20, 21}));

  const std::vector<int64_t> past_end = {46};
  EXPECT_THAT(error_message([&] { fill_windows(ids, past_end, T, x, y); }),
              HasSubstr("window start 46 is outside [0, 45]"));
  const std::vector<int64_t> negative = {-1};
  EXPECT_THAT(error_message([&] { fill_windows(ids, negative, T, x, y); }),
              HasSubstr("window start -1"));
}

}  // namespace
}  // namespace kvlab
