// backend/cpu/gemm.cpp: products against a packed weight, which must equal gemm's one-row
// path bit for bit, row by row, whatever the number of rows (the fused decode step relies on
// it to match the op path at batch 1, and on a row's result not depending on the others);
// from the bf16, q8_0 and q4_0 forms, on the weight rounded to the form's values. gemm at a few rows of A, and the decode
// attention of one query, against the same in double.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "autograd/backend/cpu/bf16.h"
#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/backend/kernels.h"
#include "platform/ggml_blocks.h"
#include "platform/random.h"

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
  void check(cpu::PackedForm form, const std::vector<float>& w, const std::vector<float>& w_exact) {
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
  void check_rounded(cpu::PackedForm form, Round round) {
    const auto [N, K] = std::get<0>(GetParam());
    if (cpu::packed_weight_bytes(cpu::PackedForm::F32, N, K) == 0)
      GTEST_SKIP() << "no packed kernel in this build";
    const bool whole_blocks = K % kGgmlBlock == 0;
    if (form == cpu::PackedForm::Q8_0 || form == cpu::PackedForm::Q4_0) {
      // The block forms hold only whole blocks of 32 columns, and say so.
      ASSERT_EQ(cpu::packed_weight_bytes(form, N, K) > 0, whole_blocks);
      if (!whole_blocks) return;
    }
    Generator gen(static_cast<uint64_t>(N * 1000 + K));
    const std::vector<float> w = random_floats(N * K, gen);
    std::vector<float> rounded = w;
    round(rounded);
    if (form != cpu::PackedForm::F32) {
      ASSERT_NE(bits(rounded), bits(w));  // the packing must round: the sums would differ
    }
    check(form, w, rounded);
  }
};

TEST_P(GemmPacked, EqualsTheOneRowGemmRowByRowOnEveryRange) {
  check_rounded(cpu::PackedForm::F32, [](std::vector<float>&) {});
}

TEST_P(GemmPacked, Bf16FormEqualsTheOneRowGemmOnTheRoundedWeight) {
  check_rounded(cpu::PackedForm::BF16, [](std::vector<float>& w) {
    for (float& x : w) x = cpu::bf16_to_f32(cpu::f32_to_bf16(x));
  });
}

// The block forms quantise as ggml does (platform/ggml_blocks.h) and widen each value exactly,
// so their products are the one-row gemm's on the dequantised weight, bit for bit.
TEST_P(GemmPacked, Q8FormEqualsTheOneRowGemmOnTheDequantisedWeight) {
  check_rounded(cpu::PackedForm::Q8_0, [](std::vector<float>& w) {
    round_to_q8_0(w.data(), static_cast<int64_t>(w.size()));
  });
}

TEST_P(GemmPacked, Q4FormEqualsTheOneRowGemmOnTheDequantisedWeight) {
  check_rounded(cpu::PackedForm::Q4_0, [](std::vector<float>& w) {
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
    [](const auto& info) {
      std::string name = "n";  // not "n" + ...: GCC 12's -Wrestrict
      name += std::to_string(std::get<0>(info.param).first);
      name += "_k";
      name += std::to_string(std::get<0>(info.param).second);
      name += "_m";
      name += std::to_string(std::get<1>(info.param));
      return name;
    });

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
  for (float& x : v) x = cpu::bf16_to_f32(cpu::f32_to_bf16(x));
  EXPECT_TRUE(cpu::all_bf16(v.data(), static_cast<int64_t>(v.size())));
  EXPECT_TRUE(cpu::all_bf16(v.data(), 0));
  for (const size_t i : {size_t{0}, size_t{1500}, size_t{2499}}) {
    std::vector<float> w = v;
    w[i] = std::nextafter(w[i], 1e9f);  // one ulp of f32 off a bf16 value
    EXPECT_FALSE(cpu::all_bf16(w.data(), static_cast<int64_t>(w.size()))) << "at " << i;
  }
}

}  // namespace
}  // namespace kvlab
