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
};

// Reads and tokenizes `file`, or loads the token cache an earlier call wrote next to it (a
// corrupt or mismatched cache is ignored; an unwritable folder just means no cache). The split
// is nanoGPT's: n_train = int((1 - val_fraction) * n). Anything but a regular file (a folder,
// a FIFO, a device) is refused before it is opened.
Corpus load_corpus(const std::filesystem::path& file, TokenizerKind kind, double val_fraction = 0.1,
                   bool use_cache = true);

// Throws unless train and val each hold at least block_size + 1 tokens (a window and its
// targets).
void check_corpus_fits(const Corpus& corpus, int block_size);

uint64_t fnv1a64(std::string_view bytes);
// A content hash as 16 lowercase hex digits, as in the token cache's file name and checkpoints.
std::string hash_hex(uint64_t hash);

// Token cache, keyed by content hash and tokenizer kind: <file>.<hash, 16 hex>.<kind>.kvlab-cache
struct TokenCache {
  Tokenizer tokenizer;
  std::vector<int32_t> ids;  // (N,)
};
std::filesystem::path token_cache_path(const std::filesystem::path& file, uint64_t content_hash,
                                       TokenizerKind kind);
// Writes a temporary file, then renames it over `cache`. Returns false, leaving nothing behind,
// when that fails.
bool write_token_cache(const std::filesystem::path& cache, uint64_t content_hash,
                       const Tokenizer& tokenizer, std::span<const int32_t> ids);
// nullopt when the cache is missing, truncated, corrupt, or for other content or another kind.
std::optional<TokenCache> read_token_cache(const std::filesystem::path& cache,
                                           uint64_t content_hash, TokenizerKind kind);

}  // namespace kvlab
