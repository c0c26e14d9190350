#include "infer/stop_filter.h"

#include <algorithm>

namespace kvlab {

std::string_view StopStringFilter::push(std::string_view piece) {
  if (stops_->empty() || stopped_) return stopped_ ? std::string_view() : piece;
  held_.erase(0, released_);
  held_ += piece;
  size_t cut = std::string::npos;
  for (const auto& s : *stops_) cut = std::min(cut, held_.find(s));
  if (cut != std::string::npos) {
    held_.resize(cut);
    released_ = cut;
    stopped_ = true;
    return held_;
  }
  // Hold back the longest tail that could begin a stop string; release the rest.
  size_t hold = 0;
  const std::string_view h(held_);
  for (const auto& s : *stops_)
    for (size_t k = std::min(s.size() - 1, h.size()); k > hold; --k)
      if (h.substr(h.size() - k) == std::string_view(s).substr(0, k)) {
        hold = k;
        break;
      }
  released_ = h.size() - hold;
  return h.substr(0, released_);
}

std::string_view StopStringFilter::flush() {
  held_.erase(0, released_);
  released_ = held_.size();
  return held_;
}

}  // namespace kvlab
