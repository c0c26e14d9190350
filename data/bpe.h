#pragma once
// Byte-level BPE: text is cut into chunks by a pre-split regex, each chunk's bytes start as
// one token each and adjacent tokens are merged by the lowest-ranked merge until none applies
// (GPT-2's and tiktoken's scheme). kvlab trains such vocabularies (train_bpe) and imports
// GPT-2's vocab.json + merges.txt and tiktoken's rank files.
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvlab {

// The pre-split regexes: gpt2 (GPT-2, r50k_base), cl100k (cl100k_base) and kvlab, kvlab's own
// vocabularies' name for the cl100k regex (letters, numbers in groups of up to three,
// punctuation, whitespace runs); llama3 (Llama 3's vocabularies, llama.cpp's `llama-bpe`): the
// cl100k regex, and a chunk that is itself a token is that token without merging (tiktoken's
// rule and Hugging Face's ignore_merges, which its merges need); qwen2 (Qwen2's, llama.cpp's
// `qwen2`): the cl100k regex with numbers one digit a chunk; deepseek_llm and deepseek_coder
// (DeepSeek LLM's and Coder's, llama.cpp's `deepseek-llm` and `deepseek-coder`): several regexes
// in turn, each cutting every chunk the ones before it left.
enum class SplitPattern { Gpt2, Cl100k, Kvlab, Llama3, Qwen2, DeepseekLlm, DeepseekCoder };
std::string pattern_name(SplitPattern pattern);
std::vector<std::string> pattern_name_list();
std::string pattern_names();  // "gpt2, cl100k, kvlab, llama3, qwen2, ... or deepseek_coder"
SplitPattern parse_pattern(std::string_view name);

// The chunks of a text under a pattern (PCRE2, JIT-compiled, Unicode properties). Every byte
// lands in exactly one chunk: bytes that are not valid UTF-8 never match the regex and come
// out as chunks of their own, so the chunks always concatenate to the text. A pattern of several
// regexes cuts the text by the first into its matches and the text between, then each such
// chunk by the next, and so on (llama.cpp's unicode_regex_split).
class PreSplitter {
 public:
  explicit PreSplitter(SplitPattern pattern);
  void split(std::string_view text, const std::function<void(std::string_view)>& on_chunk) const;
  std::vector<std::string_view> split(std::string_view text) const;

 private:
  // One pcre2_code_8 a regex, in the order they cut, freed with pcre2_code_free_8.
  std::vector<std::shared_ptr<void>> codes_;
  void split_by(size_t regex, std::string_view text,
                const std::function<void(std::string_view)>& on_chunk) const;
};

struct BpeMerge {
  int32_t left, right, token;  // left followed by right becomes token
  bool operator==(const BpeMerge&) const = default;
};

class BpeTokenizer {
 public:
  // tokens: the bytes of every id; merges: in rank order (rank 0 applies first); the last
  // n_special ids are special (never produced by encode) or unused: an unused id has no bytes
  // (tiktoken's cl100k leaves 100256 free), and decoding it is an error. Checked: exactly 256
  // single-byte tokens, each other ordinary token made by at least one merge of two ordinary
  // tokens, no pair merged twice. A vocabulary kvlab trains or reads from tiktoken's ranks makes
  // each token by one merge of earlier-made ones; Llama 3's merges (derived from its ranks)
  // make a token from several pairs, which rank order alone decides between.
  static BpeTokenizer from_parts(SplitPattern pattern, std::vector<std::string> tokens,
                                 std::vector<BpeMerge> merges, int n_special);
  // As a checkpoint stores it: every id's bytes (empty: unused), the merges as (left, right)
  // pairs in rank order (each makes the ordinary token of their joined bytes), and the ids of
  // the special tokens. The ordinary ids are those below the first special or unused one.
  static BpeTokenizer from_pairs(SplitPattern pattern, std::vector<std::string> tokens,
                                 std::span<const std::pair<int32_t, int32_t>> pairs,
                                 std::span<const int32_t> special_ids);
  // A tiktoken rank file ("<base64 bytes> <rank>" per line, ranks 0..N-1); the merges are
  // recovered by encoding each token with the merges of the lower ranks, which must leave two
  // pieces. The special tokens get tiktoken's ids (tiktoken_specials); ids between the ranks
  // and them stay unused.
  static BpeTokenizer from_tiktoken(std::string_view rank_file, SplitPattern pattern);
  // GPT-2's vocab.json (token text under bytes_to_unicode -> id) and merges.txt.
  static BpeTokenizer from_gpt2(std::string_view vocab_json, std::string_view merges_txt,
                                SplitPattern pattern);

  // The ids of the text; special tokens' text is encoded as ordinary text (tiktoken's
  // encode_ordinary). Any bytes, valid UTF-8 or not; decode gives them back (but a byte that
  // falls back to a special token, in DeepSeek's vocabularies, decodes as that token's text).
  std::vector<int32_t> encode(std::string_view text) const;
  std::string decode(std::span<const int32_t> ids) const;
  const std::string& token(int32_t id) const;  // its bytes; throws for an id out of range

  SplitPattern pattern() const { return pattern_; }
  int vocab_size() const { return static_cast<int>(tokens_.size()); }
  // The special and unused ids at the end of the vocabulary.
  int n_special() const { return n_special_; }
  // The ids of the special tokens (those of the last n_special() that have bytes).
  std::vector<int32_t> special_ids() const;
  const std::vector<std::string>& tokens() const { return tokens_; }
  const std::vector<BpeMerge>& merges() const { return merges_; }

  // One uint32 array holding everything (the token cache's vocabulary, and /tokenizer/vocab of
  // kind bpe in checkpoints written before the separate datasets) and back; unpack checks it
  // as from_parts does.
  std::vector<uint32_t> pack() const;
  static BpeTokenizer unpack(std::span<const uint32_t> words);

  bool operator==(const BpeTokenizer& other) const;

 private:
  struct Tables;  // split regex, byte and merge lookups, chunk cache
  BpeTokenizer() = default;
  std::vector<int32_t> encode_chunk(std::string_view chunk) const;

  SplitPattern pattern_ = SplitPattern::Kvlab;
  std::vector<std::string> tokens_;
  std::vector<BpeMerge> merges_;
  int n_special_ = 0;
  std::shared_ptr<Tables> tables_;
};

// tiktoken's special tokens for the encoding a pre-split pattern belongs to, given its
// number of ranks: cl100k_base's five at their fixed ids (from 100257), otherwise
// <|endoftext|> right after the ranks (r50k_base's 50256).
std::vector<std::pair<std::string, int32_t>> tiktoken_specials(SplitPattern pattern,
                                                               int32_t n_ranks);

// Called after each merge of training: merges done, merges wanted.
using BpeProgress = std::function<void(int64_t done, int64_t total)>;

// Trains a vocabulary of vocab_size tokens: 256 bytes (id = byte value), vocab_size - 256 -
// specials.size() merges, then the special tokens. Throws when vocab_size leaves no room for
// the bytes and specials, when the corpus is empty, and when it has fewer distinct adjacent
// pairs to merge than wanted (the message gives the largest vocab_size the corpus supports).
BpeTokenizer train_bpe(std::string_view corpus, int vocab_size, SplitPattern pattern,
                       const BpeProgress& progress = {},
                       const std::vector<std::string>& specials = {"<|endoftext|>"});

// Joins the bytes of generated tokens into text that never ends inside a UTF-8 character: an
// incomplete character is held back until its last byte arrives. Bytes that cannot become a
// character are passed through as they are.
class Utf8StreamDecoder {
 public:
  std::string push(std::string_view bytes);
  std::string finish();  // what is held back, complete or not

 private:
  std::string pending_;
};

// GPT-2's bytes_to_unicode spelling of a token's bytes (vocab.json's, and GGUF's
// tokenizer.ggml.tokens), and back: false for text that is not such a spelling.
std::string gpt2_bytes_to_text(std::string_view bytes);
bool gpt2_text_to_bytes(const std::string& text, std::string& out);

}  // namespace kvlab
