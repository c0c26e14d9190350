#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>

#include "data/bpe.h"
#include "data/tokenizer.h"
#include "tests/data/data_test_util.h"
#include "tests/test_dir.h"
#include "tests/torture_text.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;
using testing::error_message;
using ::testing::HasSubstr;

constexpr const char* kTorture = test::kTortureText;

std::string read_file(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const fs::path& file, std::string_view text) {
  std::ofstream(file, std::ios::binary) << text;
}

// stdout of a shell command, and whether it exited 0.
bool run(const std::string& command, std::string& out) {
  out.clear();
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) return false;
  char buf[1 << 16];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  return pclose(p) == 0;
}

std::string sample_corpus() {
  // Words of random syllables with skewed frequencies (so that counts tie and do not), some
  // punctuation, digits, contractions and non-ASCII letters.
  const char* syllables[] = {"th", "e",   "an", "d", "lo", "rd", "wo", "r",  "ld",  "in", "g",
                             "ü",  "ber", "na", "ï", "ve", "日", "本", "qu", "ick", "s",  "t"};
  const char* glue[] = {" ", " ", " ", " ", "\n", ", ", ". ", "'s ", "'ll ", " 1234 ", "  "};
  std::mt19937 rng(7);
  std::vector<std::string> words(400);
  for (std::string& w : words)
    for (int n = 1 + static_cast<int>(rng() % 4); n > 0; --n) w += syllables[rng() % 22];
  std::string text;
  for (int i = 0; i < 8000; ++i) {
    text += words[std::min(rng() % 400, rng() % 400)];
    text += glue[rng() % 11];
  }
  return text;
}

TEST(Bpe, RoundTripsAnyBytes) {
  const BpeTokenizer tok = train_bpe(sample_corpus(), 400, SplitPattern::Kvlab);
  EXPECT_TRUE(tok.encode("").empty());
  std::mt19937 rng(1);
  for (int i = 0; i < 3000; ++i) {
    std::string s(rng() % 64, '\0');
    // Half pure random bytes, half mostly ASCII and text with a few stray bytes.
    for (char& c : s) c = static_cast<char>(i % 2 ? rng() : (rng() % 8 ? 'a' + rng() % 26 : rng()));
    ASSERT_EQ(tok.decode(tok.encode(s)), s) << "string " << i;
  }
  for (const std::string& bad :
       {std::string("\xff\xfe"), std::string("ab\xc3"), std::string("\xe2\x82 x"),
        std::string("\xed\xa0\x80"), std::string("\xc0\xaf hi \xf5"), std::string(1, '\0')})
    EXPECT_EQ(tok.decode(tok.encode(bad)), bad);
  // One chunk of 10^6 bytes: merging stays O(n log n), not a rescan per merge.
  for (const char c : {' ', 'a', '\xff'}) {
    const std::string run(1000000, c);
    EXPECT_EQ(tok.decode(tok.encode(run)), run);
  }
}

TEST(Bpe, SplitCoversEveryByte) {
  const PreSplitter split(SplitPattern::Cl100k);
  const std::string text = std::string("ok \xff\xfe bad") + "\xe2\x82" + "end";
  std::string joined;
  for (const std::string_view c : split.split(text)) joined += c;
  EXPECT_EQ(joined, text);
  EXPECT_THAT(split.split("Hello world's 123456"),
              ::testing::ElementsAre("Hello", " world", "'s", " ", "123", "456"));
  EXPECT_THAT(PreSplitter(SplitPattern::Gpt2).split("Hello world's 123456"),
              ::testing::ElementsAre("Hello", " world", "'s", " 123456"));
}

TEST(Bpe, EncodeIsDeterministic) {
  const BpeTokenizer a = train_bpe(sample_corpus(), 350, SplitPattern::Kvlab);
  const BpeTokenizer b = train_bpe(sample_corpus(), 350, SplitPattern::Kvlab);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.encode(kTorture), b.encode(kTorture));
  EXPECT_EQ(a.encode(kTorture), a.encode(kTorture));  // the second one from the cache
}

TEST(Bpe, TrainedVocabularyLayout) {
  const BpeTokenizer tok = train_bpe(sample_corpus(), 300, SplitPattern::Kvlab);
  EXPECT_EQ(tok.vocab_size(), 300);
  EXPECT_EQ(tok.merges().size(), 300u - 257u);
  EXPECT_EQ(tok.token('a'), "a");
  EXPECT_EQ(tok.token(299), "<|endoftext|>");
  EXPECT_EQ(tok.n_special(), 1);
  // Special tokens' text is ordinary text to encode.
  EXPECT_THAT(tok.encode("<|endoftext|>"), ::testing::Not(::testing::Contains(299)));
}

TEST(Bpe, PackRoundTrips) {
  const BpeTokenizer tok = train_bpe(sample_corpus(), 320, SplitPattern::Gpt2);
  const BpeTokenizer back = BpeTokenizer::unpack(tok.pack());
  EXPECT_EQ(back, tok);
  EXPECT_EQ(back.pattern(), SplitPattern::Gpt2);
  const Tokenizer wrapped = Tokenizer::from_vocab(TokenizerKind::Bpe, tok.pack());
  EXPECT_EQ(wrapped.kind_name(), "bpe");
  EXPECT_EQ(wrapped.vocab_size(), 320);
  EXPECT_EQ(wrapped.decode(wrapped.encode(kTorture)), kTorture);
  std::vector<uint32_t> cut = tok.pack();
  cut.pop_back();
  EXPECT_THAT(error_message([&] { BpeTokenizer::unpack(cut); }), HasSubstr("ends inside"));
}

TEST(Bpe, BadInputsAreClearErrors) {
  EXPECT_THAT(error_message([] { train_bpe("abc", 256, SplitPattern::Kvlab); }),
              HasSubstr("vocab size 256 is below the 256 bytes plus 1 special token(s); it must "
                        "be at least 257"));
  EXPECT_THAT(error_message([] { train_bpe("", 300, SplitPattern::Kvlab); }),
              HasSubstr("corpus is empty"));
  EXPECT_THAT(error_message([] { train_bpe("abab", 300, SplitPattern::Kvlab); }),
              HasSubstr("supports a vocab size of at most 259"));
  EXPECT_THAT(error_message([] { parse_pattern("o200k"); }), HasSubstr("unknown pre-split"));
  EXPECT_THAT(
      error_message([] { BpeTokenizer::from_tiktoken("YQ== 0\nYg== 2\n", SplitPattern::Gpt2); }),
      HasSubstr("ranks must run 0, 1, 2"));
  EXPECT_THAT(
      error_message([] { BpeTokenizer::from_tiktoken("not base64!\n", SplitPattern::Gpt2); }),
      HasSubstr("expected '<base64 bytes> <rank>'"));
  EXPECT_THAT(error_message([] {
                BpeTokenizer::unpack(std::vector<uint32_t>{7, 1});
              }),
              HasSubstr("layout 7"));
  const BpeTokenizer tok = train_bpe("aaaa", 258, SplitPattern::Kvlab);
  EXPECT_THAT(error_message([&] { tok.token(258); }), HasSubstr("out of range"));
}

TEST(Bpe, StreamDecoderHoldsIncompleteCharacters) {
  Utf8StreamDecoder d;
  EXPECT_EQ(d.push("a\xe2"), "a");
  EXPECT_EQ(d.push("\x82"), "");
  EXPECT_EQ(d.push("\xac"
                   "b\xf0\x9f"),
            "\xe2\x82\xac"
            "b");
  EXPECT_EQ(d.push("\x98\x80"), "\xf0\x9f\x98\x80");
  EXPECT_EQ(d.push("\xff"), "\xff");          // never a character: passed through
  EXPECT_EQ(d.push("\xe0\x80"), "\xe0\x80");  // an overlong form cannot complete
  EXPECT_EQ(d.push("\xc3"), "");
  EXPECT_EQ(d.finish(), "\xc3");
  // Byte by byte, a text comes out whole and in pieces that are each valid UTF-8.
  const BpeTokenizer tok = train_bpe(kTorture, 300, SplitPattern::Kvlab);
  Utf8StreamDecoder stream;
  std::string out;
  for (const int32_t id : tok.encode(kTorture)) {
    const std::string piece = stream.push(tok.token(id));
    ASSERT_NO_THROW(Tokenizer::build_char(piece.empty() ? "x" : piece));
    out += piece;
  }
  out += stream.finish();
  EXPECT_EQ(out, kTorture);
}

// ---- Against references outside kvlab ----

class BpeReference : public testing::TestDirFixture {
 protected:
  BpeReference() : TestDirFixture("kvlab-bpe") {}
  static fs::path source(const char* rel) { return fs::path(KVLAB_SOURCE_DIR) / rel; }
};

// Merges equal those of tests/data/bpe_reference.py, a plain recount-per-merge trainer.
TEST_F(BpeReference, TrainingMatchesPythonReference) {
  std::string out;
  if (!run("python3 -c 'import regex' 2>/dev/null", out))
    GTEST_SKIP() << "python3 with the regex module (Debian: python3-regex) is missing";
  const fs::path corpus = dir_ / "corpus.txt";
  const std::string text = sample_corpus() + kTorture;
  write_file(corpus, text);
  for (const int vocab : {300, 1000}) {
    ASSERT_TRUE(run(detail::cat("python3 ", source("tests/data/bpe_reference.py"), " ", corpus, " ",
                                vocab, " kvlab"),
                    out));
    std::string expected;
    const BpeTokenizer trained = train_bpe(text, vocab, SplitPattern::Kvlab);
    for (const BpeMerge& m : trained.merges())
      expected += detail::cat(m.left, " ", m.right, " ", m.token, "\n");
    EXPECT_EQ(out, expected) << "vocab " << vocab;
  }
}

// kvlab's ids equal tiktoken's (the npm package, tests/data/tiktoken) for the vocabulary it
// exports, on the default corpus and the torture text.
void expect_same_as_tiktoken(const fs::path& dir, const char* encoding, SplitPattern pattern) {
  const fs::path script = fs::path(KVLAB_SOURCE_DIR) / "tests/data/tiktoken/reference.js";
  const fs::path package = script.parent_path() / "node_modules/tiktoken/package.json";
  std::string out;
  if (!run("node --version >/dev/null 2>&1", out)) GTEST_SKIP() << "node is not installed";
  if (!fs::exists(package))
    GTEST_SKIP() << "the tiktoken npm package is missing: run scripts/setup.sh --tests";
  const fs::path ranks = dir / "ranks.tiktoken";
  ASSERT_TRUE(run(detail::cat("node ", script, " ranks ", encoding, " ", ranks), out));
  const BpeTokenizer tok = BpeTokenizer::from_tiktoken(read_file(ranks), pattern);
  // The special tokens carry tiktoken's ids; an id between the ranks and them decodes to an
  // error, not to text (cl100k leaves 100256 unused).
  ASSERT_TRUE(run(detail::cat("node ", script, " specials ", encoding), out));
  const nlohmann::json specials = nlohmann::json::parse(out);
  std::vector<int32_t> special_ids;
  for (auto it = specials.begin(); it != specials.end(); ++it) {
    EXPECT_EQ(tok.token(it->get<int32_t>()), it.key());
    special_ids.push_back(it->get<int32_t>());
  }
  std::sort(special_ids.begin(), special_ids.end());
  EXPECT_EQ(tok.special_ids(), special_ids);
  EXPECT_EQ(tok.vocab_size(), special_ids.back() + 1);
  for (int32_t id = tok.vocab_size() - tok.n_special(); id < tok.vocab_size(); ++id) {
    if (!std::binary_search(special_ids.begin(), special_ids.end(), id)) {
      EXPECT_THAT(error_message([&] { tok.token(id); }), HasSubstr("is unused")) << id;
    }
  }
  const fs::path bible = fs::path(KVLAB_SOURCE_DIR) / "data/corpora/bible-kjv.txt";
  const fs::path torture = dir / "torture.txt";
  write_file(torture, kTorture);
  std::vector<fs::path> texts = {torture};
  if (fs::exists(bible))
    texts.push_back(bible);
  else
    ADD_FAILURE() << bible << " is missing: run scripts/setup.sh";
  for (const fs::path& text : texts) {
    ASSERT_TRUE(run(detail::cat("node ", script, " encode ", encoding, " ", text), out));
    const auto expected = nlohmann::json::parse(out).get<std::vector<int32_t>>();
    const std::vector<int32_t> ids = tok.encode(read_file(text));
    ASSERT_EQ(ids.size(), expected.size()) << text;
    for (size_t i = 0; i < ids.size(); ++i)
      ASSERT_EQ(ids[i], expected[i]) << text << ": first difference at token " << i;
  }
}

TEST_F(BpeReference, Gpt2EqualsTiktoken) {
  expect_same_as_tiktoken(dir_, "gpt2", SplitPattern::Gpt2);
}

// GPT-2's vocab.json spells each byte as a printable character (bytes_to_unicode in OpenAI's
// encoder.py): the printable Latin-1 bytes as themselves, the rest as U+0100 upwards.
std::string gpt2_spelling(std::string_view bytes) {
  std::string out;
  for (const char c : bytes) {
    const auto b = static_cast<uint8_t>(c);
    uint32_t cp = b, next = 256;
    const auto printable = [](uint32_t x) {
      return (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE;
    };
    if (!printable(b)) {
      for (uint32_t x = 0; x < b; ++x) next += printable(x) ? 0 : 1;
      cp = next;
    }
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return out;
}

// A vocabulary written as GPT-2's vocab.json + merges.txt imports to the same tokenizer.
TEST(Bpe, Gpt2FilesImportToTheSameTokenizer) {
  const BpeTokenizer base = train_bpe(sample_corpus() + kTorture, 600, SplitPattern::Gpt2);
  nlohmann::json vocab = nlohmann::json::object();
  for (int id = 0; id < base.vocab_size(); ++id)
    vocab[id == base.vocab_size() - 1 ? base.token(id) : gpt2_spelling(base.token(id))] = id;
  std::string merges = "#version: 0.2\n";
  for (const BpeMerge& m : base.merges())
    merges += gpt2_spelling(base.token(m.left)) + " " + gpt2_spelling(base.token(m.right)) + "\n";
  const BpeTokenizer imported = BpeTokenizer::from_gpt2(vocab.dump(), merges, SplitPattern::Gpt2);
  EXPECT_EQ(imported, base);
  EXPECT_EQ(imported.encode(kTorture), base.encode(kTorture));
  EXPECT_THAT(
      error_message([&] { BpeTokenizer::from_gpt2(vocab.dump(), "a zzz\n", SplitPattern::Gpt2); }),
      HasSubstr("merges.txt, line 1: 'zzz' is not in vocab.json"));
}

TEST_F(BpeReference, Cl100kEqualsTiktoken) {
  expect_same_as_tiktoken(dir_, "cl100k_base", SplitPattern::Cl100k);
}

}  // namespace
}  // namespace kvlab
