#pragma once
// SentencePiece vocabularies as llama.cpp's `llama` tokenizer model holds them (Llama 2's,
// Mistral's, Phi-3's): pieces spelling a space as U+2581 '▁', a score each, and a type each.
// Text is encoded as llama.cpp's SPM tokenizer does: spaces become '▁' (after one prefixed
// where add_space_prefix says), the text starts as one symbol per UTF-8 character, and the
// adjacent pair whose joined text is the piece of highest score is merged until no pair is a
// piece; a symbol that is no piece falls back to its bytes' <0xNN> pieces. User-defined pieces
// are matched in the text first, longest first, and encoded as themselves.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/token_split.h"

namespace kvlab {

// llama.cpp's token types (tokenizer.ggml.token_type), which a SentencePiece vocabulary uses all
// of.
enum class PieceType : uint8_t {
  Normal = 1,
  Unknown = 2,
  Control = 3,
  UserDefined = 4,
  Unused = 5,
  Byte = 6,  // <0xNN>: the byte NN
};

class SpmTokenizer {
 public:
  // Checked: as many scores and types as pieces, scores finite, types 1..6, no piece twice, no
  // empty piece, each Byte piece spelled <0xNN>. A byte falls back to its <0xNN> piece, or the
  // byte itself as a piece, as llama.cpp looks them up; encode throws for text that needs a
  // byte with neither.
  static SpmTokenizer from_parts(std::vector<std::string> pieces, std::vector<float> scores,
                                 std::vector<uint8_t> types, bool add_space_prefix);

  // Any bytes: invalid UTF-8 comes out as byte pieces, and decode gives them back.
  std::vector<int32_t> encode(std::string_view text) const;
  // A text already cut at some pieces (split_at_tokens): the pieces as they are, the text
  // between encoded, with the space prefix where it begins the text or follows a piece.
  std::vector<int32_t> encode_fragments(std::span<const TextFragment> fragments) const;
  // The text of ids: each id's bytes (token_bytes), less the one space that add_space_prefix
  // put before the first, as llama.cpp's detokenize strips it.
  std::string decode(std::span<const int32_t> ids) const;
  // What an id stands for in a stream of text: a Normal piece with '▁' as ' ', a Byte piece's
  // byte, any other its piece as it is. Throws for an id out of range.
  std::string token_bytes(int32_t id) const;

  int vocab_size() const { return static_cast<int>(pieces_.size()); }
  const std::vector<std::string>& pieces() const { return pieces_; }
  const std::vector<float>& scores() const { return scores_; }
  const std::vector<uint8_t>& types() const { return types_; }
  bool add_space_prefix() const { return add_space_prefix_; }

  bool operator==(const SpmTokenizer& o) const {
    return pieces_ == o.pieces_ && scores_ == o.scores_ && types_ == o.types_ &&
           add_space_prefix_ == o.add_space_prefix_;
  }

 private:
  struct Tables;  // piece -> id, each byte's fallback ids, the user-defined pieces
  SpmTokenizer() = default;
  void encode_fragment(std::string_view text, std::vector<int32_t>& out) const;

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::vector<uint8_t> types_;
  bool add_space_prefix_ = true;
  std::shared_ptr<const Tables> tables_;
};

}  // namespace kvlab
