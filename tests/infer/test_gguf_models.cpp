// kvlab's models through GGUF files: export then import gives the same f32 weights bit for bit
// and the same greedy text; what llama.cpp has no architecture for is refused; and llama.cpp
// itself (node-llama-cpp's prebuilt CPU binaries, tests/infer/llama_cpp/) continues a prompt
// as kvlab does.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>

#include "checkpoints/gguf_model.h"
#include "checkpoints/model_io.h"
#include "data/bpe.h"
#include "infer/engine.h"
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

// 8 heads of 8 channels, 2 layers, a context of 128: room for a prompt of 8 and 112 new tokens.
GPTConfig llama_config(int64_t n_kv_head, bool tied = true) {
  GPTConfig c;
  c.pos = "rope";
  c.norm = "rmsnorm";
  c.mlp = "swiglu";
  c.bias = false;
  c.vocab_size = 27;
  c.block_size = 128;
  c.n_layer = 2;
  c.n_head = 8;
  c.n_kv_head = n_kv_head;
  c.n_embd = 64;
  c.mlp_hidden = 128;  // whole q8_0 blocks in every matrix
  c.tied = tied;
  c.rope_theta = 500.0;  // positions up to 128 turn every pair noticeably
  return c;
}

Tokenizer letters() { return Tokenizer::build_char("abcdefghijklmnopqrstuvwxyz "); }

GgufFile reparsed(const GgufFile& f) { return parse_gguf(serialize_gguf(f), "test"); }

const std::vector<int32_t> kPrompt = {7, 4, 11, 11, 14, 26, 22, 14};  // "hello wo"

// ---- export then import ------------------------------------------------------------------------

class GgufRoundTrip : public ::testing::TestWithParam<std::tuple<int64_t, bool>> {};

TEST_P(GgufRoundTrip, F32WeightsBitIdenticalAndSameGreedyText) {
  const auto [nkv, tied] = GetParam();
  auto model = random_model(llama_config(nkv, tied), 11 + static_cast<uint64_t>(nkv));
  const Tokenizer tok = letters();
  const GgufFile file = reparsed(model_to_gguf(*model, tok, GgmlType::F32, {}));
  EXPECT_EQ(file.get_string("general.architecture", "t"), "llama");
  EXPECT_EQ(file.get_int("llama.attention.head_count_kv", "t"), nkv);
  EXPECT_EQ(file.tensor("output.weight") == nullptr, tied);

  const Checkpoint back = gguf_to_checkpoint(file, "test");
  const NamedArrays before = to_arrays(model->named_parameters());
  ASSERT_EQ(back.model.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(back.model[i].first, before[i].first);
    EXPECT_EQ(back.model[i].second.shape, before[i].second.shape);
    EXPECT_EQ(0, std::memcmp(back.model[i].second.data.data(), before[i].second.data.data(),
                             before[i].second.data.size() * sizeof(float)))
        << before[i].first;
  }
  EXPECT_EQ(get_tokenizer(back, "import"), tok);

  auto imported = model_of(back);
  const auto expected = greedy(*model, tok, kPrompt, 40);
  EXPECT_EQ(greedy(*imported, tok, kPrompt, 40), expected);
  EXPECT_GE(std::set<int32_t>(expected.begin(), expected.end()).size(), 5u)
      << "the random model's greedy text is degenerate";
}

INSTANTIATE_TEST_SUITE_P(KvHeads, GgufRoundTrip,
                         ::testing::Combine(::testing::Values(8, 2, 1), ::testing::Bool()));

// The q and k rows are reordered for llama.cpp's RoPE; the stored matrix is not kvlab's.
TEST(GgufExport, ReordersQueryAndKeyRowsPerHead) {
  auto model = random_model(llama_config(2), 3);
  const GgufFile f = model_to_gguf(*model, letters(), GgmlType::F32, {});
  const ArrayF32 q = gguf_tensor_values(*f.tensor("blk.0.attn_q.weight"));
  const ArrayF32 v = gguf_tensor_values(*f.tensor("blk.0.attn_v.weight"));
  const NamedArrays a = to_arrays(model->named_parameters());
  auto find = [&](const std::string& n) {
    for (const auto& [name, arr] : a)
      if (name == n) return arr;
    return ArrayF32{};
  };
  const ArrayF32 kq = find("blocks.0.attn.q_proj.weight"), kv = find("blocks.0.attn.v_proj.weight");
  const int64_t C = 64, HS = 8;
  // Head 1's GGUF row 2 * 3 + 1 is kvlab's row HS/2 + 3 of that head.
  EXPECT_EQ(0, std::memcmp(&q.data[(HS + 7) * C], &kq.data[(HS + 4 + 3) * C], C * 4));
  EXPECT_EQ(0, std::memcmp(&q.data[(HS + 6) * C], &kq.data[(HS + 3) * C], C * 4));
  EXPECT_NE(0, std::memcmp(q.data.data(), kq.data.data(), q.data.size() * 4));
  EXPECT_EQ(v.data, kv.data);  // values are not rotated
}

TEST(GgufExport, Gpt2BlockAsLlamaCppsGpt2) {
  GPTConfig c = test::tiny_config(2, 16, "gpt2");
  auto model = random_model(c, 5);
  const GgufFile f = model_to_gguf(*model, test::tiny_tokenizer(), GgmlType::F16, {});
  EXPECT_EQ(f.get_string("general.architecture", "t"), "gpt2");
  const GgufTensor* qkv = f.tensor("blk.1.attn_qkv.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->dims, (std::vector<int64_t>{32, 32 + 2 * 2 * 8}));
  EXPECT_EQ(qkv->type, GgmlType::F16);
  EXPECT_EQ(f.tensor("blk.1.attn_qkv.bias")->type, GgmlType::F32);
  EXPECT_NE(f.tensor("position_embd.weight"), nullptr);
  // Import takes llama files only, and says so.
  EXPECT_NE(error_of([&] { gguf_to_checkpoint(f, "g.gguf"); }).find("general.architecture"),
            std::string::npos);
}

TEST(GgufExport, RefusesWhatLlamaCppHasNoArchitectureFor) {
  GPTConfig mixed = test::tiny_config(4, 16, "gpt2");
  mixed.pos = "rope";  // GPT-2's block with RoPE: neither architecture
  auto m = random_model(mixed, 1);
  EXPECT_NE(error_of([&] { model_to_gguf(*m, test::tiny_tokenizer(), GgmlType::F32, {}); })
                .find("neither llama.cpp's llama"),
            std::string::npos);
}

TEST(GgufExport, TokenizersComeBackEqual) {
  const std::string text = "the quick brown fox jumps over the lazy dog; the dog sleeps. ";
  std::string corpus;
  for (int i = 0; i < 20; ++i) corpus += text;
  const std::vector<Tokenizer> toks = {
      Tokenizer::build_char("ab\ncd \xc3\xa9\xe2\x82\xac"), Tokenizer::byte_level(),
      Tokenizer::bpe(train_bpe(corpus, 280, SplitPattern::Gpt2)),
      Tokenizer::bpe(train_bpe(corpus, 275, SplitPattern::Kvlab))};
  for (const Tokenizer& tok : toks) {
    GPTConfig c = llama_config(2);
    c.vocab_size = tok.vocab_size();
    auto model = random_model(c, 2);
    const Checkpoint back =
        gguf_to_checkpoint(reparsed(model_to_gguf(*model, tok, GgmlType::F32, {})), "t");
    EXPECT_EQ(get_tokenizer(back, "t"), tok) << tok.kind_name();
  }
}

// ---- import refusals ------------------------------------------------------------------------------

TEST(GgufImport, RefusesNamingTheKeyOrTensor) {
  auto model = random_model(llama_config(2), 4);
  const GgufFile good = model_to_gguf(*model, letters(), GgmlType::Q8_0, {});
  auto refusal = [&](const std::function<void(GgufFile&)>& damage) {
    GgufFile f = good;
    damage(f);
    return error_of([&] { gguf_to_checkpoint(reparsed(f), "m.gguf"); });
  };
  EXPECT_EQ(refusal([](GgufFile&) {}), "no error");
  EXPECT_NE(refusal([](GgufFile& f) { f.set("tokenizer.ggml.model", GgufValue::string("llama")); })
                .find("tokenizer.ggml.model"),
            std::string::npos);
  EXPECT_NE(refusal([](GgufFile& f) {
              f.set("tokenizer.ggml.pre", GgufValue::string("qwen2"));
              f.metadata.erase(f.metadata.begin() + 0);  // general.architecture gone too
            }).find("general.architecture"),
            std::string::npos);
  EXPECT_NE(refusal([](GgufFile& f) {
              f.set("llama.attention.layer_norm_rms_epsilon", GgufValue::real(GgufType::F32, 1e-6));
            }).find("layer_norm_rms_epsilon"),
            std::string::npos);
  EXPECT_NE(refusal([](GgufFile& f) {
              f.tensors.push_back(make_gguf_tensor("blk.0.attn_q.bias", {{64}, std::vector<float>(64)},
                                                   GgmlType::F32));
            }).find("blk.0.attn_q.bias"),
            std::string::npos);
  EXPECT_NE(refusal([](GgufFile& f) {
              f.set("llama.block_count", GgufValue::scalar(GgufType::U32, 100000000));
            }).find("llama.block_count 100000000 is more layers"),
            std::string::npos);
  EXPECT_NE(refusal([](GgufFile& f) { f.tensors.erase(f.tensors.begin() + 3); })
                .find("is missing"),
            std::string::npos);
  EXPECT_NE(refusal([](GgufFile& f) {
              f.set("llama.attention.head_count_kv", GgufValue::scalar(GgufType::U32, 4));
            }).find("wrong shape"),
            std::string::npos);
}

// ---- llama.cpp itself ------------------------------------------------------------------------------

struct PeerJob {
  std::string name;
  fs::path gguf;
  std::vector<int32_t> expected;             // kvlab's greedy tokens
  std::vector<std::vector<float>> logits;    // kvlab's logits before each of them
  size_t min_same;                           // greedy tokens that must agree
  double tolerance;                          // on each step's log-probabilities
};

class GgufLlamaCpp : public kvlab::testing::TestDirFixture {
 protected:
  GgufLlamaCpp() : TestDirFixture("kvlab-gguf-llama-cpp") {}
};

// kvlab and llama.cpp decode the same GGUF, llama.cpp on 1 thread with an f32 KV cache: f32
// exports of the llama block at n_kv_head 8, 2 and 1 give the same 112 greedy tokens and
// next-token log-probabilities within 2e-4 at every step (GPT-2's block with 2 KV heads, as
// llama.cpp's gpt2: the same tokens, within 1e-2); f16 and q8_0 exports are compared with kvlab
// decoding the same rounded weights (the import of the file), up to the step where the greedy
// texts part (and that step).
TEST_F(GgufLlamaCpp, SameGreedyContinuationAsKvlab) {
  std::string why;
  if (!test::have_llama_cpp(why)) GTEST_SKIP() << why;
  const Tokenizer tok = letters();
  const int64_t n_new = 112;
  std::vector<PeerJob> jobs;
  for (int64_t nkv : {8, 2, 1, 0})
    for (GgmlType type : {GgmlType::F32, GgmlType::F16, GgmlType::Q8_0}) {
      if (type != GgmlType::F32 && nkv != 2) continue;
      // nkv 0: GPT-2's block (llama.cpp's gpt2) with 2 KV heads.
      GPTConfig c = llama_config(nkv > 0 ? nkv : 2, nkv != 1);
      if (nkv == 0) {
        c.pos = "learned";
        c.norm = "layernorm";
        c.mlp = "gelu";
        c.bias = true;
      }
      auto model = random_model(c, 20 + static_cast<uint64_t>(nkv));
      PeerJob job;
      job.name = (nkv > 0 ? "nkv" + std::to_string(nkv) : std::string("gpt2_nkv2")) + "_" +
                 ggml_type_name(type);
      job.gguf = dir_ / (job.name + ".gguf");
      // f32: every token and 2e-4. f16: llama.cpp rounds the activations to f16 as well, and
      // q8_0 quantises them to q8_0 blocks, so the two part after a few tokens (q8_0 at once,
      // with these weights): their first steps' log-probabilities are compared.
      // gpt2: ggml's CPU GELU rounds its input to f16 and reads a table, so 1e-2 there.
      job.min_same = type == GgmlType::F32 ? n_new : type == GgmlType::F16 ? 16 : 0;
      job.tolerance = type == GgmlType::F32 ? (nkv == 0 ? 1e-2 : 2e-4)
                      : type == GgmlType::F16 ? 0.1 : 0.5;
      const GgufFile f = model_to_gguf(*model, tok, type, {});
      write_gguf(job.gguf, f);
      // f32 is exact (GgufRoundTrip); the rounded types are compared with their import.
      std::unique_ptr<GPT> rounded;
      if (type != GgmlType::F32) rounded = model_of(gguf_to_checkpoint(read_gguf(job.gguf), job.name));
      job.expected = greedy(rounded ? *rounded : *model, tok, kPrompt, n_new, &job.logits);
      jobs.push_back(std::move(job));
    }
  nlohmann::json spec = nlohmann::json::array();
  for (const PeerJob& j : jobs)
    spec.push_back({{"model", j.gguf.string()}, {"prompt", kPrompt}, {"new_tokens", n_new},
                    {"threads", 1}});
  std::string failure;
  const nlohmann::json out = test::llama_cpp_greedy(spec, dir_, failure);
  if (!failure.empty()) FAIL() << failure;
  ASSERT_EQ(out.size(), jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    const PeerJob& j = jobs[i];
    ASSERT_EQ(out[i]["tokens"].size(), j.expected.size()) << j.name;
    const test::Agreement a = test::agreement(out[i], j.expected, j.logits);
    std::printf("[ llama.cpp ] %s: %zu of %zu greedy tokens the same, max |d log p| %.2e\n",
                j.name.c_str(), a.same, j.expected.size(), a.worst);
    EXPECT_GE(a.same, j.min_same) << j.name;
    EXPECT_LT(a.worst, j.tolerance) << j.name;
  }
}

}  // namespace
}  // namespace kvlab
