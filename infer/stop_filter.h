#pragma once
// Streamed text and stop strings: a row stops once its text contains one of them, and the stop
// string is never returned or streamed, so text that may begin one is held back until the
// next piece decides it.
#include <string>
#include <string_view>
#include <vector>

namespace kvlab {

class StopStringFilter {
 public:
  // `stops` (none empty) must outlive the filter.
  explicit StopStringFilter(const std::vector<std::string>& stops) : stops_(&stops) {}

  // Adds a piece of text; returns what can be released now (valid until the next call). When
  // a stop string appears, the text before it is returned, the rest dropped, and stopped()
  // turns true.
  std::string_view push(std::string_view piece);
  // The text still held, released because the row ends for another reason.
  std::string_view flush();
  bool stopped() const { return stopped_; }

 private:
  const std::vector<std::string>* stops_;
  std::string held_;     // text not yet released, after the first `released_` bytes
  size_t released_ = 0;  // bytes at the front of held_ returned by the last call
  bool stopped_ = false;
};

}  // namespace kvlab
