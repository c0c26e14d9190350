#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>

#include "checkpoints/model_io.h"
#include "tests/test_dir.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;

// A checkpoint of a tiny GQA model (1 layer, 2 heads, 1 KV head) with `tok` as its tokenizer.
Checkpoint tiny_model_checkpoint(const Tokenizer& tok) {
  GPTConfig cfg;
  cfg.vocab_size = tok.vocab_size();
  cfg.block_size = 8;
  cfg.n_layer = 1;
  cfg.n_head = 2;
  cfg.n_kv_head = 1;
  cfg.n_embd = 8;
  GPT model(cfg, 1);
  Checkpoint c;
  put_gpt_config(c.config, cfg);
  put_tokenizer(c, tok);
  c.model = to_arrays(model.named_parameters());
  return c;
}

class ModelIoTest : public testing::TestDirFixture {
 protected:
  ModelIoTest() : TestDirFixture("kvlab-model-io") {}

  // A checkpoint of a small GQA model with value `poison` at index 3 of tensor `target` (none
  // when empty).
  // edit: a last change to the tensors before the file is written.
  fs::path write(
      const std::string& target, float poison,
      const std::function<void(NamedArrays&)>& edit = [](NamedArrays&) {}) {
    Checkpoint c = tiny_model_checkpoint(Tokenizer::build_char("abcdefgh"));
    for (auto& [name, array] : c.model)
      if (name == target) array.data[3] = poison;
    edit(c.model);
    const fs::path file = dir_ / "model.h5";
    save_checkpoint(file, c);
    return file;
  }
};

TEST_F(ModelIoTest, CleanCheckpointLoads) {
  const LoadedModel m = load_model(write("", 0.0f));
  EXPECT_EQ(m.model->config().n_kv_head, 1);
}

// A run that diverged must not come back as weights: generate would print token 0 forever and
// a resumed run would train on NaN. The file and the tensor are named.
// The block's parts round-trip through /config; a /config from before they existed (no pos,
// norm, mlp, bias or rope_theta keys) reads as GPT-2's block.
TEST(ModelIo, BlockComponentsRoundTripAndDefaultToGpt2) {
  GPTConfig c;
  c.vocab_size = 9;
  c.pos = "rope";
  c.rope_theta = 500.0;
  c.norm = "rmsnorm";
  c.mlp = "swiglu";
  c.bias = false;
  Attrs a;
  put_gpt_config(a, c);
  const GPTConfig back = get_gpt_config(a, "x.h5");
  EXPECT_EQ(back.pos, "rope");
  EXPECT_EQ(back.rope_theta, 500.0);
  EXPECT_EQ(back.norm, "rmsnorm");
  EXPECT_EQ(back.mlp, "swiglu");
  EXPECT_FALSE(back.bias);
  EXPECT_EQ(back.hidden(), c.hidden());
  EXPECT_EQ(back.attn, "gqa");
  // MLA's attention and its sizes.
  GPTConfig m = c;
  m.attn = "mla";
  m.kv_lora_rank = 8;
  m.rope_head_dim = 4;
  m.q_lora_rank = 6;
  Attrs am;
  put_gpt_config(am, m);
  const GPTConfig mla = get_gpt_config(am, "x.h5");
  EXPECT_TRUE(mla.mla());
  EXPECT_EQ(mla.kv_lora_rank, 8);
  EXPECT_EQ(mla.rope_head_dim, 4);
  EXPECT_EQ(mla.q_lora_rank, 6);
  for (const char* key : {"pos", "rope_theta", "norm", "mlp", "bias", "attn", "kv_lora_rank",
                          "rope_head_dim", "q_lora_rank"})
    a.erase(key);
  const GPTConfig old = get_gpt_config(a, "x.h5");
  EXPECT_EQ(old.attn, "gqa");
  EXPECT_EQ(old.pos, "learned");
  EXPECT_EQ(old.norm, "layernorm");
  EXPECT_EQ(old.mlp, "gelu");
  EXPECT_TRUE(old.bias);
  a["pos"] = std::string("alibi");
  try {
    get_gpt_config(a, "x.h5");
    FAIL() << "an unknown position scheme loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("pos 'alibi'"), std::string::npos) << e.what();
  }
}

// What imported families add: Qwen2's q, k and v biases, and scaled RoPE (a linear scale and
// Llama 3.1's per-frequency factors, kept to the float); bad values are refused by name.
// A task run's settings round-trip through /config; a text run's /config names none; an unknown
// task or a mistyped key is an error naming the file.
TEST(ModelIo, TaskSettingsRoundTripAndATextRunHasNone) {
  MqarSettings s;
  s.vocab = 64;
  s.pairs = 7;
  s.train_examples = 123;
  s.val_examples = 45;
  s.seed = 6;
  Attrs a;
  EXPECT_FALSE(get_mqar_settings(a, "x.h5"));
  put_mqar_settings(a, s);
  const std::optional<MqarSettings> back = get_mqar_settings(a, "x.h5");
  ASSERT_TRUE(back);
  EXPECT_EQ(back->vocab, 64);
  EXPECT_EQ(back->pairs, 7);
  EXPECT_EQ(back->train_examples, 123);
  EXPECT_EQ(back->val_examples, 45);
  EXPECT_EQ(back->seed, 6u);
  Attrs unknown = a;
  unknown["task"] = std::string("sorting");
  EXPECT_THROW(get_mqar_settings(unknown, "x.h5"), Error);
  Attrs mistyped = a;
  mistyped["mqar_pairs"] = std::string("seven");
  EXPECT_THROW(get_mqar_settings(mistyped, "x.h5"), Error);
  Attrs huge = a;
  huge["mqar_vocab"] = int64_t{1} << 40;
  EXPECT_THROW(get_mqar_settings(huge, "x.h5"), Error);
}

TEST(ModelIo, QkvBiasesAndScaledRopeRoundTrip) {
  GPTConfig c;
  c.vocab_size = 9;
  c.n_embd = 16;
  c.n_head = 2;
  c.n_kv_head = 2;
  c.pos = "rope";
  c.bias = false;
  c.qkv_bias = true;
  c.rope_scale = 0.25;
  c.rope_freqs = {1.0f, 1.0f / 3.0f, 2.5f, 8.0f};
  Attrs a;
  put_gpt_config(a, c);
  const GPTConfig back = get_gpt_config(a, "x.h5");
  EXPECT_TRUE(back.qkv_bias);
  EXPECT_EQ(back.rope_scale, 0.25);
  EXPECT_EQ(back.rope_freqs, c.rope_freqs);
  GPTConfig plain;
  plain.vocab_size = 9;
  Attrs p;
  put_gpt_config(p, plain);
  EXPECT_EQ(p.count("rope_scale") + p.count("rope_freqs") + p.count("qkv_bias"), 0u)
      << "a model without them writes none";
  for (const auto& [value, message] :
       std::vector<std::pair<std::string, const char*>>{{"1 x 2 3", "holds 'x'"},
                                                        {"1 2 3", "3 rope_freqs"},
                                                        {"1 2 -3 4", "factor is -3"}}) {
    Attrs bad = a;
    bad["rope_freqs"] = value;
    try {
      get_gpt_config(bad, "x.h5");
      ADD_FAILURE() << value << " loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
}

TEST_F(ModelIoTest, NonFiniteTensorIsAnErrorNamingFileAndTensor) {
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), INFINITY, -INFINITY}) {
    const fs::path file = write("blocks.0.attn.q_proj.weight", bad);
    try {
      load_model(file);
      FAIL() << "no error for " << bad;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("checkpoint " + file.string()), std::string::npos) << msg;
      EXPECT_NE(msg.find("tensor blocks.0.attn.q_proj.weight holds non-finite values"),
                std::string::npos)
          << msg;
    }
    // The file itself is still readable (kvlab inspect shows it).
    EXPECT_NO_THROW(load_checkpoint(file, true));
  }
}

// A file that lacks a tensor, or holds one the model does not have, says which.
TEST_F(ModelIoTest, MissingOrExtraTensorsAreNamed) {
  auto message = [](const fs::path& file) {
    try {
      load_model(file);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const fs::path missing = write("", 0.0f, [](NamedArrays& t) {
    std::erase_if(t, [](const auto& entry) { return entry.first == "ln_f.bias"; });
  });
  std::string msg = message(missing);
  EXPECT_NE(msg.find("missing dataset /model/ln_f.bias"), std::string::npos) << msg;
  const fs::path extra = write("", 0.0f, [](NamedArrays& t) {
    t.emplace_back("stray", ArrayF32{{2}, {1.0f, 2.0f}});
  });
  msg = message(extra);
  EXPECT_NE(msg.find("unexpected dataset /model/stray"), std::string::npos) << msg;
}

// What --resume refuses and inspect lists, each named: moments holding NaN, a negative step, an
// rng_state of the wrong length for world_size, and a generator state of all zeros (which
// xoshiro256** never leaves: a resumed run would train on one window at every step).
TEST(TrainingState, ProblemsAreNamed) {
  Checkpoint c;
  c.model = {{"w", ArrayF32{{2}, {1.0f, 2.0f}}}};
  c.has_optimizer = true;
  c.optimizer_m = c.model;
  c.optimizer_v = c.model;
  c.has_train_state = true;
  c.rng_state = {1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_TRUE(training_state_problems(c).empty());

  auto only = [](const Checkpoint& k) {
    const std::vector<std::string> p = training_state_problems(k);
    return p.size() == 1 ? p[0] : "problems: " + std::to_string(p.size());
  };
  Checkpoint bad = c;
  bad.optimizer_m[0].second.data[1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(only(bad), "/optimizer/m/w holds non-finite values (1 of 2 are NaN or inf)");
  bad = c;
  bad.optimizer_step = -1;
  EXPECT_EQ(only(bad), "attribute 'step' of /optimizer is -1");
  bad = c;
  bad.rng_state.resize(7);
  EXPECT_EQ(only(bad), "/train/rng_state holds 7 words, 8 expected for 1 rank(s)");
  bad = c;
  bad.train_extra["world_size"] = int64_t{2};
  EXPECT_EQ(only(bad), "/train/rng_state holds 8 words, 16 expected for 2 rank(s)");
  bad.train_extra["world_size"] = std::string("2");
  EXPECT_EQ(only(bad), "attribute 'world_size' of /train is not a positive integer");
  for (size_t g = 0; g < 8; g += 4) {
    bad = c;
    std::fill_n(bad.rng_state.begin() + g, 4, 0);
    EXPECT_EQ(only(bad), "/train/rng_state words " + std::to_string(g) + "-" +
                             std::to_string(g + 3) + " (rank 0's " +
                             (g ? "dropout" : "batch sampler") +
                             " generator) are all zero, a state xoshiro256** never leaves");
  }
  bad = c;
  bad.rng_state[0] = bad.rng_state[1] = bad.rng_state[2] = 0;  // three zero words are a state
  EXPECT_TRUE(training_state_problems(bad).empty());
}

}  // namespace
}  // namespace kvlab

namespace kvlab {
namespace {

class TokenizerFileTest : public testing::TestDirFixture {
 protected:
  TokenizerFileTest() : TestDirFixture("kvlab-tokenizer-file") {}
};

// A BPE tokenizer round-trips through a tokenizer file and through a model checkpoint.
TEST_F(TokenizerFileTest, BpeRoundTripsThroughHdf5) {
  std::string corpus;
  for (int i = 0; i < 200; ++i) corpus += "the lord's word, the world " + std::to_string(i) + "\n";
  const Tokenizer tok = Tokenizer::bpe(train_bpe(corpus, 300, SplitPattern::Gpt2));
  const fs::path file = dir_ / "tok.h5";
  save_tokenizer(file, tok);
  const Tokenizer back = load_tokenizer(file);
  EXPECT_EQ(back, tok);
  ASSERT_NE(back.bpe(), nullptr);
  EXPECT_EQ(*back.bpe(), *tok.bpe());
  EXPECT_EQ(back.bpe()->pattern(), SplitPattern::Gpt2);
  EXPECT_EQ(back.encode(corpus), tok.encode(corpus));

  save_checkpoint(dir_ / "model.h5", tiny_model_checkpoint(tok));
  EXPECT_EQ(load_model(dir_ / "model.h5").tokenizer, tok);
  EXPECT_EQ(load_tokenizer(dir_ / "model.h5"), tok);
}

// The stored arrays are the vocabulary itself: each token's bytes at its offsets, the merges as
// id pairs, the special ids; an unused id (an imported cl100k's 100256) has no bytes.
TEST_F(TokenizerFileTest, BpeIsStoredAsBytesMergesAndSpecials) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
  tokens.push_back("ab");
  tokens.push_back("");  // unused
  tokens.push_back("<|endoftext|>");
  const Tokenizer tok = Tokenizer::bpe(BpeTokenizer::from_parts(
      SplitPattern::Kvlab, tokens, {{'a', 'b', 256}}, 2));
  const fs::path file = dir_ / "tok.h5";
  save_tokenizer(file, tok);
  const Checkpoint c = load_checkpoint(file, false);
  EXPECT_EQ(c.tokenizer_kind, "bpe");
  EXPECT_TRUE(c.tokenizer_vocab.empty());
  EXPECT_EQ(c.tokenizer_bpe.pattern, "kvlab");
  EXPECT_EQ(c.tokenizer_bpe.merges, (std::vector<uint32_t>{'a', 'b'}));
  EXPECT_EQ(c.tokenizer_bpe.special_ids, (std::vector<uint32_t>{258}));
  ASSERT_EQ(c.tokenizer_bpe.token_offsets.size(), 260u);
  EXPECT_EQ(c.tokenizer_bpe.token_offsets[256], 256u);
  EXPECT_EQ(c.tokenizer_bpe.token_offsets[257], 258u);  // "ab"
  EXPECT_EQ(c.tokenizer_bpe.token_offsets[258], 258u);  // unused: no bytes
  EXPECT_EQ(c.tokenizer_bpe.token_offsets.back(), c.tokenizer_bpe.token_bytes.size());
  const Tokenizer back = load_tokenizer(file);
  EXPECT_EQ(back, tok);
  EXPECT_EQ(back.decode_one(258), "<|endoftext|>");
  try {
    back.decode_one(257);
    ADD_FAILURE() << "decoded an unused id";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 257 is unused"), std::string::npos) << e.what();
  }
}

// A damaged bpe layout is refused by name before any token is built from it.
TEST_F(TokenizerFileTest, HostileBpeArraysAreRefused) {
  const Tokenizer tok = Tokenizer::bpe(train_bpe(std::string(50, 'a') + "bcbcbc", 260,
                                                 SplitPattern::Kvlab));
  Checkpoint good;
  put_tokenizer(good, tok);
  const auto refused = [&](const std::function<void(BpeArrays&)>& damage) {
    Checkpoint c = good;
    damage(c.tokenizer_bpe);
    const fs::path file = dir_ / "bad.h5";
    save_checkpoint(file, c);
    try {
      load_tokenizer(file);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  const auto has = [](const std::string& msg, const char* needle) {
    return msg.find(needle) != std::string::npos;
  };
  std::string msg = refused([](BpeArrays& a) { std::swap(a.token_offsets[3], a.token_offsets[4]); });
  EXPECT_TRUE(has(msg, "/tokenizer/token_offsets: offset 4")) << msg;
  msg = refused([](BpeArrays& a) { a.token_offsets.front() = 1; a.token_offsets[1] = 1; });
  EXPECT_TRUE(has(msg, "must start at 0")) << msg;
  msg = refused([](BpeArrays& a) { a.merges[1] = 100000; });
  EXPECT_TRUE(has(msg, "/tokenizer/merges: id 100000 is outside the 260 tokens")) << msg;
  msg = refused([](BpeArrays& a) { a.special_ids = {260}; });
  EXPECT_TRUE(has(msg, "/tokenizer/special_ids: entry 0 (260)")) << msg;
  msg = refused([](BpeArrays& a) { a.merges[0] = a.merges[1] = 'q'; });
  EXPECT_TRUE(has(msg, "bpe: merge 0")) << msg;
  msg = refused([](BpeArrays& a) { a.special_ids.clear(); });
  EXPECT_TRUE(has(msg, "neither a byte nor made by a merge")) << msg;
  msg = refused([](BpeArrays& a) { a.pattern = "o200k"; });
  EXPECT_TRUE(has(msg, "unknown pre-split pattern 'o200k'")) << msg;
}

// What a family's vocabulary says of BOS, EOS, the tokens that end a generation and its chat
// template is kept in /tokenizer (a char tokenizer's too), and values that are no ids of it are
// refused.
TEST_F(TokenizerFileTest, BosEosAndEndTokensRoundTripAndBadOnesAreRefused) {
  Tokenizer tok = Tokenizer::build_char("abcdef");
  const std::string chat = "{% for m in messages %}{{ m['content'] }}{% endfor %}";
  tok.set_controls({.bos = 1,
                    .eos = 4,
                    .add_bos = true,
                    .add_eos = true,
                    .user_defined = {},
                    .eog = {2, 4},
                    .chat_template = chat});
  const fs::path file = dir_ / "controls.h5";
  save_tokenizer(file, tok);
  const Checkpoint c = load_checkpoint(file, false);
  EXPECT_EQ(c.tokenizer_chat_template, chat);
  EXPECT_EQ(c.tokenizer_bos, 1);
  EXPECT_EQ(c.tokenizer_eos, 4);
  EXPECT_EQ(c.tokenizer_add_bos, 1);
  EXPECT_EQ(c.tokenizer_add_eos, 1);
  EXPECT_EQ(c.tokenizer_eog, (std::vector<uint32_t>{2, 4}));
  EXPECT_EQ(load_tokenizer(file), tok);
  EXPECT_EQ(load_tokenizer(file).encode_prompt("ab"), (std::vector<int32_t>{1, 0, 1, 4}));
  // A tokenizer without them writes none.
  save_tokenizer(dir_ / "plain.h5", Tokenizer::build_char("abcdef"));
  EXPECT_EQ(load_checkpoint(dir_ / "plain.h5", false).tokenizer_eog.size(), 0u);
  EXPECT_EQ(load_tokenizer(dir_ / "plain.h5").controls(), TokenControls{});

  const auto refused = [&](const std::function<void(Checkpoint&)>& damage) {
    Checkpoint bad = c;
    damage(bad);
    save_checkpoint(dir_ / "bad.h5", bad);
    try {
      load_tokenizer(dir_ / "bad.h5");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  for (const auto& [damage, needle] :
       std::vector<std::pair<std::function<void(Checkpoint&)>, const char*>>{
           {[](Checkpoint& b) { b.tokenizer_eog = {2, 6}; }, "end-of-generation id 6"},
           {[](Checkpoint& b) { b.tokenizer_eog = {4, 2}; }, "end-of-generation id 2"},
           {[](Checkpoint& b) { b.tokenizer_bos = 6; }, "BOS or EOS id 6"},
           {[](Checkpoint& b) { b.tokenizer_bos = int64_t{1} << 40; }, "is not an id"},
           {[](Checkpoint& b) { b.tokenizer_eos = 3; }, "EOS id 3 is not among"},
           {[](Checkpoint& b) { b.tokenizer_add_bos = 2; }, "add_bos or add_eos is 2"},
           {[](Checkpoint& b) { b.tokenizer_add_eos = 3; }, "add_bos or add_eos is 3"},
           {[](Checkpoint& b) { b.tokenizer_user_defined = {2}; },
            "user-defined tokens are for bpe vocabularies"},
           {[](Checkpoint& b) { b.tokenizer_bos = -1; }, "no BOS token"},
           {[](Checkpoint& b) {
              b.tokenizer_eos = -1;
              b.tokenizer_eog = {2};
            },
            "no EOS token"},
       }) {
    const std::string msg = refused(damage);
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_NE(msg.find("/tokenizer"), std::string::npos) << msg;
  }
}

TEST_F(TokenizerFileTest, NotATokenizerIsAClearError) {
  const fs::path text = dir_ / "notes.h5";
  std::ofstream(text) << "just some text\n";
  try {
    load_tokenizer(text);
    ADD_FAILURE() << "loaded a text file as a tokenizer";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text.string()), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvlab
