#pragma once
// A text cut at some tokens' texts, as llama.cpp's tokenizer first cuts a text at its
// user-defined tokens (src/llama-vocab.cpp, tokenizer_st_partition): each token in turn, the
// longest first, splits every stretch of text still uncut at each of its occurrences, leftmost
// first; the pieces between are text, encoded as text.
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

namespace kvlab {

struct TextFragment {
  std::string_view text;  // where id is -1
  int32_t id;             // a token found in the text, or -1
};

// `ids` in the order to match them (longest text first); text_of gives a token's text, never
// empty. An empty text has no fragments.
std::vector<TextFragment> split_at_tokens(std::string_view text, std::span<const int32_t> ids,
                                          const std::function<std::string_view(int32_t)>& text_of);

// The ids ordered longest text first (ties in id order), as split_at_tokens takes them.
std::vector<int32_t> longest_first(std::vector<int32_t> ids,
                                   const std::function<std::string_view(int32_t)>& text_of);

}  // namespace kvlab
