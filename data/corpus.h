#pragma once
// A text file as token ids: tokenized once, cached next to the file, split by position into
// train and val.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace kvlab {

struct Corpus {
  Tokenizer tokenizer;
  std::vector<int32_t> train;  // (N_train,) the first (1 - val_fraction) of the ids
  std::vector<int32_t> val;    // (N_val,) the rest
  std::string path;
  uint64_t content_hash = 0;  // fnv1a64 of the file's bytes
  int64_t val_bytes = 0;      // bytes of text the val ids stand for (bits per byte's divisor)
  // A task's corpus (data/mqar.h): per token the id it must be predicted as, -1 where the loss
  // does not score it, and windows that start at multiples of example_tokens (one example
  // each). Empty and 0 for text: every next token is scored, a window starts anywhere.
  std::vector<int32_t> train_targets = {}, val_targets = {};
  int64_t example_tokens = 0;
};

// A bpe corpus's vocabulary: vocab_size tokens (the model's vocabulary), learnt under
// `pattern` from the training split; `progress` is called after each merge.
struct BpeSettings {
  int vocab_size = 0;
  SplitPattern pattern = SplitPattern::Kvlab;
  BpeProgress progress;
};

// Reads and tokenizes `file`, or loads the token cache an earlier call wrote next to it (a
// corrupt or mismatched cache is ignored; an unwritable folder just means no cache). The split
// is nanoGPT's: n_train = int((1 - val_fraction) * n). Bpe splits the text instead, at byte
// int((1 - val_fraction) * bytes): the vocabulary is learnt from the training bytes alone and
// each part is encoded on its own, so no token spans the split. Anything but a regular file
// (a folder, a FIFO, a device) is refused before it is opened.
Corpus load_corpus(const std::filesystem::path& file, TokenizerKind kind, double val_fraction = 0.1,
                   bool use_cache = true, const BpeSettings& bpe = {});

// Validation tokens per byte of validation text (0 without any): a loss in nats per token
// times it, over ln 2, is bits per byte, which compares models across tokenizers.
double val_tokens_per_byte(const Corpus& corpus);
double bits_per_byte(double nats_per_token, double tokens_per_byte);

// Throws unless train and val each hold at least block_size + 1 tokens (a window and its
// targets).
void check_corpus_fits(const Corpus& corpus, int block_size);

uint64_t fnv1a64(std::string_view bytes);
// A content hash as 16 lowercase hex digits, as in the token cache's file name and checkpoints.
std::string hash_hex(uint64_t hash);

// Token cache, keyed by content hash and tokenizer: <file>.<hash, 16 hex>.<key>.kvlab-cache,
// the key being the kind, or for bpe what its vocabulary depends on:
// bpe-<vocab size>-<pattern>-val<val_fraction> (the training split's bytes).
struct TokenCache {
  Tokenizer tokenizer;
  std::vector<int32_t> ids;  // (N,)
};
std::string token_cache_key(TokenizerKind kind, const BpeSettings& bpe = {},
                            double val_fraction = 0.1);
std::filesystem::path token_cache_path(const std::filesystem::path& file, uint64_t content_hash,
                                       TokenizerKind kind);
std::filesystem::path token_cache_path(const std::filesystem::path& file, uint64_t content_hash,
                                       std::string_view key);
// Writes a temporary file, then renames it over `cache`. Returns false, leaving nothing behind,
// when that fails.
bool write_token_cache(const std::filesystem::path& cache, uint64_t content_hash,
                       const Tokenizer& tokenizer, std::span<const int32_t> ids);
// nullopt when the cache is missing, truncated, corrupt, or for other content or another kind.
std::optional<TokenCache> read_token_cache(const std::filesystem::path& cache,
                                           uint64_t content_hash, TokenizerKind kind);

}  // namespace kvlab
