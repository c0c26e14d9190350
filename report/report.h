#pragma once
// The ablation report: turns the results document of `kvlab ablate` (one entry per n_kv_head,
// each trained with one or more seeds) into verdicts, the terminal table and report files.
// The schema of the document is in report/README.md.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kvlab {

// Validation-loss comparison of two variants, named by their labels ("n_kv_head=4 (MHA)",
// "MLA kv_lora_rank=32").
struct Verdict {
  std::string a, b;
  std::string text;              // one line, names both variants and the figures it rests on
  // By the paired bootstrap where the results hold the pair's paired evaluation (every seed's
  // 95% interval excludes 0 on one side; the text gives the seed-spread verdict beside it),
  // else by the seeds' spread (>= 2 seeds each and mean ± std intervals do not overlap).
  bool distinguishable = false;
};

// Adjacent pairs in descending n_kv_head order, then each remaining variant against MHA
// (n_kv_head == config.n_head, when that variant was run); then each MLA variant against the
// n_kv_head variant nearest in cache bytes per token, and against MHA. Throws kvlab::Error on
// a document without variants or with a variant lacking n_kv_head (or MLA's kv_lora_rank) or
// val_loss_mean.
std::vector<Verdict> compare_variants(const nlohmann::json& results);

// Terminal text: the record table (n_kv_head | cache bytes (measured) | formula | vs MHA |
// tokens/s | val loss | Δ val loss vs MHA | bits/byte), a second table with the other figures,
// then the verdict lines.
// Figures are in human units (B/KiB/MiB/GiB, ms or s, thousands separators), as in the report
// files' tables; results.json and results.csv carry the exact values.
std::string format_table(const nlohmann::json& results);

// Writes into out_dir (created if needed): results.json, results.csv, report.md, report.html
// (self-contained, readable offline and printable; it and report.md open with findings that
// link the tables showing their figures), val_loss_curves.svg, val_loss_curves_vs_mha.svg
// (with MHA in the sweep), val_loss_vs_kv.svg,
// cache_bytes_vs_kv.svg, tokens_per_s_vs_kv.svg (and served_vs_rate.svg, ttft_p99_vs_rate.svg
// when the results hold a serving sweep), and a PNG of each plot when rsvg-convert is on
// PATH. Each file is written to a temporary name and renamed into place. Throws kvlab::Error
// naming the path when out_dir cannot be created or written, and when rsvg-convert fails
// (after every other file is in place).
void write_report(const nlohmann::json& results, const std::filesystem::path& out_dir);

}  // namespace kvlab
