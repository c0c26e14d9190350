#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "data/tokenizer.h"
#include "platform/random.h"
#include "tests/data/data_test_util.h"

namespace kvlab {
namespace {

using testing::error_message;
using ::testing::HasSubstr;

TEST(Tokenizer, CharVocabIsSortedDistinctCodePoints) {
  const Tokenizer ascii = Tokenizer::build_char("hello world");
  EXPECT_EQ(ascii.kind(), TokenizerKind::Char);
  EXPECT_EQ(ascii.vocab(), (std::vector<uint32_t>{' ', 'd', 'e', 'h', 'l', 'o', 'r', 'w'}));
  EXPECT_EQ(ascii.vocab_size(), 8);

  const Tokenizer wide = Tokenizer::build_char("\U0001F600€éa€a");
  EXPECT_EQ(wide.vocab(), (std::vector<uint32_t>{0x61, 0xE9, 0x20AC, 0x1F600}));
}

TEST(Tokenizer, CharIdsAreVocabIndices) {
  const Tokenizer tok = Tokenizer::build_char("cabbage");
  EXPECT_EQ(tok.encode("cabbage"), (std::vector<int32_t>{2, 0, 1, 1, 0, 4, 3}));
}

TEST(Tokenizer, CharRoundTripMultiByte) {
  const std::string text = "héllo € \U0001F600 wörld\n\tend";
  const Tokenizer tok = Tokenizer::build_char(text);
  const std::vector<int32_t> ids = tok.encode(text);
  EXPECT_EQ(ids.size(), 20u);  // code points, not bytes
  EXPECT_EQ(tok.decode(ids), text);
  std::string joined;
  for (const int32_t id : ids) joined += tok.decode_one(id);
  EXPECT_EQ(joined, text);
  EXPECT_EQ(tok.decode_one(tok.encode("€")[0]), "€");
}

TEST(Tokenizer, InvalidUtf8NamesByteOffset) {
  const std::pair<std::string, int> cases[] = {
      {"abc\xFF!", 3},            // byte that never occurs in UTF-8
      {"ab\xC3", 2},              // truncated 2-byte sequence
      {"a\xE2\x82\xAC\x80", 4},   // stray continuation byte after '€'
      {"xy\xC0\xAF", 2},          // overlong '/'
      {"\xED\xA0\x80", 0},        // surrogate U+D800
      {"ok\xF4\x90\x80\x80", 2},  // past U+10FFFF
      {"é\xE2\x82!", 2},          // bad continuation
  };
  for (const auto& [text, offset] : cases) {
    const std::string msg = error_message([&] { Tokenizer::build_char(text); });
    EXPECT_THAT(msg, HasSubstr("invalid UTF-8 at byte " + std::to_string(offset) + " "))
        << "offset " << offset;
    EXPECT_THAT(msg, HasSubstr("--tokenizer byte"));
  }
  const Tokenizer tok = Tokenizer::build_char("abc");
  EXPECT_THAT(error_message([&] { tok.encode("ab\xFF", "prompt"); }),
              HasSubstr("prompt: invalid UTF-8 at byte 2"));
}

TEST(Tokenizer, EmptyTextIsError) {
  EXPECT_THAT(error_message([] { Tokenizer::build_char(""); }), HasSubstr("empty"));
}

TEST(Tokenizer, UnknownCharactersAreListed) {
  const Tokenizer tok = Tokenizer::build_char("abc");
  EXPECT_EQ(error_message([&] { tok.encode("aZb€Zc€", "prompt"); }),
            "prompt: 2 characters are not in the model's vocabulary: 'Z' (U+005A), '€' (U+20AC)");
  EXPECT_EQ(error_message([&] { tok.encode("a\nb", "prompt"); }),
            "prompt: 1 character is not in the model's vocabulary: U+000A");
}

TEST(Tokenizer, ByteRoundTripOnArbitraryBytes) {
  const Tokenizer tok = Tokenizer::byte_level();
  EXPECT_EQ(tok.kind(), TokenizerKind::Byte);
  EXPECT_EQ(tok.vocab_size(), 256);
  for (uint32_t b = 0; b < 256; ++b) ASSERT_EQ(tok.vocab()[b], b);

  std::string bytes;
  for (int b = 0; b < 256; ++b) bytes += static_cast<char>(b);
  Generator gen(7);
  for (int i = 0; i < 1000; ++i) bytes += static_cast<char>(gen.below(256));
  const std::vector<int32_t> ids = tok.encode(bytes);
  ASSERT_EQ(ids.size(), bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) {
    ASSERT_EQ(ids[i], static_cast<uint8_t>(bytes[i])) << "at " << i;
  }
  EXPECT_EQ(tok.decode(ids), bytes);
  EXPECT_EQ(tok.decode_one(0xE2), "\xE2");
}

TEST(Tokenizer, DecodeRejectsOutOfRangeIds) {
  const Tokenizer tok = Tokenizer::build_char("abc");
  EXPECT_THAT(error_message([&] { tok.decode_one(3); }), HasSubstr("token id 3 is out of range"));
  EXPECT_THAT(error_message([&] { tok.decode_one(-1); }), HasSubstr("token id -1"));
  const std::vector<int32_t> ids = {0, 1, 7};
  EXPECT_THAT(error_message([&] { tok.decode(ids); }), HasSubstr("token id 7"));
  EXPECT_THAT(error_message([] { Tokenizer::byte_level().decode_one(256); }),
              HasSubstr("token id 256"));
}

TEST(Tokenizer, FromVocabRestoresAndValidates) {
  const Tokenizer built = Tokenizer::build_char("to be or not to be");
  const Tokenizer restored = Tokenizer::from_vocab(TokenizerKind::Char, built.vocab());
  EXPECT_EQ(restored, built);
  EXPECT_EQ(restored.encode("be not"), built.encode("be not"));
  EXPECT_EQ(Tokenizer::from_vocab(TokenizerKind::Byte, Tokenizer::byte_level().vocab()),
            Tokenizer::byte_level());

  EXPECT_THAT(error_message([] { Tokenizer::from_vocab(TokenizerKind::Char, {}); }),
              HasSubstr("empty"));
  EXPECT_THAT(error_message([] {
                Tokenizer::from_vocab(TokenizerKind::Char, {'a', 'c', 'b'});
              }),
              HasSubstr("sorted and unique"));
  EXPECT_THAT(error_message([] {
                Tokenizer::from_vocab(TokenizerKind::Char, {'a', 'a'});
              }),
              HasSubstr("sorted and unique"));
  EXPECT_THAT(error_message([] {
                Tokenizer::from_vocab(TokenizerKind::Char, {'a', 0xD800});
              }),
              HasSubstr("U+D800 is not a Unicode scalar value"));
  EXPECT_THAT(error_message([] { Tokenizer::from_vocab(TokenizerKind::Char, {0x110000}); }),
              HasSubstr("not a Unicode scalar value"));
  EXPECT_THAT(error_message([] {
                Tokenizer::from_vocab(TokenizerKind::Byte, {0, 1, 2});
              }),
              HasSubstr("byte vocabulary is the 256 values 0..255"));
  std::vector<uint32_t> shifted(256);
  for (uint32_t i = 0; i < 256; ++i) shifted[i] = i + 1;
  EXPECT_THAT(error_message([&] { Tokenizer::from_vocab(TokenizerKind::Byte, shifted); }),
              HasSubstr("0..255"));
}

TEST(Tokenizer, KindNames) {
  EXPECT_EQ(Tokenizer::parse_kind("char"), TokenizerKind::Char);
  EXPECT_EQ(Tokenizer::parse_kind("byte"), TokenizerKind::Byte);
  EXPECT_EQ(Tokenizer::parse_kind("bpe"), TokenizerKind::Bpe);
  EXPECT_EQ(Tokenizer::parse_kind("spm"), TokenizerKind::Spm);
  EXPECT_EQ(Tokenizer::build_char("x").kind_name(), "char");
  EXPECT_EQ(Tokenizer::byte_level().kind_name(), "byte");
  EXPECT_EQ(error_message([] { Tokenizer::parse_kind("wordpiece"); }),
            "tokenizer: unknown kind 'wordpiece' (expected 'char', 'byte', 'bpe' or 'spm')");
}

}  // namespace
}  // namespace kvlab
