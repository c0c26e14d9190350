// The vocabularies of real model families, as llama.cpp ships them (models/ggml-vocab-*.gguf in
// its source, vocabulary-only GGUF files), through kvlab's GGUF tokenizer import, held to the
// test vectors beside them (.inp texts, .out ids: what each family's own tokenizer gives, which
// llama.cpp's test-tokenizer-0 holds llama.cpp to): every text gives exactly the expected ids,
// and decoding them gives the text back. Families kvlab cannot read yet are refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>

#include "checkpoints/gguf_model.h"
#include "checkpoints/model_io.h"
#include "tests/error_of.h"
#include "tests/llama_cpp_source.h"
#include "tests/torture_text.h"
#include "tests/test_dir.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The vocabulary file of a family, or "" with why (its source or the file is missing).
fs::path vocab_file(const std::string& family, std::string& why) {
  const fs::path src = test::llama_cpp_source(why);
  if (src.empty()) return {};
  const fs::path f = src / "models" / ("ggml-vocab-" + family + ".gguf");
  if (fs::exists(f)) return f;
  why = f.string() + " is not in this llama.cpp source";
  return {};
}

// test-tokenizer-0's format: texts separated by "\n__ggml_vocab_test__\n", one line of ids each.
std::vector<std::pair<std::string, std::vector<int32_t>>> test_vectors(const fs::path& vocab) {
  const std::string inp = read_file(vocab.string() + ".inp");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> texts;
  for (size_t pos = 0; pos < inp.size();) {
    const size_t next = inp.find(sep, pos);
    texts.push_back(inp.substr(pos, next == std::string::npos ? std::string::npos : next - pos));
    pos = next == std::string::npos ? inp.size() : next + sep.size();
  }
  std::istringstream out(read_file(vocab.string() + ".out"));
  std::vector<std::pair<std::string, std::vector<int32_t>>> vectors;
  std::string line;
  for (const std::string& text : texts) {
    std::getline(out, line);
    std::istringstream ids(line);
    std::vector<int32_t> expected;
    for (int32_t id; ids >> id;) expected.push_back(id);
    vectors.emplace_back(text, std::move(expected));
  }
  return vectors;
}

struct Family {
  const char* vocab;    // models/ggml-vocab-<vocab>.gguf
  const char* pattern;  // the split pattern kvlab reads its pre-tokenizer as; "spm": SentencePiece
};

class GgufVocab : public ::testing::TestWithParam<Family> {};

TEST_P(GgufVocab, TestVectorsGiveTheExpectedIdsAndDecodeBack) {
  std::string why;
  const fs::path file = vocab_file(GetParam().vocab, why);
  if (file.empty()) GTEST_SKIP() << why;
  const Tokenizer tok = gguf_tokenizer(read_gguf(file), file.string());
  if (GetParam().pattern == std::string("spm")) {
    ASSERT_NE(tok.spm(), nullptr);
  } else {
    ASSERT_NE(tok.bpe(), nullptr);
    EXPECT_EQ(pattern_name(tok.bpe()->pattern()), GetParam().pattern);
  }
  const auto vectors = test_vectors(file);
  ASSERT_GE(vectors.size(), 40u) << file << ".inp/.out hold fewer tests than expected";
  int same = 0;
  for (const auto& [text, expected] : vectors) {
    const std::vector<int32_t> ids = tok.encode(text, "test vector");
    EXPECT_EQ(ids, expected) << "'" << text << "'";
    EXPECT_EQ(tok.decode(ids), text);
    same += ids == expected;
  }
  std::printf("[ %s ] %d of %zu test vectors give llama.cpp's expected ids\n", GetParam().vocab,
              same, vectors.size());
}

INSTANTIATE_TEST_SUITE_P(Families, GgufVocab,
                         ::testing::Values(Family{"gpt-2", "gpt2"}, Family{"llama-bpe", "llama3"},
                                           Family{"qwen2", "qwen2"}, Family{"llama-spm", "spm"},
                                           Family{"phi-3", "spm"},
                                           Family{"deepseek-llm", "deepseek_llm"},
                                           Family{"deepseek-coder", "deepseek_coder"}),
                         [](const auto& info) {
                           std::string n = info.param.vocab;
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

// Any bytes through Llama 2's and Phi-3's SentencePiece vocabularies: random bytes (mostly not
// UTF-8; no spaces, which llama.cpp's tokenizer turns into '▁' and then may read into a symbol
// begun by an invalid lead byte, so that they come back as '▁') and pieces of the torture text
// decode back to themselves, and the ids' pieces pushed one
// at a time through the stream decoder give the same text, after the space the encoder put
// before it.
TEST(SpmBytes, AnyBytesDecodeBackWholeAndAsAStream) {
  for (const char* family : {"llama-spm", "phi-3"}) {
    std::string why;
    const fs::path file = vocab_file(family, why);
    if (file.empty()) GTEST_SKIP() << why;
    const Tokenizer tok = gguf_tokenizer(read_gguf(file), file.string());
    std::mt19937_64 gen(3);
    const std::string torture = test::kTortureText;
    for (int i = 0; i < 200; ++i) {
      std::string text;
      if (i % 2 == 0) {  // no spaces: one after a lead byte would be read into its symbol
        for (uint64_t n = gen() % 40; n-- > 0;)
          if (const char c = static_cast<char>(gen()); c != ' ') text += c;
      } else {
        const size_t at = gen() % torture.size();
        text = torture.substr(at, gen() % 60);
      }
      const std::vector<int32_t> ids = tok.encode(text);
      ASSERT_EQ(tok.decode(ids), text) << family << " text " << i;
      Utf8StreamDecoder stream;
      std::string streamed;
      for (const int32_t id : ids) streamed += stream.push(tok.decode_one(id));
      streamed += stream.finish();
      ASSERT_EQ(streamed, (text.empty() ? "" : " ") + text) << family << " text " << i;
    }
  }
}

class VocabFile : public testing::TestDirFixture {
 protected:
  VocabFile() : TestDirFixture("kvlab-vocab-file") {}
};

// Llama 2's SentencePiece vocabulary is kept whole by a tokenizer file (its pieces, scores,
// types and add_space_prefix), and a damaged one is refused naming what is wrong: a type that
// is none of llama.cpp's, a score that is not finite, a piece twice, arrays of unequal length;
// a byte with no piece to fall back to, where a text needs one.
TEST_F(VocabFile, RoundTripsThroughATokenizerFileAndDamagedOnesAreRefused) {
  std::string why;
  const fs::path file = vocab_file("llama-spm", why);
  if (file.empty()) GTEST_SKIP() << why;
  const Tokenizer tok = gguf_tokenizer(read_gguf(file), file.string());
  ASSERT_NE(tok.spm(), nullptr);
  save_tokenizer(dir_ / "tok.h5", tok);
  const Tokenizer back = load_tokenizer(dir_ / "tok.h5");
  EXPECT_EQ(back, tok);
  EXPECT_EQ(back.encode(test::kTortureText), tok.encode(test::kTortureText));

  Checkpoint good;
  put_tokenizer(good, tok);
  const auto refusal = [&](const std::function<void(SpmArrays&)>& damage) {
    Checkpoint c = good;
    damage(c.tokenizer_spm);
    return error_of([&] {
      save_checkpoint(dir_ / "bad.h5", c);
      load_tokenizer(dir_ / "bad.h5");
    });
  };
  // Two neighbouring pieces of one length, the second to be spelled as the first.
  size_t twin = 500;
  const std::vector<uint64_t>& off = good.tokenizer_spm.token_offsets;
  while (off[twin + 1] - off[twin] != off[twin + 2] - off[twin + 1]) ++twin;
  const std::string repeats = "piece " + std::to_string(twin + 1) + " (";
  for (const auto& [damage, named] :
       std::vector<std::pair<std::function<void(SpmArrays&)>, std::string>>{
           {[](SpmArrays& a) { a.token_types[7] = 9; }, "piece 7 has type 9"},
           {[](SpmArrays& a) { a.scores[300] = NAN; }, "piece 300 has score nan"},
           {[&](SpmArrays& a) {
              std::copy_n(a.token_bytes.begin() + static_cast<int64_t>(off[twin]),
                          off[twin + 1] - off[twin],
                          a.token_bytes.begin() + static_cast<int64_t>(off[twin + 1]));
            },
            repeats},
           {[](SpmArrays& a) { a.scores.pop_back(); }, "do not agree in length"},
       }) {
    const std::string e = refusal(damage);
    EXPECT_NE(e.find(named), std::string::npos) << e;
  }
  // Without a piece for byte 0 (<0x00>, id 3, respelled <Xx00>) the vocabulary loads, as in
  // llama.cpp, and only a text holding that byte is refused, by name.
  Checkpoint no_zero = good;
  no_zero.tokenizer_spm.token_types[3] = 1;
  no_zero.tokenizer_spm.token_bytes[no_zero.tokenizer_spm.token_offsets[3] + 1] = 'X';
  save_checkpoint(dir_ / "no_zero.h5", no_zero);
  const Tokenizer t = load_tokenizer(dir_ / "no_zero.h5");
  EXPECT_EQ(t.encode("plain text"), tok.encode("plain text"));
  const std::string e = error_of([&] { t.encode(std::string("a\0b", 3)); });
  EXPECT_NE(e.find("no piece stands for byte <0x00>"), std::string::npos) << e;
}

// Qwen2's user-defined tokens ([PAD151643] ...) are read from text as themselves, as llama.cpp
// reads them, and a tokenizer file keeps them so, and the vocabulary's chat template.
TEST_F(VocabFile, UserDefinedTokensAreReadFromTextAndKept) {
  std::string why;
  const fs::path file = vocab_file("qwen2", why);
  if (file.empty()) GTEST_SKIP() << why;
  const Tokenizer tok = gguf_tokenizer(read_gguf(file), file.string());
  ASSERT_EQ(tok.controls().user_defined.size(), 290u);
  const int32_t pad = tok.controls().user_defined[7];
  const std::string text = "x" + tok.decode_one(pad) + "y";
  const std::vector<int32_t> ids = tok.encode(text);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), pad), 1) << "not read as itself";
  EXPECT_EQ(tok.decode(ids), text);
  // Its chat template comes with it.
  EXPECT_EQ(tok.controls().chat_template,
            read_gguf(file).get_string("tokenizer.chat_template", "qwen2"));
  save_tokenizer(dir_ / "tok.h5", tok);
  const Tokenizer back = load_tokenizer(dir_ / "tok.h5");
  EXPECT_EQ(back, tok);
  EXPECT_EQ(back.encode(text), ids);
}

// Llama 2's vocabulary with random damage to its values (a type out of range, a score not
// finite, a piece emptied, repeated or replaced by random bytes, an id key pointing anywhere):
// each is refused with a kvlab::Error or read into a tokenizer that encodes and decodes any
// text; nothing else is thrown and, under the sanitizers, nothing is read out of bounds.
TEST_F(VocabFile, DamagedValuesAreRefusedOrRead) {
  std::string why;
  const fs::path file = vocab_file("llama-spm", why);
  if (file.empty()) GTEST_SKIP() << why;
  const GgufFile good = read_gguf(file);
  const auto value = [](GgufFile& f, const char* key) {
    for (auto& [k, v] : f.metadata)
      if (k == key) return &v;
    throw std::logic_error(key);
  };
  std::mt19937_64 gen(7);
  int refused = 0, read = 0;
  for (int i = 0; i < 60; ++i) {
    GgufFile f = good;
    GgufValue& tokens = *value(f, "tokenizer.ggml.tokens");
    const size_t V = tokens.strings.size();
    const size_t id = gen() % V;
    switch (gen() % 6) {
      case 0:
        value(f, "tokenizer.ggml.token_type")->ints[id] = static_cast<int64_t>(gen() % 12) - 2;
        break;
      case 1:
        value(f, "tokenizer.ggml.scores")->floats[id] = (gen() % 2) ? NAN : -INFINITY;
        break;
      case 2:
        tokens.strings[id].clear();
        break;
      case 3:
        tokens.strings[id] = tokens.strings[gen() % V];
        break;
      case 4:
        for (char& c : tokens.strings[id]) c = static_cast<char>(gen());
        break;
      default:
        value(f, "tokenizer.ggml.bos_token_id")->ints[0] =
            static_cast<int64_t>(gen() % (2 * V)) - 5;
    }
    try {
      const Tokenizer tok = gguf_tokenizer(f, "damaged");
      const std::vector<int32_t> ids = tok.encode(test::kTortureText);
      EXPECT_FALSE(tok.decode(ids).empty());
      ++read;
    } catch (const Error&) {
      ++refused;
    }
  }
  std::printf("[ spm vocab ] %d damaged vocabularies refused, %d read\n", refused, read);
  EXPECT_GT(refused, 0);
  EXPECT_GT(read, 0);
}

// What kvlab cannot read, refused naming what: Falcon's pre-tokenizer, BERT's WordPiece.
TEST(GgufVocabRefusals, NameTheTokenizerModelOrPreTokenizer) {
  for (const auto& [family, named] :
       {std::pair{"falcon", "tokenizer.ggml.pre 'falcon'"},
        std::pair{"bert-bge", "tokenizer.ggml.model is 'bert'"}}) {
    std::string why;
    const fs::path file = vocab_file(family, why);
    if (file.empty()) GTEST_SKIP() << why;
    const std::string e = error_of([&] { gguf_tokenizer(read_gguf(file), file.string()); });
    EXPECT_NE(e.find(named), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace kvlab
