// The number format table (platform/formats.h): every row's codec round-trips within its stated
// error and writes exactly the bytes the table gives it, its dot product is the dequantised
// values' one, and the subsets and look-ups agree with the rows. The rows are read from the
// table itself, so a new format is tested here from the moment it has a row (and fails until
// its error bound is stated below).
#include "platform/formats.h"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "platform/ggml_blocks.h"
#include "platform/kquant_blocks.h"
#include "platform/kv_rows.h"
#include "tests/llama_cpp_source.h"

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
      {"q5_0", 1.0 / 16 + 0x1p-9},  // as q4_0 with codes to 15 of 16
      {"q5_1", 1.0 / 31 + 0x1p-9},  // half a step of the range / 31, the f16 d and minimum
      // K-quants: half a code's step over a sub-block's range (at most 2 amax), and the 6-bit
      // (Q4_K, Q5_K) or 8-bit (Q6_K) rounding of each sub-block's scale and min.
      {"q4_k", 1.0 / 15 + 2.0 / 63},
      {"q5_k", 1.0 / 31 + 2.0 / 63},
      {"q6_k", 1.0 / 32 + 1.0 / 127},  // codes -32..31 of max / -32: the positive end errs a step
      {"q8_k", 0.5 / 127 * 1.01},
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
    for (const FormatRole r : {kTensorElement, kWeights, kKVEntries, kGgufTensor, kActivations})
      EXPECT_EQ(format_named(f.name, r), f.holds(r) ? &f : nullptr);
    if (f.holds(kGgufTensor)) {
      EXPECT_GE(f.ggml_type, 0);
    }
    if (f.ggml_type >= 0) {
      EXPECT_EQ(format_of_ggml_type(static_cast<uint32_t>(f.ggml_type)), &f);
    }
    // A tensor element holds a whole number of bytes; a block holds its scale and codes.
    EXPECT_GE(f.block_values, 0);
    EXPECT_GT(f.block_bytes, 0);
  }
  EXPECT_EQ(format_named("q4_k", kWeights), nullptr);
  EXPECT_EQ(format_of_ggml_type(16), nullptr);  // IQ2_XXS: not a row
  EXPECT_EQ(format_of_ggml_type(12), &format(Fmt::Q4_K));
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


// ---- the block formats against llama.cpp's own numpy reference ----

// gguf-py (llama.cpp's Python package, whose quants.py dequantises every ggml type in numpy),
// in llama.cpp's source; "" with why when it is missing.
std::string gguf_py_dir(std::string& why) {
  const std::filesystem::path src = test::llama_cpp_source(why);
  return src.empty() ? "" : (src / "gguf-py").string();
}

// Runs tests/platform/ggml_reference.py with `args` on `input` (written to a file), reading
// what it writes back as T. False with why when the peer is not there (its exit 77: the test
// skips); any other failure fails the test.
template <class T, class In>
bool run_reference(const std::string& args, const std::vector<In>& input, std::vector<T>& output,
                   std::string& why) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("kvlab_ggml_ref_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path in = dir / "in.bin", out = dir / "out.bin";
  std::ofstream(in, std::ios::binary)
      .write(reinterpret_cast<const char*>(input.data()),
             static_cast<std::streamsize>(input.size() * sizeof(In)));
  const std::string cmd = std::string(KVLAB_PYTHON3) + " '" + KVLAB_SOURCE_DIR +
                          "/tests/platform/ggml_reference.py' " + args + " '" + in.string() +
                          "' '" + out.string() + "'";
  const int status = std::system(cmd.c_str());
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  const bool ok = rc == 0 && fs::exists(out);
  if (rc != 0 && rc != 77) ADD_FAILURE() << cmd << " failed (exit " << rc << ")";
  if (ok) {
    output.assign(fs::file_size(out) / sizeof(T), T{});
    std::ifstream(out, std::ios::binary)
        .read(reinterpret_cast<char*>(output.data()),
              static_cast<std::streamsize>(output.size() * sizeof(T)));
  } else {
    why = "llama.cpp's reference could not run (" + cmd + ": exit " + std::to_string(rc) + ")";
  }
  fs::remove_all(dir);
  return ok;
}

// node-llama-cpp's prebuilt libggml-base.so, whose ggml_quantize_chunk llama-quantize calls.
std::string libggml_base(std::string& why) {
  const std::string lib = std::string(KVLAB_SOURCE_DIR) +
                          "/tests/infer/llama_cpp/node_modules/@node-llama-cpp/linux-x64/bins/"
                          "linux-x64/libggml-base.so";
  if (std::filesystem::exists(lib)) return lib;
  why = "node-llama-cpp's prebuilt libggml-base.so is not installed (scripts/setup.sh --tests)";
  return "";
}

// Blocks that reach every part of a block format: random bytes under finite f16 scales (every
// 6-bit scale and min, every code and high bit), an all-zero block, every scale byte at its
// largest, codes counting through every byte value, and the blocks kvlab's quantiser writes.
std::vector<uint8_t> kquant_test_blocks(const Format& f) {
  const auto bb = static_cast<size_t>(f.block_bytes);
  std::mt19937 gen(static_cast<uint32_t>(f.ggml_type) * 7919u);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(-2.0f, 2.0f);
  // Where each format keeps its f16 scales (ggml-common.h).
  const std::vector<size_t> halves = f.id == Fmt::Q6_K   ? std::vector<size_t>{208}
                                     : f.id == Fmt::Q5_0 ? std::vector<size_t>{0}
                                                         : std::vector<size_t>{0, 2};
  std::vector<uint8_t> out;
  auto add = [&](std::vector<uint8_t> b) { out.insert(out.end(), b.begin(), b.end()); };
  for (int r = 0; r < 24; ++r) {
    std::vector<uint8_t> b(bb);
    for (auto& v : b) v = static_cast<uint8_t>(byte(gen));
    for (size_t h : halves) {
      const uint16_t d = f32_to_f16(r == 0 ? 1.0f : scale(gen) * std::ldexp(1.0f, -r % 12));
      std::memcpy(b.data() + h, &d, 2);
    }
    add(b);
  }
  add(std::vector<uint8_t>(bb, 0));
  std::vector<uint8_t> max(bb, 0xFF), count(bb);
  for (size_t i = 0; i < bb; ++i) count[i] = static_cast<uint8_t>(i * 37 + 11);
  for (size_t h : halves) {
    const uint16_t one = f32_to_f16(1.0f);
    std::memcpy(max.data() + h, &one, 2);
    std::memcpy(count.data() + h, &one, 2);
  }
  add(max);
  add(count);
  const std::vector<float> x = row_of(4 * kSuperBlock, static_cast<uint32_t>(f.block_bytes));
  std::vector<uint8_t> ours(static_cast<size_t>(format_row_bytes(f, 4 * kSuperBlock)));
  f.quantise(x.data(), 4 * kSuperBlock, ours.data());
  add(ours);
  return out;
}

// The block formats and their names in ggml's (and gguf-py's) spelling.
constexpr std::pair<Fmt, const char*> kGgmlBlockTypes[] = {
    {Fmt::Q4_K, "Q4_K"}, {Fmt::Q5_K, "Q5_K"}, {Fmt::Q6_K, "Q6_K"}, {Fmt::Q8_0, "Q8_0"},
    {Fmt::Q4_0, "Q4_0"}, {Fmt::Q5_0, "Q5_0"}, {Fmt::Q5_1, "Q5_1"}};

TEST(Formats, BlockFormatsDequantiseBitForBitAsLlamaCppsNumpyReference) {
  std::string why;
  const std::string gguf_py = gguf_py_dir(why);
  if (gguf_py.empty()) GTEST_SKIP() << why;
  for (const auto& [id, type] : kGgmlBlockTypes) {
    const Format& f = format(id);
    SCOPED_TRACE(f.name);
    const std::vector<uint8_t> blocks = kquant_test_blocks(f);
    const int64_t n = static_cast<int64_t>(blocks.size()) / f.block_bytes * f.block_values;
    std::vector<float> ours(static_cast<size_t>(n)), theirs;
    f.dequantise(blocks.data(), n, ours.data());
    if (!run_reference("dequantize '" + gguf_py + "' " + type, blocks, theirs, why))
      GTEST_SKIP() << why;
    ASSERT_EQ(theirs.size(), ours.size());
    int64_t differ = 0, first = -1;
    for (int64_t i = 0; i < n; ++i)
      if (std::memcmp(&ours[static_cast<size_t>(i)], &theirs[static_cast<size_t>(i)], 4) != 0) {
        if (first < 0) first = i;
        ++differ;
      }
    const auto at = static_cast<size_t>(std::max<int64_t>(first, 0));
    EXPECT_EQ(differ, 0) << "first at value " << first << " (block " << first / f.block_values
                         << "): kvlab " << ours[at] << ", gguf-py " << theirs[at];
  }
}


// Rows that reach the quantisers' branches: normal values at three scales, zeros, a constant
// row, one spike among small values, all positive, all negative, and sub-blocks of zeros
// among values (a zero scale).
std::vector<float> quantiser_test_rows(int64_t n) {
  std::vector<float> rows;
  for (const float scale : {1e-3f, 1.0f, 300.0f}) {
    std::vector<float> r = row_of(n, static_cast<uint32_t>(scale * 1000) + 5);
    for (float& v : r) v *= scale;
    rows.insert(rows.end(), r.begin(), r.end());
  }
  rows.insert(rows.end(), static_cast<size_t>(n), 0.0f);
  rows.insert(rows.end(), static_cast<size_t>(n), 0.75f);
  std::vector<float> spike = row_of(n, 99);
  for (float& v : spike) v *= 1e-3f;
  spike[static_cast<size_t>(n / 3)] = 50.0f;
  rows.insert(rows.end(), spike.begin(), spike.end());
  std::vector<float> pos = row_of(n, 7), neg = row_of(n, 8), holes = row_of(n, 9);
  for (float& v : pos) v = std::fabs(v) + 0.5f;
  for (float& v : neg) v = -std::fabs(v) - 0.25f;
  for (int64_t i = 0; i < n; ++i)
    if (i / 32 % 3 == 1) holes[static_cast<size_t>(i)] = 0.0f;
  for (const auto* r : {&pos, &neg, &holes}) rows.insert(rows.end(), r->begin(), r->end());
  return rows;
}

TEST(Formats, BlockQuantisersWriteTheBytesLlamaQuantizeWrites) {
  std::string why;
  const std::string lib = libggml_base(why);
  if (lib.empty()) GTEST_SKIP() << why;
  constexpr int64_t kRow = 4 * kSuperBlock;
  const std::vector<float> x = quantiser_test_rows(kRow);
  const int64_t rows = static_cast<int64_t>(x.size()) / kRow;
  for (const auto& [id, type] : kGgmlBlockTypes) {
    const Format& f = format(id);
    SCOPED_TRACE(f.name);
    std::vector<uint8_t> ours(static_cast<size_t>(rows * format_row_bytes(f, kRow))), theirs;
    for (int64_t r = 0; r < rows; ++r)
      f.quantise(x.data() + r * kRow, kRow, ours.data() + r * format_row_bytes(f, kRow));
    if (!run_reference("quantize '" + lib + "' " + type + " " + std::to_string(kRow), x, theirs,
                       why))
      GTEST_SKIP() << why;
    ASSERT_EQ(theirs.size(), ours.size());
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = r * format_row_bytes(f, kRow);
      EXPECT_EQ(0, std::memcmp(ours.data() + at, theirs.data() + at,
                               static_cast<size_t>(format_row_bytes(f, kRow))))
          << "row " << r << " differs";
    }
  }
}

}  // namespace
}  // namespace kvlab

