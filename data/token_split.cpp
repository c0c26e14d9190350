#include "data/token_split.h"

#include <algorithm>

namespace kvlab {

std::vector<TextFragment> split_at_tokens(
    std::string_view text, std::span<const int32_t> ids,
    const std::function<std::string_view(int32_t)>& text_of) {
  std::vector<TextFragment> fragments;
  if (!text.empty()) fragments.push_back({text, -1});
  for (const int32_t id : ids) {
    const std::string_view t = text_of(id);
    if (std::none_of(fragments.begin(), fragments.end(), [&](const TextFragment& f) {
          return f.id < 0 && f.text.find(t) != std::string_view::npos;
        }))
      continue;  // most texts hold few of the tokens: no copy for the others
    std::vector<TextFragment> cut;
    for (const TextFragment& f : fragments) {
      if (f.id >= 0) {
        cut.push_back(f);
        continue;
      }
      std::string_view rest = f.text;
      for (size_t at; (at = rest.find(t)) != std::string_view::npos;) {
        if (at > 0) cut.push_back({rest.substr(0, at), -1});
        cut.push_back({{}, id});
        rest.remove_prefix(at + t.size());
      }
      if (!rest.empty()) cut.push_back({rest, -1});
    }
    fragments = std::move(cut);
  }
  return fragments;
}

std::vector<int32_t> longest_first(std::vector<int32_t> ids,
                                   const std::function<std::string_view(int32_t)>& text_of) {
  std::sort(ids.begin(), ids.end());
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    return text_of(a).size() > text_of(b).size();
  });
  return ids;
}

}  // namespace kvlab
