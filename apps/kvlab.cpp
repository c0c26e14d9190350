// kvlab: train GPTs with MHA/GQA/MQA attention, generate through a KV cache, and compare
// n_kv_head settings side by side.

#include <algorithm>
#include <cstdio>
#include <exception>
#include <iostream>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/cli.h"
#include "apps/config_file.h"
#include "apps/train_progress.h"
#include "platform/blas_core.h"
#include "platform/threads.h"

namespace kvlab {
namespace {
std::string g_command_line;
}
const std::string& command_line() { return g_command_line; }
void set_command_line(int argc, char** argv) {
  g_command_line.clear();
  for (int i = 0; i < argc; ++i) g_command_line += (i ? " " : "") + std::string(i ? argv[i] : "kvlab");
}
}  // namespace kvlab

namespace {

// Output that could not be written (a full disk, say) is a failure, not a success.
bool flushed_stdout() {
  std::cout.flush();
  if (std::fflush(stdout) != 0 || std::ferror(stdout) != 0 || !std::cout) {
    std::fprintf(stderr, "kvlab: error: writing the standard output failed\n");
    return false;
  }
  return true;
}

// The command and, for one that has its own (bench), its subcommand: an unknown or missing
// one is named with the choices, where CLI11 would only say "A subcommand is required" or
// list the word as an unexpected argument. Flags before the command are left to CLI11.
void check_command_names(const CLI::App& app, const std::vector<std::string>& args) {
  const CLI::App* parent = &app;
  std::string path = "kvlab";
  for (size_t i = 1; !parent->get_subcommands({}).empty(); ++i) {
    std::string names;
    const CLI::App* found = nullptr;
    for (const CLI::App* sub : parent->get_subcommands({})) {
      names += (names.empty() ? "" : ", ") + sub->get_name();
      if (i < args.size() && sub->get_name() == args[i]) found = sub;
    }
    if (i < args.size() && args[i].rfind('-', 0) == 0) return;  // --help, --version, ...
    KVLAB_USAGE_CHECK(i < args.size(), "'", path, "' needs a command (commands: ", names, ")");
    KVLAB_USAGE_CHECK(found != nullptr, "unknown command '", args[i], "'",
                      parent == &app ? "" : " for '" + path + "'", " (commands: ", names, ")");
    path += " " + args[i];
    parent = found;
  }
}

}  // namespace

int main(int argc, char** argv) {
  kvlab::apply_thread_wait_policy(argv);
  kvlab::set_command_line(argc, argv);
  CLI::App app{"kvlab: train small GPTs with MHA, GQA or MQA attention and measure what sharing "
               "key/value heads costs and buys"};
  app.name("kvlab");
  app.require_subcommand(1);
  // The BLAS build and the kernels it runs on this CPU: they set most of the training speed.
  const std::string note = kvlab::blas_kernels_note();
  app.set_version_flag("--version", std::string("kvlab " KVLAB_VERSION "\nBLAS: ") +
                                        kvlab::blas_config() + "; kernels " +
                                        kvlab::blas_kernels() +
                                        (note.empty() ? "" : "\nnote: " + note));
  kvlab::add_train_command(app);
  kvlab::add_generate_command(app);
  kvlab::add_bench_command(app);
  kvlab::add_ablate_command(app);
  kvlab::add_report_command(app);
  kvlab::add_inspect_command(app);
  kvlab::add_serve_command(app);
  kvlab::add_convert_command(app);
  kvlab::add_export_command(app);
  kvlab::add_import_command(app);
  kvlab::add_tokenizer_command(app);
  kvlab::add_eval_command(app);
  try {
    std::vector<std::string> args(argv, argv + argc);
    check_command_names(app, args);
    args = kvlab::expand_config_file(args);
    args.erase(args.begin());
    std::reverse(args.begin(), args.end());  // CLI11 takes the arguments last-first
    app.parse(args);
  } catch (const CLI::ExtrasError&) {
    // CLI11's own message lists them last-first (it parses a reversed vector); remaining()
    // has them in the order given.
    std::string list;
    for (const std::string& a : app.remaining(true)) list += " " + a;
    std::fprintf(stderr,
                 "kvlab: error: unexpected arguments:%s\nRun with --help for more information.\n",
                 list.c_str());
    return 2;
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help/version (rc 0) or the parse error
    if (rc != 0) return 2;
    return flushed_stdout() ? 0 : 1;
  } catch (const kvlab::Interrupted& e) {  // its work is saved
    std::fprintf(stderr, "kvlab: %s\n", e.what());
    return 128 + e.signal();
  } catch (const kvlab::UsageError& e) {
    std::fprintf(stderr, "kvlab: error: %s\n", e.what());
    return 2;
  } catch (const kvlab::Error& e) {
    std::fprintf(stderr, "kvlab: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc& e) {
    std::fprintf(stderr,
                 "kvlab: error: out of memory (%s): a smaller batch, length or model "
                 "needs less\n",
                 e.what());
    return 1;
  } catch (const std::length_error& e) {
    std::fprintf(stderr, "kvlab: error: a size is too large to allocate (%s)\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvlab: error: %s\n", e.what());
    return 1;
  }
  return flushed_stdout() ? 0 : 1;
}
