#pragma once
// What a call throws as kvlab::Error, or "no error": for tests that check a refusal's message.
#include <functional>
#include <string>

#include "platform/error.h"

namespace kvlab {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace kvlab
