#pragma once
// --config FILE for any subcommand: the file holds the command's flags as `key = value` lines
// (TOML/INI style: `n-layer = 4`, `corpus = "input.txt"`, `untied = true`,
// `kv-heads = [8, 4, 2]`; `#` comments; keys may use - or _). Lines before any `[section]`,
// or in the section named like the subcommand, apply. Flags given on the command line win.
#include <string>
#include <vector>

namespace kvlab {

// Returns argv with `--config FILE` replaced by the file's flags (those not already given on
// the command line), placed right after the subcommand. Throws UsageError for an unreadable
// file or a malformed line, naming the file and line number.
std::vector<std::string> expand_config_file(const std::vector<std::string>& args);

}  // namespace kvlab
