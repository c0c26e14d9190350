// kvlab's models through GGUF files: export then import gives the same f32 weights bit for bit
// and the same greedy text; what llama.cpp has no architecture for is refused; and llama.cpp
// itself (node-llama-cpp's prebuilt CPU binaries, tests/infer/llama_cpp/) continues a prompt
// as kvlab does.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <tuple>

#include "autograd/graph.h"
#include "checkpoints/gguf_model.h"
#include "checkpoints/model_io.h"
#include "data/chat_template.h"
#include "data/bpe.h"
#include "infer/engine.h"
#include "platform/ggml_blocks.h"
#include "platform/scalar_codecs.h"
#include "tests/error_of.h"
#include "tests/infer/gguf_test_util.h"
#include "tests/infer/infer_test_util.h"
#include "tests/llama_cpp_source.h"
#include "tests/test_dir.h"
#include "tests/torture_text.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;
using test::greedy;
using test::log_softmax;
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
  const GgufFile file = reparsed(model_to_gguf(*model, tok, gguf_mix(GgmlType::F32), {}));
  EXPECT_EQ(file.get_string("general.architecture", "t"), "llama");
  EXPECT_EQ(file.get_int("llama.attention.head_count_kv", "t"), nkv);
  EXPECT_EQ(file.tensor("output.weight") == nullptr, tied);

  const Checkpoint back = gguf_to_checkpoint(file, "test");
  const NamedArrays before = to_arrays(model->named_parameters());
  test::expect_bit_identical(back.model, before);
  EXPECT_EQ(get_tokenizer(back, "import"), tok);

  auto imported = model_of(back);
  const auto expected = greedy(*model, tok, kPrompt, 40);
  EXPECT_EQ(greedy(*imported, tok, kPrompt, 40), expected);
  EXPECT_GE(std::set<int32_t>(expected.begin(), expected.end()).size(), 5u)
      << "the random model's greedy text is degenerate";
}

INSTANTIATE_TEST_SUITE_P(KvHeads, GgufRoundTrip,
                         ::testing::Combine(::testing::Values(8, 2, 1), ::testing::Bool()));

// q4_0: the blocks' matrices in q4_0, the LM head (output, or token_embd when the head is tied
// to it) in q8_0, and a matrix whose rows are not whole blocks (c_proj's 80) in bf16. Import
// gives each matrix as ggml rounds it (round_to_q4_0, the head round_to_q8_0, of the original;
// c_proj to nearest bf16), the values GPT::round_matrices gives too,
// and exporting the import again gives the same bytes: the quantisers are idempotent.
class GgufQ4RoundTrip : public ::testing::TestWithParam<bool> {};

TEST_P(GgufQ4RoundTrip, ImportHoldsTheRoundedMatricesAndExportsTheSameBytes) {
  const bool tied = GetParam();
  GPTConfig c = llama_config(2, tied);
  c.mlp_hidden = 80;
  auto model = random_model(c, 31);
  const Tokenizer tok = letters();
  const GgufFile file = reparsed(model_to_gguf(*model, tok, gguf_mix(GgmlType::Q4_0), {}));
  EXPECT_EQ(file.get_int("general.file_type", "t"), 2);  // llama.cpp's MOSTLY_Q4_0
  auto type_of = [&](const char* name) {
    const GgufTensor* t = file.tensor(name);
    return t ? ggml_type_name(t->type) : std::string("missing");
  };
  EXPECT_EQ(type_of("blk.0.attn_q.weight"), "q4_0");
  EXPECT_EQ(type_of("blk.1.attn_output.weight"), "q4_0");
  EXPECT_EQ(type_of("blk.1.ffn_gate.weight"), "q4_0");
  EXPECT_EQ(type_of("blk.1.ffn_down.weight"), "bf16");  // rows of 80
  EXPECT_EQ(type_of("blk.0.attn_norm.weight"), "f32");
  EXPECT_EQ(type_of("token_embd.weight"), tied ? "q8_0" : "q4_0");
  EXPECT_EQ(type_of("output.weight"), tied ? "missing" : "q8_0");

  const Checkpoint back = gguf_to_checkpoint(file, "test");
  const NamedArrays original = to_arrays(model->named_parameters());
  NamedArrays rounded = original;
  int changed = 0;
  for (auto& [name, arr] : rounded) {
    if (arr.shape.size() != 2) continue;
    const bool head = name == "lm_head.weight" || (tied && name == "wte.weight");
    if (arr.shape[1] % kGgmlBlock != 0)
      for (float& v : arr.data) v = bf16_to_f32(f32_to_bf16(v));
    else
      (head ? round_to_q8_0 : round_to_q4_0)(arr.data.data(), static_cast<int64_t>(arr.data.size()));
    changed += 1;
  }
  EXPECT_EQ(changed, 1 + 2 * 7 + (tied ? 0 : 1));  // wte, 7 matrices a layer, lm_head
  // The same values as kvlab's own --weight-dtype q4_0 (which leaves an untied token table
  // f32: it is read a row a token, not a product).
  auto own = random_model(c, 31);
  own->round_matrices(WeightDtype::Q4_0);
  NamedArrays mine = to_arrays(own->named_parameters());
  for (auto& [name, arr] : mine)
    if (name == "wte.weight" && !tied) arr = rounded[0].second;
  ASSERT_EQ(rounded[0].first, "wte.weight");
  test::expect_bit_identical(mine, rounded);
  EXPECT_NE(rounded[0].second.data, original[0].second.data) << "nothing was rounded";
  test::expect_bit_identical(back.model, rounded);

  const GgufFile again =
      reparsed(model_to_gguf(*model_of(back), tok, gguf_mix(GgmlType::Q4_0), {}));
  ASSERT_EQ(again.tensors.size(), file.tensors.size());
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    const GgufTensor &a = file.tensors[i], &b = again.tensors[i];
    EXPECT_EQ(b.name, a.name);
    EXPECT_EQ(b.type, a.type) << a.name;
    EXPECT_EQ(b.dims, a.dims) << a.name;
    EXPECT_TRUE(b.data == a.data) << a.name << ": the second export's bytes differ";
  }
}

INSTANTIATE_TEST_SUITE_P(Tied, GgufQ4RoundTrip, ::testing::Bool());

// The q and k rows are reordered for llama.cpp's RoPE; the stored matrix is not kvlab's.
TEST(GgufExport, ReordersQueryAndKeyRowsPerHead) {
  auto model = random_model(llama_config(2), 3);
  const GgufFile f = model_to_gguf(*model, letters(), gguf_mix(GgmlType::F32), {});
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
  const GgufFile f = model_to_gguf(*model, test::tiny_tokenizer(), gguf_mix(GgmlType::F16), {});
  EXPECT_EQ(f.get_string("general.architecture", "t"), "gpt2");
  const GgufTensor* qkv = f.tensor("blk.1.attn_qkv.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->dims, (std::vector<int64_t>{32, 32 + 2 * 2 * 8}));
  EXPECT_EQ(qkv->type, GgmlType::F16);
  EXPECT_EQ(f.tensor("blk.1.attn_qkv.bias")->type, GgmlType::F32);
  EXPECT_NE(f.tensor("position_embd.weight"), nullptr);
  // q4_0: the tied head (token_embd) in q8_0, the blocks' matrices in q4_0.
  const GgufFile q4 = model_to_gguf(*model, test::tiny_tokenizer(), gguf_mix(GgmlType::Q4_0), {});
  EXPECT_EQ(q4.tensor("token_embd.weight")->type, GgmlType::Q8_0);
  EXPECT_EQ(q4.tensor("blk.1.attn_qkv.weight")->type, GgmlType::Q4_0);
  EXPECT_EQ(q4.tensor("blk.1.ffn_down.weight")->type, GgmlType::Q4_0);
  // Import takes llama files only, and says so.
  EXPECT_NE(error_of([&] { gguf_to_checkpoint(f, "g.gguf"); }).find("general.architecture"),
            std::string::npos);
}

TEST(GgufExport, RefusesWhatLlamaCppHasNoArchitectureFor) {
  GPTConfig mixed = test::tiny_config(4, 16, "gpt2");
  mixed.pos = "rope";  // GPT-2's block with RoPE: neither architecture
  auto m = random_model(mixed, 1);
  const auto refused = [&] {
    model_to_gguf(*m, test::tiny_tokenizer(), gguf_mix(GgmlType::F32), {});
  };
  EXPECT_NE(error_of(refused).find("neither llama.cpp's llama"), std::string::npos);
}

TEST(GgufExport, TokenizersComeBackEqual) {
  const std::string text = "the quick brown fox jumps over the lazy dog; the dog sleeps. ";
  std::string corpus;
  for (int i = 0; i < 20; ++i) corpus += text;
  const std::vector<Tokenizer> toks = {
      Tokenizer::build_char("ab\ncd \xc3\xa9\xe2\x82\xac"), Tokenizer::byte_level(),
      Tokenizer::bpe(train_bpe(corpus, 280, SplitPattern::Gpt2)),
      Tokenizer::bpe(train_bpe(corpus, 275, SplitPattern::Kvlab)),
      Tokenizer::bpe(train_bpe(corpus, 278, SplitPattern::Llama3, {}, {"<|a|>", "<|é|>"})),
      Tokenizer::bpe(train_bpe(corpus, 276, SplitPattern::Qwen2))};
  for (const Tokenizer& tok : toks) {
    GPTConfig c = llama_config(2);
    c.vocab_size = tok.vocab_size();
    auto model = random_model(c, 2);
    const Checkpoint back =
        gguf_to_checkpoint(reparsed(model_to_gguf(*model, tok, gguf_mix(GgmlType::F32), {})), "t");
    const Tokenizer got = get_tokenizer(back, "t");
    EXPECT_EQ(got.kind(), tok.kind());
    EXPECT_EQ(got.vocab(), tok.vocab()) << tok.kind_name();
    // The export names a bpe vocabulary's first special token BOS and EOS (as llama.cpp then
    // reads the file), so it comes back so, ending a generation.
    const int n_special = tok.bpe() ? tok.bpe()->n_special() : 0;
    if (n_special == 0) {
      EXPECT_EQ(got.controls(), TokenControls{}) << tok.kind_name();
      continue;
    }
    const int32_t first = tok.vocab_size() - n_special;
    EXPECT_EQ(got.controls().bos, first);
    EXPECT_EQ(got.controls().eos, first);
    EXPECT_FALSE(got.controls().add_bos);
    EXPECT_TRUE(got.ends_generation(first));
  }
}

// A vocabulary that is damaged or hostile is refused naming the key or entry, never read
// into a tokenizer that encodes something else.
TEST(GgufImport, HostileVocabulariesAreRefusedByName) {
  std::string corpus;
  for (int i = 0; i < 20; ++i) corpus += "the quick brown fox jumps over the lazy dog. ";
  const Tokenizer tok = Tokenizer::bpe(train_bpe(corpus, 280, SplitPattern::Llama3));
  GPTConfig c = llama_config(2);
  c.vocab_size = tok.vocab_size();
  const GgufFile good = model_to_gguf(*random_model(c, 2), tok, gguf_mix("f32"), {});
  auto refusal = [&](const std::function<void(GgufFile&)>& damage) {
    GgufFile f = good;
    damage(f);
    return error_of([&] { gguf_tokenizer(reparsed(f), "v.gguf"); });
  };
  auto strings = [](GgufFile& f, const char* key) -> std::vector<std::string>& {
    for (auto& [k, v] : f.metadata)
      if (k == key) return v.strings;
    throw std::runtime_error(key);
  };
  auto ints = [](GgufFile& f, const char* key) -> std::vector<int64_t>& {
    for (auto& [k, v] : f.metadata)
      if (k == key) return v.ints;
    throw std::runtime_error(key);
  };
  EXPECT_EQ(refusal([](GgufFile&) {}), "no error");
  const struct {
    const char* what;
    std::function<void(GgufFile&)> damage;
    const char* named;
  } cases[] = {
      {"a token twice", [&](GgufFile& f) { strings(f, "tokenizer.ggml.tokens")[270] =
                                               strings(f, "tokenizer.ggml.tokens")[265]; },
       "tokenizer.ggml.tokens[270] repeats an earlier token"},
      {"a merge of a missing token",
       [&](GgufFile& f) { strings(f, "tokenizer.ggml.merges")[3] = "zzzq t"; },
       "tokenizer.ggml.merges[3] ('zzzq t') is not two ordinary tokens"},
      {"a merge without a space",
       [&](GgufFile& f) { strings(f, "tokenizer.ggml.merges")[0] = "th"; },
       "tokenizer.ggml.merges[0] ('th')"},
      {"a merge making no token",
       [&](GgufFile& f) { strings(f, "tokenizer.ggml.merges")[5] = "x q"; }, "makes bytes no token has"},
      {"a pair merged twice",
       [&](GgufFile& f) { strings(f, "tokenizer.ggml.merges")[7] = strings(f, "tokenizer.ggml.merges")[6]; },
       "repeats an earlier merge's pair"},
      {"token types of another length",
       [&](GgufFile& f) { ints(f, "tokenizer.ggml.token_type").pop_back(); },
       "tokenizer.ggml.token_type is not one integer a token"},
      {"a token type a BPE has not",
       [&](GgufFile& f) { ints(f, "tokenizer.ggml.token_type")[9] = 6; },
       "tokenizer.ggml.token_type[9] is 6"},
      {"a special token inside the ordinary ones",
       [&](GgufFile& f) { ints(f, "tokenizer.ggml.token_type")[100] = 3; },
       "token 100 is special but ordinary token 101 follows it"},
      {"an ordinary token not in GPT-2's spelling",
       [&](GgufFile& f) { strings(f, "tokenizer.ggml.tokens")[266] = "a b"; },
       "tokenizer.ggml.tokens[266] is not in GPT-2's byte-to-character spelling"},
      {"a pattern other than the pre-tokenizer's",
       [&](GgufFile& f) { f.set("kvlab.bpe_pattern", GgufValue::string("qwen2")); },
       "kvlab.bpe_pattern 'qwen2' is not what tokenizer.ggml.pre 'llama-bpe' splits by"},
  };
  for (const auto& k : cases) {
    const std::string e = refusal(k.damage);
    EXPECT_NE(e.find(k.named), std::string::npos) << k.what << ": " << e;
  }
}

// ---- import refusals ------------------------------------------------------------------------------

TEST(GgufImport, RefusesNamingTheKeyOrTensor) {
  auto model = random_model(llama_config(2), 4);
  const GgufFile good = model_to_gguf(*model, letters(), gguf_mix(GgmlType::Q8_0), {});
  auto refusal = [&](const std::function<void(GgufFile&)>& damage) {
    GgufFile f = good;
    damage(f);
    return error_of([&] { gguf_to_checkpoint(reparsed(f), "m.gguf"); });
  };
  EXPECT_EQ(refusal([](GgufFile&) {}), "no error");
  EXPECT_NE(refusal([](GgufFile& f) { f.set("tokenizer.ggml.model", GgufValue::string("bert")); })
                .find("tokenizer.ggml.model"),
            std::string::npos);
  EXPECT_NE(refusal([](GgufFile& f) {
              f.set("tokenizer.ggml.pre", GgufValue::string("qwen2"));
              f.metadata.erase(f.metadata.begin() + 0);  // general.architecture gone too
            }).find("general.architecture"),
            std::string::npos);
  EXPECT_NE(refusal([](GgufFile& f) {
              f.set("llama.attention.layer_norm_rms_epsilon", GgufValue::real(GgufType::F32, 0));
            }).find("layer_norm_rms_epsilon is 0"),
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
  // Scaled RoPE kvlab lacks, and factors that are not factors.
  EXPECT_NE(refusal([](GgufFile& f) {
              f.set("llama.rope.scaling.type", GgufValue::string("yarn"));
            }).find("llama.rope.scaling.type is 'yarn'"),
            std::string::npos);
  EXPECT_NE(refusal([](GgufFile& f) {
              f.set("llama.rope.scaling.factor", GgufValue::real(GgufType::F32, -2));
            }).find("llama.rope.scaling.factor is -2"),
            std::string::npos);
  const int64_t half = llama_config(2).head_size() / 2;
  for (const auto& [n, factor, message] :
       {std::tuple{half + 1, 2.0f, "rope_freqs.weight is not one factor"},
        std::tuple{half, std::nanf(""), "rope_freqs factor is nan"},
        std::tuple{half, 0.0f, "rope_freqs factor is 0"}}) {
    const std::string why = refusal([&](GgufFile& f) {
      f.tensors.push_back(make_gguf_tensor(
          "rope_freqs.weight", {{n}, std::vector<float>(static_cast<size_t>(n), factor)},
          GgmlType::F32));
    });
    EXPECT_NE(why.find(message), std::string::npos) << why;
  }
}

// A block tensor whose scale is an infinity or a NaN (a hostile or broken file) decodes to
// values that are not finite: import refuses it by the tensor's name, for every block type.
TEST(GgufImport, BlocksWithNonFiniteScalesAreRefusedByTensor) {
  GPTConfig c = llama_config(2);
  c.n_head = 4;
  c.n_embd = 256;  // whole super-blocks in attn_q's rows
  auto model = random_model(c, 4);
  const GgufFile good = model_to_gguf(*model, letters(), gguf_mix("f32"), {});
  const ArrayF32 q = gguf_tensor_values(*good.tensor("blk.0.attn_q.weight"));
  for (const GgmlType type : {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q5_1,
                              GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K}) {
    // Where the block keeps its first f16 scale (ggml-common.h): q6_K's after its codes.
    const size_t scale_at = type == GgmlType::Q6_K ? 208 : 0;
    for (const uint16_t bad : {uint16_t{0x7c00}, uint16_t{0x7e00}}) {  // +inf, a NaN
      GgufFile f = good;
      for (GgufTensor& t : f.tensors)
        if (t.name == "blk.0.attn_q.weight") {
          t = make_gguf_tensor(t.name, q, type);
          std::memcpy(t.data.data() + scale_at, &bad, 2);
        }
      const std::string e = error_of([&] { gguf_to_checkpoint(reparsed(f), "m.gguf"); });
      EXPECT_NE(e.find("blk.0.attn_q.weight holds NaN or inf"), std::string::npos)
          << ggml_type_name(type) << ": " << e;
    }
  }
}

// ---- llama.cpp itself ------------------------------------------------------------------------------

struct PeerJob {
  std::string name;
  fs::path gguf;
  GgmlType type;
  bool tame;                                 // the matrices scaled down
  bool rounded;                              // f16, q8_0 or q4_0 matrices
  std::vector<int32_t> expected;             // kvlab's greedy tokens
  std::vector<std::vector<float>> logits;    // kvlab's logits before each of them
  // Rounded types: the unrounded (f32) model's logits before each of kvlab's greedy tokens,
  // and those of the model rounded apart from the file (rounded_copy) to the activations' type.
  std::vector<std::vector<float>> unrounded, rounded_here;
  // q8_0 and q4_0: kvlab's logits before each greedy token with integer products (int8_logits).
  std::vector<std::vector<float>> int8;
  double tolerance;                          // f32: on each step's log-probabilities
  // The bound tau must not pass llama.cpp against the unrounded weights (4-bit matrices).
  bool bound_excludes_unrounded = false;
  double activation_rounding = 0;  // tau / W (kActivationRounding where 0)
};

// The largest |log p| difference between kvlab's logits and llama.cpp's log-probabilities of
// one step, over the tokens kvlab gives at least 1e-4 (node-llama-cpp leaves out tokens of
// probability 0; below 1e-4 float rounding of the normaliser dominates).
double logprob_gap(const std::vector<float>& ours_logits, const nlohmann::json& theirs) {
  const std::vector<double> ours = log_softmax(ours_logits);
  double worst = 0;
  for (size_t id = 0; id < ours.size(); ++id) {
    if (ours[id] < std::log(1e-4)) continue;
    if (id >= theirs.size() || theirs[id].is_null()) return INFINITY;  // llama.cpp gave it 0
    worst = std::max(worst, std::fabs(theirs[id].get<double>() - ours[id]));
  }
  return worst;
}

// The gap between kvlab's two largest logits: the same in log p.
double top2_margin(const std::vector<float>& l) {
  float a = -INFINITY, b = -INFINITY;
  for (float v : l) {
    if (v > a) b = a, a = v;
    else if (v > b) b = v;
  }
  return a - b;
}

// One row of kvlab's logits as log-probabilities in the form llama.cpp's come in.
nlohmann::json as_logprobs(const std::vector<float>& logits) { return log_softmax(logits); }

// The model's logits before each of `tokens` fed after `prompt` (one forward pass).
std::vector<std::vector<float>> forced_logits(GPT& model, const std::vector<int32_t>& prompt,
                                              const std::vector<int32_t>& tokens) {
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), tokens.begin(), tokens.end() - 1);
  const int64_t T = static_cast<int64_t>(seq.size());
  NoGradGuard no_grad;
  const Tensor logits = model.forward(Tensor::from_vector(seq, {1, T})).contiguous();
  const int64_t V = logits.size(2);
  const float* d = logits.data<float>();
  std::vector<std::vector<float>> rows;
  for (int64_t t = static_cast<int64_t>(prompt.size()) - 1; t < T; ++t)
    rows.emplace_back(d + t * V, d + (t + 1) * V);
  return rows;
}

// forced_logits through the fused decode step with integer products (DecodeStep::int8_products):
// every position a step, the prompt's too, so that each product's input is rounded to q8_0
// blocks as llama.cpp rounds it.
std::vector<std::vector<float>> int8_logits(const GPT& model, const std::vector<int32_t>& prompt,
                                            const std::vector<int32_t>& tokens) {
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), tokens.begin(), tokens.end() - 1);
  const GPTConfig& c = model.config();
  DecodeStep step(model);
  step.int8_products = true;
  const DecodeStep::PackGuard pack = step.pack();
  ContiguousKVCache cache(c.n_layer, 1, c.block_size, c.n_kv_head, c.head_size());
  NoGradGuard no_grad;
  std::vector<std::vector<float>> rows;
  for (size_t t = 0; t < seq.size(); ++t) {
    const Tensor logits = step.forward(Tensor::from_vector(std::vector<int32_t>{seq[t]}, {1, 1}), cache);
    if (t + 1 >= prompt.size()) rows.push_back(logits.to_vector<float>());
  }
  return rows;
}

// The model with every matrix rounded to `type` (norms stay f32), made here from the weights,
// apart from the file and its import: what rounding alone moves.
std::unique_ptr<GPT> rounded_copy(GPT& model, const Format& format) {
  NamedArrays a = to_arrays(model.named_parameters());
  for (auto& [name, arr] : a)
    if (arr.shape.size() == 2) {
      std::vector<uint8_t> bytes(static_cast<size_t>(
          format_row_bytes(format, static_cast<int64_t>(arr.data.size()))));
      format.quantise(arr.data.data(), static_cast<int64_t>(arr.data.size()), bytes.data());
      format.dequantise(bytes.data(), static_cast<int64_t>(arr.data.size()), arr.data.data());
    }
  auto m = std::make_unique<GPT>(model.config(), 0);
  copy_into(m->named_parameters(), a, "model", "test");
  m->set_training(false);
  return m;
}

// What llama.cpp's CPU products round the activations to for weights of `type` (ggml's
// vec_dot_type): f16 for f16, q8_0 blocks for q8_0 and for q4_0 (the q8_0 head's too).
GgmlType activation_type(GgmlType type) {
  return type == GgmlType::F16 ? GgmlType::F16 : GgmlType::Q8_0;
}

int32_t argmax(const nlohmann::json& logprobs) {
  int32_t best = -1;
  for (size_t id = 0; id < logprobs.size(); ++id)
    if (!logprobs[id].is_null() &&
        (best < 0 || logprobs[id].get<double>() > logprobs[best].get<double>()))
      best = static_cast<int32_t>(id);
  return best;
}

// llama.cpp's rounding of the activations moves the log-probabilities by at most this many times
// W, what rounding the weights to the activations' type moves kvlab's (measured: 0.50 to 1.35 W;
// docs/gguf.md).
constexpr double kActivationRounding = 1.5;

// One job: a random model of n_kv_head nkv (0: GPT-2's block with 2 KV heads; -2: 2 KV heads
// with tamed matrices) exported at `type` into dir, with kvlab's greedy tokens and logits.
PeerJob make_peer_job(GgmlType type, int64_t nkv, const Tokenizer& tok, const fs::path& dir,
                      int64_t n_new) {
  // nkv 0: GPT-2's block (llama.cpp's gpt2) with 2 KV heads.
  GPTConfig c = llama_config(nkv > 0 ? nkv : 2, nkv != 1);
  // nkv -2: 2 KV heads with the matrices scaled by 0.4 (std 0.14), whose log-probabilities
  // q8_0 moves by a tenth of the large ones': there most steps decide a token.
  const bool tame = nkv < 0;
  if (nkv == 0) {
    c.pos = "learned";
    c.norm = "layernorm";
    c.mlp = "gelu";
    c.bias = true;
  }
  auto model = random_model(c, 20 + static_cast<uint64_t>(nkv));
  if (tame)
    for (auto& [n, t] : model->named_parameters())
      if (t.dim() == 2) {
        Tensor p = t;
        for (int64_t k = 0; k < p.numel(); ++k) p.data<float>()[k] *= 0.4f;
      }
  PeerJob job;
  job.name = (tame      ? std::string("tame_nkv2")
              : nkv > 0 ? "nkv" + std::to_string(nkv)
                        : std::string("gpt2_nkv2")) +
             "_" +
             ggml_type_name(type);
  job.gguf = dir / (job.name + ".gguf");
  job.type = type;
  job.tame = tame;
  job.rounded = type != GgmlType::F32;
  job.bound_excludes_unrounded = type == GgmlType::Q4_0;
  // gpt2: ggml's CPU GELU rounds its input to f16 and reads a table, so 1e-2 there.
  job.tolerance = nkv == 0 ? 1e-2 : 2e-4;  // f32; the rounded types' is kActivationRounding W
  const GgufFile f = model_to_gguf(*model, tok, gguf_mix(type), {});
  write_gguf(job.gguf, f);
  // f32 is exact (GgufRoundTrip); the rounded types are compared with their import.
  std::unique_ptr<GPT> rounded;
  if (job.rounded) rounded = model_of(gguf_to_checkpoint(read_gguf(job.gguf), job.name));
  job.expected = greedy(rounded ? *rounded : *model, tok, kPrompt, n_new, &job.logits);
  if (rounded) {
    job.unrounded = forced_logits(*model, kPrompt, job.expected);
    job.rounded_here =
        forced_logits(*rounded_copy(*model, format_of(activation_type(type))), kPrompt, job.expected);
    if (type == GgmlType::Q8_0 || type == GgmlType::Q4_0)
      job.int8 = int8_logits(*rounded, kPrompt, job.expected);
  }
  return job;
}

// A rounded job against llama.cpp's output for it (out: tokens, logprobs, forced_logprobs;
// `same` of its greedy tokens kvlab's): SameGreedyContinuationAsKvlab's rules below.
void expect_within_activation_rounding(const PeerJob& j, const nlohmann::json& out,
                                       const std::vector<int32_t>& tokens, size_t same) {
  // W: what rounding the weights alone moves kvlab's log-probabilities by on these steps (the
  // f32 model against its matrices rounded here, not through the file): the scale of what
  // llama.cpp's rounding of the other operand of each product, the activations, moves.
  const nlohmann::json& forced = out["forced_logprobs"];
  ASSERT_EQ(forced.size(), j.expected.size()) << j.name;
  double weight_rounding = 0;
  for (size_t s = 0; s < forced.size(); ++s)
    weight_rounding =
        std::max(weight_rounding, logprob_gap(j.rounded_here[s], as_logprobs(j.unrounded[s])));
  const double tau =
      (j.activation_rounding > 0 ? j.activation_rounding : kActivationRounding) * weight_rounding;
  size_t first_close = 0;  // the first step whose top-2 margin is at most 2 tau
  while (first_close < j.logits.size() && top2_margin(j.logits[first_close]) > 2 * tau)
    ++first_close;
  double forced_worst = 0, vs_unrounded = 0, int8_worst = 0;
  size_t decided = 0, decided_alike = 0;
  for (size_t s = 0; s < forced.size(); ++s) {
    if (!j.int8.empty()) int8_worst = std::max(int8_worst, logprob_gap(j.int8[s], forced[s]));
    const double gap = logprob_gap(j.logits[s], forced[s]);
    forced_worst = std::max(forced_worst, gap);
    vs_unrounded = std::max(vs_unrounded, logprob_gap(j.unrounded[s], forced[s]));
    EXPECT_LT(gap, tau) << j.name << " step " << s << " (teacher-forced)";
    const double margin = top2_margin(j.logits[s]);
    if (margin > 2 * tau) {
      ++decided;
      decided_alike += argmax(forced[s]) == j.expected[s];
      EXPECT_EQ(argmax(forced[s]), j.expected[s])
          << j.name << " step " << s << ": kvlab's margin " << margin;
    }
  }
  std::printf(
      "[ llama.cpp ] %s: weight rounding W %.2e, tau %.2e; teacher-forced: max |d log p| %.2e "
      "(%.2f W) over %zu steps, top token the same at %zu of the %zu steps with margin > 2 tau; "
      "free decode: %zu of %zu greedy tokens the same, first margin <= 2 tau at step %zu; "
      "llama.cpp against the unrounded model: %.2e (%.2f W)\n",
      j.name.c_str(), weight_rounding, tau, forced_worst, forced_worst / weight_rounding,
      forced.size(), decided_alike, decided, same, tokens.size(), first_close, vs_unrounded,
      vs_unrounded / weight_rounding);
  EXPECT_GE(same, first_close) << j.name << ": the texts part before any close step";
  // With integer products kvlab rounds the activations as llama.cpp does: what is left is
  // the order of float sums, and a code where that moves a value across a rounding edge,
  // which the large random weights amplify (measured 0.02-0.2 W) and the tame ones do not
  // (5e-7: the same numbers).
  if (!j.int8.empty()) {
    std::printf("[ llama.cpp ] %s: kvlab with integer products: max |d log p| %.2e (%.3f W)\n",
                j.name.c_str(), int8_worst, int8_worst / weight_rounding);
    EXPECT_LT(int8_worst, j.tame ? 1e-4 : 0.35 * weight_rounding) << j.name << ": integer products";
  }
  // q8_0 moves the large random weights' log-probabilities by 1 to 1.6: few steps have a
  // margin past 2 tau there, and the top-token check is nearly empty; the tame model's have.
  if (j.type == GgmlType::F16 || j.tame) {
    EXPECT_GE(decided, forced.size() / 2) << j.name << ": too few steps decide anything";
  }
  // q4_0's own rounding is some 16 times q8_0's (4 bits against 8), so the bound, scaled by
  // the activations' q8_0 rounding, cannot pass llama.cpp against the unrounded weights.
  if (j.bound_excludes_unrounded) {
    EXPECT_GT(vs_unrounded, tau) << j.name << ": the bound does not tell 4-bit weights from f32";
  }
}

class GgufLlamaCpp : public kvlab::testing::TestDirFixture {
 protected:
  GgufLlamaCpp() : TestDirFixture("kvlab-gguf-llama-cpp") {}
};

// kvlab and llama.cpp decode the same GGUF, llama.cpp on 1 thread with an f32 KV cache.
//
// f32 exports of the llama block at n_kv_head 8, 2 and 1: the same 112 greedy tokens and
// next-token log-probabilities within 2e-4 at every step (GPT-2's block with 2 KV heads, as
// llama.cpp's gpt2: the same tokens, within 1e-2).
//
// f16, q8_0 and q4_0 exports, at n_kv_head 8, 2 and 1, against kvlab decoding the same rounded
// weights (the file imported back). llama.cpp also rounds what it multiplies those weights by
// (the activations: to f16 for f16 weights, to q8_0 blocks of 32 with one scale each for q8_0
// and q4_0 weights), kvlab does not, so their log-probabilities differ by up to a tolerance
// tau = kActivationRounding W, W being what rounding the weights alone to the activations' type
// moves kvlab's own (measured in the run; docs/gguf.md has the figures). What must then hold:
//  - with llama.cpp fed kvlab's greedy tokens (teacher forcing, every one of the 112 steps):
//    each step's log-probabilities within tau, and llama.cpp's top token kvlab's wherever
//    kvlab's top-2 margin exceeds 2 tau (a gap below tau on both cannot swap them there);
//  - decoding freely, the same greedy tokens up to the first step whose margin is at most 2 tau
//    (where the texts may part, and after which they need not agree);
//  - f16, and q8_0 and q4_0 on the tame model: at least half of the steps have a margin past
//    2 tau;
//  - q4_0: the same comparison with kvlab decoding the unrounded model instead of the import
//    (a planted error: weights other than the file's) fails, its gap past tau.
// q8_0 and q4_0 again with kvlab's integer products (DecodeStep::int8_products, which round the
// activations as llama.cpp does), teacher-forced: within 1e-4 on the tame model, 0.35 W on the
// large random ones.
TEST_F(GgufLlamaCpp, SameGreedyContinuationAsKvlab) {
  std::string why;
  if (!test::have_llama_cpp(why)) GTEST_SKIP() << why;
  const Tokenizer tok = letters();
  const int64_t n_new = 112;
  std::vector<PeerJob> jobs;
  for (GgmlType type : {GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0})
    for (int64_t nkv : {8, 2, 1, 0, -2}) {
      if (type != GgmlType::F32 && nkv == 0) continue;
      if (type == GgmlType::F32 && nkv < 0) continue;
      jobs.push_back(make_peer_job(type, nkv, tok, dir_, n_new));
    }
  nlohmann::json spec = nlohmann::json::array();
  for (const PeerJob& j : jobs) {
    nlohmann::json s = {{"model", j.gguf.string()}, {"prompt", kPrompt}, {"new_tokens", n_new},
                        {"threads", 1}};
    if (j.rounded) s["forced"] = j.expected;
    spec.push_back(s);
  }
  std::string failure;
  const nlohmann::json out = test::llama_cpp_greedy(spec, dir_, failure);
  if (!failure.empty()) FAIL() << failure;
  ASSERT_EQ(out.size(), jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    const PeerJob& j = jobs[i];
    const auto tokens = out[i]["tokens"].get<std::vector<int32_t>>();
    ASSERT_EQ(tokens.size(), j.expected.size()) << j.name;
    size_t same = 0;
    while (same < tokens.size() && tokens[same] == j.expected[same]) ++same;
    // The log-probabilities at each step both decoded alike (and the next).
    double worst = 0;
    for (size_t s = 0; s <= std::min(same, tokens.size() - 1); ++s)
      worst = std::max(worst, logprob_gap(j.logits[s], out[i]["logprobs"][s]));
    if (!j.rounded) {
      std::printf("[ llama.cpp ] %s: %zu of %zu greedy tokens the same, max |d log p| %.2e\n",
                  j.name.c_str(), same, tokens.size(), worst);
      EXPECT_EQ(same, tokens.size()) << j.name;
      EXPECT_LT(worst, j.tolerance) << j.name;
      continue;
    }
    expect_within_activation_rounding(j, out[i], tokens, same);
  }
}


// ---- llama-quantize's own files ---------------------------------------------------------------

// llama-quantize's mix `ftype` (llama.h's llama_ftype) of the f32 GGUF `in`, written to `out` by
// its own quantiser (tests/infer/llama_cpp/quantize.py: llama_model_quantize from
// node-llama-cpp's prebuilt libllama), or its --pure form; false with why when it cannot run.
bool llama_quantize(const fs::path& in, const fs::path& out, int ftype, std::string& why,
                    bool pure = false) {
  const fs::path bins = test::kLlamaCppPeer / "node_modules/@node-llama-cpp/linux-x64/bins/linux-x64";
  const std::string cmd = std::string(KVLAB_PYTHON3) + " '" +
                          (test::kLlamaCppPeer / "quantize.py").string() + "' '" + bins.string() +
                          "' '" + in.string() + "' '" + out.string() + "' " +
                          std::to_string(ftype) + (pure ? " --pure" : "");
  return test::run_peer_script(cmd, out.string() + ".log", "llama-quantize's library", why);
}

// One job: a random llama model of 256 channels and an MLP of 768, so that every matrix is
// whole K-quant super-blocks and each mix keeps its own types, its matrices scaled to 0.12 of
// the large random ones (tamer than 0.4 at 64 channels: most steps' margins then pass 2 tau),
// written at f32 by kvlab and quantised by llama-quantize's library; kvlab decodes the import.
// W's rounding: q8_K, what llama.cpp rounds a K-quant product's activations to (q8_0 for
// the q4_0 mix, whose matrices are q4_0 but for its q6_K token table).
PeerJob make_llama_quantize_job(int ftype, const std::string& name, const Tokenizer& tok,
                                const fs::path& dir, int64_t n_new, std::string& why) {
  GPTConfig c = llama_config(2);
  c.n_head = 4;
  c.n_embd = 256;
  c.mlp_hidden = 768;
  auto model = random_model(c, 40);
  for (auto& [n, t] : model->named_parameters())
    if (t.dim() == 2) {
      Tensor p = t;
      for (int64_t k = 0; k < p.numel(); ++k) p.data<float>()[k] *= 0.12f;
    }
  PeerJob job;
  job.name = name;
  job.gguf = dir / (name + ".gguf");
  job.type = GgmlType::F32;  // a mix: the file's tensors say their types
  job.tame = true;
  job.rounded = true;
  job.bound_excludes_unrounded = ftype == 2;
  // q8_K's one scale per 256 activations rounds coarser than q8_0's per 32 that
  // kActivationRounding was measured for: 1.02-1.48 W here (AVX2), so 2 W.
  job.activation_rounding = 2.0;
  const fs::path f32 = dir / (name + "_f32.gguf");
  write_gguf(f32, model_to_gguf(*model, tok, gguf_mix(GgmlType::F32), {}));
  if (!llama_quantize(f32, job.gguf, ftype, why)) return job;
  const auto imported = model_of(gguf_to_checkpoint(read_gguf(job.gguf), name));
  job.expected = greedy(*imported, tok, kPrompt, n_new, &job.logits);
  job.unrounded = forced_logits(*model, kPrompt, job.expected);
  const Format& activations = format(ftype == 2 ? Fmt::Q8_0 : Fmt::Q8_K);
  job.rounded_here = forced_logits(*rounded_copy(*model, activations), kPrompt, job.expected);
  return job;
}

// The ggml types of a file's tensors, by name.
std::map<std::string, std::string> tensor_types(const fs::path& gguf) {
  std::map<std::string, std::string> types;
  for (const GgufTensor& t : read_gguf(gguf).tensors) types[t.name] = ggml_type_name(t.type);
  return types;
}

// llama-quantize's Q4_K_M, Q5_K_M, Q6_K and Q4_0 of one random model, imported by kvlab (the
// K-quants dequantised as ggml does) and decoded by both, teacher-forced, by the rules of
// SameGreedyContinuationAsKvlab below with W measured against q8_K (or q8_0) rounding, and
// tau = 2 W.
TEST_F(GgufLlamaCpp, LlamaQuantizeMixesImportAndDecodeAsLlamaCpp) {
  std::string why;
  if (!test::have_llama_cpp(why)) GTEST_SKIP() << why;
  const Tokenizer tok = letters();
  const int64_t n_new = 112;
  std::vector<PeerJob> jobs;
  for (const auto& [ftype, name, k_type] :
       {std::tuple{15, "q4_k_m", "q4_k"}, std::tuple{17, "q5_k_m", "q5_k"},
        std::tuple{18, "q6_k", "q6_k"}, std::tuple{2, "q4_0", "q6_k"}}) {
    jobs.push_back(make_llama_quantize_job(ftype, std::string("llama_quantize_") + name, tok,
                                           dir_, n_new, why));
    if (jobs.back().expected.empty()) GTEST_SKIP() << why;
    // The mix holds the K-quant it is named for (the q4_0 mix: its q6_K token table).
    const auto types = tensor_types(jobs.back().gguf);
    EXPECT_TRUE(std::any_of(types.begin(), types.end(),
                            [&](const auto& t) { return t.second == k_type; }))
        << name << " holds no " << k_type << " tensor";
  }
  nlohmann::json spec = nlohmann::json::array();
  for (const PeerJob& j : jobs)
    spec.push_back({{"model", j.gguf.string()}, {"prompt", kPrompt}, {"new_tokens", n_new},
                    {"threads", 1}, {"forced", j.expected}});
  std::string failure;
  const nlohmann::json out = test::llama_cpp_greedy(spec, dir_, failure);
  if (!failure.empty()) FAIL() << failure;
  ASSERT_EQ(out.size(), jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    const auto tokens = out[i]["tokens"].get<std::vector<int32_t>>();
    ASSERT_EQ(tokens.size(), jobs[i].expected.size()) << jobs[i].name;
    size_t same = 0;
    while (same < tokens.size() && tokens[same] == jobs[i].expected[same]) ++same;
    expect_within_activation_rounding(jobs[i], out[i], tokens, same);
  }
}

// ---- kvlab's mixes against llama-quantize's -------------------------------------------------

// kvlab export --dtype D (and --pure) against llama-quantize's D (and --pure) of kvlab's f32
// export of the same model: the same tensors (llama-quantize orders them its own way), each of
// the same shape and type and the same bytes, and the files the same general.file_type. Eight layers, so that the _M mixes' more-bits
// layers (0, 3, 6 and 7) and the others are both there; an FFN of 800, so that ffn_down's rows
// are not whole super-blocks and fall back (q5_0, q5_1, q8_0); tied and untied heads, so that
// the 6-bit rule meets token_embd and output; and GPT-2's block, whose attn_qkv is attn_v-like
// and whose position table is left alone.
TEST_F(GgufLlamaCpp, ExportMixesAreLlamaQuantizesTypesAndBytes) {
  std::vector<std::pair<std::string, GPTConfig>> models;
  for (const bool tied : {true, false}) {
    GPTConfig c = llama_config(2, tied);
    c.n_layer = 8;
    c.n_head = 4;
    c.n_embd = 256;
    c.mlp_hidden = 800;
    models.emplace_back(tied ? "llama_tied" : "llama_untied", c);
  }
  GPTConfig gpt2 = test::tiny_config(2, 16, "gpt2");
  gpt2.n_layer = 8;
  gpt2.n_embd = 256;
  gpt2.vocab_size = 27;
  models.emplace_back("gpt2", gpt2);
  const Tokenizer tok = letters();
  int quantised_tensors = 0;
  std::set<std::string> types_seen;
  for (const auto& [model_name, c] : models) {
    auto model = random_model(c, 50);
    const fs::path f32 = dir_ / (model_name + "_f32.gguf");
    write_gguf(f32, model_to_gguf(*model, tok, gguf_mix("f32"), {}));
    for (const GgufMix& mix : kGgufMixes) {
      if (mix.file_type == 0) continue;
      for (const bool pure : {false, true}) {
        const std::string name = model_name + "_" + mix.name + (pure ? "_pure" : "");
        SCOPED_TRACE(name);
        std::string why;
        const fs::path theirs_path = dir_ / (name + ".gguf");
        if (!llama_quantize(f32, theirs_path, mix.file_type, why, pure)) GTEST_SKIP() << why;
        const GgufFile theirs = read_gguf(theirs_path);
        const GgufFile ours = reparsed(model_to_gguf(*model, tok, mix, {}, MlaUpForm::Split, pure));
        EXPECT_EQ(ours.get_int("general.file_type", name), theirs.get_int("general.file_type", name));
        ASSERT_EQ(ours.tensors.size(), theirs.tensors.size());
        for (const GgufTensor& a : ours.tensors) {  // llama-quantize writes them in its order
          const GgufTensor* found = theirs.tensor(a.name);
          ASSERT_NE(found, nullptr) << a.name;
          const GgufTensor& b = *found;
          EXPECT_EQ(a.dims, b.dims) << a.name;
          EXPECT_EQ(ggml_type_name(a.type), ggml_type_name(b.type)) << a.name;
          EXPECT_TRUE(a.data == b.data) << a.name << ": the same type, other bytes";
          quantised_tensors += format_of(a.type).block_values > 1;
          types_seen.insert(ggml_type_name(a.type));
        }
      }
    }
  }
  // The comparison reached every type the mixes write.
  for (const char* t : {"q8_0", "q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "f16", "bf16"})
    EXPECT_TRUE(types_seen.count(t)) << "no tensor was " << t;
  EXPECT_GT(quantised_tensors, 0);
}

// ---- model families' vocabularies ---------------------------------------------------------------

// A random llama block written by gguf-py around a family's vocabulary (llama.cpp's
// models/ggml-vocab-<family>.gguf, tests/infer/llama_cpp/family_model.py); false with why when
// the source or gguf-py is missing.
bool write_family_model(const std::string& family, const fs::path& out, std::string& why,
                        const std::string& arch = "llama", const std::string& rope = "plain") {
  const fs::path src = test::llama_cpp_source(why);
  if (src.empty()) return false;
  const std::string cmd = std::string(KVLAB_PYTHON3) + " '" +
                          (test::kLlamaCppPeer / "family_model.py").string() + "' '" +
                          (src / "gguf-py").string() + "' '" +
                          (src / "models" / ("ggml-vocab-" + family + ".gguf")).string() + "' '" +
                          out.string() + "' 7 " + (family == "qwen2" ? "1e-6" : "1e-5") + " " +
                          arch + " " + rope;
  return test::run_peer_script(cmd, out.string() + ".log", "gguf-py's writer", why);
}

// The largest difference between llama.cpp's log-probabilities of one step and kvlab's logits
// (over the tokens kvlab gives at least 1e-4), each side less its mean over those tokens: the
// logits compared up to the normaliser, whose f32 sum over a vocabulary of 150,000 tokens
// rounds by more than the logits differ.
double logit_gap(const nlohmann::json& theirs, const std::vector<float>& ours_logits) {
  const std::vector<double> ours = log_softmax(ours_logits);
  std::vector<double> d;
  for (size_t id = 0; id < ours.size(); ++id) {
    if (ours[id] < std::log(1e-4)) continue;
    if (id >= theirs.size() || theirs[id].is_null()) return INFINITY;  // llama.cpp gave it 0
    d.push_back(theirs[id].get<double>() - ours[id]);
  }
  double mean = 0, worst = 0;
  for (double v : d) mean += v / static_cast<double>(d.size());
  for (double v : d) worst = std::max(worst, std::fabs(v - mean));
  return worst;
}

// Bytes as a JavaScript string holds them (what node-llama-cpp's detokenize returns): each
// maximal part of an invalid UTF-8 sequence one U+FFFD, as WHATWG's decoder replaces it.
std::string as_js_string(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<uint8_t>(s[i]);
    size_t need = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b < 0x80) {
      out += s[i++];
      continue;
    }
    if (b >= 0xC2 && b <= 0xDF) {
      need = 1;
    } else if (b >= 0xE0 && b <= 0xEF) {
      need = 2, lo = b == 0xE0 ? 0xA0 : 0x80, hi = b == 0xED ? 0x9F : 0xBF;
    } else if (b >= 0xF0 && b <= 0xF4) {
      need = 3, lo = b == 0xF0 ? 0x90 : 0x80, hi = b == 0xF4 ? 0x8F : 0xBF;
    }
    size_t k = 1;
    for (; need > 0 && k <= need && i + k < s.size(); ++k, lo = 0x80, hi = 0xBF) {
      const auto c = static_cast<uint8_t>(s[i + k]);
      if (c < lo || c > hi) break;
    }
    out += need > 0 && k == need + 1 ? std::string(s.substr(i, k)) : "\xEF\xBF\xBD";
    i += k;
  }
  return out;
}

// Text holding user-defined tokens of Qwen2's ([PAD151650]) and DeepSeek Coder's (ö, ü)
// vocabularies, which llama.cpp reads from text as themselves, and text of control tokens and of
// Phi-3's user-defined </s>, which it does not.
constexpr const char* kUserDefinedText =
    "a[PAD151650]b [PAD151650][PAD151651] x</s>y <|endoftext|><s>z <|im_start|> schön, Tür";

// A conversation for each family, rendered by the family's chat template: the file's own where
// the vocabulary carries one (Qwen2's, Phi-3's), else the template of a model of that family
// from llama.cpp's models/templates (GPT-2's vocabulary has none: ChatML's markers are text to
// it).
std::string family_chat(const std::string& family, const Tokenizer& tok, const fs::path& src) {
  const std::map<std::string, std::string> templates = {
      {"gpt-2", "Qwen-Qwen2.5-7B-Instruct"},
      {"llama-bpe", "meta-llama-Llama-3.1-8B-Instruct"},
      {"llama-spm", "mistralai-Mistral-Nemo-Instruct-2407"},
      {"deepseek-llm", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B"},
      {"deepseek-coder", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"}};
  std::string source = tok.controls().chat_template;
  if (source.empty()) {
    std::ifstream in(src / "models" / "templates" / (templates.at(family) + ".jinja"));
    source.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const nlohmann::ordered_json messages = {
      {{"role", "system"}, {"content", "Be brief."}},
      {{"role", "user"}, {"content", "Hi <|im_end|> there, schön?"}},
      {{"role", "assistant"}, {"content", "Hello!"}},
      {{"role", "user"}, {"content", " Two  spaces\n\nand lines."}}};
  return chat_prompt(ChatTemplate(source, family), tok, messages).text;
}

// From text to text, as llama.cpp: for GPT-2's, Llama 3's, Qwen2's, Llama 2's, Phi-3's (these
// two SentencePiece), DeepSeek LLM's and DeepSeek Coder's vocabularies, each in a random llama
// model written by gguf-py (Qwen2's with its RMSNorm epsilon, 1e-6), kvlab's import tokenizes
// the prompt (after BOS where the file asks, as llama.cpp's prompts begin), the torture text
// and kUserDefinedText into llama.cpp's ids, and continues the prompt with llama.cpp's 24 greedy tokens (each step's
// logits within the f32 tolerance, 2e-4, of llama.cpp's less the normaliser), which decode to
// llama.cpp's text. A conversation rendered by the family's chat template encodes, special
// tokens parsed, into llama.cpp's ids, with one BOS first where the file asks.
TEST_F(GgufLlamaCpp, FamilyVocabulariesFromTextToTextAsLlamaCpp) {
  std::string why;
  if (!test::have_llama_cpp(why)) GTEST_SKIP() << why;
  const std::string prompt = "The quick brown fox jumps over the lazy dog's back";
  const int64_t n_new = 24;
  struct Run {
    std::string family;
    Tokenizer tok;
    std::vector<int32_t> prompt, tokens;
    std::vector<std::vector<float>> logits;
    std::string chat;
  };
  std::vector<Run> runs;
  const fs::path src = test::llama_cpp_source(why);
  nlohmann::json spec = nlohmann::json::array();
  for (const std::string family :
       {"gpt-2", "llama-bpe", "qwen2", "llama-spm", "phi-3", "deepseek-llm", "deepseek-coder"}) {
    const fs::path gguf = dir_ / (family + ".gguf");
    if (!write_family_model(family, gguf, why)) GTEST_SKIP() << why;
    const Checkpoint c = gguf_to_checkpoint(read_gguf(gguf), gguf.string());
    EXPECT_EQ(get_gpt_config(c.config, family).norm_eps, family == "qwen2" ? 1e-6f : 1e-5f);
    Run r{family, get_tokenizer(c, family), {}, {}, {}, {}};
    EXPECT_EQ(r.tok.controls().chat_template.empty(), family != "qwen2" && family != "phi-3")
        << "the vocabulary's tokenizer.chat_template is kept";
    r.chat = family_chat(family, r.tok, src);
    r.prompt = r.tok.encode_prompt(prompt, "prompt");
    EXPECT_EQ(r.prompt.front() == 128000, family == "llama-bpe") << "Llama 3's BOS begins a prompt";
    r.tokens = greedy(*model_of(c), r.tok, r.prompt, n_new, &r.logits);
    spec.push_back({{"model", gguf.string()},
                    {"text", prompt},
                    {"bos", true},
                    {"new_tokens", n_new},
                    {"threads", 1},
                    {"tokenize", {std::string(test::kTortureText), kUserDefinedText}},
                    {"tokenize_special", {r.chat}}});
    runs.push_back(std::move(r));
  }
  std::string failure;
  const nlohmann::json out = test::llama_cpp_greedy(spec, dir_, failure);
  if (!failure.empty()) FAIL() << failure;
  ASSERT_EQ(out.size(), runs.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& r = runs[i];
    SCOPED_TRACE(r.family);
    EXPECT_EQ(out[i]["prompt"].get<std::vector<int32_t>>(), r.prompt);
    EXPECT_EQ(out[i]["tokenized"][0].get<std::vector<int32_t>>(),
              r.tok.encode(test::kTortureText, "torture text"));
    EXPECT_EQ(out[i]["tokenized"][1].get<std::vector<int32_t>>(),
              r.tok.encode(kUserDefinedText, "user-defined text"));
    std::vector<int32_t> chat = out[i]["tokenized_special"][0].get<std::vector<int32_t>>();
    const TokenControls& ctl = r.tok.controls();
    if (ctl.add_bos && (chat.empty() || chat.front() != ctl.bos))
      chat.insert(chat.begin(), ctl.bos);
    if (ctl.add_eos && (chat.empty() || chat.back() != ctl.eos)) chat.push_back(ctl.eos);
    EXPECT_EQ(r.tok.encode_chat(r.chat), chat) << r.chat;
    std::printf("[ llama.cpp ] %s: a chat of %zu tokens (%zu as plain text) encoded as llama.cpp\n",
                r.family.c_str(), chat.size(), r.tok.encode(r.chat, "chat").size());
    const test::Agreement a = test::agreement(out[i], r.tokens, r.logits);
    double worst = 0;
    for (size_t step = 0; step < std::min(a.same + 1, r.tokens.size()); ++step)
      worst = std::max(worst, logit_gap(out[i]["logprobs"][step], r.logits[step]));
    std::printf("[ llama.cpp ] %s: %zu of %zu greedy tokens the same, max |d log p| %.2e, "
                "%.2e less the normaliser\n",
                r.family.c_str(), a.same, r.tokens.size(), a.worst, worst);
    EXPECT_EQ(a.same, r.tokens.size());
    EXPECT_LT(worst, 2e-4);
    EXPECT_EQ(out[i]["continuation"].get<std::string>(), as_js_string(r.tok.decode(r.tokens)));
  }
}

// The same text from a model file as llama.cpp, both ways: kvlab imports `gguf` (written by
// gguf-py), exports it again (which must import back to the same weights and tokenizer, chat
// template included, under the same architecture), and continues a text prompt (after BOS where
// the vocabulary asks) with the 24 greedy tokens llama.cpp gives on either file, each step's
// logits within 2e-4 of llama.cpp's less the normaliser. Returns the imported config.
GPTConfig expect_continued_as_llama_cpp(const fs::path& gguf, const fs::path& dir,
                                        const std::string& label) {
  SCOPED_TRACE(label);
  const Checkpoint c = gguf_to_checkpoint(read_gguf(gguf), gguf.string());
  const Tokenizer tok = get_tokenizer(c, label);
  auto model = model_of(c);
  const fs::path exported = dir / (gguf.stem().string() + "-export.gguf");
  write_gguf(exported, model_to_gguf(*model, tok, gguf_mix("f32"), {}));
  const std::string arch = "general.architecture";
  EXPECT_EQ(read_gguf(exported).get_string(arch, "export"), read_gguf(gguf).get_string(arch, "in"));
  const Checkpoint back = gguf_to_checkpoint(read_gguf(exported), exported.string());
  test::expect_bit_identical(back.model, c.model);
  EXPECT_EQ(back.config, c.config);
  EXPECT_EQ(get_tokenizer(back, "export"), tok) << "the vocabulary, its controls and chat template";

  const std::string text = "The quick brown fox jumps over the lazy dog's back";
  const int64_t n_new = 24;
  const std::vector<int32_t> prompt = tok.encode_prompt(text, "prompt");
  std::vector<std::vector<float>> logits;
  const std::vector<int32_t> tokens = greedy(*model, tok, prompt, n_new, &logits);
  nlohmann::json spec = nlohmann::json::array();
  for (const fs::path& f : {gguf, exported})
    spec.push_back({{"model", f.string()}, {"text", text}, {"bos", true}, {"new_tokens", n_new},
                    {"threads", 1}});
  std::string failure;
  const nlohmann::json out = test::llama_cpp_greedy(spec, dir, failure);
  EXPECT_TRUE(failure.empty()) << failure;
  if (!failure.empty() || out.size() != 2) return get_gpt_config(c.config, label);
  for (size_t i = 0; i < out.size(); ++i) {
    const char* which = i == 0 ? "gguf-py's file" : "kvlab's export";
    SCOPED_TRACE(which);
    EXPECT_EQ(out[i]["prompt"].get<std::vector<int32_t>>(), prompt);
    const test::Agreement a = test::agreement(out[i], tokens, logits);
    double worst = 0;
    for (size_t step = 0; step < std::min(a.same + 1, tokens.size()); ++step)
      worst = std::max(worst, logit_gap(out[i]["logprobs"][step], logits[step]));
    std::printf("[ llama.cpp ] %s, %s: %zu of %zu greedy tokens the same, %.2e less the "
                "normaliser\n", label.c_str(), which, a.same, tokens.size(), worst);
    EXPECT_EQ(a.same, tokens.size());
    EXPECT_LT(worst, 2e-4);
  }
  return get_gpt_config(c.config, label);
}

// Qwen2's block: the llama block with biases on q, k and v, and RoPE that pairs channels as
// kvlab's does (llama.cpp's NEOX type): a random qwen2 model, Qwen2's vocabulary, its biases
// read, from text to text as llama.cpp, its export again a qwen2 file.
TEST_F(GgufLlamaCpp, Qwen2sBlockWithQkvBiasesAsLlamaCpp) {
  std::string why;
  if (!test::have_llama_cpp(why)) GTEST_SKIP() << why;
  const fs::path gguf = dir_ / "qwen2-block.gguf";
  if (!write_family_model("qwen2", gguf, why, "qwen2")) GTEST_SKIP() << why;
  const GPTConfig cfg = expect_continued_as_llama_cpp(gguf, dir_, "qwen2 block");
  EXPECT_TRUE(cfg.qkv_bias);
  EXPECT_FALSE(cfg.bias);
  const auto model = model_of(gguf_to_checkpoint(read_gguf(gguf), gguf.string()));
  const Tensor& bias = model->blocks[1]->attn->k_proj.bias;
  ASSERT_TRUE(bias.defined());
  float most = 0;
  for (const float v : bias.to_vector<float>()) most = std::max(most, std::fabs(v));
  EXPECT_GT(most, 0.1f) << "the k bias was not read";
}

// A GGUF file is a model wherever a checkpoint is (load_model_file): a random Llama 3 model
// written by gguf-py, and llama-quantize's Q4_K_M of it, load as their import (`kvlab import`'s
// checkpoint, saved and loaded) does: the same config, tokenizer and every weight bit for bit.
TEST_F(GgufLlamaCpp, AGgufFileLoadsAsItsImport) {
  std::string why;
  const fs::path f32 = dir_ / "direct-f32.gguf", q4km = dir_ / "direct-q4_k_m.gguf";
  if (!write_family_model("llama-bpe", f32, why)) GTEST_SKIP() << why;
  if (!llama_quantize(f32, q4km, /*LLAMA_FTYPE_MOSTLY_Q4_K_M*/ 15, why)) GTEST_SKIP() << why;
  for (const fs::path& gguf : {f32, q4km}) {
    SCOPED_TRACE(gguf.filename().string());
    EXPECT_TRUE(is_gguf_file(gguf));
    const fs::path h5 = dir_ / (gguf.stem().string() + ".h5");
    save_checkpoint(h5, gguf_to_checkpoint(read_gguf(gguf), gguf.string()));
    EXPECT_FALSE(is_gguf_file(h5));
    const LoadedModel direct = load_model(gguf), imported = load_model(h5);
    Attrs a, b;
    put_gpt_config(a, direct.model->config());
    put_gpt_config(b, imported.model->config());
    EXPECT_EQ(a, b);
    EXPECT_TRUE(direct.tokenizer == imported.tokenizer);
    EXPECT_TRUE(load_tokenizer(gguf) == imported.tokenizer);
    const auto ours = direct.model->named_parameters(), theirs = imported.model->named_parameters();
    ASSERT_EQ(ours.size(), theirs.size());
    for (size_t i = 0; i < ours.size(); ++i) {
      ASSERT_EQ(ours[i].first, theirs[i].first);
      EXPECT_EQ(ours[i].second.to_vector<float>(), theirs[i].second.to_vector<float>())
          << ours[i].first;
    }
  }
  // Cut short, it is refused by name, not read as a smaller model.
  const fs::path cut = dir_ / "cut.gguf";
  fs::copy_file(f32, cut);
  fs::resize_file(cut, fs::file_size(f32) / 2);
  EXPECT_NE(error_of([&] { load_model(cut); }).find(cut.string()), std::string::npos);
}

// Scaled RoPE as llama.cpp applies it: linear scaling (rope.scaling.factor 4: positions / 4),
// and Llama 3.1's rope_freqs tensor (each frequency divided by its factor), each in a random
// llama model with Llama 3's vocabulary, from text to text, and exported again as they came.
TEST_F(GgufLlamaCpp, ScaledRopeAsLlamaCpp) {
  std::string why;
  if (!test::have_llama_cpp(why)) GTEST_SKIP() << why;
  for (const std::string rope : {"linear4", "llama3"}) {
    const fs::path gguf = dir_ / ("rope-" + rope + ".gguf");
    if (!write_family_model("llama-bpe", gguf, why, "llama", rope)) GTEST_SKIP() << why;
    const GPTConfig cfg = expect_continued_as_llama_cpp(gguf, dir_, "rope " + rope);
    EXPECT_EQ(cfg.rope_scale, rope == "linear4" ? 0.25 : 1.0);
    EXPECT_EQ(cfg.rope_freqs.size(), rope == "llama3" ? 8u : 0u);
  }
}

// Where a generation begins and ends, as llama.cpp reads the same file: for GPT-2's, Llama 3's,
// Qwen2's, Llama 2's, Phi-3's and DeepSeek's vocabulary files, and for kvlab's own export of a
// Llama 3 and a Llama 2 model it imported, the BOS and EOS ids, whether a prompt begins with BOS,
// and every id that ends a generation.
TEST_F(GgufLlamaCpp, FamilyVocabulariesBeginAndEndAsLlamaCpp) {
  std::string why;
  if (!test::have_llama_cpp(why)) GTEST_SKIP() << why;
  const fs::path src = test::llama_cpp_source(why);
  if (src.empty()) GTEST_SKIP() << why;
  std::vector<std::pair<fs::path, Tokenizer>> files;
  for (const std::string family :
       {"gpt-2", "llama-bpe", "qwen2", "llama-spm", "phi-3", "deepseek-llm", "deepseek-coder"}) {
    const fs::path f = src / "models" / ("ggml-vocab-" + family + ".gguf");
    files.emplace_back(f, gguf_tokenizer(read_gguf(f), f.string()));
  }
  // kvlab's export of a family model carries its vocabulary, bos, eos and add_bos.
  for (const std::string name : {"llama-bpe", "llama-spm"}) {
    const fs::path family = dir_ / (name + ".gguf"), exported = dir_ / (name + "-export.gguf");
    if (!write_family_model(name, family, why)) GTEST_SKIP() << why;
    const Checkpoint c = gguf_to_checkpoint(read_gguf(family), family.string());
    const Tokenizer imported = get_tokenizer(c, "import");
    write_gguf(exported, model_to_gguf(*model_of(c), imported, gguf_mix("f32"), {}));
    files.emplace_back(exported, gguf_tokenizer(read_gguf(exported), exported.string()));
    EXPECT_EQ(files.back().second, imported) << name << ": export changed the tokenizer";
  }

  nlohmann::json spec = nlohmann::json::array();
  for (const auto& [f, tok] : files)
    spec.push_back({{"model", f.string()}, {"controls", true}, {"vocab_size", tok.vocab_size()}});
  std::string failure;
  const nlohmann::json out = test::llama_cpp_greedy(spec, dir_, failure);
  if (!failure.empty()) FAIL() << failure;
  ASSERT_EQ(out.size(), files.size());
  for (size_t i = 0; i < files.size(); ++i) {
    const TokenControls& k = files[i].second.controls();
    SCOPED_TRACE(files[i].first.filename().string());
    const auto id_or_none = [](const nlohmann::json& v) { return v.is_null() ? -1 : v.get<int>(); };
    EXPECT_EQ(k.bos, id_or_none(out[i]["bos"]));
    EXPECT_EQ(k.eos, id_or_none(out[i]["eos"]));
    EXPECT_EQ(k.add_bos, out[i]["add_bos"].get<bool>());
    EXPECT_EQ(k.add_eos, out[i]["add_eos"].get<bool>());
    EXPECT_EQ(k.eog, out[i]["eog"].get<std::vector<int32_t>>());
    std::printf("[ llama.cpp ] %s: bos %d, eos %d, add_bos %d, %zu end-of-generation ids\n",
                files[i].first.filename().c_str(), k.bos, k.eos, k.add_bos, k.eog.size());
  }
}

}  // namespace
}  // namespace kvlab
