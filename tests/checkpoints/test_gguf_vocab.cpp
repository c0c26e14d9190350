// The vocabularies of real model families, as llama.cpp ships them (models/ggml-vocab-*.gguf in
// its source, vocabulary-only GGUF files), through kvlab's GGUF tokenizer import, held to the
// test vectors beside them (.inp texts, .out ids: what each family's own tokenizer gives, which
// llama.cpp's test-tokenizer-0 holds llama.cpp to): every text gives exactly the expected ids,
// and decoding them gives the text back. Families kvlab cannot read yet are refused by name.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "checkpoints/gguf_model.h"
#include "tests/error_of.h"
#include "tests/llama_cpp_source.h"

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
  const char* pattern;  // the split pattern kvlab reads its pre-tokenizer as
};

class GgufVocab : public ::testing::TestWithParam<Family> {};

TEST_P(GgufVocab, TestVectorsGiveTheExpectedIdsAndDecodeBack) {
  std::string why;
  const fs::path file = vocab_file(GetParam().vocab, why);
  if (file.empty()) GTEST_SKIP() << why;
  const Tokenizer tok = gguf_tokenizer(read_gguf(file), file.string());
  ASSERT_NE(tok.bpe(), nullptr);
  EXPECT_EQ(pattern_name(tok.bpe()->pattern()), GetParam().pattern);
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
                                           Family{"qwen2", "qwen2"}),
                         [](const auto& info) {
                           std::string n = info.param.vocab;
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

// What kvlab cannot read yet, refused naming what: SentencePiece (Llama 2's), and the
// DeepSeek pre-tokenizers (several regexes in turn).
TEST(GgufVocabRefusals, NameTheTokenizerModelOrPreTokenizer) {
  for (const auto& [family, named] :
       {std::pair{"llama-spm", "tokenizer.ggml.model is 'llama'"},
        std::pair{"deepseek-llm", "tokenizer.ggml.pre 'deepseek-llm'"}}) {
    std::string why;
    const fs::path file = vocab_file(family, why);
    if (file.empty()) GTEST_SKIP() << why;
    const std::string e = error_of([&] { gguf_tokenizer(read_gguf(file), file.string()); });
    EXPECT_NE(e.find(named), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace kvlab
