#pragma once
#include <gtest/gtest.h>

#include <string>

#include "platform/error.h"

namespace kvlab::testing {

// The message of the kvlab::Error that f() throws; a test failure (and "") if it throws none.
template <class F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a kvlab::Error";
  return "";
}

}  // namespace kvlab::testing
