#pragma once
// Character-, byte- and BPE-level tokenizers. For char and byte, a token id is an index into
// vocab(): the sorted Unicode code points of the training text (char) or the byte values
// 0..255 (byte). A bpe tokenizer is a byte-level BPE vocabulary (data/bpe.h), trained or
// imported; an spm one a SentencePiece vocabulary, imported (data/spm.h).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/bpe.h"
#include "data/spm.h"
#include "data/token_split.h"

namespace kvlab {

enum class TokenizerKind { Char, Byte, Bpe, Spm };

// The UTF-8 bytes of a code point (at most U+10FFFF), appended.
void append_utf8(std::string& out, uint32_t cp);

// "char", "byte", "bpe" or "spm": the names used on the command line, in checkpoints and in cache
// file names.
std::string kind_name(TokenizerKind kind);

// What a model's vocabulary says beyond its tokens (a GGUF file's tokenizer.ggml.*, kept in
// /tokenizer): the token a prompt begins with, and the tokens that end a generation.
struct TokenControls {
  int32_t bos = -1;           // begins a text (none: -1)
  int32_t eos = -1;           // ends one (none: -1); also in eog
  bool add_bos = false;       // a prompt encoded from text begins with bos
  bool add_eos = false;       // and ends with eos
  // Ascending: bpe tokens read from text as themselves wherever their text appears (llama.cpp's
  // user-defined tokens, Qwen2's). An spm vocabulary's are its own (data/spm.h).
  std::vector<int32_t> user_defined;
  std::vector<int32_t> eog;   // ascending: a sequence that makes one of these ends there
  // The model's chat template (GGUF's tokenizer.chat_template; data/chat_template.h), or empty.
  std::string chat_template = {};  // a default: designated initializers may leave it out
  bool operator==(const TokenControls&) const = default;
};

class Tokenizer {
 public:
  // Vocabulary = the sorted distinct code points of utf8_text. `what` names the text in errors.
  static Tokenizer build_char(std::string_view utf8_text, std::string_view what = "corpus");
  static Tokenizer byte_level();
  // Restores a vocabulary (from a checkpoint): sorted, unique, non-empty; char entries must be
  // Unicode scalar values, a byte vocabulary must be exactly 0..255; bpe's is
  // BpeTokenizer::pack()'s words.
  static Tokenizer from_vocab(TokenizerKind kind, std::vector<uint32_t> code_points);
  static Tokenizer bpe(BpeTokenizer bpe);
  static Tokenizer spm(SpmTokenizer spm);
  static TokenizerKind parse_kind(std::string_view name);

  TokenizerKind kind() const { return kind_; }
  std::string kind_name() const { return kvlab::kind_name(kind_); }
  int vocab_size() const {
    return bpe_ ? bpe_->vocab_size() : spm_ ? spm_->vocab_size() : static_cast<int>(vocab_.size());
  }
  // Char and byte: the code points. Bpe: BpeTokenizer::pack()'s words, what a checkpoint holds.
  // Spm: empty.
  const std::vector<uint32_t>& vocab() const { return vocab_; }
  // The BPE vocabulary of a bpe tokenizer, else null.
  const BpeTokenizer* bpe() const { return bpe_.get(); }
  // The SentencePiece vocabulary of an spm tokenizer, else null.
  const SpmTokenizer* spm() const { return spm_.get(); }

  // Char kind: throws on invalid UTF-8 and lists every distinct character missing from the
  // vocabulary. `what` names the text in errors ("prompt").
  std::vector<int32_t> encode(std::string_view text, std::string_view what = "text") const;
  // Bpe and spm take any bytes (special tokens' text is encoded as ordinary text, but for
  // user-defined ones, as llama.cpp does).
  // UTF-8 out; byte, bpe and spm return the raw bytes, which need not be valid UTF-8 (a bpe or
  // spm token can end inside a character: Utf8StreamDecoder joins them for printing). Spm's
  // decode drops the space its encode put before the text.
  std::string decode(std::span<const int32_t> ids) const;
  std::string decode_one(int32_t id) const;

  // A prompt's ids: encode(text), after bos where add_bos says so and before eos where add_eos
  // does (as llama.cpp tokenizes a prompt with its special tokens).
  std::vector<int32_t> encode_prompt(std::string_view text, std::string_view what = "prompt") const;
  // A rendered chat's ids, as llama.cpp tokenizes one (parse_special): the text is cut at every
  // special token's text first (control, user-defined and unknown tokens), so that the
  // template's <|im_start|> is that token; a BOS (EOS) text the template put first (last) is
  // the BOS (EOS) that add_bos (add_eos) adds. Char and byte vocabularies have no special tokens.
  std::vector<int32_t> encode_chat(std::string_view text) const;
  const TokenControls& controls() const { return controls_; }
  // Throws kvlab::Error naming an id outside the vocabulary, add_bos without bos (add_eos
  // without eos), user-defined ids not ascending or without text, or on a vocabulary other
  // than bpe, eog not
  // ascending, or an eos not in it.
  void set_controls(TokenControls controls);
  bool ends_generation(int32_t id) const {
    return std::binary_search(controls_.eog.begin(), controls_.eog.end(), id);
  }

  bool operator==(const Tokenizer& o) const {
    // a bpe vocab_ is its packed vocabulary
    return kind_ == o.kind_ && vocab_ == o.vocab_ && controls_ == o.controls_ &&
           (!spm_ || *spm_ == *o.spm_);
  }

 private:
  Tokenizer(TokenizerKind kind, std::vector<uint32_t> vocab)
      : kind_(kind), vocab_(std::move(vocab)) {}
  void append_token(std::string& out, int32_t id) const;
  // A bpe or spm token's own text (a special token's as it is written).
  std::string_view special_text(int32_t id) const;
  // Fragments of a text cut at tokens: those tokens as they are, the text between BPE-encoded.
  std::vector<int32_t> bpe_fragments(std::span<const TextFragment> fragments) const;

  TokenizerKind kind_;
  std::vector<uint32_t> vocab_;  // (V,) code point or byte value of each id; bpe: packed
  std::shared_ptr<const BpeTokenizer> bpe_;
  std::shared_ptr<const SpmTokenizer> spm_;
  TokenControls controls_;
  std::vector<int32_t> user_defined_;  // controls_.user_defined, longest text first
  std::vector<int32_t> specials_;      // every special token with text, longest text first
};

}  // namespace kvlab
