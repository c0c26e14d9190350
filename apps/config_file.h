#pragma once
// --config FILE for any subcommand: the file holds the command's flags as `key = value` lines
// (TOML/INI style: `n-layer = 4`, `corpus = "input.txt"`, `untied = true`,
// `kv-heads = [8, 4, 2]`; `#` comments; keys may use - or _). Lines before any `[section]`,
// or in the section named like the subcommand, apply. Flags given on the command line win.
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace kvlab {

// Returns argv with `--config FILE` replaced by the file's flags (those not already given on
// the command line), placed right after the subcommand. Throws UsageError for an unreadable
// file (a folder included) or a malformed line, naming the file and line number: a line
// without '=', a key without a value, a nested `config` key, or (for a command registered
// below) a key that is not one of its flags.
std::vector<std::string> expand_config_file(const std::vector<std::string>& args);

// Lets expand_config_file check a file's keys against the flags of `cmd` (a subcommand, found
// by name; it must outlive the parse). Keys for other commands are left to CLI11.
void register_config_command(const CLI::App* cmd);

}  // namespace kvlab
