#pragma once
// A test fixture whose tests each get a fresh, empty folder `dir_` under the system's temp
// directory, removed after the test.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>
#include <utility>

namespace kvlab::testing {

class TestDirFixture : public ::testing::Test {
 protected:
  // The folder's name: `prefix`, the process id (a build's and a clone's test runs on one
  // machine stay apart) and the test's name.
  explicit TestDirFixture(std::string prefix) : prefix_(std::move(prefix)) {}

  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           (prefix_ + "-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::filesystem::path dir_;

 private:
  std::string prefix_;
};

}  // namespace kvlab::testing
