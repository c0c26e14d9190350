// Quantised KV-cache rows (platform/kv_rows.h): each format's round
// trip within its bound, adversarial rows, the row kernel that reads them in place against
// the same rows widened, and the caches' bytes against the formula.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "autograd/backend/cpu/decode_kernels.h"
#include "infer/block_manager.h"
#include "infer/kv_cache.h"
#include "infer/paged_kv_cache.h"
#include "platform/error.h"
#include "platform/kv_rows.h"
#include "platform/kv_rows.h"
#include "platform/random.h"

namespace kvlab {
namespace {

constexpr DType kQuantised[] = {DType::FP8, DType::INT8, DType::INT4};

std::vector<float> normal_row(Generator& gen, int64_t n, double sd) {
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = static_cast<float>(gen.normal() * sd);
  return x;
}

std::vector<float> round_trip(DType t, const std::vector<float>& x, float fp8_scale) {
  const auto HS = static_cast<int64_t>(x.size());
  std::vector<uint8_t> row(static_cast<size_t>(kv_row_bytes(t, HS)), 0xAB);
  EXPECT_TRUE(quantise_kv_row(t, row.data(), x.data(), HS, fp8_scale));
  std::vector<float> y(x.size());
  dequantise_kv_row(t, y.data(), row.data(), HS, fp8_scale);
  return y;
}

// The largest error each format allows on x: int8 half a step of amax / 127; int4 half a step
// of its group's range / 15, plus the bf16 rounding of the group's scale and minimum; fp8 half
// an E4M3 step of each value (2^-4 of it) or, below its normal range, half of 2^-9 times the
// scale.
double bound(DType t, const std::vector<float>& x, int64_t i, float fp8_scale) {
  const auto HS = static_cast<int64_t>(x.size());
  if (t == DType::FP8)
    return std::max(std::fabs(x[static_cast<size_t>(i)]) / 16.0,
                    double(std::ldexp(fp8_scale, -10))) *
           1.0001;
  if (t == DType::INT8) {
    double amax = 0;
    for (float v : x) amax = std::max(amax, double(std::fabs(v)));
    return amax / 254.0 * 1.0001 + 1e-38;
  }
  const int64_t G = kv_int4_group(HS), g = i / G;
  double lo = x[static_cast<size_t>(g * G)], hi = lo, big = 0;
  for (int64_t j = g * G; j < (g + 1) * G; ++j) {
    lo = std::min(lo, double(x[static_cast<size_t>(j)]));
    hi = std::max(hi, double(x[static_cast<size_t>(j)]));
    big = std::max(big, std::fabs(double(x[static_cast<size_t>(j)])));
  }
  return (hi - lo) / 30.0 * 1.01 + big * std::ldexp(1.0, -7) + 1e-38;
}

TEST(KVQuant, RoundTripWithinEachFormatsBound) {
  Generator gen(3);
  for (const DType t : kQuantised)
    for (const int64_t HS : {8, 16, 32, 64, 96})
      for (const double sd : {1e-3, 1.0, 40.0})
        for (int rep = 0; rep < 20; ++rep) {
          const std::vector<float> x = normal_row(gen, HS, sd);
          const auto scale = static_cast<float>(6 * sd / kFp8Max);
          const std::vector<float> y = round_trip(t, x, scale);
          for (int64_t i = 0; i < HS; ++i)
            ASSERT_LE(std::fabs(y[i] - x[i]), bound(t, x, i, scale))
                << dtype_name(t) << " HS " << HS << " sd " << sd << " i " << i << " x " << x[i];
        }
}

TEST(KVQuant, AdversarialRows) {
  for (const DType t : kQuantised) {
    // All zeros come back exactly.
    const std::vector<float> zeros(32, 0.0f);
    EXPECT_EQ(round_trip(t, zeros, 1.0f), zeros) << dtype_name(t);
    // One huge outlier: it survives, and the rest stay within the bound it sets.
    std::vector<float> outlier(32, 0.25f);
    outlier[7] = -3e30f;
    const float big_scale = 3e30f / kFp8Max;
    const std::vector<float> y = round_trip(t, outlier, big_scale);
    for (int64_t i = 0; i < 32; ++i)
      EXPECT_LE(std::fabs(y[i] - outlier[i]), bound(t, outlier, i, big_scale))
          << dtype_name(t) << " i " << i;
    EXPECT_LT(y[7], -2e30f);
    // Denormals: within an absolute bound far below anything a model computes.
    std::vector<float> tiny(32);
    for (int64_t i = 0; i < 32; ++i) tiny[i] = std::ldexp(float(i % 7) - 3.0f, -140);
    const std::vector<float> z = round_trip(t, tiny, 1e-38f);
    for (int64_t i = 0; i < 32; ++i) EXPECT_LE(std::fabs(z[i] - tiny[i]), 1e-38) << dtype_name(t);
    // Infinities and NaNs are refused, and the row is left zeroed, not half written.
    for (const float bad : {std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()}) {
      std::vector<float> x(32, 1.0f);
      x[5] = bad;
      std::vector<uint8_t> row(static_cast<size_t>(kv_row_bytes(t, 32)), 0xAB);
      EXPECT_FALSE(quantise_kv_row(t, row.data(), x.data(), 32, 1.0f)) << dtype_name(t);
      EXPECT_EQ(row, std::vector<uint8_t>(row.size(), 0)) << dtype_name(t);
    }
  }
}

// Every E4M3 byte but the NaNs encodes back to itself; values past 448 saturate.
TEST(KVQuant, Fp8EncodesEveryE4M3ValueToItself) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;  // NaN: never stored
    const auto code = static_cast<uint8_t>(b);
    EXPECT_EQ(fp8_encode(fp8_value(code)), code) << b;
  }
  EXPECT_EQ(fp8_value(0x7E), 448.0f);
  EXPECT_EQ(fp8_value(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_encode(1e9f), 0x7E);
  EXPECT_EQ(fp8_encode(-1e9f), 0xFE);
  // Ties go to even: 1 + 1/16 lies halfway between 1 and 1 + 1/8.
  EXPECT_EQ(fp8_value(fp8_encode(1.0f + 1.0f / 16)), 1.0f);
  EXPECT_EQ(fp8_value(fp8_encode(1.0f + 3.0f / 16)), 1.25f);
}

// The row kernel reads quantised rows in place; the same rows widened to f32 and attended by
// the f32 kernel give the same output within f32 rounding, contiguous and through a block
// table, for head sizes with and without a whole number of vectors.
TEST(KVQuant, RowKernelEqualsTheWidenedRows) {
  Generator gen(11);
  for (const DType t : kQuantised)
    for (const int64_t HS : {16, 32, 64, 24}) {
      if (t == DType::INT4 && HS % 2 != 0) continue;
      const int64_t n = 45, rb = kv_row_bytes(t, HS), block = 8;
      std::vector<uint8_t> k(static_cast<size_t>(n * rb)), v(k.size());
      std::vector<float> kw(static_cast<size_t>(n * HS)), vw(kw.size());
      const cpu::KVQuant fmt{t, 0.05f, 0.02f};
      for (int64_t j = 0; j < n; ++j) {
        for (auto [rows, wide, s] : {std::tuple{&k, &kw, fmt.k_scale}, std::tuple{&v, &vw, fmt.v_scale}}) {
          const std::vector<float> x = normal_row(gen, HS, 3.0);
          ASSERT_TRUE(quantise_kv_row(t, rows->data() + j * rb, x.data(), HS, s));
          dequantise_kv_row(t, wide->data() + j * HS, rows->data() + j * rb, HS, s);
        }
      }
      const std::vector<float> q = normal_row(gen, HS, 1.0);
      const float scale = 1.0f / std::sqrt(float(HS));
      std::vector<float> want(static_cast<size_t>(HS)), got(want.size()), p(static_cast<size_t>(n));
      cpu::attend_one_query<float>(want.data(), q.data(), kw.data(), HS, vw.data(), HS, n, HS,
                                   scale, p.data());
      double mag = 0;
      for (float w : want) mag = std::max(mag, double(std::fabs(w)));
      // Where the build has row kernels, a head size of whole AVX-512 (and so AVX2) vectors
      // takes them; others may fall back (the caller then widens the rows).
      const bool must_run = cpu::packed_weight_bytes(WeightDtype::F32, 1, 1) > 0 && HS % 16 == 0;
      const bool ran = cpu::attend_one_query_kernel(got.data(), q.data(), k.data(), rb, v.data(),
                                                    rb, n, HS, scale, p.data(), fmt);
      EXPECT_TRUE(ran || !must_run) << dtype_name(t) << " HS " << HS;
      if (ran) {
        for (int64_t i = 0; i < HS; ++i)
          EXPECT_NEAR(got[i], want[i], 1e-5 * mag) << dtype_name(t) << " HS " << HS;
      }
      // Through a block table: the rows scattered over blocks in reverse order.
      const int64_t blocks = (n + block - 1) / block;
      std::vector<uint8_t> kp(static_cast<size_t>(blocks * block * rb)), vp(kp.size());
      std::vector<int32_t> table(static_cast<size_t>(blocks));
      for (int64_t b = 0; b < blocks; ++b) table[b] = static_cast<int32_t>(blocks - 1 - b);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = (table[j / block] * block + j % block) * rb;
        std::copy_n(k.data() + j * rb, rb, kp.data() + at);
        std::copy_n(v.data() + j * rb, rb, vp.data() + at);
      }
      const cpu::BlockRows<uint8_t> kr{kp.data(), table.data(), 3, block * rb, rb};
      const cpu::BlockRows<uint8_t> vr{vp.data(), table.data(), 3, block * rb, rb};
      std::fill(got.begin(), got.end(), 0.0f);
      const bool ran_paged =
          cpu::attend_one_query_kernel(got.data(), q.data(), kr, vr, n, HS, scale, p.data(), fmt);
      EXPECT_EQ(ran_paged, ran) << dtype_name(t) << " HS " << HS;
      if (ran_paged) {
        for (int64_t i = 0; i < HS; ++i)
          EXPECT_NEAR(got[i], want[i], 1e-5 * mag) << dtype_name(t) << " HS " << HS << " paged";
      }
    }
}

// Measured allocations equal the formula (scales included) for every dtype and n_kv_head, in
// both caches.
TEST(KVQuant, MeasuredBytesEqualTheFormula) {
  const int64_t L = 3, HS = 32, S = 64, B = 2;
  for (const DType t : {DType::F32, DType::BF16, DType::FP8, DType::INT8, DType::INT4})
    for (const int64_t nkv : {8, 2, 1}) {
      std::vector<float> scales(t == DType::FP8 ? 2 * L * nkv : 0, 0.1f);
      const ContiguousKVCache c(L, B, S, nkv, HS, t, Device::CPU, scales);
      EXPECT_EQ(c.bytes(), kv_cache_formula_bytes(L, B, S, nkv, HS, t)) << dtype_name(t);
      BlockManager blocks(2 * S / 16, 16, 0, false);
      PagedKVCache p(blocks, L, nkv, HS, S, t, B, scales);
      std::vector<int32_t> tokens(static_cast<size_t>(B * 20), 1);
      p.prepare(tokens);  // 20 positions a row: 2 blocks each
      EXPECT_EQ(p.bytes(), kv_cache_formula_bytes(L, B, 32, nkv, HS, t)) << dtype_name(t);
    }
  // The per-token bytes of the default ablation's head size, 16: f32 64, bf16 32, fp8 16,
  // int8 16 + its scale, int4 8 + a group's scale and minimum.
  EXPECT_EQ(kv_row_bytes(DType::F32, 16), 64);
  EXPECT_EQ(kv_row_bytes(DType::BF16, 16), 32);
  EXPECT_EQ(kv_row_bytes(DType::FP8, 16), 16);
  EXPECT_EQ(kv_row_bytes(DType::INT8, 16), 20);
  EXPECT_EQ(kv_row_bytes(DType::INT4, 16), 12);
  EXPECT_EQ(kv_row_bytes(DType::INT4, 64), 40);  // two groups of 32
}

TEST(KVQuant, CachesRefuseWhatTheyCannotHold) {
  EXPECT_THROW(ContiguousKVCache(2, 1, 8, 2, 7, DType::INT4), Error);  // odd head size
  EXPECT_THROW(ContiguousKVCache(2, 1, 8, 2, 8, DType::FP8), Error);   // no scales
  EXPECT_THROW(ContiguousKVCache(2, 1, 8, 2, 8, DType::INT8, Device::CPU, {1, 1}), Error);
  // A non-finite key is refused where it is stored, naming it; the cache does not advance.
  ContiguousKVCache c(2, 1, 8, 2, 8, DType::INT8);
  Tensor k = Tensor::full({1, 2, 3, 8}, 1.0);
  k.data<float>()[2 * 8 + 5] = std::numeric_limits<float>::quiet_NaN();  // head 0, position 2
  try {
    c.append(1, k, Tensor::full({1, 2, 3, 8}, 1.0));
    FAIL() << "a NaN key was stored";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 1, row 0, KV head 0, position 2"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("infinite or NaN"), std::string::npos) << e.what();
  }
  EXPECT_EQ(c.lengths()[0], 0);
}

}  // namespace
}  // namespace kvlab
