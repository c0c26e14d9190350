// ggml's q8_0 and q4_0 blocks (platform/ggml_blocks.h) on blocks worked by hand, and the
// idempotence the decode step's packing relies on to tell their values apart.
#include "platform/ggml_blocks.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace kvlab {
namespace {

using Block = std::array<float, kGgmlBlock>;

TEST(GgmlBlocks, Q4ZeroScaleComesFromTheLargestMagnitudeWithItsSign) {
  Block x{};
  x[0] = 2.0f;
  x[1] = -4.0f;  // the largest magnitude: d = -4 / -8 = 0.5, its code 0
  x[2] = 1.0f;
  x[17] = 0.5f;
  x[18] = 3.9f;  // 3.9 * 2 + 8.5 = 16.3: clamped to 15
  std::array<uint8_t, 16> qs{};
  const uint16_t d = quantise_q4_0(x.data(), qs.data());
  EXPECT_EQ(f16_to_f32(d), 0.5f);
  EXPECT_EQ(qs[0], 12 | (8 << 4));   // x[0] 2 -> 12, x[16] 0 -> 8
  EXPECT_EQ(qs[1], 0 | (9 << 4));    // x[1] -4 -> 0, x[17] 0.5 -> 9
  EXPECT_EQ(qs[2], 10 | (15 << 4));  // x[2] 1 -> 10, x[18] 3.9 -> 15
  Block back{};
  dequantise_q4_0(d, qs.data(), back.data());
  EXPECT_EQ(back[0], 2.0f);
  EXPECT_EQ(back[1], -4.0f);
  EXPECT_EQ(back[17], 0.5f);
  EXPECT_EQ(back[18], 3.5f);  // (15 - 8) * 0.5
  // A positive largest value gives a negative scale, and the value itself is code 0.
  x[1] = 4.0f;
  x[18] = -3.9f;
  const uint16_t d2 = quantise_q4_0(x.data(), qs.data());
  EXPECT_EQ(f16_to_f32(d2), -0.5f);
  dequantise_q4_0(d2, qs.data(), back.data());
  EXPECT_EQ(back[1], 4.0f);
  EXPECT_EQ(back[18], -3.5f);
}

TEST(GgmlBlocks, Q8ZeroScaleIsTheLargestMagnitudeOver127) {
  Block x{};
  x[3] = -2.54f;  // d = 0.02 (in f16), code -127
  x[4] = 0.03f;   // 1.5: rounds away from zero to 2
  x[5] = -0.01f;  // -0.5: to -1
  std::array<int8_t, kGgmlBlock> q{};
  const uint16_t d = quantise_q8_0(x.data(), q.data());
  EXPECT_EQ(d, f32_to_f16(2.54f / 127.0f));
  EXPECT_EQ(q[3], -127);
  EXPECT_EQ(q[4], 2);
  EXPECT_EQ(q[5], -1);
  EXPECT_EQ(q[0], 0);
  Block back{};
  dequantise_q8_0(d, q.data(), back.data());
  EXPECT_EQ(back[4], 2.0f * f16_to_f32(d));
}

// Rounding twice is rounding once, so a model's rounded matrices (or a file's dequantised
// ones) are recognised, and other values are not.
TEST(GgmlBlocks, RoundingIsIdempotentAndRecognised) {
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> x(64 * kGgmlBlock);
  for (float& v : x) v = normal(gen);
  std::fill_n(x.begin() + 5 * kGgmlBlock, kGgmlBlock, 0.0f);  // an all-zero block
  x[7 * kGgmlBlock + 3] = 1e-7f;  // a block whose scale is an f16 subnormal
  // A block whose scale underflows to a zero f16 (max |x| below 127 * 2^-25 for q8_0, 8 *
  // 2^-25 for q4_0) while its codes are not zero: rounding must still reach a fixed point.
  for (int64_t j = 0; j < kGgmlBlock; ++j) x[9 * kGgmlBlock + j] = 1e-8f * normal(gen);
  // A block holding a NaN: never exact, and rounding leaves it as it is.
  x[11 * kGgmlBlock + 5] = std::numeric_limits<float>::quiet_NaN();
  for (auto [round, exact] : {std::pair{&round_to_q8_0, &exact_q8_0},
                              std::pair{&round_to_q4_0, &exact_q4_0}}) {
    std::vector<float> y = x;
    EXPECT_FALSE(exact(y.data(), static_cast<int64_t>(y.size())));
    round(y.data(), static_cast<int64_t>(y.size()));
    EXPECT_TRUE(std::isnan(y[11 * kGgmlBlock + 5]));
    EXPECT_FALSE(exact(y.data(), static_cast<int64_t>(y.size())));  // the NaN's block
    std::fill_n(y.begin() + 11 * kGgmlBlock, kGgmlBlock, 0.0f);
    round(y.data(), static_cast<int64_t>(y.size()));
    const std::vector<float> once = y;
    EXPECT_TRUE(exact(y.data(), static_cast<int64_t>(y.size())));
    round(y.data(), static_cast<int64_t>(y.size()));
    EXPECT_EQ(std::memcmp(y.data(), once.data(), y.size() * sizeof(float)), 0);
    y[100] = std::nextafter(y[100], 1.0f);  // one value off its grid
    EXPECT_FALSE(exact(y.data(), static_cast<int64_t>(y.size())));
  }
  // q4_0's values are q8_0's only by chance: the 4-bit grid's scale is max / -8.
  std::vector<float> y = x;
  y[11 * kGgmlBlock + 5] = 0.0f;
  round_to_q4_0(y.data(), static_cast<int64_t>(y.size()));
  EXPECT_FALSE(exact_q8_0(y.data(), static_cast<int64_t>(y.size())));
}

}  // namespace
}  // namespace kvlab
