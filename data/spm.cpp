#include "data/spm.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <queue>
#include <unordered_map>

#include "data/token_split.h"
#include "platform/error.h"

namespace kvlab {
namespace {

constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's space

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// The bytes llama.cpp takes as one symbol from a lead byte: by its top four bits, so that a
// continuation or invalid byte is a symbol of its own and a cut-off character ends at the text.
size_t symbol_length(char lead) {
  static constexpr uint8_t kLength[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLength[static_cast<uint8_t>(lead) >> 4];
}

std::string byte_piece(unsigned b) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "<0x%02X>", b);
  return buf;
}

// The byte a <0xNN> piece names, or -1.
int byte_of_piece(std::string_view p) {
  if (p.size() != 6 || !p.starts_with("<0x") || p[5] != '>') return -1;
  int b = 0;
  for (const char c : p.substr(3, 2)) {
    const int d = c >= '0' && c <= '9'   ? c - '0'
                  : c >= 'A' && c <= 'F' ? c - 'A' + 10
                  : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                         : -1;
    if (d < 0) return -1;
    b = b * 16 + d;
  }
  return b;
}

}  // namespace

struct SpmTokenizer::Tables {
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> id_of;
  std::array<int32_t, 256> byte_id{};
  std::vector<int32_t> user_defined;  // longest piece first (longest_first)
  bool space_bounds = false;  // no piece has a '▁' after another character

  int32_t find(std::string_view s) const {
    const auto it = id_of.find(s);
    return it == id_of.end() ? -1 : it->second;
  }
};

SpmTokenizer SpmTokenizer::from_parts(std::vector<std::string> pieces, std::vector<float> scores,
                                      std::vector<uint8_t> types, bool add_space_prefix) {
  const size_t V = pieces.size();
  KVLAB_CHECK(V > 0 && V <= INT32_MAX, "spm: a vocabulary of ", V, " pieces");
  KVLAB_CHECK(scores.size() == V && types.size() == V, "spm: ", V, " pieces but ", scores.size(),
              " scores and ", types.size(), " types");
  auto tables = std::make_shared<Tables>();
  tables->id_of.reserve(V);
  for (size_t id = 0; id < V; ++id) {
    const std::string& p = pieces[id];
    const uint8_t t = types[id];
    KVLAB_CHECK(t >= 1 && t <= 6, "spm: piece ", id, " has type ", int{t},
                " (llama.cpp's are 1 to 6)");
    KVLAB_CHECK(std::isfinite(scores[id]), "spm: piece ", id, " has score ", scores[id]);
    KVLAB_CHECK(!p.empty(), "spm: piece ", id, " is empty");
    KVLAB_CHECK(static_cast<PieceType>(t) != PieceType::Byte || byte_of_piece(p) >= 0,
                "spm: piece ", id, " ('", p, "') is a byte piece not spelled <0xNN>");
    KVLAB_CHECK(tables->id_of.emplace(p, static_cast<int32_t>(id)).second, "spm: piece ", id,
                " ('", p, "') repeats piece ", tables->find(p));
  }
  // A symbol that is no piece is written as its bytes: llama.cpp's <0xNN> piece, else the byte
  // (-1: neither, which only a text that needs it refuses, as llama.cpp loads such a vocabulary).
  for (unsigned b = 0; b < 256; ++b) {
    const int32_t id = tables->find(byte_piece(b));
    tables->byte_id[b] = id >= 0 ? id : tables->find(std::string(1, static_cast<char>(b)));
  }
  tables->space_bounds = std::none_of(pieces.begin(), pieces.end(), [](const std::string& p) {
    for (size_t at = p.find(kSpace, 1); at != std::string::npos; at = p.find(kSpace, at + 1))
      if (at < kSpace.size() || p.compare(at - kSpace.size(), kSpace.size(), kSpace) != 0)
        return true;
    return false;
  });
  std::vector<int32_t> user_defined;
  for (size_t id = 0; id < V; ++id)
    if (static_cast<PieceType>(types[id]) == PieceType::UserDefined)
      user_defined.push_back(static_cast<int32_t>(id));
  tables->user_defined = longest_first(
      std::move(user_defined), [&](int32_t id) -> std::string_view { return pieces[id]; });
  SpmTokenizer tok;
  tok.pieces_ = std::move(pieces);
  tok.scores_ = std::move(scores);
  tok.types_ = std::move(types);
  tok.add_space_prefix_ = add_space_prefix;
  tok.tables_ = std::move(tables);
  return tok;
}

std::vector<int32_t> SpmTokenizer::encode(std::string_view text) const {
  // The text cut at each user-defined piece (control and unknown pieces are never read from
  // text).
  return encode_fragments(
      split_at_tokens(text, tables_->user_defined, [&](int32_t id) -> std::string_view {
        return pieces_[static_cast<size_t>(id)];
      }));
}

std::vector<int32_t> SpmTokenizer::encode_fragments(std::span<const TextFragment> fragments) const {
  // Each text fragment with its spaces as '▁', after one more where it begins the text or
  // follows a piece.
  std::vector<int32_t> out;
  std::string escaped;
  bool after_piece = true;
  for (const TextFragment& f : fragments) {
    if (f.id >= 0) {
      out.push_back(f.id);
      after_piece = true;
      continue;
    }
    escaped.clear();
    if (add_space_prefix_ && after_piece) escaped += kSpace;
    for (const char c : f.text) {
      if (c == ' ')
        escaped += kSpace;
      else
        escaped += c;
    }
    encode_fragment(escaped, out);
    after_piece = false;
  }
  return out;
}

// llama.cpp's llm_tokenizer_spm_session: the symbols as a linked list over the text; a queue of
// adjacent pairs whose joined text is a piece, the highest score first (the leftmost on a tie);
// a pair taken whose symbols have changed since it was queued is stale and skipped.
void SpmTokenizer::encode_fragment(std::string_view text, std::vector<int32_t>& out) const {
  struct Symbol {
    size_t at, n;
    int prev, next;
  };
  struct Pair {
    float score;
    int left, right;
    size_t size;
  };
  const auto below = [](const Pair& a, const Pair& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  // The symbols, linked within segments. Where no piece has a '▁' after another character
  // (space_bounds), no pair across a '▁' that follows another character is ever a piece, so
  // the text merges as independent segments each begun by such a '▁': the same result, in small
  // queues.
  std::vector<Symbol> symbols;
  for (size_t at = 0; at < text.size();) {
    const size_t n = std::min(symbol_length(text[at]), text.size() - at);
    const int i = static_cast<int>(symbols.size());
    const bool begins = i > 0 && tables_->space_bounds && text.substr(at, n) == kSpace &&
                        text.substr(symbols[i - 1].at, symbols[i - 1].n) != kSpace;
    if (begins) symbols.back().next = -1;
    symbols.push_back({at, n, begins ? -1 : i - 1, at + n == text.size() ? -1 : i + 1});
    at += n;
  }
  std::priority_queue<Pair, std::vector<Pair>, decltype(below)> queue(below);
  const auto try_pair = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const size_t size = symbols[left].n + symbols[right].n;
    const int32_t id = tables_->find(text.substr(symbols[left].at, size));
    if (id >= 0) queue.push({scores_[static_cast<size_t>(id)], left, right, size});
  };
  for (int first = 0; first < static_cast<int>(symbols.size());) {
    int last = first;
    for (; symbols[last].next >= 0; last = symbols[last].next) try_pair(last, symbols[last].next);
    while (!queue.empty()) {
      const Pair p = queue.top();
      queue.pop();
      Symbol& left = symbols[p.left];
      Symbol& right = symbols[p.right];
      if (left.n == 0 || right.n == 0 || left.n + right.n != p.size) continue;
      left.n += right.n;
      right.n = 0;
      left.next = right.next;
      if (right.next >= 0) symbols[right.next].prev = p.left;
      try_pair(left.prev, p.left);
      try_pair(p.left, left.next);
    }
    // Every merged symbol is a piece; a single character that is none falls back to its bytes.
    for (int i = first; i != -1; i = symbols[i].next) {
      const std::string_view s = text.substr(symbols[i].at, symbols[i].n);
      const int32_t id = tables_->find(s);
      if (id >= 0) {
        out.push_back(id);
        continue;
      }
      for (const char c : s) {
        const auto b = static_cast<uint8_t>(c);
        KVLAB_CHECK(tables_->byte_id[b] >= 0, "spm: no piece stands for byte ", byte_piece(b),
                    " (neither that piece nor the byte itself), which this text needs");
        out.push_back(tables_->byte_id[b]);
      }
    }
    first = last + 1;
  }
}

std::string SpmTokenizer::token_bytes(int32_t id) const {
  KVLAB_CHECK(id >= 0 && id < vocab_size(), "decode: token id ", id, " is out of range [0, ",
              vocab_size(), ")");
  const std::string& p = pieces_[static_cast<size_t>(id)];
  switch (static_cast<PieceType>(types_[static_cast<size_t>(id)])) {
    case PieceType::Normal: {
      std::string s;
      for (size_t at = 0; at < p.size();) {
        if (p.compare(at, kSpace.size(), kSpace) == 0) {
          s += ' ';
          at += kSpace.size();
        } else {
          s += p[at++];
        }
      }
      return s;
    }
    case PieceType::Byte:
      return std::string(1, static_cast<char>(byte_of_piece(p)));
    case PieceType::Unused:  // llama.cpp writes nothing for them
      return {};
    default:
      return p;
  }
}

std::string SpmTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string s = token_bytes(ids[i]);
    out.append(s, i == 0 && add_space_prefix_ && s.starts_with(' ') ? 1 : 0);
  }
  return out;
}

}  // namespace kvlab
