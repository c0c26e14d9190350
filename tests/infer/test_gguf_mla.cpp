// kvlab's multi-head latent attention as llama.cpp's deepseek2: export then import gives the
// same f32 weights bit for bit (queries projected directly or through q_lora_rank, the
// up-projection split or whole); what either side cannot hold is refused naming it; and
// llama.cpp itself (node-llama-cpp) continues prompts as kvlab does, which it does not when the
// rotary channels are left in kvlab's pairing.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "checkpoints/gguf_model.h"
#include "checkpoints/model_io.h"
#include "nn/adamw.h"
#include "tests/error_of.h"
#include "tests/infer/gguf_test_util.h"
#include "tests/infer/infer_test_util.h"
#include "tests/test_dir.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;
using test::greedy;
using test::model_of;
using test::random_model;

GgufFile reparsed(const GgufFile& f) { return parse_gguf(serialize_gguf(f), "test"); }

ArrayF32 param(const GPT& m, const std::string& name) {
  for (auto& [n, a] : to_arrays(m.named_parameters()))
    if (n == name) return a;
  throw Error("no parameter " + name);
}

// ---- export then import ------------------------------------------------------------------------

class GgufMlaRoundTrip
    : public ::testing::TestWithParam<std::tuple<std::string, MlaUpForm>> {};

TEST_P(GgufMlaRoundTrip, F32WeightsBitIdenticalAndSameGreedyText) {
  const auto [arch, up] = GetParam();
  GPTConfig c = test::tiny_config(4, 32, arch);
  c.tied = arch == "mla";  // both ways of the LM head
  auto model = random_model(c, 17);
  const Tokenizer tok = test::tiny_tokenizer();
  const GgufFile f = reparsed(model_to_gguf(*model, tok, gguf_mix(GgmlType::F32), {}, up));
  EXPECT_EQ(f.get_string("general.architecture", "t"), "deepseek2");
  EXPECT_EQ(f.get_int("deepseek2.attention.q_lora_rank", "t"), c.q_lora_rank);
  EXPECT_EQ(f.tensor("blk.0.attn_q_a.weight") != nullptr, c.q_lora_rank > 0);
  EXPECT_EQ(f.tensor("blk.0.attn_k_b.weight") != nullptr, up == MlaUpForm::Split);
  EXPECT_EQ(f.tensor("blk.0.attn_kv_b.weight") != nullptr, up == MlaUpForm::Whole);

  const Checkpoint back = gguf_to_checkpoint(f, "test");
  const GPTConfig bc = get_gpt_config(back.config, "test");
  EXPECT_EQ(bc.attn, "mla");
  EXPECT_EQ(bc.kv_lora_rank, c.kv_lora_rank);
  EXPECT_EQ(bc.rope_head_dim, c.rope_head_dim);
  EXPECT_EQ(bc.q_lora_rank, c.q_lora_rank);
  EXPECT_EQ(bc.tied, c.tied);
  const NamedArrays before = to_arrays(model->named_parameters());
  test::expect_bit_identical(back.model, before);
  const std::vector<int32_t> prompt = {1, 2, 3, 10, 4};
  auto imported = model_of(back);
  EXPECT_EQ(greedy(*imported, tok, prompt, 20), greedy(*model, tok, prompt, 20));
}

INSTANTIATE_TEST_SUITE_P(
    QueriesAndUpForms, GgufMlaRoundTrip,
    ::testing::Combine(::testing::Values("mla", "mla_q"),
                       ::testing::Values(MlaUpForm::Split, MlaUpForm::Whole)),
    [](const auto& info) {
      return std::get<0>(info.param) +
             (std::get<1>(info.param) == MlaUpForm::Split ? "_split" : "_whole");
    });

// The split form as llama.cpp's converter writes it: one cached head of R + D keys and R
// values, attn_k_b each head's key rows transposed, attn_v_b its value rows; the rotary rows of
// the query and of the shared key re-paired, nothing else moved.
TEST(GgufMlaExport, SplitFormLayoutAndKeys) {
  const GPTConfig c = test::tiny_config(4, 16, "mla");  // NH 4, HS 8, R 12, D 4, C 32
  auto model = random_model(c, 5);
  const GgufFile f = model_to_gguf(*model, test::tiny_tokenizer(), gguf_mix(GgmlType::F32), {});
  const int64_t NH = 4, HS = 8, R = 12, D = 4, C = 32;
  EXPECT_EQ(f.get_int("deepseek2.attention.head_count_kv", "t"), 1);
  EXPECT_EQ(f.get_int("deepseek2.attention.key_length", "t"), R + D);
  EXPECT_EQ(f.get_int("deepseek2.attention.value_length", "t"), R);
  EXPECT_EQ(f.get_int("deepseek2.attention.key_length_mla", "t"), HS + D);
  EXPECT_EQ(f.get_int("deepseek2.attention.value_length_mla", "t"), HS);
  EXPECT_EQ(f.get_int("deepseek2.attention.kv_lora_rank", "t"), R);
  EXPECT_EQ(f.get_int("deepseek2.rope.dimension_count", "t"), D);
  EXPECT_EQ(f.get_int("deepseek2.leading_dense_block_count", "t"), c.n_layer);
  EXPECT_EQ(f.find("deepseek2.expert_count"), nullptr);
  EXPECT_EQ(f.find("deepseek2.rope.scaling.type"), nullptr);

  const ArrayF32 up = param(*model, "blocks.1.attn.kv_up.weight");  // (NH * 2 HS, R)
  const GgufTensor* kb = f.tensor("blk.1.attn_k_b.weight");
  const GgufTensor* vb = f.tensor("blk.1.attn_v_b.weight");
  ASSERT_TRUE(kb && vb);
  EXPECT_EQ(kb->dims, (std::vector<int64_t>{HS, R, NH}));
  EXPECT_EQ(vb->dims, (std::vector<int64_t>{R, HS, NH}));
  const ArrayF32 k = gguf_tensor_values(*kb), v = gguf_tensor_values(*vb);
  // Head 2, key channel 5, latent 7; value channel 3, latent 9.
  EXPECT_EQ(k.data[(2 * R + 7) * HS + 5], up.data[(2 * 2 * HS + 5) * R + 7]);
  EXPECT_EQ(v.data[(2 * HS + 3) * R + 9], up.data[((2 * 2 + 1) * HS + 3) * R + 9]);

  // The shared rotary key: rows R + 2i + t of attn_kv_a_mqa are kv_down's R + t D/2 + i.
  const ArrayF32 down = param(*model, "blocks.0.attn.kv_down.weight");
  const ArrayF32 mqa = gguf_tensor_values(*f.tensor("blk.0.attn_kv_a_mqa.weight"));
  EXPECT_EQ(0, std::memcmp(mqa.data.data(), down.data.data(), R * C * 4));  // the latent
  EXPECT_EQ(0, std::memcmp(&mqa.data[(R + 1) * C], &down.data[(R + D / 2) * C], C * 4));
  EXPECT_EQ(0, std::memcmp(&mqa.data[(R + 2) * C], &down.data[(R + 1) * C], C * 4));
  // Each head's query: HS rows as they are, then its D rotary rows re-paired.
  const ArrayF32 q = param(*model, "blocks.0.attn.q_proj.weight");
  const ArrayF32 gq = gguf_tensor_values(*f.tensor("blk.0.attn_q.weight"));
  const int64_t h3 = 3 * (HS + D);
  EXPECT_EQ(0, std::memcmp(&gq.data[h3 * C], &q.data[h3 * C], HS * C * 4));
  EXPECT_EQ(0, std::memcmp(&gq.data[(h3 + HS + 3) * C], &q.data[(h3 + HS + D / 2 + 1) * C], C * 4));
}

TEST(GgufMlaExport, RefusesWhatDeepseek2CannotHold) {
  GPTConfig ln = test::tiny_config(4, 16, "mla");
  ln.norm = "layernorm";
  EXPECT_NE(error_of([&] { gguf_architecture(ln); }).find("deepseek2 only in the llama block"),
            std::string::npos);
  GPTConfig lite = test::tiny_config(4, 16, "mla_q");
  lite.n_layer = 27;  // llama.cpp's DeepSeek-V2-Lite count: it reads no q_lora_rank there
  EXPECT_NE(error_of([&] { gguf_architecture(lite); }).find("reads no q_lora_rank for 27 layers"),
            std::string::npos);
  lite.q_lora_rank = 0;
  EXPECT_EQ(gguf_architecture(lite), "deepseek2");
}

TEST(GgufMlaImport, RefusesNamingTheKey) {
  auto model = random_model(test::tiny_config(4, 16, "mla_q"), 4);
  const GgufFile good = model_to_gguf(*model, test::tiny_tokenizer(), gguf_mix(GgmlType::F32), {});
  auto refusal = [&](const std::function<void(GgufFile&)>& damage) {
    GgufFile f = good;
    damage(f);
    return error_of([&] { gguf_to_checkpoint(reparsed(f), "m.gguf"); });
  };
  auto u32 = [](int64_t v) { return GgufValue::scalar(GgufType::U32, v); };
  EXPECT_EQ(refusal([](GgufFile&) {}), "no error");
  const std::vector<std::pair<std::string, std::function<void(GgufFile&)>>> cases = {
      {"deepseek2.expert_count", [&](GgufFile& f) { f.set("deepseek2.expert_count", u32(8)); }},
      {"deepseek2.leading_dense_block_count",
       [&](GgufFile& f) { f.set("deepseek2.leading_dense_block_count", u32(1)); }},
      {"deepseek2.rope.scaling.yarn_log_multiplier",
       [](GgufFile& f) {
         f.set("deepseek2.rope.scaling.yarn_log_multiplier", GgufValue::real(GgufType::F32, 0.07));
       }},
      {"deepseek2.rope.scaling.type",
       [](GgufFile& f) { f.set("deepseek2.rope.scaling.type", GgufValue::string("yarn")); }},
      {"deepseek2.attention.value_length_mla",
       [&](GgufFile& f) { f.set("deepseek2.attention.value_length_mla", u32(16)); }},
      {"deepseek2.attention.head_count_kv",
       [&](GgufFile& f) { f.set("deepseek2.attention.head_count_kv", u32(4)); }},
      {"deepseek2.attention.kv_lora_rank",
       [](GgufFile& f) {
         std::erase_if(f.metadata, [](const auto& kv) {
           return kv.first == "deepseek2.attention.kv_lora_rank";
         });
       }},
      {"blk.1.attn_v_b.weight is missing",
       [](GgufFile& f) {
         std::erase_if(f.tensors,
                       [](const GgufTensor& t) { return t.name == "blk.1.attn_v_b.weight"; });
       }},
  };
  for (const auto& [key, damage] : cases)
    EXPECT_NE(refusal(damage).find(key), std::string::npos) << key << ": " << refusal(damage);
}

// ---- llama.cpp itself ----------------------------------------------------------------------

// Text with structure and without repeats, independent of any file: the numbers from one
// upwards spelled out ("one hundred and forty two, one hundred and forty three, "), n
// characters of it (20 symbols).
std::string counting(size_t n) {
  static const char* ones[] = {"",        "one",     "two",       "three",    "four",
                               "five",    "six",     "seven",     "eight",    "nine",
                               "ten",     "eleven",  "twelve",    "thirteen", "fourteen",
                               "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"};
  static const char* tens[] = {"",      "",      "twenty",  "thirty", "forty",
                               "fifty", "sixty", "seventy", "eighty", "ninety"};
  std::string out;
  for (int i = 1; out.size() < n; ++i) {
    std::string w;
    if (i >= 100) w = std::string(ones[i / 100]) + " hundred" + (i % 100 ? " and " : "");
    const int r = i % 100;
    if (r >= 20) w += std::string(tens[r / 10]) + (r % 10 ? std::string(" ") + ones[r % 10] : "");
    else w += ones[r];
    out += w + ", ";
  }
  return out.substr(0, n);
}

// A small MLA model (queries through q_lora_rank) trained on `text` until its greedy text
// follows the counting rather than a loop of a few characters.
std::unique_ptr<GPT> trained_mla(const Tokenizer& tok, const std::string& text) {
  GPTConfig c;
  c.pos = "rope";
  c.norm = "rmsnorm";
  c.mlp = "swiglu";
  c.bias = false;
  c.attn = "mla";
  c.vocab_size = tok.vocab_size();
  c.block_size = 160;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 4;
  c.n_embd = 64;
  c.mlp_hidden = 128;
  c.kv_lora_rank = 24;
  c.rope_head_dim = 8;
  c.q_lora_rank = 32;
  c.rope_theta = 500.0;  // positions up to 128 turn every pair noticeably
  auto model = std::make_unique<GPT>(c, 3);
  const std::vector<int32_t> ids = tok.encode(text);
  test::train_briefly(*model, ids, 200, 8, 64);
  return model;
}

class GgufMlaLlamaCpp : public kvlab::testing::TestDirFixture {
 protected:
  GgufMlaLlamaCpp() : TestDirFixture("kvlab-gguf-mla-llama-cpp") {}
};

struct MlaJob {
  std::string name;
  fs::path gguf;
  std::vector<int32_t> prompt, expected;
  std::vector<std::vector<float>> logits;
  bool planted = false;  // rotary channels left in kvlab's pairing
};

// llama.cpp (1 thread, f32 cache, no flash attention) decodes f32 deepseek2 exports: the
// trained model's split form on three prompts, its whole form on one, and a random model whose
// queries are not compressed give kvlab's 112 greedy tokens and its log-probabilities within
// 2e-4 at every step. The trained model with its rotary rows left in kvlab's pairing (the
// re-pairing undone in the file) gives other text.
TEST_F(GgufMlaLlamaCpp, SameGreedyContinuationAsKvlabAndWrongPairingDiffers) {
  std::string why;
  if (!test::have_llama_cpp(why)) GTEST_SKIP() << why;
  const std::string text = counting(6000);
  const Tokenizer tok = Tokenizer::build_char(text);
  auto model = trained_mla(tok, text);
  GPTConfig rc = model->config();
  rc.q_lora_rank = 0;
  auto plain = random_model(rc, 9);
  const int64_t n_new = 112;

  const GgufFile split = model_to_gguf(*model, tok, gguf_mix(GgmlType::F32), {});
  // The same file with the re-pairing of the query's and the shared key's rotary rows undone.
  GgufFile planted = split;
  for (GgufTensor& t : planted.tensors) {
    const bool q = t.name.ends_with("attn_q_b.weight");
    const bool k = t.name.ends_with("attn_kv_a_mqa.weight");
    if (!q && !k) continue;
    t = make_gguf_tensor(t.name,
                         reorder_rope_rows(gguf_tensor_values(t), q ? rc.n_head : 1,
                                           rc.rope_head_dim, /*to_gguf=*/false),
                         GgmlType::F32);
  }
  const std::vector<std::pair<std::string, GgufFile>> files = {
      {"split", split},
      {"whole", model_to_gguf(*model, tok, gguf_mix(GgmlType::F32), {}, MlaUpForm::Whole)},
      {"plain", model_to_gguf(*plain, tok, gguf_mix(GgmlType::F32), {})},
      {"planted", planted}};
  for (const auto& [name, f] : files) write_gguf(dir_ / (name + ".gguf"), f);

  std::vector<MlaJob> jobs;
  for (size_t at : {0, 1500, 3500}) {
    const std::vector<int32_t> prompt = tok.encode(text.substr(at, 16));
    for (const char* name : {"split", "whole", "plain", "planted"}) {
      if (at != 0 && (std::string(name) == "whole" || std::string(name) == "plain")) continue;
      MlaJob j;
      j.name = std::string(name) + "@" + std::to_string(at);
      j.gguf = dir_ / (std::string(name) + ".gguf");
      j.prompt = prompt;
      j.planted = std::string(name) == "planted";
      j.expected = greedy(std::string(name) == "plain" ? *plain : *model, tok, prompt, n_new,
                          &j.logits);
      jobs.push_back(std::move(j));
    }
  }
  nlohmann::json spec = nlohmann::json::array();
  for (const MlaJob& j : jobs)
    spec.push_back({{"model", j.gguf.string()}, {"prompt", j.prompt}, {"new_tokens", n_new},
                    {"threads", 1}});
  std::string failure;
  const nlohmann::json out = test::llama_cpp_greedy(spec, dir_, failure);
  if (!failure.empty()) FAIL() << failure;
  ASSERT_EQ(out.size(), jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    const MlaJob& j = jobs[i];
    const test::Agreement a = test::agreement(out[i], j.expected, j.logits);
    std::printf("[ llama.cpp ] %s: %zu of %zu greedy tokens the same, max |d log p| %.2e: %s\n",
                j.name.c_str(), a.same, j.expected.size(), a.worst, tok.decode(j.expected).c_str());
    if (j.planted) {
      EXPECT_LT(a.same, j.expected.size()) << j.name;
      EXPECT_GT(a.worst, 1e-2) << j.name;
      continue;
    }
    EXPECT_EQ(a.same, j.expected.size()) << j.name;
    EXPECT_LT(a.worst, 2e-4) << j.name;
    // The trained model's text varies: many symbols, no short loop.
    if (j.name.starts_with("split")) {
      EXPECT_GE(std::set<int32_t>(j.expected.begin(), j.expected.end()).size(), 12u) << j.name;
    }
  }
}

}  // namespace
}  // namespace kvlab
