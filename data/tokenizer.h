#pragma once
// Character- and byte-level tokenizers. A token id is an index into vocab(): the sorted Unicode
// code points of the training text (char) or the byte values 0..255 (byte).
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvlab {

enum class TokenizerKind { Char, Byte };

// "char" or "byte": the names used on the command line, in checkpoints and in cache file names.
std::string kind_name(TokenizerKind kind);

class Tokenizer {
 public:
  // Vocabulary = the sorted distinct code points of utf8_text. `what` names the text in errors.
  static Tokenizer build_char(std::string_view utf8_text, std::string_view what = "corpus");
  static Tokenizer byte_level();
  // Restores a vocabulary (from a checkpoint): sorted, unique, non-empty; char entries must be
  // Unicode scalar values, a byte vocabulary must be exactly 0..255.
  static Tokenizer from_vocab(TokenizerKind kind, std::vector<uint32_t> code_points);
  static TokenizerKind parse_kind(std::string_view name);

  TokenizerKind kind() const { return kind_; }
  std::string kind_name() const { return kvlab::kind_name(kind_); }
  int vocab_size() const { return static_cast<int>(vocab_.size()); }
  const std::vector<uint32_t>& vocab() const { return vocab_; }

  // Char kind: throws on invalid UTF-8 and lists every distinct character missing from the
  // vocabulary. `what` names the text in errors ("prompt").
  std::vector<int32_t> encode(std::string_view text, std::string_view what = "text") const;
  // UTF-8 out; the byte kind returns the raw bytes, which need not be valid UTF-8.
  std::string decode(std::span<const int32_t> ids) const;
  std::string decode_one(int32_t id) const;

  bool operator==(const Tokenizer&) const = default;

 private:
  Tokenizer(TokenizerKind kind, std::vector<uint32_t> vocab)
      : kind_(kind), vocab_(std::move(vocab)) {}
  void append_token(std::string& out, int32_t id) const;

  TokenizerKind kind_;
  std::vector<uint32_t> vocab_;  // (V,) code point or byte value of each id
};

}  // namespace kvlab
