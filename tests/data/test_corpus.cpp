#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <fstream>

#include "data/corpus.h"
#include "tests/data/data_test_util.h"
#include "tests/test_dir.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;
using testing::error_message;
using ::testing::HasSubstr;

// Each test gets a fresh folder under the system temp dir, removed afterwards.
class CorpusTest : public testing::TestDirFixture {
 protected:
  CorpusTest() : TestDirFixture("kvlab-data-test") {}

  fs::path write(const std::string& name, const std::string& bytes) {
    const fs::path file = dir_ / name;
    std::ofstream(file, std::ios::binary) << bytes;
    return file;
  }
  static std::string read(const fs::path& file) {
    std::ifstream in(file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::vector<fs::path> caches() const {
    std::vector<fs::path> found;
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().string().ends_with(".kvlab-cache")) found.push_back(e.path());
    }
    std::sort(found.begin(), found.end());  // directory order is unspecified
    return found;
  }
};

std::string sample_text(size_t n_chars) {
  const char* pieces[] = {"a", "b", "é", "€", "\n", " ", "\U0001F600", "z"};
  std::string text;
  for (size_t i = 0; i < n_chars; ++i) text += pieces[(i * 7 + i / 3) % 8];
  return text;
}

TEST_F(CorpusTest, SplitsByPositionTrainFirst) {
  const std::string text = sample_text(1000);
  const fs::path file = write("c.txt", text);
  const Corpus c = load_corpus(file, TokenizerKind::Char);
  const std::vector<int32_t> ids = Tokenizer::build_char(text).encode(text);
  ASSERT_EQ(c.train.size(), 900u);
  ASSERT_EQ(c.val.size(), 100u);
  EXPECT_EQ(c.train, std::vector<int32_t>(ids.begin(), ids.begin() + 900));
  EXPECT_EQ(c.val, std::vector<int32_t>(ids.begin() + 900, ids.end()));
  EXPECT_EQ(c.tokenizer, Tokenizer::build_char(text));
  EXPECT_EQ(c.path, file.string());
  EXPECT_EQ(c.content_hash, fnv1a64(text));

  // nanoGPT's n = int(0.9 * len): 1001 tokens -> 900 train.
  const Corpus odd = load_corpus(write("odd.txt", sample_text(1001)), TokenizerKind::Char);
  EXPECT_EQ(odd.train.size(), 900u);
  EXPECT_EQ(odd.val.size(), 101u);
  const Corpus quarter = load_corpus(file, TokenizerKind::Char, 0.25);
  EXPECT_EQ(quarter.train.size(), 750u);
  EXPECT_EQ(quarter.val.size(), 250u);
  EXPECT_THAT(error_message([&] { load_corpus(file, TokenizerKind::Char, 1.0); }),
              HasSubstr("val_fraction"));
}

TEST(Corpus, Fnv1aMatchesReferenceValues) {
  EXPECT_EQ(fnv1a64(""), 0xCBF29CE484222325ull);
  EXPECT_EQ(fnv1a64("a"), 0xAF63DC4C8601EC8Cull);
  EXPECT_EQ(fnv1a64("foobar"), 0x85944171F73967E8ull);
}

TEST_F(CorpusTest, CacheIsCreatedNextToTheFile) {
  const std::string text = sample_text(300);
  const fs::path file = write("input.txt", text);
  EXPECT_TRUE(caches().empty());
  load_corpus(file, TokenizerKind::Char);
  const fs::path cache = token_cache_path(file, fnv1a64(text), TokenizerKind::Char);
  EXPECT_EQ(caches(), std::vector<fs::path>{cache});
  const std::string name = cache.filename().string();  // input.txt.<16 hex>.char.kvlab-cache
  ASSERT_EQ(name.size(), 10 + 16 + 17);
  EXPECT_TRUE(name.starts_with("input.txt.") && name.ends_with(".char.kvlab-cache")) << name;
  EXPECT_EQ(name.substr(10, 16).find_first_not_of("0123456789abcdef"), std::string::npos) << name;
  const std::optional<TokenCache> cached =
      read_token_cache(cache, fnv1a64(text), TokenizerKind::Char);
  ASSERT_TRUE(cached);
  EXPECT_EQ(cached->tokenizer, Tokenizer::build_char(text));
  EXPECT_EQ(cached->ids, Tokenizer::build_char(text).encode(text));
}

TEST_F(CorpusTest, CacheIsTheSourceOnTheSecondLoad) {
  const std::string text = sample_text(200);
  const fs::path file = write("c.txt", text);
  const Corpus first = load_corpus(file, TokenizerKind::Char);
  const Corpus second = load_corpus(file, TokenizerKind::Char);
  EXPECT_EQ(second.train, first.train);
  EXPECT_EQ(second.val, first.val);
  EXPECT_EQ(second.tokenizer, first.tokenizer);

  // Plant a valid cache holding different ids: load_corpus must return them, not re-tokenize.
  std::vector<int32_t> planted = first.train;
  planted.insert(planted.end(), first.val.begin(), first.val.end());
  std::reverse(planted.begin(), planted.end());
  const fs::path cache = token_cache_path(file, fnv1a64(text), TokenizerKind::Char);
  ASSERT_TRUE(write_token_cache(cache, fnv1a64(text), first.tokenizer, planted));
  const Corpus from_cache = load_corpus(file, TokenizerKind::Char);
  EXPECT_EQ(from_cache.train, std::vector<int32_t>(planted.begin(), planted.begin() + 180));
  EXPECT_NE(from_cache.train, first.train);
  // use_cache = false neither reads nor replaces it.
  EXPECT_EQ(load_corpus(file, TokenizerKind::Char, 0.1, false).train, first.train);
  EXPECT_EQ(read_token_cache(cache, fnv1a64(text), TokenizerKind::Char)->ids, planted);
}

TEST_F(CorpusTest, CorruptCacheIsIgnoredAndRewritten) {
  const std::string text = sample_text(500);
  const fs::path file = write("c.txt", text);
  const Corpus good = load_corpus(file, TokenizerKind::Char);
  const fs::path cache = token_cache_path(file, fnv1a64(text), TokenizerKind::Char);
  const std::string valid = read(cache);

  std::string flipped = valid;
  flipped[flipped.size() / 2] ^= 0x01;  // inside the ids
  std::string bad_magic = valid;
  bad_magic[0] = 'X';
  const std::string corruptions[] = {flipped, valid.substr(0, valid.size() - 5), bad_magic, "",
                                     valid + "extra"};
  for (const std::string& corrupt : corruptions) {
    std::ofstream(cache, std::ios::binary | std::ios::trunc) << corrupt;
    EXPECT_FALSE(read_token_cache(cache, fnv1a64(text), TokenizerKind::Char));
    const Corpus again = load_corpus(file, TokenizerKind::Char);
    EXPECT_EQ(again.train, good.train);
    EXPECT_EQ(again.val, good.val);
    EXPECT_EQ(read(cache), valid);  // rewritten
  }
  // A header for other content or another kind is rejected too.
  EXPECT_FALSE(read_token_cache(cache, fnv1a64(text) + 1, TokenizerKind::Char));
  EXPECT_FALSE(read_token_cache(cache, fnv1a64(text), TokenizerKind::Byte));
}

TEST_F(CorpusTest, TokenizerKindsUseSeparateCaches) {
  const std::string text = sample_text(400);
  const fs::path file = write("c.txt", text);
  const Corpus chars = load_corpus(file, TokenizerKind::Char);
  const Corpus bytes = load_corpus(file, TokenizerKind::Byte);
  const fs::path char_cache = token_cache_path(file, fnv1a64(text), TokenizerKind::Char);
  const fs::path byte_cache = token_cache_path(file, fnv1a64(text), TokenizerKind::Byte);
  EXPECT_NE(char_cache, byte_cache);
  EXPECT_TRUE(fs::exists(char_cache));
  EXPECT_TRUE(fs::exists(byte_cache));
  EXPECT_EQ(caches().size(), 2u);

  EXPECT_EQ(bytes.tokenizer, Tokenizer::byte_level());
  EXPECT_EQ(bytes.train.size() + bytes.val.size(), text.size());
  for (size_t i = 0; i < bytes.train.size(); ++i) {
    ASSERT_EQ(bytes.train[i], static_cast<uint8_t>(text[i]));
  }
  EXPECT_LT(chars.train.size() + chars.val.size(), text.size());  // multi-byte characters
  // Reloading each kind still gives its own ids.
  EXPECT_EQ(load_corpus(file, TokenizerKind::Byte).train, bytes.train);
  EXPECT_EQ(load_corpus(file, TokenizerKind::Char).train, chars.train);
}

// A bpe vocabulary is learnt from the training bytes alone: the validation text's own word
// ("zzzz") is never merged, each split decodes to its part of the text, and a second load
// comes from the cache named by vocab size, pattern and split.
TEST_F(CorpusTest, BpeLearnsFromTheTrainingSplitOnly) {
  std::string text;
  for (int i = 0; i < 90; ++i) text += "abc abd ";  // 720 bytes
  for (int i = 0; i < 16; ++i) text += "zzzz ";     // 80 bytes: the last 10%
  const fs::path file = write("c.txt", text);
  BpeSettings bpe{262, SplitPattern::Kvlab, {}};
  int64_t merges_seen = 0;
  bpe.progress = [&](int64_t done, int64_t) { merges_seen = done; };
  const Corpus c = load_corpus(file, TokenizerKind::Bpe, 0.1, true, bpe);
  ASSERT_NE(c.tokenizer.bpe(), nullptr);
  EXPECT_EQ(c.tokenizer.vocab_size(), 262);
  EXPECT_EQ(merges_seen, 5);
  for (const std::string& t : c.tokenizer.bpe()->tokens())
    EXPECT_EQ(t.find("zz"), std::string::npos) << "a merge learnt from the validation text";
  EXPECT_EQ(c.tokenizer.decode(c.train), text.substr(0, 720));
  EXPECT_EQ(c.tokenizer.decode(c.val), text.substr(720));
  EXPECT_EQ(c.val_bytes, 80);
  EXPECT_DOUBLE_EQ(val_tokens_per_byte(c), static_cast<double>(c.val.size()) / 80.0);
  EXPECT_LT(c.train.size(), 720u / 2);  // merged: fewer ids than bytes

  const fs::path cache = token_cache_path(file, fnv1a64(text), "bpe-262-kvlab-val0.1");
  EXPECT_EQ(token_cache_key(TokenizerKind::Bpe, bpe, 0.1), "bpe-262-kvlab-val0.1");
  ASSERT_TRUE(fs::exists(cache));
  merges_seen = 0;
  const Corpus again = load_corpus(file, TokenizerKind::Bpe, 0.1, true, bpe);
  EXPECT_EQ(merges_seen, 0) << "learnt again instead of read from the cache";
  EXPECT_EQ(again.tokenizer, c.tokenizer);
  EXPECT_EQ(again.train, c.train);
  EXPECT_EQ(again.val, c.val);
  // Another vocabulary size is another cache.
  bpe.vocab_size = 261;
  EXPECT_EQ(load_corpus(file, TokenizerKind::Bpe, 0.1, true, bpe).tokenizer.vocab_size(), 261);
  EXPECT_EQ(caches().size(), 2u);
  EXPECT_THAT(error_message([&] { load_corpus(file, TokenizerKind::Bpe); }),
              HasSubstr("needs a vocabulary size (--vocab-size N)"));
}

TEST_F(CorpusTest, ValBytesCountTheValidationText) {
  const std::string text = sample_text(1000);
  const fs::path file = write("c.txt", text);
  const Corpus chars = load_corpus(file, TokenizerKind::Char);
  EXPECT_EQ(chars.val_bytes, static_cast<int64_t>(chars.tokenizer.decode(chars.val).size()));
  EXPECT_GT(chars.val_bytes, static_cast<int64_t>(chars.val.size()));  // multi-byte characters
  const Corpus bytes = load_corpus(file, TokenizerKind::Byte);
  EXPECT_EQ(bytes.val_bytes, static_cast<int64_t>(bytes.val.size()));
  EXPECT_DOUBLE_EQ(val_tokens_per_byte(bytes), 1.0);
  EXPECT_NEAR(bits_per_byte(std::log(2.0), 0.5), 0.5, 1e-12);
}

TEST_F(CorpusTest, ChangedContentGetsNewCacheAndTheOldOnesGo) {
  const fs::path file = write("c.txt", "aaaa bbbb cccc");
  const Corpus before = load_corpus(file, TokenizerKind::Char);
  write("c.txt", "xyzw xyzw xyzw");
  const Corpus after = load_corpus(file, TokenizerKind::Char);
  EXPECT_EQ(after.tokenizer.vocab(), (std::vector<uint32_t>{' ', 'w', 'x', 'y', 'z'}));
  EXPECT_NE(after.content_hash, before.content_hash);
  // The old content's caches (either tokenizer) are removed; other files' are not.
  const fs::path other = write("c.txt2.0123456789abcdef.char.kvlab-cache", "x");
  auto only = [&](const Corpus& c) {
    std::vector<fs::path> want{other, token_cache_path(file, c.content_hash, TokenizerKind::Char)};
    std::sort(want.begin(), want.end());
    return want;
  };
  EXPECT_EQ(caches(), only(after));
  load_corpus(file, TokenizerKind::Byte);
  write("c.txt", "qqqq rrrr ssss");
  const Corpus third = load_corpus(file, TokenizerKind::Char);
  EXPECT_EQ(caches(), only(third));
}

TEST_F(CorpusTest, UnwritableCacheIsSkippedSilently) {
  const std::string text = sample_text(100);
  const fs::path file = write("c.txt", text);
  // A folder squatting on the cache's name makes the final rename fail, even for root.
  const fs::path cache = token_cache_path(file, fnv1a64(text), TokenizerKind::Char);
  fs::create_directory(cache);
  const Corpus c = load_corpus(file, TokenizerKind::Char);
  EXPECT_EQ(c.train.size(), 90u);
  EXPECT_FALSE(write_token_cache(cache, c.content_hash, c.tokenizer, c.train));
  EXPECT_FALSE(write_token_cache(dir_ / "missing-folder" / "x.kvlab-cache", c.content_hash,
                                 c.tokenizer, c.train));
  size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++entries;
  EXPECT_EQ(entries, 2u) << "temporary files left behind";
}

TEST_F(CorpusTest, BadFilesAreErrorsNamingThePath) {
  const fs::path missing = dir_ / "nope.txt";
  EXPECT_THAT(error_message([&] { load_corpus(missing, TokenizerKind::Char); }),
              HasSubstr("cannot read '" + missing.string() + "'"));
  const fs::path empty = write("empty.txt", "");
  EXPECT_THAT(error_message([&] { load_corpus(empty, TokenizerKind::Byte); }),
              HasSubstr("'" + empty.string() + "' is empty"));
  EXPECT_THAT(error_message([&] { load_corpus(dir_, TokenizerKind::Char); }),
              HasSubstr("is a directory"));
  const fs::path latin1 = write("latin1.txt", "caf\xE9 au lait");
  const std::string msg = error_message([&] { load_corpus(latin1, TokenizerKind::Char); });
  EXPECT_THAT(msg, HasSubstr(latin1.string()));
  EXPECT_THAT(msg, HasSubstr("invalid UTF-8 at byte 3 (use --tokenizer byte"));
  EXPECT_EQ(load_corpus(latin1, TokenizerKind::Byte).train.size(), 10u);
}

// A FIFO would block the open until a writer came (forever, for a stray one): anything but a
// regular file is refused before it is opened, naming what it is. A link to a file is fine.
TEST_F(CorpusTest, NotARegularFileIsRefusedWithoutOpeningIt) {
  const fs::path fifo = dir_ / "corpus.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THAT(error_message([&] { load_corpus(fifo, TokenizerKind::Char); }),
              HasSubstr("corpus: '" + fifo.string() + "' is not a regular file (it is a FIFO)"));
  EXPECT_THAT(error_message([&] { load_corpus("/dev/null", TokenizerKind::Char); }),
              HasSubstr("'/dev/null' is not a regular file (it is a character device)"));
  const fs::path link = dir_ / "link.txt";
  fs::create_symlink(write("text.txt", sample_text(50)), link);
  EXPECT_EQ(load_corpus(link, TokenizerKind::Char).train.size(), 45u);
}

TEST_F(CorpusTest, TooShortCorpusError) {
  const Corpus c = load_corpus(write("c.txt", sample_text(100)), TokenizerKind::Char);
  EXPECT_NO_THROW(check_corpus_fits(c, 9));  // val has exactly 10 = block_size + 1
  EXPECT_EQ(error_message([&] { check_corpus_fits(c, 10); }),
            "corpus '" + c.path +
                "' is too short for block_size 10: train has 90 tokens and val has 10, each "
                "split needs at least 11 (block_size + 1)");
  EXPECT_THAT(error_message([&] { check_corpus_fits(c, 0); }), HasSubstr("block_size"));
}

}  // namespace
}  // namespace kvlab
