#include "data/bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <climits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "platform/error.h"

namespace kvlab {
namespace {

// tiktoken's regexes (tiktoken_ext/openai_public.py), which PCRE2 reads as they are.
constexpr char kGpt2Regex[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr char kCl100kRegex[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Qwen2's (its tokenizer.json): cl100k's with \p{N} one digit at a time.
constexpr char kQwen2Regex[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// DeepSeek's pre-tokenizers as llama.cpp's src/llama-vocab.cpp lists them. llama.cpp runs a
// regex without \p{..} through std::wregex, whose \s is ASCII whitespace, and one with them
// over its category-collapsed text, where \s is any Unicode space: `ucp` says which. `$` is
// written \z: std::regex's end of the chunk (PCRE2's $ would match before a final newline).
struct SplitRegex {
  const char* regex;
  bool ucp;
};
constexpr SplitRegex kDeepseekLlmRegexes[] = {
    {R"([\r\n])", false},
    {R"(\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-)"
     R"(\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386})"
     R"(\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F})"
     R"(\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA})"
     R"(\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-)"
     R"(\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59})"
     R"(\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-)"
     R"(\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2})"
     R"(-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D})"
     R"(\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F})"
     R"(\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-)"
     R"(\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-)"
     R"(\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21})"
     R"(-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB})"
     R"(\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+)",
     false},
    {R"(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)", false},
    {R"(\s+\z)", false},
    {R"([\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+)", false},
    {R"(\p{N}+)", true},
};
constexpr SplitRegex kDeepseekCoderRegexes[] = {
    {R"([\r\n])", false},
    {R"(\s?\p{L}+)", true},
    {R"(\s?\p{P}+)", true},
    {R"([\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+)", false},
    {R"(\p{N})", true},
};

std::vector<SplitRegex> pattern_regexes(SplitPattern pattern) {
  switch (pattern) {
    case SplitPattern::Gpt2:
      return {{kGpt2Regex, true}};
    case SplitPattern::Qwen2:
      return {{kQwen2Regex, true}};
    case SplitPattern::DeepseekLlm:
      return {std::begin(kDeepseekLlmRegexes), std::end(kDeepseekLlmRegexes)};
    case SplitPattern::DeepseekCoder:
      return {std::begin(kDeepseekCoderRegexes), std::end(kDeepseekCoderRegexes)};
    default:
      return {{kCl100kRegex, true}};
  }
}

constexpr SplitPattern kPatterns[] = {SplitPattern::Gpt2,        SplitPattern::Cl100k,
                                      SplitPattern::Kvlab,       SplitPattern::Llama3,
                                      SplitPattern::Qwen2,       SplitPattern::DeepseekLlm,
                                      SplitPattern::DeepseekCoder};

// Whether a chunk that is itself an ordinary token encodes as that token, merges unasked.
bool whole_chunk_first(SplitPattern p) { return p == SplitPattern::Llama3; }

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// Pair of adjacent tokens -> its merge's rank and the token it makes.
struct MergeTarget {
  int32_t rank, token;
};
using MergeMap = std::unordered_map<uint64_t, MergeTarget>;

// Merges adjacent pieces, always the lowest-ranked merge first (the leftmost of equals), until
// no merge applies. The pieces form a linked list and the candidate pairs a min-heap of (rank,
// position), entries going stale as their pieces merge: O(n log n), where rescanning for the
// best pair after each merge would make a long chunk (a run of spaces) quadratic.
void apply_merges(std::vector<int32_t>& pieces, const MergeMap& merges) {
  const auto n = static_cast<int32_t>(pieces.size());
  if (n < 2) return;
  struct Candidate {
    int32_t rank, pos, left, right;  // pair (left, right) at pos and the piece after it
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  std::vector<int32_t> prev(static_cast<size_t>(n)), next(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i)
    prev[static_cast<size_t>(i)] = i - 1, next[static_cast<size_t>(i)] = i + 1;
  const auto offer = [&](int32_t i) {  // the pair starting at piece i, if it merges
    if (i < 0) return;
    const int32_t j = next[static_cast<size_t>(i)];
    if (j >= n) return;
    const int32_t l = pieces[static_cast<size_t>(i)], r = pieces[static_cast<size_t>(j)];
    const auto it = merges.find(pair_key(l, r));
    if (it != merges.end()) heap.push({it->second.rank, i, l, r});
  };
  for (int32_t i = 0; i + 1 < n; ++i) offer(i);
  std::vector<bool> gone(static_cast<size_t>(n));
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    const auto i = static_cast<size_t>(c.pos);
    const int32_t j = next[i];
    if (gone[i] || j >= n || pieces[i] != c.left || pieces[static_cast<size_t>(j)] != c.right)
      continue;  // stale: one of its pieces merged since
    pieces[i] = merges.at(pair_key(c.left, c.right)).token;
    gone[static_cast<size_t>(j)] = true;
    next[i] = next[static_cast<size_t>(j)];
    if (next[i] < n) prev[static_cast<size_t>(next[i])] = c.pos;
    offer(prev[i]);
    offer(c.pos);
  }
  size_t out = 0;  // piece 0 is never merged away: only right-hand pieces go
  for (int32_t i = 0; i < n; i = next[static_cast<size_t>(i)])
    pieces[out++] = pieces[static_cast<size_t>(i)];
  pieces.resize(out);
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

// Standard base64 with padding, as tiktoken's rank files hold it.
bool decode_base64(std::string_view in, std::string& out) {
  static const std::array<int8_t, 256> table = [] {
    std::array<int8_t, 256> t{};
    t.fill(-1);
    const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; ++i) t[static_cast<uint8_t>(alphabet[i])] = static_cast<int8_t>(i);
    return t;
  }();
  out.clear();
  if (in.empty() || in.size() % 4 != 0) return false;
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] == '=') {
      if (i + 2 < in.size() || (i + 1 < in.size() && in[i + 1] != '=')) return false;
      break;
    }
    const int v = table[static_cast<uint8_t>(in[i])];
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xFF);
    }
  }
  return true;
}

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
// for U+0100 upwards, so that every token's bytes read as printable text in vocab.json.
std::array<uint32_t, 256> gpt2_byte_chars() {
  std::array<uint32_t, 256> chars{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    chars[b] = printable ? b : next++;
  }
  return chars;
}

std::string printable(std::string_view bytes) {
  std::string out;
  for (const char c : bytes) {
    const auto b = static_cast<uint8_t>(c);
    if (b >= 0x20 && b < 0x7F && b != '\\') {
      out += c;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", b);
      out += buf;
    }
  }
  return out;
}

}  // namespace

// ---- Patterns and the splitter ----

std::string pattern_name(SplitPattern pattern) {
  switch (pattern) {
    case SplitPattern::Gpt2:
      return "gpt2";
    case SplitPattern::Cl100k:
      return "cl100k";
    case SplitPattern::Kvlab:
      return "kvlab";
    case SplitPattern::Llama3:
      return "llama3";
    case SplitPattern::Qwen2:
      return "qwen2";
    case SplitPattern::DeepseekLlm:
      return "deepseek_llm";
    case SplitPattern::DeepseekCoder:
      return "deepseek_coder";
  }
  return "?";
}

std::vector<std::string> pattern_name_list() {
  std::vector<std::string> names;
  for (const SplitPattern p : kPatterns) names.push_back(pattern_name(p));
  return names;
}

std::string pattern_names() {
  const std::vector<std::string> names = pattern_name_list();
  std::string out;
  for (size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  return out;
}

SplitPattern parse_pattern(std::string_view name) {
  for (const auto p : kPatterns)
    if (name == pattern_name(p)) return p;
  throw Error(detail::cat("bpe: unknown pre-split pattern '", name, "' (expected ",
                          pattern_names(), ")"));
}

PreSplitter::PreSplitter(SplitPattern pattern) {
  for (const auto& [regex, ucp] : pattern_regexes(pattern)) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* code = pcre2_compile(
        reinterpret_cast<PCRE2_SPTR>(regex), PCRE2_ZERO_TERMINATED,
        PCRE2_UTF | (ucp ? PCRE2_UCP : 0) | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
    KVLAB_CHECK(code != nullptr, "bpe: the ", pattern_name(pattern),
                " regex does not compile at ", offset, ": ", pcre2_message(error));
    codes_.emplace_back(code, [](void* c) { pcre2_code_free(static_cast<pcre2_code*>(c)); });
    // Without JIT (a platform PCRE2 lacks it for) matching is slower, not different.
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  }
}

void PreSplitter::split(std::string_view text,
                        const std::function<void(std::string_view)>& on_chunk) const {
  split_by(0, text, on_chunk);
}

// The text's chunks under regex `r`, each cut further by the regexes after it.
void PreSplitter::split_by(size_t r, std::string_view text,
                           const std::function<void(std::string_view)>& emit) const {
  const auto on_chunk = [&](std::string_view chunk) {
    if (r + 1 < codes_.size())
      split_by(r + 1, chunk, emit);
    else
      emit(chunk);
  };
  auto* code = static_cast<pcre2_code*>(codes_[r].get());
  std::unique_ptr<pcre2_match_data, void (*)(pcre2_match_data*)> match(
      pcre2_match_data_create_from_pattern(code, nullptr), pcre2_match_data_free);
  KVLAB_CHECK(match != nullptr, "bpe: out of memory for a regex match");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0, covered = 0;  // bytes [0, covered) are in chunks already
  while (pos < text.size()) {
    const int rc = pcre2_match(code, subject, text.size(), pos, 0, match.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    KVLAB_CHECK(rc > 0, "bpe: splitting text failed at byte ", pos, ": ", pcre2_message(rc));
    const PCRE2_SIZE* span = pcre2_get_ovector_pointer(match.get());
    // Text no match took: invalid UTF-8, or with several regexes, text between matches.
    if (span[0] > covered) on_chunk(text.substr(covered, span[0] - covered));
    if (span[1] == span[0]) {  // no pattern matches empty text; never loop on one that did
      pos = span[0] + 1;
      covered = span[0];
      continue;
    }
    on_chunk(text.substr(span[0], span[1] - span[0]));
    pos = covered = span[1];
  }
  if (covered < text.size()) on_chunk(text.substr(covered));
}

std::vector<std::string_view> PreSplitter::split(std::string_view text) const {
  std::vector<std::string_view> chunks;
  split(text, [&](std::string_view c) { chunks.push_back(c); });
  return chunks;
}

// ---- The tokenizer ----

struct BpeTokenizer::Tables {
  explicit Tables(SplitPattern p) : splitter(p) {}
  PreSplitter splitter;
  std::array<int32_t, 256> byte_token{};
  MergeMap merges;
  std::unordered_map<std::string, int32_t> whole_token;  // whole_chunk_first: bytes -> id
  // Chunk -> ids. Text repeats its words, so most chunks are found here; emptied when full.
  static constexpr size_t kCacheEntries = 1 << 18;
  std::mutex cache_mutex;
  std::unordered_map<std::string, std::vector<int32_t>> cache;
};

BpeTokenizer BpeTokenizer::from_parts(SplitPattern pattern, std::vector<std::string> tokens,
                                      std::vector<BpeMerge> merges, int n_special) {
  const auto n_tokens = static_cast<int32_t>(tokens.size());
  KVLAB_CHECK(n_special >= 0 && n_special <= n_tokens, "bpe: ", n_special,
              " special tokens in a vocabulary of ", n_tokens);
  const int32_t ordinary = n_tokens - n_special;
  auto tables = std::make_shared<Tables>(pattern);
  tables->byte_token.fill(-1);
  // made[id]: a byte, or made by a merge.
  std::vector<bool> made(static_cast<size_t>(ordinary));
  int n_bytes = 0;
  for (int32_t id = 0; id < n_tokens; ++id) {
    const std::string& t = tokens[static_cast<size_t>(id)];
    KVLAB_CHECK(!t.empty() || id >= ordinary, "bpe: ordinary token ", id, " is empty");
    if (id >= ordinary || t.size() != 1) continue;
    int32_t& slot = tables->byte_token[static_cast<uint8_t>(t[0])];
    KVLAB_CHECK(slot < 0, "bpe: tokens ", slot, " and ", id, " are both the byte ", printable(t));
    slot = id;
    made[static_cast<size_t>(id)] = true;
    ++n_bytes;
  }
  // A byte no ordinary token is (DeepSeek's lack the 13 that UTF-8 never uses) is the special
  // token spelled as GPT-2 spells the byte, where there is one: llama.cpp finds a byte's token
  // by that spelling whatever its type.
  for (unsigned b = 0; b < 256 && n_bytes < 256; ++b) {
    if (tables->byte_token[b] >= 0) continue;
    const std::string spelled = gpt2_bytes_to_text(std::string(1, static_cast<char>(b)));
    for (int32_t id = ordinary; id < n_tokens; ++id)
      if (tokens[static_cast<size_t>(id)] == spelled) {
        tables->byte_token[b] = id;
        ++n_bytes;
        break;
      }
  }
  KVLAB_CHECK(n_bytes == 256, "bpe: the vocabulary has ", n_bytes,
              " single-byte tokens (or special tokens spelled as GPT-2 spells a byte); byte-level "
              "BPE needs all 256");
  tables->merges.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const BpeMerge& m = merges[rank];
    const auto is_ordinary = [&](int32_t id) { return id >= 0 && id < ordinary; };
    KVLAB_CHECK(is_ordinary(m.left) && is_ordinary(m.right) && is_ordinary(m.token), "bpe: merge ",
                rank, " (", m.left, " ", m.right, " -> ", m.token, ") names an id outside [0, ",
                ordinary, ")");
    const std::string& left = tokens[static_cast<size_t>(m.left)];
    const std::string& right = tokens[static_cast<size_t>(m.right)];
    KVLAB_CHECK(tokens[static_cast<size_t>(m.token)] == left + right, "bpe: merge ", rank,
                " joins '", printable(left), "' and '", printable(right), "' but token ", m.token,
                " is '", printable(tokens[static_cast<size_t>(m.token)]), "'");
    made[static_cast<size_t>(m.token)] = true;
    const auto r = static_cast<int32_t>(rank);
    KVLAB_CHECK(tables->merges.emplace(pair_key(m.left, m.right), MergeTarget{r, m.token}).second,
                "bpe: merge ", rank, " repeats an earlier merge's pair");
  }
  for (int32_t id = 0; id < ordinary; ++id)
    KVLAB_CHECK(made[static_cast<size_t>(id)], "bpe: token ", id, " ('",
                printable(tokens[static_cast<size_t>(id)]),
                "') is neither a byte nor made by a merge, and not special");
  BpeTokenizer tok;
  tok.pattern_ = pattern;
  tok.tokens_ = std::move(tokens);
  tok.merges_ = std::move(merges);
  tok.n_special_ = n_special;
  if (whole_chunk_first(pattern))
    for (int32_t id = 0; id < ordinary; ++id)
      tables->whole_token.emplace(tok.tokens_[static_cast<size_t>(id)], id);
  tok.tables_ = std::move(tables);
  return tok;
}

BpeTokenizer BpeTokenizer::from_tiktoken(std::string_view rank_file, SplitPattern pattern) {
  // Phase 1: the tokens, in rank order.
  std::vector<std::string> tokens;
  size_t line_no = 0;
  for (size_t pos = 0; pos < rank_file.size();) {
    size_t end = rank_file.find('\n', pos);
    if (end == std::string_view::npos) end = rank_file.size();
    std::string_view line = rank_file.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    int64_t rank = -1;
    const std::string_view rank_text =
        space == std::string_view::npos ? std::string_view() : line.substr(space + 1);
    const auto [stop, ec] =
        std::from_chars(rank_text.data(), rank_text.data() + rank_text.size(), rank);
    std::string bytes;
    KVLAB_CHECK(space != std::string_view::npos && ec == std::errc() &&
                    stop == rank_text.data() + rank_text.size() &&
                    decode_base64(line.substr(0, space), bytes),
                "tiktoken rank file, line ", line_no, ": expected '<base64 bytes> <rank>', got '",
                printable(line.substr(0, 60)), "'");
    KVLAB_CHECK(rank == static_cast<int64_t>(tokens.size()), "tiktoken rank file, line ", line_no,
                ": rank ", rank, " where ", tokens.size(),
                " comes next (ranks must run 0, 1, 2, ...)");
    tokens.push_back(std::move(bytes));
  }
  KVLAB_CHECK(!tokens.empty(), "tiktoken rank file: no tokens in it");
  // Phase 2: each longer token is the merge its bytes reach under the lower ranks' merges.
  std::array<int32_t, 256> byte_token{};
  byte_token.fill(-1);
  for (size_t id = 0; id < tokens.size(); ++id)
    if (tokens[id].size() == 1)
      byte_token[static_cast<uint8_t>(tokens[id][0])] = static_cast<int32_t>(id);
  KVLAB_CHECK(std::count(byte_token.begin(), byte_token.end(), -1) == 0,
              "tiktoken rank file: not every byte value is a token of its own");
  std::vector<BpeMerge> merges;
  MergeMap map;
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (tokens[id].size() < 2) continue;
    std::vector<int32_t> pieces;
    for (const char c : tokens[id]) pieces.push_back(byte_token[static_cast<uint8_t>(c)]);
    apply_merges(pieces, map);
    KVLAB_CHECK(pieces.size() == 2, "tiktoken rank file: token ", id, " ('", printable(tokens[id]),
                "') is not one merge of two lower-ranked tokens");
    const auto token = static_cast<int32_t>(id);
    map.emplace(pair_key(pieces[0], pieces[1]),
                MergeTarget{static_cast<int32_t>(merges.size()), token});
    merges.push_back({pieces[0], pieces[1], token});
  }
  // Phase 3: the special tokens at their ids, the ids between them unused.
  const auto n_ranks = static_cast<int32_t>(tokens.size());
  const auto specials = tiktoken_specials(pattern, n_ranks);
  for (const auto& [text, id] : specials) {
    if (static_cast<size_t>(id) >= tokens.size()) tokens.resize(static_cast<size_t>(id) + 1);
    tokens[static_cast<size_t>(id)] = text;
  }
  return from_parts(pattern, std::move(tokens), std::move(merges),
                    static_cast<int>(tokens.size()) - n_ranks);
}

std::vector<std::pair<std::string, int32_t>> tiktoken_specials(SplitPattern pattern,
                                                               int32_t n_ranks) {
  if (pattern != SplitPattern::Cl100k) return {{"<|endoftext|>", n_ranks}};
  // tiktoken_ext/openai_public.py's cl100k_base; its 100256 ranks end at 100255.
  KVLAB_CHECK(n_ranks <= 100257, "tiktoken rank file: ", n_ranks,
              " ranks overlap cl100k_base's special tokens, which start at id 100257");
  return {{"<|endoftext|>", 100257},
          {"<|fim_prefix|>", 100258},
          {"<|fim_middle|>", 100259},
          {"<|fim_suffix|>", 100260},
          {"<|endofprompt|>", 100276}};
}

BpeTokenizer BpeTokenizer::from_pairs(SplitPattern pattern, std::vector<std::string> tokens,
                                      std::span<const std::pair<int32_t, int32_t>> pairs,
                                      std::span<const int32_t> special_ids) {
  // Phase 1: the ordinary ids end at the first special or unused one; after it, an id is
  // special exactly when it is listed.
  const auto n_tokens = static_cast<int32_t>(tokens.size());
  std::vector<bool> special(tokens.size());
  for (const int32_t id : special_ids) {
    KVLAB_CHECK(id >= 0 && id < n_tokens, "bpe: special token id ", id, " is outside [0, ",
                n_tokens, ")");
    KVLAB_CHECK(!special[static_cast<size_t>(id)], "bpe: special token id ", id,
                " is listed twice");
    KVLAB_CHECK(!tokens[static_cast<size_t>(id)].empty(), "bpe: special token ", id,
                " has no bytes");
    special[static_cast<size_t>(id)] = true;
  }
  int32_t ordinary = 0;
  while (ordinary < n_tokens && !special[static_cast<size_t>(ordinary)] &&
         !tokens[static_cast<size_t>(ordinary)].empty())
    ++ordinary;
  for (int32_t id = ordinary; id < n_tokens; ++id)
    KVLAB_CHECK(special[static_cast<size_t>(id)] || tokens[static_cast<size_t>(id)].empty(),
                "bpe: token ", id, " follows the first special or unused id (", ordinary,
                ") but is not listed as special");
  // Phase 2: each pair makes the ordinary token of its joined bytes.
  std::unordered_map<std::string_view, int32_t> id_of;
  for (int32_t id = 0; id < ordinary; ++id) id_of.emplace(tokens[static_cast<size_t>(id)], id);
  std::vector<BpeMerge> merges;
  merges.reserve(pairs.size());
  for (size_t rank = 0; rank < pairs.size(); ++rank) {
    const auto [left, right] = pairs[rank];
    KVLAB_CHECK(left >= 0 && left < ordinary && right >= 0 && right < ordinary, "bpe: merge ",
                rank, " (", left, " ", right, ") names an id outside [0, ", ordinary, ")");
    const auto it = id_of.find(tokens[static_cast<size_t>(left)] +
                               tokens[static_cast<size_t>(right)]);
    KVLAB_CHECK(it != id_of.end(), "bpe: merge ", rank, " (", left, " ", right,
                ") makes bytes no token has");
    merges.push_back({left, right, it->second});
  }
  return from_parts(pattern, std::move(tokens), std::move(merges), n_tokens - ordinary);
}

BpeTokenizer BpeTokenizer::from_gpt2(std::string_view vocab_json, std::string_view merges_txt,
                                     SplitPattern pattern) {
  // Phase 1: vocab.json, id -> bytes.
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(vocab_json);
  } catch (const nlohmann::json::exception& e) {
    throw Error(detail::cat("vocab.json: not JSON: ", e.what()));
  }
  KVLAB_CHECK(vocab.is_object() && !vocab.empty(), "vocab.json: expected an object of token -> id");
  std::vector<std::string> tokens(vocab.size());
  std::vector<bool> seen(vocab.size());
  std::unordered_map<std::string, int32_t> id_of;  // as vocab.json spells the token
  for (const auto& [text, id_json] : vocab.items()) {
    KVLAB_CHECK(id_json.is_number_integer(), "vocab.json: the id of '", text,
                "' is not an integer");
    const auto id = id_json.get<int64_t>();
    KVLAB_CHECK(
        id >= 0 && id < static_cast<int64_t>(tokens.size()) && !seen[static_cast<size_t>(id)],
        "vocab.json: ids must be 0..", tokens.size() - 1, " once each; '", text, "' has ", id);
    seen[static_cast<size_t>(id)] = true;
    KVLAB_CHECK(gpt2_text_to_bytes(text, tokens[static_cast<size_t>(id)]), "vocab.json: token '",
                text, "' is not in GPT-2's byte-to-character mapping");
    id_of.emplace(text, static_cast<int32_t>(id));
  }
  // Phase 2: merges.txt, one "left right" per line in rank order after a "#version" line.
  std::vector<BpeMerge> merges;
  std::vector<bool> made(tokens.size());
  size_t line_no = 0;
  for (size_t pos = 0; pos < merges_txt.size();) {
    size_t end = merges_txt.find('\n', pos);
    if (end == std::string_view::npos) end = merges_txt.size();
    std::string_view line = merges_txt.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const size_t space = line.find(' ');
    KVLAB_CHECK(
        space != std::string_view::npos && line.find(' ', space + 1) == std::string_view::npos,
        "merges.txt, line ", line_no, ": expected 'left right', got '", line, "'");
    const std::string left(line.substr(0, space)), right(line.substr(space + 1));
    const auto find = [&](const std::string& text) {
      const auto it = id_of.find(text);
      KVLAB_CHECK(it != id_of.end(), "merges.txt, line ", line_no, ": '", text,
                  "' is not in vocab.json");
      return it->second;
    };
    const int32_t left_id = find(left), right_id = find(right), token = find(left + right);
    merges.push_back({left_id, right_id, token});
    made[static_cast<size_t>(token)] = true;
  }
  // Phase 3: what is neither a byte nor merged is special, and must come last.
  int n_special = 0;
  for (size_t id = tokens.size(); id-- > 0 && tokens[id].size() > 1 && !made[id];) ++n_special;
  return from_parts(pattern, std::move(tokens), std::move(merges), n_special);
}

std::vector<int32_t> BpeTokenizer::encode_chunk(std::string_view chunk) const {
  Tables& t = *tables_;
  std::string key(chunk);
  {
    std::lock_guard<std::mutex> lock(t.cache_mutex);
    const auto it = t.cache.find(key);
    if (it != t.cache.end()) return it->second;
  }
  std::vector<int32_t> pieces;
  const auto whole = t.whole_token.find(key);
  if (whole != t.whole_token.end()) {
    pieces.push_back(whole->second);
  } else {
    pieces.reserve(chunk.size());
    for (const char c : chunk) pieces.push_back(t.byte_token[static_cast<uint8_t>(c)]);
    apply_merges(pieces, t.merges);
  }
  std::lock_guard<std::mutex> lock(t.cache_mutex);
  if (t.cache.size() >= Tables::kCacheEntries) t.cache.clear();
  t.cache.emplace(std::move(key), pieces);
  return pieces;
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3);
  tables_->splitter.split(text, [&](std::string_view chunk) {
    const std::vector<int32_t> piece = encode_chunk(chunk);
    ids.insert(ids.end(), piece.begin(), piece.end());
  });
  return ids;
}

const std::string& BpeTokenizer::token(int32_t id) const {
  KVLAB_CHECK(id >= 0 && id < vocab_size(), "decode: token id ", id, " is out of range [0, ",
              vocab_size(), ")");
  const std::string& bytes = tokens_[static_cast<size_t>(id)];
  KVLAB_CHECK(!bytes.empty(), "decode: token id ", id,
              " is unused in this vocabulary (no token has it)");
  return bytes;
}

std::vector<int32_t> BpeTokenizer::special_ids() const {
  std::vector<int32_t> ids;
  for (int32_t id = vocab_size() - n_special_; id < vocab_size(); ++id)
    if (!tokens_[static_cast<size_t>(id)].empty()) ids.push_back(id);
  return ids;
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (const int32_t id : ids) out += token(id);
  return out;
}

bool BpeTokenizer::operator==(const BpeTokenizer& o) const {
  return pattern_ == o.pattern_ && n_special_ == o.n_special_ && tokens_ == o.tokens_ &&
         merges_ == o.merges_;
}

// ---- Packing into one uint32 array ----
// [layout 1, V, n_special, M, name length L, L name bytes, M x (left, right, token),
//  then per token: its length n, n bytes]; each byte takes one word.

namespace {
constexpr uint32_t kPackLayout = 1;
}

std::vector<uint32_t> BpeTokenizer::pack() const {
  const std::string name = pattern_name(pattern_);
  std::vector<uint32_t> w = {
      kPackLayout, static_cast<uint32_t>(tokens_.size()), static_cast<uint32_t>(n_special_),
      static_cast<uint32_t>(merges_.size()), static_cast<uint32_t>(name.size())};
  for (const char c : name) w.push_back(static_cast<uint8_t>(c));
  for (const BpeMerge& m : merges_) {
    w.push_back(static_cast<uint32_t>(m.left));
    w.push_back(static_cast<uint32_t>(m.right));
    w.push_back(static_cast<uint32_t>(m.token));
  }
  for (const std::string& t : tokens_) {
    w.push_back(static_cast<uint32_t>(t.size()));
    for (const char c : t) w.push_back(static_cast<uint8_t>(c));
  }
  return w;
}

BpeTokenizer BpeTokenizer::unpack(std::span<const uint32_t> words) {
  size_t at = 0;
  const auto next = [&](const char* what) {
    KVLAB_CHECK(at < words.size(), "bpe: the packed vocabulary ends at word ", at, " before its ",
                what);
    return words[at++];
  };
  const auto next_bytes = [&](uint32_t n, const char* what) {
    KVLAB_CHECK(n <= words.size() - at, "bpe: the packed vocabulary ends inside its ", what);
    std::string s;
    for (uint32_t i = 0; i < n; ++i) {
      KVLAB_CHECK(words[at] < 256, "bpe: word ", at, " of the packed vocabulary is not a byte");
      s += static_cast<char>(words[at++]);
    }
    return s;
  };
  const uint32_t layout = next("layout");
  KVLAB_CHECK(layout == kPackLayout, "bpe: packed vocabulary layout ", layout, ", expected ",
              kPackLayout);
  const uint32_t n_tokens = next("token count"), n_special = next("special count"),
                 n_merges = next("merge count");
  KVLAB_CHECK(n_tokens <= words.size() && n_merges <= words.size() / 3,
              "bpe: the packed vocabulary claims ", n_tokens, " tokens and ", n_merges,
              " merges in ", words.size(), " words");
  const SplitPattern pattern = parse_pattern(next_bytes(next("pattern name"), "pattern name"));
  std::vector<BpeMerge> merges(n_merges);
  for (BpeMerge& m : merges) {
    m.left = static_cast<int32_t>(next("merges"));
    m.right = static_cast<int32_t>(next("merges"));
    m.token = static_cast<int32_t>(next("merges"));
  }
  std::vector<std::string> tokens(n_tokens);
  for (std::string& t : tokens) t = next_bytes(next("tokens"), "tokens");
  KVLAB_CHECK(at == words.size(), "bpe: ", words.size() - at,
              " words follow the packed vocabulary's last token");
  return from_parts(pattern, std::move(tokens), std::move(merges), static_cast<int>(n_special));
}

// ---- Training ----

namespace {

// A distinct chunk of the corpus as token ids, and how often it occurs.
struct Word {
  std::vector<int32_t> ids;
  int64_t count;
};

// The pair to merge next: the highest count, and among equal counts the lowest (left, right)
// pair of ids, so that a corpus always trains to the same merges (tests/data/bpe_reference.py
// applies the same rule).
struct Candidate {
  int64_t count;
  uint64_t pair;
  bool operator<(const Candidate& o) const {  // "less urgent than": the queue's top is the max
    return count != o.count ? count < o.count : pair > o.pair;
  }
};

class PairCounts {
 public:
  void add(uint64_t pair, int64_t delta) { delta_[pair] += delta; }
  // Applies the pending deltas; each changed pair is queued again with its new count (its old
  // entries stay in the queue and are dropped when popped: lazy deletion).
  void commit() {
    for (const auto& [pair, d] : delta_) {
      if (d == 0) continue;
      int64_t& c = count_[pair];
      c += d;
      if (c > 0)
        queue_.push({c, pair});
      else
        count_.erase(pair);
    }
    delta_.clear();
  }
  // The best pair with a current count, or false when none is left.
  bool pop(Candidate& best) {
    while (!queue_.empty()) {
      best = queue_.top();
      queue_.pop();
      const auto it = count_.find(best.pair);
      if (it != count_.end() && it->second == best.count) {
        count_.erase(it);
        return true;
      }
    }
    return false;
  }

 private:
  std::unordered_map<uint64_t, int64_t> count_, delta_;
  std::priority_queue<Candidate> queue_;
};

// Replaces each (left, right) in ids by token, left to right; whether there was any.
bool merge_word(std::vector<int32_t>& ids, int32_t left, int32_t right, int32_t token) {
  size_t out = 0;
  bool any = false;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i + 1 < ids.size() && ids[i] == left && ids[i + 1] == right) {
      ids[out++] = token;
      ++i;
      any = true;
    } else {
      ids[out++] = ids[i];
    }
  }
  ids.resize(out);
  return any;
}

}  // namespace

BpeTokenizer train_bpe(std::string_view corpus, int vocab_size, SplitPattern pattern,
                       const BpeProgress& progress, const std::vector<std::string>& specials) {
  const int floor = 256 + static_cast<int>(specials.size());
  KVLAB_CHECK(vocab_size >= floor, "bpe: vocab size ", vocab_size, " is below the 256 bytes plus ",
              specials.size(), " special token(s); it must be at least ", floor);
  KVLAB_CHECK(!corpus.empty(), "bpe: the corpus is empty, there is nothing to learn merges from");
  const int64_t n_merges = vocab_size - floor;

  // Phase 1: each distinct chunk once, with its count.
  std::unordered_map<std::string_view, int64_t> chunk_counts;
  PreSplitter(pattern).split(corpus, [&](std::string_view c) { ++chunk_counts[c]; });
  std::vector<Word> words;
  words.reserve(chunk_counts.size());
  for (const auto& [chunk, count] : chunk_counts) {
    Word w{{}, count};
    for (const char c : chunk) w.ids.push_back(static_cast<uint8_t>(c));
    words.push_back(std::move(w));
  }
  // Hash-map order depends on the library: sort so that nothing downstream can.
  std::sort(words.begin(), words.end(), [](const Word& a, const Word& b) { return a.ids < b.ids; });

  // Phase 2: pair counts and, per pair, the words it may occur in (stale entries are skipped).
  PairCounts counts;
  std::unordered_map<uint64_t, std::vector<int32_t>> where;
  for (size_t w = 0; w < words.size(); ++w) {
    const auto& ids = words[w].ids;
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      const uint64_t p = pair_key(ids[i], ids[i + 1]);
      counts.add(p, words[w].count);
      where[p].push_back(static_cast<int32_t>(w));
    }
  }
  counts.commit();

  // Phase 3: merge the best pair, updating only the counts of the words that hold it.
  std::vector<std::string> tokens(256);
  for (int b = 0; b < 256; ++b)
    tokens[static_cast<size_t>(b)] = std::string(1, static_cast<char>(b));
  std::vector<BpeMerge> merges;
  for (int64_t k = 0; k < n_merges; ++k) {
    Candidate best;
    KVLAB_CHECK(counts.pop(best), "bpe: the corpus has no pair left to merge after ", k,
                " merges, so it supports a vocab size of at most ", floor + k, " (asked for ",
                vocab_size, ")");
    const auto left = static_cast<int32_t>(best.pair >> 32);
    const auto right = static_cast<int32_t>(best.pair & 0xFFFFFFFFu);
    const auto token = static_cast<int32_t>(tokens.size());
    std::vector<int32_t> holders = std::move(where[best.pair]);
    where.erase(best.pair);
    std::sort(holders.begin(), holders.end());
    holders.erase(std::unique(holders.begin(), holders.end()), holders.end());
    for (const int32_t w : holders) {
      Word& word = words[static_cast<size_t>(w)];
      std::vector<int32_t> before = word.ids;
      if (!merge_word(word.ids, left, right, token)) continue;
      for (size_t i = 0; i + 1 < before.size(); ++i)
        counts.add(pair_key(before[i], before[i + 1]), -word.count);
      for (size_t i = 0; i + 1 < word.ids.size(); ++i) {
        const uint64_t p = pair_key(word.ids[i], word.ids[i + 1]);
        counts.add(p, word.count);
        if (word.ids[i] == token || word.ids[i + 1] == token) where[p].push_back(w);
      }
    }
    counts.commit();
    merges.push_back({left, right, token});
    tokens.push_back(tokens[static_cast<size_t>(left)] + tokens[static_cast<size_t>(right)]);
    if (progress) progress(k + 1, n_merges);
  }
  tokens.insert(tokens.end(), specials.begin(), specials.end());
  return BpeTokenizer::from_parts(pattern, std::move(tokens), std::move(merges),
                                  static_cast<int>(specials.size()));
}

// ---- Streaming decode ----

namespace {
// The length of the UTF-8 character a lead byte starts (0: not a lead byte), and whether
// `prefix` (lead byte first, shorter than that) can still become a valid character.
size_t utf8_length(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}
bool can_complete(std::string_view prefix) {
  const auto lead = static_cast<uint8_t>(prefix[0]);
  for (size_t i = 1; i < prefix.size(); ++i) {
    const auto b = static_cast<uint8_t>(prefix[i]);
    uint8_t lo = 0x80, hi = 0xBF;  // the second byte's narrower ranges exclude overlong
    if (i == 1) {                  // forms, surrogates and code points past U+10FFFF
      if (lead == 0xE0) lo = 0xA0;
      if (lead == 0xED) hi = 0x9F;
      if (lead == 0xF0) lo = 0x90;
      if (lead == 0xF4) hi = 0x8F;
    }
    if (b < lo || b > hi) return false;
  }
  return true;
}
}  // namespace

std::string Utf8StreamDecoder::push(std::string_view bytes) {
  pending_ += bytes;
  // Hold back the last character if it is incomplete and can still be completed.
  size_t keep = pending_.size();
  for (size_t back = 1; back <= 3 && back <= pending_.size(); ++back) {
    const size_t start = pending_.size() - back;
    const auto b = static_cast<uint8_t>(pending_[start]);
    if ((b & 0xC0) == 0x80) continue;  // a continuation byte: its lead is further back
    const size_t len = utf8_length(b);
    if (len > back && can_complete(std::string_view(pending_).substr(start))) keep = start;
    break;
  }
  std::string out = pending_.substr(0, keep);
  pending_.erase(0, keep);
  return out;
}

std::string Utf8StreamDecoder::finish() {
  std::string out;
  out.swap(pending_);
  return out;
}

std::string gpt2_bytes_to_text(std::string_view bytes) {
  static const std::array<uint32_t, 256> chars = gpt2_byte_chars();
  std::string out;
  for (const char c : bytes) {
    const uint32_t cp = chars[static_cast<uint8_t>(c)];  // below U+0800: one or two bytes
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return out;
}

bool gpt2_text_to_bytes(const std::string& text, std::string& out) {
  static const std::unordered_map<uint32_t, char> byte_of = [] {
    std::unordered_map<uint32_t, char> m;
    const auto chars = gpt2_byte_chars();
    for (int b = 0; b < 256; ++b) m[chars[b]] = static_cast<char>(b);
    return m;
  }();
  out.clear();
  for (size_t i = 0; i < text.size();) {
    const auto b0 = static_cast<uint8_t>(text[i]);
    uint32_t cp;
    size_t len;
    if (b0 < 0x80) {
      cp = b0, len = 1;
    } else if ((b0 & 0xE0) == 0xC0 && i + 1 < text.size()) {
      cp = ((b0 & 0x1Fu) << 6) | (static_cast<uint8_t>(text[i + 1]) & 0x3Fu), len = 2;
    } else {
      return false;  // every mapped code point is below U+0800
    }
    const auto it = byte_of.find(cp);
    if (it == byte_of.end()) return false;
    out += it->second;
    i += len;
  }
  return true;
}


}  // namespace kvlab
