// backend/cpu/gemm.cpp: products against a packed weight, which must equal gemm's one-row
// path bit for bit, row by row, whatever the number of rows (the fused decode step relies on
// it to match the op path at batch 1, and on a row's result not depending on the others);
// from the bf16, q8_0 and q4_0 forms, on the weight rounded to the form's values. The integer
// products of the q8_0 and q4_0 forms (gemm_packed_int8) against integer sums. gemm at a few
// rows of A, and the decode attention of one query, against the same in double.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/backend/kernels.h"
#include "platform/ggml_blocks.h"
#include "platform/random.h"
#include "platform/scalar_codecs.h"

namespace kvlab {
namespace {

std::vector<float> random_floats(int64_t n, Generator& gen) {
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(gen.normal());
  return v;
}

// Bits, so that -0 and 0 or two NaNs are told apart from each other.
std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
  return b;
}

// A case's name: "n<N>_k<K>_m<M>" of its ((N, K), M).
std::string shape_name(
    const ::testing::TestParamInfo<std::tuple<std::pair<int64_t, int64_t>, int64_t>>& info) {
  std::string name = "n";  // not "n" + ...: GCC 12's -Wrestrict
  name += std::to_string(std::get<0>(info.param).first);
  name += "_k";
  name += std::to_string(std::get<0>(info.param).second);
  name += "_m";
  name += std::to_string(std::get<1>(info.param));
  return name;
}

// (N, K, M): whole blocks, a short last block of rows, K with and without a 16-column tail,
// and for the bf16 form's pairs of chunks: K = 40 ends on a lone short chunk, 48 on a lone
// whole one, 56 on a whole and a short one, 17 within one pair; one row, one column; 1 to 7
// rows of a (whole tiles of three rows, and the last tile of one or two).
class GemmPacked
    : public ::testing::TestWithParam<std::tuple<std::pair<int64_t, int64_t>, int64_t>> {
 protected:
  // gemm_packed against w packed in `form` (into a buffer poisoned first with 0xff bytes, NaN
  // in every form: padding read as anything but zero would show in the sums) equals the
  // one-row gemm on `w_exact`, bit for bit, on every range of rows.
  void check(WeightDtype form, const std::vector<float>& w, const std::vector<float>& w_exact) {
    const auto [NK, M] = GetParam();
    const auto [N, K] = NK;
    Generator gen(static_cast<uint64_t>((N * 1000 + K) * 10 + M));
    // a and y at strides wider than their rows, as the decode step's (B, C) slices can be; a
    // ends with its last row, and the gaps between its rows hold NaN: a read past a row's K
    // columns (the 16-column tail) would poison the sums.
    const int64_t lda = K + 3, ldy = N + 5;
    std::vector<float> a = random_floats((M - 1) * lda + K, gen);
    for (int64_t m = 0; m + 1 < M; ++m)
      std::fill_n(a.begin() + m * lda + K, lda - K, std::numeric_limits<float>::quiet_NaN());
    const std::vector<float> y0 = random_floats(M * ldy, gen);
    std::vector<char> packed(static_cast<size_t>(cpu::packed_weight_bytes(form, N, K)), '\xff');
    cpu::pack_weight(form, packed.data(), w.data(), N, K);
    // Ranges that start and end inside 8-row blocks, as the threads' shares of q/k/v do.
    const std::vector<std::pair<int64_t, int64_t>> ranges = {
        {0, N}, {0, N / 2}, {N / 2, N}, {N / 3, N - N / 3}, {N - 1, N}};
    for (const auto& [n0, n1] : ranges)
      for (const float beta : {0.0f, 1.0f}) {
        std::vector<float> expect = y0, got = y0;
        for (int64_t m = 0; m < M && n1 > n0; ++m)
          cpu::gemm<float>(false, true, 1, n1 - n0, K, 1.0f, a.data() + m * lda, lda,
                           w_exact.data() + n0 * K, K, beta, expect.data() + m * ldy + n0, ldy);
        cpu::gemm_packed(form, got.data(), ldy, a.data(), lda, packed.data(), M, K, n0, n1, beta);
        EXPECT_EQ(bits(got), bits(expect)) << "rows [" << n0 << ", " << n1 << "), beta " << beta;
      }
  }
  // The weight of this shape, and it rounded by `round` (the values the form holds).
  template <class Round>
  void check_rounded(WeightDtype form, Round round) {
    const auto [N, K] = std::get<0>(GetParam());
    if (cpu::packed_weight_bytes(WeightDtype::F32, N, K) == 0)
      GTEST_SKIP() << "no packed kernel in this build";
    const bool whole_blocks = K % kGgmlBlock == 0;
    if (form == WeightDtype::Q8_0 || form == WeightDtype::Q4_0) {
      // The block forms hold only whole blocks of 32 columns, and say so.
      ASSERT_EQ(cpu::packed_weight_bytes(form, N, K) > 0, whole_blocks);
      if (!whole_blocks) return;
    }
    Generator gen(static_cast<uint64_t>(N * 1000 + K));
    const std::vector<float> w = random_floats(N * K, gen);
    std::vector<float> rounded = w;
    round(rounded);
    if (form != WeightDtype::F32) {
      ASSERT_NE(bits(rounded), bits(w));  // the packing must round: the sums would differ
    }
    check(form, w, rounded);
  }
};

TEST_P(GemmPacked, EqualsTheOneRowGemmRowByRowOnEveryRange) {
  check_rounded(WeightDtype::F32, [](std::vector<float>&) {});
}

TEST_P(GemmPacked, Bf16FormEqualsTheOneRowGemmOnTheRoundedWeight) {
  check_rounded(WeightDtype::BF16, [](std::vector<float>& w) {
    for (float& x : w) x = bf16_to_f32(f32_to_bf16(x));
  });
}

// The block forms quantise as ggml does (platform/ggml_blocks.h) and widen each value exactly,
// so their products are the one-row gemm's on the dequantised weight, bit for bit.
TEST_P(GemmPacked, Q8FormEqualsTheOneRowGemmOnTheDequantisedWeight) {
  check_rounded(WeightDtype::Q8_0, [](std::vector<float>& w) {
    round_to_q8_0(w.data(), static_cast<int64_t>(w.size()));
  });
}

TEST_P(GemmPacked, Q4FormEqualsTheOneRowGemmOnTheDequantisedWeight) {
  check_rounded(WeightDtype::Q4_0, [](std::vector<float>& w) {
    round_to_q4_0(w.data(), static_cast<int64_t>(w.size()));
  });
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmPacked,
    ::testing::Combine(
        ::testing::Values(std::pair<int64_t, int64_t>{64, 256}, std::pair<int64_t, int64_t>{67, 64},
                          std::pair<int64_t, int64_t>{13, 40}, std::pair<int64_t, int64_t>{8, 17},
                          std::pair<int64_t, int64_t>{1, 5}, std::pair<int64_t, int64_t>{9, 1},
                          std::pair<int64_t, int64_t>{100, 1024},
                          std::pair<int64_t, int64_t>{24, 48}, std::pair<int64_t, int64_t>{13, 56},
                          std::pair<int64_t, int64_t>{5, 32}),
        ::testing::Values(1, 2, 3, 5, 7)),
    shape_name);

// ---- integer products (gemm_packed_int8) ----

// Activations round as llama.cpp's x86 path rounds them: d = max|x| / 127 to f16, codes
// x * 127 / max|x| to the nearest integer, ties to even; a block of zeros gives zeros.
TEST(Q8Activations, RoundToQ8BlocksAsLlamaCppDoes) {
  std::vector<float> x(96, 0.0f);
  // Block 0: max|x| = 127, so the codes are x rounded (2.5 -> 2, 3.5 -> 4, -0.5 -> 0).
  const float b0[6] = {127, 2.5f, 3.5f, -0.5f, -126.4f, 1.5f};
  std::copy(b0, b0 + 6, x.begin());
  // Block 1: max|x| = 16: x * 7.9375 (1 -> 8, 2 -> 16, -16 -> -127, 3 -> 23.8 -> 24).
  const float b1[4] = {1, 2, -16, 3};
  std::copy(b1, b1 + 4, x.begin() + 32);
  // Block 2: zeros.
  std::vector<int8_t> codes(96, 99);
  std::vector<float> scales(3, -1);
  if (cpu::packed_weight_bytes(WeightDtype::Q8_0, 8, 32) == 0)
    GTEST_SKIP() << "no packed kernel in this build";
  cpu::quantise_q8_activations(x.data(), 96, codes.data(), scales.data());
  const int8_t c0[6] = {127, 2, 4, 0, -126, 2};
  for (int j = 0; j < 6; ++j) EXPECT_EQ(codes[j], c0[j]) << "block 0, column " << j;
  const int8_t c1[4] = {8, 16, -127, 24};
  for (int j = 0; j < 4; ++j) EXPECT_EQ(codes[32 + j], c1[j]) << "block 1, column " << j;
  for (int j = 6; j < 32; ++j) EXPECT_EQ(codes[j], 0);
  for (int j = 64; j < 96; ++j) EXPECT_EQ(codes[j], 0);
  EXPECT_EQ(scales[0], 1.0f);
  EXPECT_EQ(scales[1], f16_to_f32(f32_to_f16(16.0f / 127.0f)));
  EXPECT_NE(scales[1], 16.0f / 127.0f);  // rounded to f16
  EXPECT_EQ(scales[2], 0.0f);
  // A block holding NaN or an infinity: a NaN scale (carried into every product) and codes
  // within range; one so small that 127 / max|x| overflows: finite codes, its f16 scale 0.
  std::fill(x.begin(), x.end(), 1.0f);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[40] = -std::numeric_limits<float>::infinity();
  std::fill(x.begin() + 64, x.end(), 1e-39f);
  cpu::quantise_q8_activations(x.data(), 96, codes.data(), scales.data());
  EXPECT_TRUE(std::isnan(scales[0]));
  EXPECT_TRUE(std::isnan(scales[1]));
  EXPECT_EQ(scales[2], 0.0f);
  for (int j = 0; j < 96; ++j) EXPECT_GE(codes[j], -127) << j;
}

// gemm_packed_int8 against the integer products in double: a's rows rounded by
// quantise_q8_activations, w's blocks by ggml's quantiser, each block's dot of codes exact.
class GemmPackedInt8
    : public ::testing::TestWithParam<std::tuple<std::pair<int64_t, int64_t>, int64_t>> {
 protected:
  struct Reference {
    std::vector<double> y;     // the products
    std::vector<double> size;  // each product's sum of |code products| times their scales
  };
  // Row m of a against row n of w, block by block (w_codes as -8..7 or -127..127).
  static Reference reference(const std::vector<float>& a, const std::vector<float>& w, int64_t M,
                             int64_t N, int64_t K, bool nibbles) {
    const int64_t blocks = K / kGgmlBlock;
    std::vector<int8_t> ac(static_cast<size_t>(M * K)), wc(static_cast<size_t>(N * K));
    std::vector<float> as(static_cast<size_t>(M * blocks)), ws(static_cast<size_t>(N * blocks));
    for (int64_t m = 0; m < M; ++m)
      cpu::quantise_q8_activations(a.data() + m * K, K, ac.data() + m * K, as.data() + m * blocks);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t p = 0; p < blocks; ++p) {
        const float* x = w.data() + n * K + p * kGgmlBlock;
        int8_t* c = wc.data() + n * K + p * kGgmlBlock;
        uint16_t d;
        if (nibbles) {
          uint8_t qs[16];
          d = quantise_q4_0(x, qs);
          for (int j = 0; j < 16; ++j) {
            c[j] = static_cast<int8_t>((qs[j] & 15) - 8);
            c[j + 16] = static_cast<int8_t>((qs[j] >> 4) - 8);
          }
        } else {
          d = quantise_q8_0(x, c);
        }
        ws[static_cast<size_t>(n * blocks + p)] = f16_to_f32(d);
      }
    Reference r{std::vector<double>(static_cast<size_t>(M * N)),
                std::vector<double>(static_cast<size_t>(M * N))};
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t p = 0; p < blocks; ++p) {
          int64_t dot = 0, size = 0;
          for (int64_t j = p * kGgmlBlock; j < (p + 1) * kGgmlBlock; ++j) {
            const int64_t t = int64_t{ac[static_cast<size_t>(m * K + j)]} *
                              wc[static_cast<size_t>(n * K + j)];
            dot += t;
            size += t < 0 ? -t : t;
          }
          const double scale = static_cast<double>(as[static_cast<size_t>(m * blocks + p)]) *
                               ws[static_cast<size_t>(n * blocks + p)];
          r.y[static_cast<size_t>(m * N + n)] += scale * static_cast<double>(dot);
          r.size[static_cast<size_t>(m * N + n)] += std::fabs(scale) * static_cast<double>(size);
        }
    return r;
  }
  // gemm_packed_int8 (into y0 at stride N + 5, on every range of rows, beta 0 and 1) within
  // `rel` of each product's sum of |terms| (0: exactly the reference rounded once to f32), and
  // each row of a alone giving the same bits as among the others.
  void check(WeightDtype form, const std::vector<float>& w, const std::vector<float>& a,
             double rel) {
    const auto [NK, M] = GetParam();
    const auto [N, K] = NK;
    const bool nibbles = form == WeightDtype::Q4_0;
    const Reference ref = reference(a, w, M, N, K, nibbles);
    std::vector<char> packed(static_cast<size_t>(cpu::packed_weight_bytes(form, N, K)), '\xff');
    cpu::pack_weight(form, packed.data(), w.data(), N, K);
    Generator gen(static_cast<uint64_t>(N + K + M));
    const int64_t ldy = N + 5;
    const std::vector<float> y0 = random_floats(M * ldy, gen);
    const std::vector<std::pair<int64_t, int64_t>> ranges = {
        {0, N}, {0, N / 2}, {N / 2, N}, {N / 3, N - N / 3}, {N - 1, N}};
    for (const auto& [n0, n1] : ranges)
      for (const float beta : {0.0f, 1.0f}) {
        std::vector<float> got = y0;
        cpu::gemm_packed_int8(form, got.data(), ldy, a.data(), K, packed.data(), M, K, n0, n1, beta);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < ldy; ++n) {
            const size_t at = static_cast<size_t>(m * ldy + n);
            if (n < n0 || n >= n1) {
              ASSERT_EQ(bits({got[at]}), bits({y0[at]})) << "wrote outside its rows at " << n;
              continue;
            }
            const size_t r = static_cast<size_t>(m * N + n);
            const double expect = ref.y[r] + (beta != 0.0f ? static_cast<double>(y0[at]) : 0.0);
            if (rel == 0) {
              ASSERT_EQ(got[at], static_cast<float>(expect)) << "row " << m << ", column " << n;
            } else {
              ASSERT_NEAR(got[at], expect, rel * ref.size[r] + 0x1p-23 * std::fabs(expect))
                  << "row " << m << ", column " << n << ", beta " << beta;
            }
          }
        for (int64_t m = 0; m < M; ++m) {  // alone
          std::vector<float> one(y0.begin() + m * ldy, y0.begin() + (m + 1) * ldy);
          cpu::gemm_packed_int8(form, one.data(), ldy, a.data() + m * K, K, packed.data(), 1, K,
                                n0, n1, beta);
          ASSERT_EQ(bits(one), bits(std::vector<float>(got.begin() + m * ldy,
                                                       got.begin() + (m + 1) * ldy)))
              << "row " << m << " alone";
        }
      }
  }
  // Whether this build has the packed kernels (else the test skips).
  bool applies() const {
    const auto [N, K] = std::get<0>(GetParam());
    return cpu::packed_weight_bytes(WeightDtype::Q8_0, N, K) > 0;
  }
  // Values code * 2^-e, each block's first of the largest magnitude (-8 for q4_0, +-127
  // else), so that the scale is 2^-e exactly; e by row.
  static std::vector<float> power_of_two_blocks(int64_t rows, int64_t K, bool nibbles,
                                                Generator& gen) {
    std::vector<float> v(static_cast<size_t>(rows * K));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < K; ++j) {
        const double unit = std::ldexp(1.0, -static_cast<int>(r % 3));
        int code = nibbles ? static_cast<int>(gen.below(16)) - 8 : static_cast<int>(gen.below(255)) - 127;
        if (j % kGgmlBlock == 0) code = nibbles ? -8 : (r % 2 == 0 ? 127 : -127);
        v[static_cast<size_t>(r * K + j)] = static_cast<float>(code * unit);
      }
    return v;
  }
};

// Scales that are powers of two make every term and every partial sum exact in f32 (the
// integer dots are at most 32 * 127 * 128 a block): the kernel must give the reference's
// bits, so an integer product off by one fails.
TEST_P(GemmPackedInt8, IntegerProductsAreExactOnPowerOfTwoScales) {
  if (!applies()) GTEST_SKIP() << "no packed kernel in this build";
  const auto [N, K] = std::get<0>(GetParam());
  const int64_t M = std::get<1>(GetParam());
  for (const WeightDtype form : {WeightDtype::Q8_0, WeightDtype::Q4_0}) {
    Generator gen(static_cast<uint64_t>(N * 7 + K + M));
    const bool nibbles = form == WeightDtype::Q4_0;
    check(form, power_of_two_blocks(N, K, nibbles, gen), power_of_two_blocks(M, K, false, gen), 0);
  }
}

// Random weights and activations: each product within (blocks + 16) f32 roundings of the sum
// of its code products' magnitudes, scaled (any split of a block's dot into lanes stays within
// it): a term's scale product, its fused add, the lanes' final sums.
TEST_P(GemmPackedInt8, ScaledSumsAreWithinTheirBoundOnRandomBlocks) {
  if (!applies()) GTEST_SKIP() << "no packed kernel in this build";
  const auto [N, K] = std::get<0>(GetParam());
  const int64_t M = std::get<1>(GetParam());
  Generator gen(static_cast<uint64_t>(N * 5 + K + M));
  const std::vector<float> w = random_floats(N * K, gen), a = random_floats(M * K, gen);
  const double rel = static_cast<double>(K / kGgmlBlock + 16) * 0x1p-24;
  check(WeightDtype::Q8_0, w, a, rel);
  check(WeightDtype::Q4_0, w, a, rel);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmPackedInt8,
    ::testing::Combine(
        ::testing::Values(std::pair<int64_t, int64_t>{64, 256}, std::pair<int64_t, int64_t>{67, 64},
                          std::pair<int64_t, int64_t>{13, 96}, std::pair<int64_t, int64_t>{100, 1024},
                          std::pair<int64_t, int64_t>{5, 32}),
        ::testing::Values(1, 2, 5)),
    shape_name);

// gemm<float> at a few rows of A (the row kernels: attention's q k^T and p v over the cache at
// decode, a Linear at a small batch) and past them (the BLAS) equals the product in double,
// for both forms of B, with alpha and beta, on operands at strides wider than their rows whose
// gaps hold NaN (a read past a row would poison the sums), over shapes with short last blocks
// of 8 rows and chunks of 16 columns, and large enough at (M, 1000, 100) for the threads to
// split the work.
class GemmFewRows
    : public ::testing::TestWithParam<std::tuple<int64_t, std::pair<int64_t, int64_t>, bool>> {};

TEST_P(GemmFewRows, EqualsTheProductInDouble) {
  const auto [M, NK, tb] = GetParam();
  const auto [N, K] = NK;
  Generator gen(static_cast<uint64_t>(M * 100000 + N * 100 + K));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // A (M, K) at stride lda; B as (N, K) when tb, else (K, N), at stride ldb; C (M, N) at ldc.
  const int64_t lda = K + 3, ldb = (tb ? K : N) + 5, ldc = N + 2, b_rows = tb ? N : K;
  auto strided = [&](int64_t rows, int64_t cols, int64_t ld) {
    std::vector<float> v = random_floats((rows - 1) * ld + cols, gen);
    for (int64_t r = 0; r + 1 < rows; ++r) std::fill_n(v.begin() + r * ld + cols, ld - cols, nan);
    return v;
  };
  const std::vector<float> a = strided(M, K, lda), b = strided(b_rows, tb ? K : N, ldb);
  const std::vector<float> c0 = strided(M, N, ldc);
  for (const auto& [alpha, beta] : {std::pair{1.0f, 0.0f}, std::pair{0.5f, 1.0f}}) {
    std::vector<float> c = c0;
    cpu::gemm<float>(false, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double sum = 0, scale = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double term = double(a[i * lda + k]) * (tb ? b[j * ldb + k] : b[k * ldb + j]);
          sum += term;
          scale += std::fabs(term);
        }
        const double expect = alpha * sum + (beta == 0.0f ? 0.0 : beta * c0[i * ldc + j]);
        ASSERT_NEAR(c[i * ldc + j], expect, 1e-6 * (scale + std::fabs(c0[i * ldc + j])) + 1e-6)
            << "row " << i << ", column " << j << ", alpha " << alpha << ", beta " << beta;
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmFewRows,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8, 9),
                                            ::testing::Values(std::pair<int64_t, int64_t>{144, 32},
                                                              std::pair<int64_t, int64_t>{32, 144},
                                                              std::pair<int64_t, int64_t>{13, 17},
                                                              std::pair<int64_t, int64_t>{7, 64},
                                                              std::pair<int64_t, int64_t>{40, 128},
                                                              std::pair<int64_t, int64_t>{1000,
                                                                                          100}),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           std::string name = "m";
                           name += std::to_string(std::get<0>(info.param));
                           name += "_n";
                           name += std::to_string(std::get<1>(info.param).first);
                           name += "_k";
                           name += std::to_string(std::get<1>(info.param).second);
                           name += std::get<2>(info.param) ? "_bt" : "_b";
                           return name;
                         });

// attend_one_query (decode attention of one query) equals softmax(scale q k^T) v in double, on
// both sides of its row kernel's reach (HS up to 128 with AVX-512, 64 with AVX2; 160 and the
// double form take gemm's products), with rows of K and V at strides wider than HS whose gaps
// hold NaN, key counts around the kernel's blocks of 8, and nothing written past out's HS.
class AttendOneQuery : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(AttendOneQuery, EqualsSoftmaxAttentionInDouble) {
  const auto [HS, n] = GetParam();
  Generator gen(static_cast<uint64_t>(HS * 1000 + n));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t kst = HS + 3, vst = HS + 7;
  auto rows = [&](int64_t st) {
    std::vector<float> m = random_floats((n - 1) * st + HS, gen);
    for (int64_t r = 0; r + 1 < n; ++r) std::fill_n(m.begin() + r * st + HS, st - HS, nan);
    return m;
  };
  const std::vector<float> q = random_floats(HS, gen), k = rows(kst), v = rows(vst);
  const double scale = 1.0 / std::sqrt(double(HS));
  std::vector<double> p(static_cast<size_t>(n)), expect(static_cast<size_t>(HS), 0.0);
  double top = -1e300, total = 0;
  for (int64_t j = 0; j < n; ++j) {
    double dot = 0;
    for (int64_t d = 0; d < HS; ++d) dot += double(q[d]) * k[j * kst + d];
    p[j] = scale * dot;
    top = std::max(top, p[j]);
  }
  for (double& x : p) total += x = std::exp(x - top);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < HS; ++d) expect[d] += p[j] / total * v[j * vst + d];
  std::vector<float> out(static_cast<size_t>(HS + 16), 7.0f), work(static_cast<size_t>(n));
  cpu::attend_one_query<float>(out.data(), q.data(), k.data(), kst, v.data(), vst, n, HS,
                               static_cast<float>(scale), work.data());
  for (int64_t d = 0; d < HS; ++d) ASSERT_NEAR(out[d], expect[d], 2e-5) << "column " << d;
  for (int64_t d = HS; d < HS + 16; ++d) ASSERT_EQ(out[d], 7.0f) << "written past HS at " << d;
  // The double form (gradient checks): gemm's products.
  const std::vector<double> qd(q.begin(), q.end()), kd(k.begin(), k.end()), vd(v.begin(), v.end());
  std::vector<double> outd(static_cast<size_t>(HS)), workd(static_cast<size_t>(n));
  cpu::attend_one_query<double>(outd.data(), qd.data(), kd.data(), kst, vd.data(), vst, n, HS,
                                scale, workd.data());
  for (int64_t d = 0; d < HS; ++d) ASSERT_NEAR(outd[d], expect[d], 1e-12) << "column " << d;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttendOneQuery,
                         ::testing::Combine(::testing::Values(8, 20, 32, 48, 64, 100, 128, 160),
                                            ::testing::Values(1, 7, 8, 9, 144, 513)),
                         [](const auto& info) {
                           return "hs" + std::to_string(std::get<0>(info.param)) + "_n" +
                                  std::to_string(std::get<1>(info.param));
                         });

// all_bf16 (which matrices the decode step packs in bf16) sees a single f32 value anywhere,
// in the first chunk it scans, a later one or a short last one.
TEST(AllBf16, FindsTheOneValueThatIsNotBf16) {
  Generator gen(7);
  std::vector<float> v = random_floats(2500, gen);
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  EXPECT_TRUE(all_bf16(v.data(), static_cast<int64_t>(v.size())));
  EXPECT_TRUE(all_bf16(v.data(), 0));
  for (const size_t i : {size_t{0}, size_t{1500}, size_t{2499}}) {
    std::vector<float> w = v;
    w[i] = std::nextafter(w[i], 1e9f);  // one ulp of f32 off a bf16 value
    EXPECT_FALSE(all_bf16(w.data(), static_cast<int64_t>(w.size()))) << "at " << i;
  }
}

}  // namespace
}  // namespace kvlab
