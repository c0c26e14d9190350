// The GGUF format alone (checkpoints/gguf.h): values and tensors of every type survive a write
// and a read; f16, q8_0 and q4_0 round as IEEE and ggml define; and damaged or hostile bytes (cut
// short, flipped, absurd counts, lengths, shapes and offsets) end in a kvlab::Error naming the
// field, never in a signal, another exception or an allocation the file cannot justify.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "checkpoints/gguf.h"
#include "platform/error.h"
#include "platform/ggml_blocks.h"
#include "platform/random.h"
#include "tests/error_of.h"

namespace kvlab {
namespace {

// ggml's block sizes (ggml-common.h): a q8_0 block is its f16 scale and 32 int8 codes, a q4_0
// block its f16 scale and 16 bytes of 4-bit codes.
constexpr size_t kQ8BlockBytes = 34;
constexpr size_t kQ4BlockBytes = 18;

ArrayF32 ramp(std::vector<int64_t> shape, float scale) {
  ArrayF32 a{shape, {}};
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  for (int64_t i = 0; i < n; ++i) a.data.push_back(scale * std::sin(0.37f * static_cast<float>(i)));
  return a;
}

// A small file holding every value type and every tensor type.
GgufFile sample_file() {
  GgufFile f;
  f.set("general.architecture", GgufValue::string("llama"));
  f.set("u8", GgufValue::scalar(GgufType::U8, 200));
  f.set("i8", GgufValue::scalar(GgufType::I8, -100));
  f.set("u16", GgufValue::scalar(GgufType::U16, 60000));
  f.set("i16", GgufValue::scalar(GgufType::I16, -30000));
  f.set("u32", GgufValue::scalar(GgufType::U32, 4000000000));
  f.set("i32", GgufValue::scalar(GgufType::I32, -2000000000));
  f.set("u64", GgufValue::scalar(GgufType::U64, int64_t{1} << 40));
  f.set("i64", GgufValue::scalar(GgufType::I64, -(int64_t{1} << 40)));
  f.set("bool", GgufValue::scalar(GgufType::Bool, 1));
  f.set("f32", GgufValue::real(GgufType::F32, 0.5));
  f.set("f64", GgufValue::real(GgufType::F64, 1e-300));
  f.set("ints", GgufValue::int_array(GgufType::I32, {1, -2, 3}));
  f.set("strings", GgufValue::string_array({"a", "", "\xc4\xa0x"}));
  f.tensors.push_back(make_gguf_tensor("a.f32", ramp({3, 5}, 1.0f), GgmlType::F32));
  f.tensors.push_back(make_gguf_tensor("b.f16", ramp({2, 7}, 3.0f), GgmlType::F16));
  f.tensors.push_back(make_gguf_tensor("c.bf16", ramp({9}, 2.0f), GgmlType::BF16));
  f.tensors.push_back(make_gguf_tensor("d.q8_0", ramp({2, 64}, 0.5f), GgmlType::Q8_0));
  f.tensors.push_back(make_gguf_tensor("e.q4_0", ramp({3, 32}, 0.5f), GgmlType::Q4_0));
  f.tensors.push_back(make_gguf_tensor("f.q5_0", ramp({2, 32}, 0.5f), GgmlType::Q5_0));
  f.tensors.push_back(make_gguf_tensor("g.q5_1", ramp({2, 32}, 0.5f), GgmlType::Q5_1));
  f.tensors.push_back(make_gguf_tensor("h.q4_k", ramp({2, 256}, 0.25f), GgmlType::Q4_K));
  f.tensors.push_back(make_gguf_tensor("i.q5_k", ramp({1, 256}, 0.25f), GgmlType::Q5_K));
  f.tensors.push_back(make_gguf_tensor("j.q6_k", ramp({1, 256}, 0.25f), GgmlType::Q6_K));
  return f;
}

TEST(GgufFormat, EveryValueAndTensorTypeRoundTrips) {
  const GgufFile f = sample_file();
  const std::string bytes = serialize_gguf(f);
  const GgufFile g = parse_gguf(bytes, "sample");
  ASSERT_EQ(g.metadata.size(), f.metadata.size());
  for (size_t i = 0; i < f.metadata.size(); ++i) {
    const auto& [k, v] = f.metadata[i];
    EXPECT_EQ(g.metadata[i].first, k);
    const GgufValue& w = g.metadata[i].second;
    EXPECT_EQ(w.type, v.type) << k;
    EXPECT_EQ(w.elem, v.elem) << k;
    EXPECT_EQ(w.ints, v.ints) << k;
    EXPECT_EQ(w.strings, v.strings) << k;
    ASSERT_EQ(w.floats.size(), v.floats.size()) << k;
    for (size_t j = 0; j < v.floats.size(); ++j)
      EXPECT_EQ(w.floats[j], v.elem == GgufType::F32 ? static_cast<float>(v.floats[j]) : v.floats[j]);
  }
  ASSERT_EQ(g.tensors.size(), f.tensors.size());
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    EXPECT_EQ(g.tensors[i].name, f.tensors[i].name);
    EXPECT_EQ(g.tensors[i].dims, f.tensors[i].dims);
    EXPECT_EQ(g.tensors[i].type, f.tensors[i].type);
    EXPECT_EQ(g.tensors[i].data, f.tensors[i].data);
  }
  EXPECT_EQ(g.get_int("u32", "t"), 4000000000);
  EXPECT_EQ(g.get_string("general.architecture", "t"), "llama");
  EXPECT_NE(error_of([&] { g.get_int("general.architecture", "t"); }).find("not an integer"),
            std::string::npos);
  EXPECT_NE(error_of([&] { g.get_float("nothing", "t"); }).find("nothing is missing"),
            std::string::npos);
}

TEST(GgufFormat, TensorsLieAtAlignedOffsets) {
  GgufFile f = sample_file();
  f.alignment = 64;
  f.set("general.alignment", GgufValue::scalar(GgufType::U32, 64));
  const std::string bytes = serialize_gguf(f);
  const GgufFile g = parse_gguf(bytes, "aligned");
  EXPECT_EQ(g.alignment, 64u);
  for (const GgufTensor& t : f.tensors) {
    const size_t at = bytes.find(t.data);
    ASSERT_NE(at, std::string::npos) << t.name;
    EXPECT_EQ(at % 64, 0u) << t.name;
  }
  EXPECT_EQ(bytes.size() % 64, 0u);
}

TEST(GgufFormat, F16RoundsToNearestEven) {
  // Every half survives f16 -> f32 -> f16 (NaNs stay NaNs).
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
    } else {
      ASSERT_EQ(f32_to_f16(f), h) << h;
    }
  }
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // a tie: to even (down)
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // a tie: to even (up)
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);                            // 65504, the largest
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);                            // rounds past: inf
  EXPECT_EQ(f32_to_f16(-1e10f), 0xfc00);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);               // half the smallest: even
  EXPECT_EQ(f32_to_f16(3 * std::ldexp(1.0f, -26)), 0x0001);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
}

TEST(GgufFormat, Q8BlocksAreScaleThenCodes) {
  ArrayF32 a = ramp({1, 64}, 2.0f);
  a.data[5] = -2.5f;  // block 0's largest magnitude
  std::fill(a.data.begin() + 32, a.data.end(), 0.0f);  // block 1: zeros
  const GgufTensor t = make_gguf_tensor("q", a, GgmlType::Q8_0);
  ASSERT_EQ(t.data.size(), 2u * kQ8BlockBytes);
  uint16_t d0;
  std::memcpy(&d0, t.data.data(), 2);
  EXPECT_EQ(d0, f32_to_f16(2.5f / 127.0f));
  EXPECT_EQ(static_cast<int8_t>(t.data[2 + 5]), -127);
  const ArrayF32 back = gguf_tensor_values(t);
  const float d = f16_to_f32(d0);
  for (int i = 0; i < 32; ++i)
    EXPECT_LE(std::fabs(back.data[i] - a.data[i]), 0.5f * d + 2e-3f * std::fabs(a.data[i])) << i;
  for (int i = 32; i < 64; ++i) EXPECT_EQ(back.data[i], 0.0f);
  EXPECT_NE(error_of([] { make_gguf_tensor("r", ramp({2, 40}, 1.0f), GgmlType::Q8_0); })
                .find("whole blocks"),
            std::string::npos);
}

// A block worked by hand: the scale max / -8 of the value of largest magnitude (the first such),
// then 16 bytes, byte j holding value j's code in its low nibble and value j + 16's in its high.
TEST(GgufFormat, Q4BlocksAreScaleThenNibbles) {
  ArrayF32 a{{1, 64}, std::vector<float>(64, 0.0f)};
  // Block 0: codes c_j = j and c_{j+16} = 15 - j on the grid of d = -4 / -8 = 0.5 (value
  // (c - 8) d); value 0 is -4, the largest magnitude, so byte j = j | (15 - j) << 4.
  for (int j = 0; j < 16; ++j) {
    a.data[j] = 0.5f * static_cast<float>(j - 8);
    a.data[j + 16] = 0.5f * static_cast<float>(7 - j);
  }
  // Block 1: the largest magnitude positive, so the scale is negative: d = 2 / -8 = -0.25;
  // 2 is code 0, -1.75 code 15, 0 code 8.
  a.data[32 + 3] = 2.0f;
  a.data[32 + 16 + 4] = -1.75f;
  const GgufTensor t = make_gguf_tensor("q", a, GgmlType::Q4_0);
  ASSERT_EQ(t.data.size(), 2u * kQ4BlockBytes);
  EXPECT_EQ(t.dims, (std::vector<int64_t>{64, 1}));
  const auto* bytes = reinterpret_cast<const uint8_t*>(t.data.data());
  EXPECT_EQ(bytes[0] | bytes[1] << 8, 0x3800);  // 0.5 in f16
  for (int j = 0; j < 16; ++j) EXPECT_EQ(bytes[2 + j], j | (15 - j) << 4) << j;
  const uint8_t* b1 = bytes + kQ4BlockBytes;
  EXPECT_EQ(b1[0] | b1[1] << 8, 0xb400);  // -0.25 in f16
  for (int j = 0; j < 16; ++j)
    EXPECT_EQ(b1[2 + j], j == 3 ? 0x80 : j == 4 ? 0xf8 : 0x88) << j;
  // These values lie on the grid, so they come back exactly, and the bytes read back as
  // dequantise_q4_0 gives them.
  EXPECT_EQ(gguf_tensor_values(t).data, a.data);
  GgufTensor u = t;
  u.data[2] = static_cast<char>(0x7f);  // value 0 code 15 (3.5), value 16 code 7 (-0.5)
  const ArrayF32 back = gguf_tensor_values(u);
  EXPECT_EQ(back.data[0], 3.5f);
  EXPECT_EQ(back.data[16], -0.5f);
  EXPECT_NE(error_of([] { make_gguf_tensor("r", ramp({2, 40}, 1.0f), GgmlType::Q4_0); })
                .find("a q4_0 row of 40 values is not whole blocks of 32"),
            std::string::npos);
}

// ---- hostile bytes -------------------------------------------------------------------------------

long peak_rss_kb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

// How much the peak may grow while thousands of damaged files are parsed: 64 MB, what the
// parser may keep; under AddressSanitizer also its quarantine (256 MB by default), which holds
// what the loop freed instead of reusing it.
#if defined(__SANITIZE_ADDRESS__)
constexpr long kPeakGrowthKb = (64 + 256) * 1024;
#else
constexpr long kPeakGrowthKb = 64 * 1024;
#endif

// Parses the bytes: "ok", or the kvlab::Error's message. Any other exception fails the test.
std::string outcome(const std::string& bytes) {
  try {
    parse_gguf(bytes, "fuzzed");
    return "ok";
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a kvlab::Error: " << e.what();
    return "other";
  }
}

template <typename T>
void poke(std::string& bytes, size_t at, T v) {
  std::memcpy(bytes.data() + at, &v, sizeof(T));
}

// Offsets of the sample's fields, found by walking its layout.
struct Layout {
  size_t n_tensors = 8, n_kv = 16, first_key = 24;
  size_t ints_count = 0;   // the "ints" array's length field
  size_t first_info = 0;   // tensor info 0's name length
  size_t data_start = 0, last_tensor_end = 0;
};

Layout layout_of(const std::string& bytes, const GgufFile& f) {
  Layout l;
  l.ints_count = bytes.find("ints") + 4 + 4 + 4;  // key, value type, element type
  l.first_info = bytes.find("a.f32") - 8;
  const GgufTensor& last = f.tensors.back();
  l.last_tensor_end = bytes.rfind(last.data) + last.data.size();
  l.data_start = bytes.find(f.tensors.front().data);
  return l;
}

TEST(GgufFuzz, TruncatedFilesAreRefused) {
  const GgufFile f = sample_file();
  const std::string bytes = serialize_gguf(f);
  const Layout l = layout_of(bytes, f);
  int refused = 0;
  for (size_t n = 0; n < bytes.size(); ++n) {
    const std::string r = outcome(bytes.substr(0, n));
    if (n < l.last_tensor_end) {
      ASSERT_NE(r, "ok") << "cut at " << n;
      ++refused;
    }
  }
  EXPECT_EQ(refused, static_cast<int>(l.last_tensor_end));
  EXPECT_NE(outcome(bytes.substr(0, 6)).find("version"), std::string::npos);
  EXPECT_NE(outcome(bytes.substr(0, l.last_tensor_end - 1)).find(f.tensors.back().name),
            std::string::npos);
}

TEST(GgufFuzz, FlippedBytesBeforeTheDataAreRefusedOrRead) {
  const GgufFile f = sample_file();
  const std::string bytes = serialize_gguf(f);
  const Layout l = layout_of(bytes, f);
  const long rss_before = peak_rss_kb();
  int refused = 0, read = 0;
  for (size_t at = 0; at < l.data_start; ++at)
    for (uint8_t mask : {0x01, 0x10, 0x80, 0xff}) {
      std::string b = bytes;
      b[at] = static_cast<char>(b[at] ^ mask);
      (outcome(b) == "ok" ? read : refused)++;
    }
  // Random damage: 1 to 8 bytes of the header, metadata and tensor infos at once.
  Generator gen(42);
  for (int i = 0; i < 3000; ++i) {
    std::string b = bytes;
    for (uint64_t k = 0, n = 1 + gen.below(8); k < n; ++k)
      b[gen.below(l.data_start)] = static_cast<char>(gen.below(256));
    (outcome(b) == "ok" ? read : refused)++;
  }
  std::printf("[ gguf fuzz ] %d damaged files refused, %d read (damage inside a string or value)\n",
              refused, read);
  EXPECT_GT(refused, read);
  EXPECT_LT(peak_rss_kb() - rss_before, kPeakGrowthKb)
      << "the damaged files made the parser allocate";
}

TEST(GgufFuzz, AbsurdCountsLengthsShapesAndOffsetsAreRefusedByName) {
  const GgufFile f = sample_file();
  const std::string bytes = serialize_gguf(f);
  const Layout l = layout_of(bytes, f);
  const long rss_before = peak_rss_kb();
  auto damaged = [&](const std::function<void(std::string&)>& damage) {
    std::string b = bytes;
    damage(b);
    return outcome(b);
  };
  constexpr uint64_t kHuge = uint64_t{1} << 62;
  const size_t info = l.first_info, dims = info + 8 + 5 + 4;  // name length, "a.f32", n_dims
  const struct {
    const char* what;
    std::function<void(std::string&)> damage;
    const char* named;
  } cases[] = {
      {"magic", [](std::string& b) { b[0] = 'X'; }, "not a GGUF file"},
      {"version 2", [](std::string& b) { poke<uint32_t>(b, 4, 2); }, "version"},
      {"tensor count", [&](std::string& b) { poke<uint64_t>(b, l.n_tensors, kHuge); }, "tensor count"},
      {"metadata count", [&](std::string& b) { poke<uint64_t>(b, l.n_kv, kHuge); }, "metadata count"},
      {"key length", [&](std::string& b) { poke<uint64_t>(b, l.first_key, kHuge); }, "metadata key 0"},
      {"value type", [&](std::string& b) { poke<uint32_t>(b, l.first_key + 8 + 20, 99); },
       "unknown value type"},
      {"array length", [&](std::string& b) { poke<uint64_t>(b, l.ints_count, kHuge); },
       "'ints''s length"},
      {"array of arrays", [&](std::string& b) { poke<uint32_t>(b, l.ints_count - 4, 9); },
       "arrays of arrays"},
      {"name length", [&](std::string& b) { poke<uint64_t>(b, info, kHuge); }, "tensor info 0"},
      {"no dimensions", [&](std::string& b) { poke<uint32_t>(b, dims - 4, 0); }, "0 dimensions"},
      {"five dimensions", [&](std::string& b) { poke<uint32_t>(b, dims - 4, 5); }, "5 dimensions"},
      {"zero dimension", [&](std::string& b) { poke<uint64_t>(b, dims, 0); }, "dimension 0"},
      {"overflowing shape",
       [&](std::string& b) {
         poke<uint64_t>(b, dims, uint64_t{1} << 40);
         poke<uint64_t>(b, dims + 8, uint64_t{1} << 40);
       },
       "tensor 'a.f32'"},
      {"type", [&](std::string& b) { poke<uint32_t>(b, dims + 16, 3); }, "ggml type 3"},
      {"q4_0 rows of 5", [&](std::string& b) { poke<uint32_t>(b, dims + 16, 2); },
       "a q4_0 row of 5 values is not whole blocks"},
      {"offset past the end", [&](std::string& b) { poke<uint64_t>(b, dims + 20, uint64_t{1} << 63); },
       "past the data section"},
      {"unaligned offset", [&](std::string& b) { poke<uint64_t>(b, dims + 20, 4); },
       "not a multiple of the alignment"},
  };
  for (const auto& c : cases) {
    const std::string r = damaged(c.damage);
    EXPECT_NE(r.find(c.named), std::string::npos) << c.what << ": " << r;
  }
  // The alignment key: a u32 power of two.
  GgufFile g = f;
  g.set("general.alignment", GgufValue::scalar(GgufType::U32, 3));
  g.alignment = 4;
  std::string b = serialize_gguf(g);
  EXPECT_NE(outcome(b).find("general.alignment"), std::string::npos);
  g.set("general.alignment", GgufValue::scalar(GgufType::U64, 32));
  EXPECT_NE(outcome(serialize_gguf(g)).find("general.alignment"), std::string::npos);
  // Keys and tensor names appear once.
  g = f;
  g.metadata.push_back(g.metadata.front());
  EXPECT_NE(outcome(serialize_gguf(g)).find("appears twice"), std::string::npos);
  g = f;
  g.tensors.push_back(g.tensors.front());
  EXPECT_NE(outcome(serialize_gguf(g)).find("appears twice"), std::string::npos);
  EXPECT_LT(peak_rss_kb() - rss_before, kPeakGrowthKb);
}

// GGUF's ids and ggml's block sizes as ggml defines them (ggml.h's enum ggml_type,
// ggml-common.h's static_asserts on block_q8_0, block_q4_0, block_q5_0 and block_q5_1).
TEST(GgufFormat, TypesAreTheFormatTablesRowsWithGgmlsIdsAndBlockSizes) {
  EXPECT_EQ(static_cast<uint32_t>(GgmlType::F32), 0u);
  EXPECT_EQ(static_cast<uint32_t>(GgmlType::F16), 1u);
  EXPECT_EQ(static_cast<uint32_t>(GgmlType::Q4_0), 2u);
  EXPECT_EQ(static_cast<uint32_t>(GgmlType::Q8_0), 8u);
  EXPECT_EQ(static_cast<uint32_t>(GgmlType::BF16), 30u);
  EXPECT_EQ(format(Fmt::Q8_0).block_bytes, 2 + 32);  // f16 d, 32 int8 codes
  EXPECT_EQ(format(Fmt::Q4_0).block_bytes, 2 + 16);  // f16 d, 32 nibbles
  EXPECT_EQ(format(Fmt::Q8_0).block_values, 32);
  EXPECT_EQ(format(Fmt::Q4_0).block_values, 32);
  EXPECT_EQ(static_cast<uint32_t>(GgmlType::Q5_0), 6u);
  EXPECT_EQ(static_cast<uint32_t>(GgmlType::Q5_1), 7u);
  EXPECT_EQ(static_cast<uint32_t>(GgmlType::Q4_K), 12u);
  EXPECT_EQ(static_cast<uint32_t>(GgmlType::Q5_K), 13u);
  EXPECT_EQ(static_cast<uint32_t>(GgmlType::Q6_K), 14u);
  EXPECT_EQ(format(Fmt::Q5_0).block_bytes, 2 + 4 + 16);      // f16 d, 32 high bits, 32 nibbles
  EXPECT_EQ(format(Fmt::Q5_1).block_bytes, 2 + 2 + 4 + 16);  // and the f16 minimum
  for (const GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::Q4_0, GgmlType::Q8_0,
                           GgmlType::BF16, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q4_K,
                           GgmlType::Q5_K, GgmlType::Q6_K})
    EXPECT_EQ(format_of(t).ggml_type, static_cast<int32_t>(t));
  EXPECT_EQ(format_names(kGgufTensor),
            "f32, bf16, f16, q8_0, q4_0, q4_k, q5_k, q6_k, q5_0 and q5_1");
}

}  // namespace
}  // namespace kvlab
