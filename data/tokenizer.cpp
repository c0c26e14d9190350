#include "data/tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <unordered_set>

#include "data/token_split.h"
#include "platform/error.h"

namespace kvlab {
namespace {

constexpr uint32_t kMaxCodePoint = 0x10FFFF;
constexpr size_t kNoError = std::string_view::npos;
constexpr size_t kMaxListed = 20;  // unknown characters named in one error message

bool is_scalar_value(uint32_t cp) { return cp <= kMaxCodePoint && (cp < 0xD800 || cp > 0xDFFF); }

std::string code_point_name(uint32_t cp) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "U+%04X", cp);
  return buf;
}


// Strict UTF-8: no overlong forms, surrogates or code points past U+10FFFF. Calls
// on_code_point(cp) per character; returns the offset of the first invalid sequence or kNoError.
template <class F>
size_t decode_utf8(std::string_view s, F&& on_code_point) {
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const auto b0 = static_cast<uint8_t>(s[i]);
    if (b0 < 0x80) {
      on_code_point(b0);
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp, min;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      len = 2, cp = b0 & 0x1F, min = 0x80;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      len = 3, cp = b0 & 0x0F, min = 0x800;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      len = 4, cp = b0 & 0x07, min = 0x10000;
    } else {
      return i;
    }
    if (len > n - i) return i;
    for (size_t k = 1; k < len; ++k) {
      const auto b = static_cast<uint8_t>(s[i + k]);
      if ((b & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (b & 0x3F);
    }
    if (cp < min || !is_scalar_value(cp)) return i;
    on_code_point(cp);
    i += len;
  }
  return kNoError;
}

// 'Z' (U+005A); control characters have no glyph and are named by code point only.
std::string describe(uint32_t cp) {
  if (cp < 0x20 || (cp >= 0x7F && cp < 0xA0)) return code_point_name(cp);
  std::string s = "'";
  append_utf8(s, cp);
  return s + "' (" + code_point_name(cp) + ")";
}

std::string unknown_message(std::string_view what, const std::vector<uint32_t>& unknown) {
  std::string msg = detail::cat(what, ": ", unknown.size(),
                                unknown.size() == 1 ? " character is" : " characters are",
                                " not in the model's vocabulary: ");
  for (size_t i = 0; i < unknown.size() && i < kMaxListed; ++i) {
    if (i > 0) msg += ", ";
    msg += describe(unknown[i]);
  }
  if (unknown.size() > kMaxListed)
    msg += detail::cat(", ... (", unknown.size() - kMaxListed, " more)");
  return msg;
}

}  // namespace

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string kind_name(TokenizerKind kind) {
  switch (kind) {
    case TokenizerKind::Char:
      return "char";
    case TokenizerKind::Byte:
      return "byte";
    case TokenizerKind::Bpe:
      return "bpe";
    case TokenizerKind::Spm:
      return "spm";
  }
  return "?";
}

Tokenizer Tokenizer::build_char(std::string_view utf8_text, std::string_view what) {
  KVLAB_CHECK(!utf8_text.empty(), what, ": text is empty, so there is no vocabulary to build");
  std::vector<bool> present(kMaxCodePoint + 1);
  const size_t bad = decode_utf8(utf8_text, [&](uint32_t cp) { present[cp] = true; });
  KVLAB_CHECK(bad == kNoError, what, ": invalid UTF-8 at byte ", bad,
              " (use --tokenizer byte for non-UTF-8 text)");
  std::vector<uint32_t> vocab;
  for (uint32_t cp = 0; cp <= kMaxCodePoint; ++cp) {
    if (present[cp]) vocab.push_back(cp);
  }
  return Tokenizer(TokenizerKind::Char, std::move(vocab));
}

Tokenizer Tokenizer::byte_level() {
  std::vector<uint32_t> vocab(256);
  for (uint32_t b = 0; b < 256; ++b) vocab[b] = b;
  return Tokenizer(TokenizerKind::Byte, std::move(vocab));
}

Tokenizer Tokenizer::from_vocab(TokenizerKind kind, std::vector<uint32_t> code_points) {
  KVLAB_CHECK(!code_points.empty(), "tokenizer: ", kvlab::kind_name(kind), " vocabulary is empty");
  KVLAB_CHECK(kind != TokenizerKind::Spm, "tokenizer: an spm vocabulary is not a list of code "
              "points");
  if (kind == TokenizerKind::Bpe) return bpe(BpeTokenizer::unpack(code_points));
  for (size_t i = 1; i < code_points.size(); ++i) {
    KVLAB_CHECK(code_points[i - 1] < code_points[i],
                "tokenizer: vocabulary must be sorted and unique, but entry ", i, " (",
                code_point_name(code_points[i]), ") follows ", code_point_name(code_points[i - 1]));
  }
  if (kind == TokenizerKind::Byte) {
    KVLAB_CHECK(code_points.size() == 256 && code_points.back() == 255,
                "tokenizer: a byte vocabulary is the 256 values 0..255, got ", code_points.size(),
                " entries from ", code_points.front(), " to ", code_points.back());
  } else {
    for (const uint32_t cp : code_points) {
      KVLAB_CHECK(is_scalar_value(cp), "tokenizer: vocabulary entry ", code_point_name(cp),
                  " is not a Unicode scalar value");
    }
  }
  return Tokenizer(kind, std::move(code_points));
}

Tokenizer Tokenizer::bpe(BpeTokenizer bpe) {
  Tokenizer tok(TokenizerKind::Bpe, bpe.pack());
  tok.bpe_ = std::make_shared<const BpeTokenizer>(std::move(bpe));
  return tok;
}

Tokenizer Tokenizer::spm(SpmTokenizer spm) {
  Tokenizer tok(TokenizerKind::Spm, {});
  tok.spm_ = std::make_shared<const SpmTokenizer>(std::move(spm));
  return tok;
}

TokenizerKind Tokenizer::parse_kind(std::string_view name) {
  for (const auto kind :
       {TokenizerKind::Char, TokenizerKind::Byte, TokenizerKind::Bpe, TokenizerKind::Spm})
    if (name == kvlab::kind_name(kind)) return kind;
  throw Error(detail::cat("tokenizer: unknown kind '", name,
                          "' (expected 'char', 'byte', 'bpe' or 'spm')"));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, std::string_view what) const {
  if (bpe_ && !user_defined_.empty())
    return bpe_fragments(
        split_at_tokens(text, user_defined_, [&](int32_t id) { return special_text(id); }));
  if (bpe_) return bpe_->encode(text);
  if (spm_) return spm_->encode(text);
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  if (kind_ == TokenizerKind::Byte) {
    for (const char c : text) ids.push_back(static_cast<uint8_t>(c));
    return ids;
  }
  std::vector<uint32_t> unknown;  // distinct, in order of first appearance
  std::unordered_set<uint32_t> seen_unknown;
  const size_t bad = decode_utf8(text, [&](uint32_t cp) {
    const auto it = std::lower_bound(vocab_.begin(), vocab_.end(), cp);
    if (it != vocab_.end() && *it == cp) {
      ids.push_back(static_cast<int32_t>(it - vocab_.begin()));
    } else if (seen_unknown.insert(cp).second) {
      unknown.push_back(cp);
    }
  });
  KVLAB_CHECK(bad == kNoError, what, ": invalid UTF-8 at byte ", bad);
  if (!unknown.empty()) throw Error(unknown_message(what, unknown));
  return ids;
}

void Tokenizer::append_token(std::string& out, int32_t id) const {
  if (bpe_) {
    out += bpe_->token(id);
    return;
  }
  if (spm_) {
    out += spm_->token_bytes(id);
    return;
  }
  KVLAB_CHECK(id >= 0 && id < vocab_size(), "decode: token id ", id, " is out of range [0, ",
              vocab_size(), ")");
  const uint32_t cp = vocab_[static_cast<size_t>(id)];
  if (kind_ == TokenizerKind::Byte) {
    out += static_cast<char>(cp);
  } else {
    append_utf8(out, cp);
  }
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  if (spm_) return spm_->decode(ids);
  std::string out;
  out.reserve(ids.size());
  for (const int32_t id : ids) append_token(out, id);
  return out;
}

std::string Tokenizer::decode_one(int32_t id) const {
  std::string out;
  append_token(out, id);
  return out;
}

std::vector<int32_t> Tokenizer::encode_prompt(std::string_view text, std::string_view what) const {
  std::vector<int32_t> ids;
  if (controls_.add_bos) ids.push_back(controls_.bos);
  const std::vector<int32_t> body = encode(text, what);
  ids.insert(ids.end(), body.begin(), body.end());
  if (controls_.add_eos) ids.push_back(controls_.eos);
  return ids;
}

std::string_view Tokenizer::special_text(int32_t id) const {
  return bpe_ ? std::string_view(bpe_->token(id))
              : std::string_view(spm_->pieces()[static_cast<size_t>(id)]);
}

std::vector<int32_t> Tokenizer::bpe_fragments(std::span<const TextFragment> fragments) const {
  std::vector<int32_t> ids;
  for (const TextFragment& f : fragments) {
    if (f.id >= 0) {
      ids.push_back(f.id);
      continue;
    }
    const std::vector<int32_t> part = bpe_->encode(f.text);
    ids.insert(ids.end(), part.begin(), part.end());
  }
  return ids;
}

std::vector<int32_t> Tokenizer::encode_chat(std::string_view text) const {
  if (!bpe_ && !spm_) return encode_prompt(text);
  const TokenControls& c = controls_;
  if (c.add_bos && text.starts_with(special_text(c.bos)))
    text.remove_prefix(special_text(c.bos).size());
  if (c.add_eos && text.ends_with(special_text(c.eos)))
    text.remove_suffix(special_text(c.eos).size());
  const std::vector<TextFragment> fragments =
      split_at_tokens(text, specials_, [&](int32_t id) { return special_text(id); });
  std::vector<int32_t> ids;
  if (c.add_bos) ids.push_back(c.bos);
  const std::vector<int32_t> body =
      spm_ ? spm_->encode_fragments(fragments) : bpe_fragments(fragments);
  ids.insert(ids.end(), body.begin(), body.end());
  if (c.add_eos) ids.push_back(c.eos);
  return ids;
}

void Tokenizer::set_controls(TokenControls c) {
  const int32_t V = vocab_size();
  for (const int32_t id : {c.bos, c.eos})
    KVLAB_CHECK(id >= -1 && id < V, "tokenizer: the BOS or EOS id ", id,
                " is outside the vocabulary [0, ", V, ")");
  KVLAB_CHECK(!c.add_bos || c.bos >= 0, "tokenizer: add_bos is set but there is no BOS token");
  KVLAB_CHECK(!c.add_eos || c.eos >= 0, "tokenizer: add_eos is set but there is no EOS token");
  for (size_t i = 0; i < c.eog.size(); ++i)
    KVLAB_CHECK(c.eog[i] >= 0 && c.eog[i] < V && (i == 0 || c.eog[i - 1] < c.eog[i]),
                "tokenizer: end-of-generation id ", c.eog[i], " (entry ", i,
                ") is not an id of the vocabulary above the one before it");
  for (size_t i = 0; i < c.user_defined.size(); ++i) {
    const int32_t id = c.user_defined[i];
    KVLAB_CHECK(bpe_ != nullptr, "tokenizer: user-defined tokens are for bpe vocabularies");
    KVLAB_CHECK(id >= 0 && id < V && (i == 0 || c.user_defined[i - 1] < id) &&
                    !bpe_->token(id).empty(),
                "tokenizer: user-defined id ", id, " (entry ", i,
                ") is not a token with text above the one before it");
  }
  user_defined_ = longest_first(c.user_defined,
                                [&](int32_t id) { return std::string_view(bpe_->token(id)); });
  specials_.clear();
  if (bpe_) specials_ = bpe_->special_ids();
  if (spm_)
    for (int32_t id = 0; id < V; ++id)
      if (const auto t = static_cast<PieceType>(spm_->types()[static_cast<size_t>(id)]);
          t == PieceType::Control || t == PieceType::UserDefined || t == PieceType::Unknown)
        specials_.push_back(id);
  specials_ = longest_first(std::move(specials_), [&](int32_t id) { return special_text(id); });
  controls_ = std::move(c);
  KVLAB_CHECK(controls_.eos < 0 || ends_generation(controls_.eos), "tokenizer: the EOS id ",
              controls_.eos, " is not among the end-of-generation ids");
}

}  // namespace kvlab
