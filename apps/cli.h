#pragma once
// Shared pieces of the kvlab command line: each subcommand lives in cmd_<name>.cpp and
// registers itself on the root app; errors follow DESIGN.md (usage errors exit 2, runtime 1).
#include <CLI/CLI.hpp>

#include <string>

#include "autograd/error.h"

namespace kvlab {

// A bad flag value or combination: printed like any error, but the exit code is 2.
class UsageError : public Error {
 public:
  explicit UsageError(const std::string& msg) : Error(msg) {}
};

#define KVLAB_USAGE_CHECK(cond, ...)                                            \
  do {                                                                          \
    if (!(cond)) throw ::kvlab::UsageError(::kvlab::detail::cat(__VA_ARGS__)); \
  } while (0)

// The command line as typed (recorded in results files).
const std::string& command_line();
void set_command_line(int argc, char** argv);

void add_train_command(CLI::App& root);
void add_generate_command(CLI::App& root);
void add_bench_command(CLI::App& root);
void add_ablate_command(CLI::App& root);
void add_inspect_command(CLI::App& root);

}  // namespace kvlab
