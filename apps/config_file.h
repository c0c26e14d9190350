#pragma once
// --config FILE for the subcommands that register for it (train, ablate): the file holds the
// command's flags as `key = value` lines (TOML/INI style: `n-layer = 4`, `corpus =
// "input.txt"`, `untied = true`, `kv-heads = [8, 4, 2]`; `#` comments; keys may use - or _).
// Lines before any `[section]`, or in the section named like the subcommand, apply; the
// sections of the other commands that take one are skipped, and any other section is an
// error. Flags given on the command line win.
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace kvlab {

// Returns argv with `--config FILE` replaced by the file's flags (those not already given on
// the command line), placed right after the subcommand. Throws UsageError for an unreadable
// file (a folder included) or a malformed line, naming the file and line number: a line
// without '=', a key without a value, a key set twice, a nested `config` key, a key that is not
// one of the command's flags, or a section that is no registered command's (naming those); and
// for --config given twice or to a command that did not register for it.
std::vector<std::string> expand_config_file(const std::vector<std::string>& args);

// Lets `cmd` (a subcommand, found by name; it must outlive the parse) take --config, whose
// keys expand_config_file checks against its flags.
void register_config_command(const CLI::App* cmd);

}  // namespace kvlab
