#pragma once
// Errors: KVLAB_CHECK for anything a caller or user can cause, KVLAB_ASSERT for internal
// invariants. Both throw kvlab::Error; library code never exits.
#include <sstream>
#include <stdexcept>
#include <string>

namespace kvlab {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

namespace detail {
// Streams every argument into one message: KVLAB_CHECK(ok, "matmul: ", a.shape_str(), ...).
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] inline void throw_error(const std::string& msg) { throw Error(msg); }
[[noreturn]] inline void throw_internal(const char* file, int line, const std::string& msg) {
  throw Error(cat("internal error at ", file, ":", line, ": ", msg));
}
}  // namespace detail

}  // namespace kvlab

#define KVLAB_CHECK(cond, ...)                                          \
  do {                                                                  \
    if (!(cond)) ::kvlab::detail::throw_error(::kvlab::detail::cat(__VA_ARGS__)); \
  } while (0)

#define KVLAB_ASSERT(cond, ...)                                                   \
  do {                                                                            \
    if (!(cond))                                                                  \
      ::kvlab::detail::throw_internal(__FILE__, __LINE__,                         \
                                      ::kvlab::detail::cat("assertion failed: " #cond " ", \
                                                           ##__VA_ARGS__));       \
  } while (0)
