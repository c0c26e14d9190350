#pragma once
// Small HDF5 C API helpers: H5_CHECK and an owning handle. Only code that reads or writes HDF5
// includes this header.
#include <hdf5.h>

#include <string>
#include <utility>

#include "platform/error.h"

namespace kvlab {

// The innermost message of HDF5's error stack, e.g. "truncated file: eof = 2048, ...".
inline std::string h5_error_message() {
  std::string msg;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* err, void* out) -> herr_t {
        if (n == 0 && err->desc != nullptr) *static_cast<std::string*>(out) = err->desc;
        return 0;
      },
      &msg);
  return msg.empty() ? "HDF5 error" : msg;
}

// HDF5 prints its error stack to stderr by default; we report through kvlab::Error instead.
inline void h5_silence_errors() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

namespace detail {
template <class T, class Context>
T h5_check(T value, const char* file, int line, const char* expr, const Context& context) {
  if (value < 0) {
    throw Error(
        cat(context(), ": ", h5_error_message(), " (", expr, " failed at ", file, ":", line, ")"));
  }
  return value;
}
}  // namespace detail

// H5_CHECK(call, message parts...): returns the call's value, or throws kvlab::Error when it is
// negative, with the message, HDF5's own reason, and the file and line of the call.
#define H5_CHECK(expr, ...)                                    \
  ::kvlab::detail::h5_check((expr), __FILE__, __LINE__, #expr, \
                            [&] { return ::kvlab::detail::cat(__VA_ARGS__); })

// Owns one HDF5 identifier and closes it with the matching H5?close.
class H5Id {
 public:
  H5Id() = default;
  H5Id(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  H5Id(H5Id&& other) noexcept
      : id_(std::exchange(other.id_, H5I_INVALID_HID)), close_(other.close_) {}
  H5Id& operator=(H5Id&& other) noexcept {
    std::swap(id_, other.id_);
    std::swap(close_, other.close_);
    return *this;
  }
  H5Id(const H5Id&) = delete;
  H5Id& operator=(const H5Id&) = delete;
  ~H5Id() {
    if (id_ >= 0) close_(id_);
  }

  operator hid_t() const { return id_; }
  // Gives up ownership, for a close whose result must be checked (H5Fclose).
  hid_t release() { return std::exchange(id_, H5I_INVALID_HID); }

 private:
  hid_t id_ = H5I_INVALID_HID;
  herr_t (*close_)(hid_t) = nullptr;
};

}  // namespace kvlab
