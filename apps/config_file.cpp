#include "apps/config_file.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include "apps/cli.h"

namespace kvlab {

namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

std::string unquote(std::string v) {
  if (v.size() >= 2 && (v.front() == '"' || v.front() == '\'') && v.back() == v.front())
    return v.substr(1, v.size() - 2);
  if (v.size() >= 2 && v.front() == '[' && v.back() == ']') {  // a list: "8, 4" -> "8,4"
    std::string out;
    for (char c : v.substr(1, v.size() - 2))
      if (c != ' ' && c != '"' && c != '\'') out += c;
    return out;
  }
  return v;
}

std::map<std::string, const CLI::App*>& registered_commands() {
  static std::map<std::string, const CLI::App*> commands;
  return commands;
}

}  // namespace

void register_config_command(const CLI::App* cmd) { registered_commands()[cmd->get_name()] = cmd; }

namespace {

// Where --config FILE (or --config=FILE) stands in args, given once.
struct ConfigFlag {
  size_t at = 0;     // its index in args
  bool two = false;  // "--config" "FILE", not "--config=FILE"
  std::string file;
};
std::optional<ConfigFlag> find_config_flag(const std::vector<std::string>& args) {
  std::optional<ConfigFlag> found;
  for (size_t i = 1; i < args.size(); ++i) {
    const bool split = args[i] == "--config", joined = args[i].rfind("--config=", 0) == 0;
    if (!split && !joined) continue;
    KVLAB_USAGE_CHECK(!found,
                      "--config is given twice: give one file (its flags can be "
                      "combined into one, and command-line flags win over it)");
    KVLAB_USAGE_CHECK(!split || i + 1 < args.size(), "--config needs a file name");
    found = ConfigFlag{i, split, split ? args[i + 1] : args[i].substr(9)};
    KVLAB_USAGE_CHECK(!found->file.empty(), "--config needs a file name, got an empty one");
    if (split) ++i;
  }
  return found;
}

// The registered names, as "[train], [ablate]" or "train and ablate".
std::string command_names(const char* before, const char* after, const char* separator) {
  std::string names;
  for (const auto& [name, app] : registered_commands())
    names += detail::cat(names.empty() ? "" : separator, before, name, after);
  return names;
}

// The command that takes the file: subcommand `sub`, which must have registered.
const CLI::App* config_command(const std::string& sub) {
  const auto known = registered_commands().find(sub);
  KVLAB_USAGE_CHECK(known != registered_commands().end(), "--config: ",
                    sub.empty() ? std::string("give it after the command")
                                : detail::cat("kvlab ", sub, " takes no config file"),
                    " (", command_names("", "", " and "), " take one)");
  return known->second;
}

// The file's settings for `cmd` (its own section's and those before any section) as flags,
// each key checked against cmd's flags; a flag given on the command line (`given`) wins.
std::vector<std::string> read_config_flags(const std::string& file, const std::string& sub,
                                           const CLI::App* cmd,
                                           const std::set<std::string>& given) {
  std::error_code ec;
  KVLAB_USAGE_CHECK(!std::filesystem::is_directory(file, ec), "--config ", file,
                    ": cannot read the file (it is a folder)");
  std::ifstream in(file);
  KVLAB_USAGE_CHECK(in.good(), "--config ", file, ": cannot read the file");
  std::vector<std::string> flags;
  std::map<std::string, int> line_of_key;  // each key once
  std::string line, section;
  for (int n = 1; std::getline(in, line); ++n) {
    line = trim(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    const std::string at_line = detail::cat("--config ", file, ":", n, ": ");
    if (line.front() == '[') {
      KVLAB_USAGE_CHECK(line.back() == ']', at_line, "malformed section '", line, "'");
      section = trim(line.substr(1, line.size() - 2));
      // A misspelt section would otherwise drop its keys without a word.
      KVLAB_USAGE_CHECK(registered_commands().count(section) != 0, at_line, "unknown section '[",
                        section, "]' (sections: ", command_names("[", "]", ", "), ")");
      continue;
    }
    if (!section.empty() && section != sub) continue;
    const auto eq = line.find('=');
    KVLAB_USAGE_CHECK(eq != std::string::npos, at_line, "expected 'key = value', got '", line, "'");
    std::string key = trim(line.substr(0, eq));
    std::replace(key.begin(), key.end(), '_', '-');
    const std::string value = unquote(trim(line.substr(eq + 1)));
    const std::string flag = "--" + key;
    KVLAB_USAGE_CHECK(!key.empty(), at_line, "no key before '=' in '", line, "'");
    KVLAB_USAGE_CHECK(key != "config", at_line,
                      "'config' cannot be nested (a config file cannot include another); "
                      "put its settings in this file");
    KVLAB_USAGE_CHECK(cmd->get_option_no_throw(flag) != nullptr, at_line, "unknown key '", key,
                      "' (kvlab ", sub, " has no flag ", flag, ")");
    KVLAB_USAGE_CHECK(!value.empty(), at_line, "'", key,
                      "' has no value (write 'key = value', or remove the line)");
    const auto [first, fresh] = line_of_key.emplace(key, n);
    KVLAB_USAGE_CHECK(fresh, at_line, "'", key, "' is set again (first at line ", first->second,
                      ")");
    if (given.count(flag) || value == "false") continue;
    flags.push_back(flag);
    if (value != "true") flags.push_back(value);
  }
  KVLAB_USAGE_CHECK(!in.bad(), "--config ", file, ": cannot read the file");
  return flags;
}

}  // namespace

std::vector<std::string> expand_config_file(const std::vector<std::string>& args) {
  // args[0] is the program, args[1] the subcommand (when it is not a flag).
  const std::optional<ConfigFlag> config = find_config_flag(args);
  if (!config) return args;
  const std::string sub = args.size() > 1 && args[1].rfind("-", 0) != 0 ? args[1] : "";
  std::set<std::string> given;  // flags on the command line win over the file
  for (const auto& a : args)
    if (a.rfind("--", 0) == 0) given.insert(a.substr(0, a.find('=')));
  const std::vector<std::string> from_file =
      read_config_flags(config->file, sub, config_command(sub), given);
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (i == config->at) {
      if (config->two) ++i;
      continue;
    }
    out.push_back(args[i]);
    if (i == (sub.empty() ? 0 : 1)) out.insert(out.end(), from_file.begin(), from_file.end());
  }
  return out;
}

}  // namespace kvlab
