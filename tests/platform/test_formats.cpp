// The number format table (platform/formats.h): every row's codec round-trips within its stated
// error and writes exactly the bytes the table gives it, its dot product is the dequantised
// values' one, and the subsets and look-ups agree with the rows. The rows are read from the
// table itself, so a new format is tested here from the moment it has a row (and fails until
// its error bound is stated below).
#include "platform/formats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "platform/ggml_blocks.h"
#include "platform/kv_rows.h"

namespace kvlab {
namespace {

// The largest error a format may make on a row whose largest magnitude is amax, each from the
// format's definition: its rounding step at amax (relative formats), half a code's step
// (scaled codes, whose f16/bf16 scales add their own rounding), or none.
double error_bound(const std::string& name, double amax) {
  static const std::map<std::string, double> relative = {
      {"f32", 0.0},
      {"f64", 0.0},
      {"bf16", 0x1p-8},          // 8 bits of significand, nearest
      {"f16", 0x1p-11},          // 11 bits
      {"fp8", 0x1p-4},           // E4M3: 4 bits, nearest (normals at these magnitudes)
      {"int8", 0.5 / 127 * 1.01},  // half of amax / 127
      {"q8_0", 0.5 / 127 + 0x1p-10},  // and the f16 scale's rounding over 127 codes
      {"int4", 0.5 / 15 + 0x1p-4},  // half of the range / 15, and the bf16 scale and minimum
      {"q4_0", 1.0 / 8 + 0x1p-9},   // the largest code is 7, not 8: its end of the range errs d
  };
  if (name == "i32") return 0.5;  // ids: rounded to the nearest integer
  const auto it = relative.find(name);
  if (it == relative.end()) {
    ADD_FAILURE() << "format " << name << " has no error bound in this test: state it";
    return 0.0;
  }
  return it->second * amax;
}

std::vector<float> row_of(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.5f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = dist(gen);
  return x;
}

// A row's length each format takes: whole blocks; int4's rows pack two channels a byte.
std::vector<int64_t> lengths_for(const Format& f) {
  if (f.block_values > 1) return {f.block_values, 4 * f.block_values};
  return {2, 6, 64, 96};
}

TEST(Formats, EveryRowRoundTripsWithinItsErrorInExactlyItsBytes) {
  for (const Format& f : formats()) {
    for (const int64_t n : lengths_for(f)) {
      SCOPED_TRACE(std::string(f.name) + ", " + std::to_string(n) + " values");
      const std::vector<float> x = row_of(n, static_cast<uint32_t>(n) * 131 + format_id(f.id));
      const int64_t bytes = format_row_bytes(f, n);
      ASSERT_GT(bytes, 0);
      // Guard bytes past the row: the codec writes its bytes and no more.
      std::vector<uint8_t> buf(static_cast<size_t>(bytes) + 16, 0xA5);
      f.quantise(x.data(), n, buf.data());
      for (size_t i = static_cast<size_t>(bytes); i < buf.size(); ++i)
        ASSERT_EQ(buf[i], 0xA5) << "wrote past its " << bytes << " bytes";
      std::vector<float> back(static_cast<size_t>(n));
      f.dequantise(buf.data(), n, back.data());
      double amax = 0.0;
      for (float v : x) amax = std::max(amax, std::fabs(static_cast<double>(v)));
      const double bound = error_bound(f.name, amax);
      double sum = 0.0;
      for (size_t i = 0; i < x.size(); ++i) {
        EXPECT_LE(std::fabs(static_cast<double>(back[i]) - x[i]), bound) << "value " << i;
        sum += static_cast<double>(back[i]) * x[i];
      }
      // The dot entry point is the dequantised row's product, summed in f32 (in order: up to
      // the compiler's contraction of each product into its sum).
      EXPECT_NEAR(f.dot(buf.data(), x.data(), n), sum, 1e-5 * (1.0 + std::fabs(sum)));
    }
  }
}

TEST(Formats, RowsAreIndexedByTheirIdsAndFoundByNameAndGgufId) {
  for (const Format& f : formats()) {
    SCOPED_TRACE(f.name);
    EXPECT_EQ(&format(f.id), &f);
    for (const FormatRole r : {kTensorElement, kWeights, kKVEntries, kGgufTensor})
      EXPECT_EQ(format_named(f.name, r), f.holds(r) ? &f : nullptr);
    EXPECT_EQ(f.holds(kGgufTensor), f.ggml_type >= 0);
    if (f.ggml_type >= 0) {
      EXPECT_EQ(format_of_ggml_type(static_cast<uint32_t>(f.ggml_type)), &f);
    }
    // A tensor element holds a whole number of bytes; a block holds its scale and codes.
    EXPECT_GE(f.block_values, 0);
    EXPECT_GT(f.block_bytes, 0);
  }
  EXPECT_EQ(format_named("q4_k", kWeights), nullptr);
  EXPECT_EQ(format_of_ggml_type(12), nullptr);  // Q4_K: not a row yet
}

// The subsets name their rows, and their names and sizes are the table's.
TEST(Formats, SubsetsAreTheirRows) {
  EXPECT_STREQ(dtype_name(DType::INT4), "int4");
  EXPECT_EQ(dtype_size(DType::F64), 8u);
  EXPECT_EQ(dtype_size(DType::INT8), 1u);  // a tensor of int8 rows holds their bytes
  EXPECT_STREQ(weight_dtype_name(WeightDtype::Q4_0), "q4_0");
  EXPECT_EQ(format_of(WeightDtype::Q8_0).id, Fmt::Q8_0);
  EXPECT_EQ(subset_member<WeightDtype>(format(Fmt::BF16)), WeightDtype::BF16);
  EXPECT_EQ(format_name_list(kKVEntries),
            (std::vector<std::string>{"f32", "bf16", "fp8", "int8", "int4"}));
  EXPECT_EQ(format_name_list(kWeights), (std::vector<std::string>{"f32", "bf16", "q8_0", "q4_0"}));
  // The KV rows' layouts are the table's.
  for (const DType t : {DType::F32, DType::BF16, DType::FP8, DType::INT8, DType::INT4})
    EXPECT_EQ(kv_row_bytes(t, 64), format_row_bytes(format_of(t), 64));
  EXPECT_EQ(kv_row_bytes(DType::INT4, 64), 4 * 2 + 32);
  EXPECT_EQ(kv_row_bytes(DType::INT8, 64), 4 + 64);
}

// The table's q8_0/q4_0 entry points are ggml's block codecs laid out as a GGUF file's blocks.
TEST(Formats, BlockRowsAreGgmlsBlocksInFileOrder) {
  const std::vector<float> x = row_of(64, 7);
  for (const Fmt id : {Fmt::Q8_0, Fmt::Q4_0}) {
    const Format& f = format(id);
    std::vector<uint8_t> row(static_cast<size_t>(format_row_bytes(f, 64)));
    f.quantise(x.data(), 64, row.data());
    for (int64_t b = 0; b < 2; ++b) {
      uint8_t codes[32];
      const uint16_t d = id == Fmt::Q8_0
                             ? quantise_q8_0(x.data() + 32 * b, reinterpret_cast<int8_t*>(codes))
                             : quantise_q4_0(x.data() + 32 * b, codes);
      const uint8_t* block = row.data() + b * f.block_bytes;
      uint16_t stored;
      std::memcpy(&stored, block, 2);
      EXPECT_EQ(stored, d) << f.name << " block " << b;
      EXPECT_EQ(std::memcmp(block + 2, codes, static_cast<size_t>(f.block_bytes - 2)), 0)
          << f.name << " block " << b;
    }
  }
}

}  // namespace
}  // namespace kvlab
