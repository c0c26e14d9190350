#include "data/corpus.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>

#include "platform/atomic_file.h"
#include "platform/error.h"
#include "platform/memory.h"

namespace kvlab {
namespace fs = std::filesystem;
namespace {

// Layout (host byte order; the cache is a local artifact): magic, u32 version, u32 kind,
// u64 content hash, u64 V, u32 vocab[V], u64 N, i32 ids[N], u64 fnv1a64 of all preceding bytes.
constexpr char kMagic[8] = {'K', 'V', 'L', 'A', 'B', 'T', 'O', 'K'};
constexpr uint32_t kVersion = 1;

// read_bytes's default: no limit (max_bytes + 1 must not wrap).
constexpr size_t kAnySize = std::numeric_limits<size_t>::max() - 1;

// Whole file, or its first max_bytes + 1 bytes when it is longer, or nullopt with errno set.
std::optional<std::string> read_bytes(const fs::path& file, size_t max_bytes = kAnySize) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(file.c_str(), "rb"), &std::fclose);
  if (!f) return std::nullopt;
  std::string bytes;
  char buf[1 << 16];
  size_t got;
  while (bytes.size() <= max_bytes && (got = std::fread(buf, 1, sizeof buf, f.get())) > 0)
    bytes.append(buf, got);
  if (std::ferror(f.get())) return std::nullopt;
  return bytes;
}

template <class T>
void put(std::string& buf, const T& v) {
  buf.append(reinterpret_cast<const char*>(&v), sizeof v);
}

template <class T>
void put_array(std::string& buf, std::span<const T> values) {
  buf.append(reinterpret_cast<const char*>(values.data()), values.size_bytes());
}

// Bounds-checked reads from a byte buffer; every failure returns false.
class Reader {
 public:
  explicit Reader(std::string_view bytes) : bytes_(bytes) {}
  template <class T>
  bool get(T& v) {
    if (bytes_.size() - pos_ < sizeof v) return false;
    std::memcpy(&v, bytes_.data() + pos_, sizeof v);
    pos_ += sizeof v;
    return true;
  }
  template <class T>
  bool get_array(std::vector<T>& values, uint64_t n) {
    if (n > (bytes_.size() - pos_) / sizeof(T)) return false;
    values.resize(n);
    std::memcpy(values.data(), bytes_.data() + pos_, n * sizeof(T));
    pos_ += n * sizeof(T);
    return true;
  }
  size_t pos() const { return pos_; }
  bool at_end() const { return pos_ == bytes_.size(); }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
};

// Where bpe cuts the text: the training split's bytes.
size_t train_bytes(size_t n_bytes, double val_fraction) {
  return static_cast<size_t>((1.0 - val_fraction) * static_cast<double>(n_bytes));
}

TokenCache tokenize(std::string_view text, TokenizerKind kind, double val_fraction,
                    const BpeSettings& bpe, const std::string& what) {
  if (kind != TokenizerKind::Bpe) {
    Tokenizer tokenizer =
        kind == TokenizerKind::Char ? Tokenizer::build_char(text, what) : Tokenizer::byte_level();
    std::vector<int32_t> ids = tokenizer.encode(text, what);
    return TokenCache{std::move(tokenizer), std::move(ids)};
  }
  // The vocabulary never sees the validation text, whose bits per byte it would flatter.
  const size_t cut = train_bytes(text.size(), val_fraction);
  KVLAB_CHECK(cut > 0, what, ": the training split is empty, there is no text to learn a bpe "
              "vocabulary from");
  Tokenizer tokenizer = Tokenizer::bpe(
      train_bpe(text.substr(0, cut), bpe.vocab_size, bpe.pattern, bpe.progress));
  std::vector<int32_t> ids = tokenizer.encode(text.substr(0, cut));
  const std::vector<int32_t> val = tokenizer.encode(text.substr(cut));
  ids.insert(ids.end(), val.begin(), val.end());
  return TokenCache{std::move(tokenizer), std::move(ids)};
}

// Bpe's training ids: those whose bytes lie in the text's first `cut` bytes (tokenize encodes
// the two parts apart, so one id ends exactly there).
size_t ids_within(const Tokenizer& tokenizer, std::span<const int32_t> ids, size_t cut) {
  size_t n = 0, bytes = 0;
  while (n < ids.size() && bytes < cut) bytes += tokenizer.decode_one(ids[n++]).size();
  return n;
}

const char* file_type_name(fs::file_type type) {
  switch (type) {
    case fs::file_type::fifo:
      return "FIFO";
    case fs::file_type::socket:
      return "socket";
    case fs::file_type::block:
      return "block device";
    case fs::file_type::character:
      return "character device";
    default:
      return "special file";
  }
}

}  // namespace

uint64_t fnv1a64(std::string_view bytes) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (const char c : bytes) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001B3ull;
  }
  return h;
}

std::string hash_hex(uint64_t hash) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(hash));
  return buf;
}

std::string token_cache_key(TokenizerKind kind, const BpeSettings& bpe, double val_fraction) {
  if (kind != TokenizerKind::Bpe) return kind_name(kind);
  return detail::cat("bpe-", bpe.vocab_size, "-", pattern_name(bpe.pattern), "-val", val_fraction);
}

fs::path token_cache_path(const fs::path& file, uint64_t content_hash, TokenizerKind kind) {
  return token_cache_path(file, content_hash, kind_name(kind));
}

fs::path token_cache_path(const fs::path& file, uint64_t content_hash, std::string_view key) {
  fs::path cache = file;
  cache += detail::cat(".", hash_hex(content_hash), ".", key, ".kvlab-cache");
  return cache;
}

bool write_token_cache(const fs::path& cache, uint64_t content_hash, const Tokenizer& tokenizer,
                       std::span<const int32_t> ids) {
  std::string buf(kMagic, sizeof kMagic);
  put(buf, kVersion);
  put(buf, static_cast<uint32_t>(tokenizer.kind()));
  put(buf, content_hash);
  put(buf, static_cast<uint64_t>(tokenizer.vocab().size()));
  put_array(buf, std::span<const uint32_t>(tokenizer.vocab()));
  put(buf, static_cast<uint64_t>(ids.size()));
  put_array(buf, ids);
  put(buf, fnv1a64(buf));

  // Several processes (data-parallel ranks) may write the same cache: each writes its own
  // temporary, and the last rename wins with identical bytes. The cache is an optimisation, so
  // a failed write is reported to the caller, not thrown.
  try {
    write_file_atomic(cache, std::string_view(buf.data(), buf.size()));
  } catch (const Error&) {
    return false;
  }
  return true;
}

std::optional<TokenCache> read_token_cache(const fs::path& cache, uint64_t content_hash,
                                           TokenizerKind kind) {
  const std::optional<std::string> bytes = read_bytes(cache);
  if (!bytes || bytes->size() < sizeof kMagic + sizeof(uint64_t) ||
      bytes->compare(0, sizeof kMagic, kMagic, sizeof kMagic) != 0) {
    return std::nullopt;
  }
  const size_t body_size = bytes->size() - sizeof(uint64_t);
  uint64_t checksum;
  std::memcpy(&checksum, bytes->data() + body_size, sizeof checksum);
  if (checksum != fnv1a64(std::string_view(*bytes).substr(0, body_size))) return std::nullopt;

  Reader r(std::string_view(*bytes).substr(sizeof kMagic, body_size - sizeof kMagic));
  uint32_t version, stored_kind;
  uint64_t stored_hash, n_vocab, n_ids;
  std::vector<uint32_t> vocab;
  std::vector<int32_t> ids;
  if (!r.get(version) || version != kVersion || !r.get(stored_kind) ||
      stored_kind != static_cast<uint32_t>(kind) || !r.get(stored_hash) ||
      stored_hash != content_hash || !r.get(n_vocab) || !r.get_array(vocab, n_vocab) ||
      !r.get(n_ids) || !r.get_array(ids, n_ids) || !r.at_end()) {
    return std::nullopt;
  }
  try {
    Tokenizer tokenizer = Tokenizer::from_vocab(kind, std::move(vocab));
    for (const int32_t id : ids) {
      if (id < 0 || id >= tokenizer.vocab_size()) return std::nullopt;
    }
    return TokenCache{std::move(tokenizer), std::move(ids)};
  } catch (const Error&) {
    return std::nullopt;
  }
}

namespace {
// The caches of earlier contents of `file` (<file>.<another hash>.<key>.kvlab-cache, any
// key): each edit of a corpus would otherwise leave more behind, ~4x its size. Best effort.
void remove_stale_token_caches(const fs::path& file, uint64_t content_hash) {
  const std::string prefix = file.filename().string() + ".";
  std::error_code ec;
  const fs::path dir = file.has_parent_path() ? file.parent_path() : fs::path(".");
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with(prefix)) continue;
    // The hash the name would carry; it is a cache only if token_cache_path gives it back.
    uint64_t hash = 0;
    const char* hex = name.data() + prefix.size();
    const auto [stop, parse] = std::from_chars(hex, name.data() + name.size(), hash, 16);
    if (parse != std::errc() || hash == content_hash || stop != hex + 16 || *stop != '.' ||
        !name.ends_with(".kvlab-cache") || name.size() <= prefix.size() + 17 + 12)
      continue;
    const std::string key = name.substr(prefix.size() + 17, name.size() - prefix.size() - 17 -
                                                                std::strlen(".kvlab-cache"));
    if (!key.empty() && token_cache_path(file, hash, key).filename() == name) {
      std::error_code ignored;
      fs::remove(it->path(), ignored);
    }
  }
}
}  // namespace

Corpus load_corpus(const fs::path& file, TokenizerKind kind, double val_fraction, bool use_cache,
                   const BpeSettings& bpe) {
  KVLAB_CHECK(val_fraction >= 0.0 && val_fraction < 1.0,
              "corpus: val_fraction must be in [0, 1), got ", val_fraction);
  KVLAB_CHECK(kind != TokenizerKind::Spm, "corpus: an spm (SentencePiece) vocabulary comes from "
              "a model file (kvlab import, kvlab tokenizer import --gguf); kvlab learns char, "
              "byte and bpe ones from a corpus");
  KVLAB_CHECK(kind != TokenizerKind::Bpe || bpe.vocab_size > 0,
              "corpus: a bpe tokenizer needs a vocabulary size (--vocab-size N)");
  const std::string name = file.string();
  std::error_code ec;
  // Anything but a regular file (a link to one is fine) is refused before it is opened: a FIFO
  // would block the open until a writer came, and the text is read more than once (ablate).
  const fs::file_type type = fs::status(file, ec).type();
  KVLAB_CHECK(type != fs::file_type::directory, "corpus: '", name, "' is a directory, not a file");
  KVLAB_CHECK(ec || type == fs::file_type::regular || type == fs::file_type::not_found, "corpus: '",
              name, "' is not a regular file (it is a ", file_type_name(type),
              "); give a text file");
  // Tokens take 4 bytes a character, and their cache as much again while it is written.
  constexpr double kBytesPerByte = 10;
  const double memory = host_memory_bytes();
  const size_t max_bytes = memory > 0 ? static_cast<size_t>(memory / kBytesPerByte) : kAnySize;
  const std::optional<std::string> bytes = read_bytes(file, max_bytes);
  KVLAB_CHECK(bytes, "corpus: cannot read '", name, "': ", std::strerror(errno));
  KVLAB_CHECK(!bytes->empty(), "corpus: '", name, "' is empty");
  KVLAB_CHECK(bytes->size() <= max_bytes, "corpus: '", name, "' is larger than ",
              static_cast<double>(max_bytes) / 1e9, " GB, the most this machine's ", memory / 1e9,
              " GB of memory can tokenize (about ", kBytesPerByte, " bytes for each byte of text)");

  const uint64_t hash = fnv1a64(*bytes);
  const fs::path cache = token_cache_path(file, hash, token_cache_key(kind, bpe, val_fraction));
  std::optional<TokenCache> tokens;
  if (use_cache) tokens = read_token_cache(cache, hash, kind);
  if (tokens && kind == TokenizerKind::Bpe &&
      (tokens->tokenizer.vocab_size() != bpe.vocab_size ||
       tokens->tokenizer.bpe()->pattern() != bpe.pattern))
    tokens.reset();  // a file renamed over the cache's name
  if (!tokens) {
    tokens = tokenize(*bytes, kind, val_fraction, bpe, "corpus '" + name + "'");
    if (use_cache && write_token_cache(cache, hash, tokens->tokenizer, tokens->ids))
      remove_stale_token_caches(file, hash);
  }

  const std::vector<int32_t>& ids = tokens->ids;
  const size_t n_train =
      kind == TokenizerKind::Bpe
          ? ids_within(tokens->tokenizer, ids, train_bytes(bytes->size(), val_fraction))
          : static_cast<size_t>((1.0 - val_fraction) * static_cast<double>(ids.size()));
  Corpus corpus{std::move(tokens->tokenizer),
                std::vector<int32_t>(ids.begin(), ids.begin() + n_train),
                std::vector<int32_t>(ids.begin() + n_train, ids.end()), name, hash};
  corpus.val_bytes = static_cast<int64_t>(corpus.tokenizer.decode(corpus.val).size());
  return corpus;
}

double val_tokens_per_byte(const Corpus& corpus) {
  return corpus.val_bytes > 0
             ? static_cast<double>(corpus.val.size()) / static_cast<double>(corpus.val_bytes)
             : 0.0;
}

double bits_per_byte(double nats_per_token, double tokens_per_byte) {
  return nats_per_token * tokens_per_byte / std::log(2.0);
}

void check_corpus_fits(const Corpus& corpus, int block_size) {
  KVLAB_CHECK(block_size >= 1, "corpus: block_size must be positive, got ", block_size);
  const size_t need = static_cast<size_t>(block_size) + 1;
  KVLAB_CHECK(corpus.train.size() >= need && corpus.val.size() >= need, "corpus '", corpus.path,
              "' is too short for block_size ", block_size, ": train has ", corpus.train.size(),
              " tokens and val has ", corpus.val.size(), ", each split needs at least ", need,
              " (block_size + 1)");
}

}  // namespace kvlab
