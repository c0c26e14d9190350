#pragma once
// Shared pieces of the kvlab command line: each subcommand lives in cmd_<name>.cpp and
// registers itself on the root app. Errors are one line; usage errors exit 2, runtime errors 1.

#include <CLI/CLI.hpp>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <type_traits>

#include "data/corpus.h"
#include "platform/blas_core.h"
#include "platform/error.h"

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

// Where OpenBLAS runs kernels narrower than this CPU's widest (OPENBLAS_CORETYPE named them),
// a note saying so, else "": they set most of the training speed (docs/benchmarks.md compares
// the two on one host).
inline std::string blas_kernels_note() {
  const char* wider = kvlab_blas_core_wider();
  if (wider == nullptr) return "";
  const char* named = std::getenv("OPENBLAS_CORETYPE");
  return detail::cat("OpenBLAS runs its ", kvlab::blas_kernels(), " kernels",
                     named != nullptr ? detail::cat(" (OPENBLAS_CORETYPE=", named, ")") : "",
                     "; this CPU can run its wider ", wider,
                     " ones, which may train faster: unset OPENBLAS_CORETYPE to let kvlab choose");
}

// Whether two paths name one file: the same file when both exist, else the same path (an
// output that would overwrite its command's input).
inline bool same_file(const std::filesystem::path& a, const std::filesystem::path& b) {
  namespace fs = std::filesystem;
  std::error_code ec, ea, eb;
  if (fs::equivalent(a, b, ec)) return true;
  const fs::path ca = fs::weakly_canonical(a, ea), cb = fs::weakly_canonical(b, eb);
  return !ea && !eb && ca == cb;
}

// "best val loss 1.2345", or, before the first evaluation after a step (the best is then
// +inf), "no best val loss yet".
// "best val loss 1.2345", then " (1.7810 bits per byte)" when the validation text's tokens
// per byte are known (0: not).
inline std::string best_val_text(double best, double tokens_per_byte = 0) {
  if (!std::isfinite(best)) return "no best val loss yet";
  char text[96];
  int n = std::snprintf(text, sizeof text, "best val loss %.4f", best);
  if (tokens_per_byte > 0)
    std::snprintf(text + n, sizeof text - static_cast<size_t>(n), " (%.4f bits per byte)",
                  bits_per_byte(best, tokens_per_byte));
  return text;
}

// A check for an integer flag of type T. CLI11 2.1 reads integers with strtoll/strtoull, so
// "-1" wraps to 2^64 - 1 for an unsigned flag, a value past the range is clamped, and "0x10"
// is read as hex; this takes only a plain decimal integer that fits T.
template <class T>
CLI::Validator integer_of() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        T value{};
        const char* end = text.data() + text.size();
        const auto [stop, ec] = std::from_chars(text.data(), end, value);
        if (ec == std::errc::result_out_of_range)
          return "'" + text + "' is outside [" + std::to_string(std::numeric_limits<T>::min()) +
                 ", " + std::to_string(std::numeric_limits<T>::max()) + "]";
        if (ec != std::errc() || stop != end || text.empty())
          return "'" + text + "' is not a decimal integer";
        return {};
      },
      "");
}

// A check for a floating-point flag: "inf", "nan" and values that overflow to inf are rejected
// at parse time (CLI11 would take them).
inline CLI::Validator finite_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size()) return {};  // CLI11 reports it
        if (!std::isfinite(v)) return "'" + text + "' is not a finite number";
        return {};
      },
      "");
}

// A numeric flag with its default shown in --help, checked at parse time: integer_of<T> for
// an integer, finite_number for a floating-point value.
template <class T>
CLI::Option* add_number(CLI::App* cmd, const std::string& name, T& value, const std::string& help) {
  CLI::Option* opt = cmd->add_option(name, value, help);
  if constexpr (std::is_integral_v<T>)
    opt->check(integer_of<T>());
  else
    opt->check(finite_number());
  return opt->capture_default_str();
}

// The command line as typed (recorded in results files).
const std::string& command_line();
void set_command_line(int argc, char** argv);

void add_train_command(CLI::App& root);
void add_generate_command(CLI::App& root);
void add_bench_command(CLI::App& root);
void add_ablate_command(CLI::App& root);
void add_report_command(CLI::App& root);
void add_inspect_command(CLI::App& root);
void add_serve_command(CLI::App& root);
void add_convert_command(CLI::App& root);
void add_export_command(CLI::App& root);
void add_import_command(CLI::App& root);
void add_tokenizer_command(CLI::App& root);
void add_eval_command(CLI::App& root);

}  // namespace kvlab
