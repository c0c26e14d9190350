#pragma once
// What the files of the ablation report share (internal to report): the results as
// parse.cpp reads them, the figures and tables of tables.cpp, the verdicts and findings of
// verdicts.cpp and the plots of plots.cpp, which documents.cpp assembles into report files.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "report/report.h"
#include "report/svg_plot.h"

namespace kvlab::report_detail {

using nlohmann::json;

// --- parse.cpp ---------------------------------------------------------------------------

// obj[key] when it is a number.
std::optional<double> number(const json& obj, const char* key);

// One variant of the results, with what verdicts and tables need checked up front: n_kv_head
// key/value heads, or MLA with a latent of rank `rank`.
struct Variant {
  int n_kv = 0;      // 0 for MLA
  int rank = 0;      // MLA's kv_lora_rank; 0 otherwise
  std::string kind;  // MHA, GQA, MQA or MLA
  int seeds = 0;     // entries in "runs"; fewer than 2 means no spread was measured
  double mean = 0, std = 0;
  const json* j = nullptr;

  bool mla() const { return rank > 0; }
  std::string label() const {
    return mla() ? "MLA kv_lora_rank=" + std::to_string(rank)
                 : "n_kv_head=" + std::to_string(n_kv) + " (" + kind + ")";
  }
  // The tables' first column.
  std::string id() const { return mla() ? "MLA " + std::to_string(rank) : std::to_string(n_kv); }
  std::optional<double> get(const char* key) const { return number(*j, key); }
};

// One (n_kv_head, method) of the uptrain experiment (results.json's uptrain.entries).
struct UptrainEntry {
  int n_kv = 0;
  std::string method;
  int seeds = 0;
  double conv = 0, conv_sd = 0, up = 0, up_sd = 0;
  std::optional<double> scratch, scratch_sd;
  const json* j = nullptr;
};

struct Uptrain {
  double fraction = 0;
  int64_t steps = 0;
  std::vector<UptrainEntry> entries;  // as the results list them: n_kv_head descending
  const json* j = nullptr;
};

// ablate's paired evaluation (results.json's generation_quality): variants and pairs by their
// index in Parsed::variants, each figure per seed.
struct SeedInterval {
  double mean = 0, lo = 0, hi = 0;
};
struct GenVariant {
  size_t v = 0;
  std::vector<double> loss, bpb, icl, kl, top1;
  std::vector<double> distinct2, repeated3;  // of its samples, per seed (empty without)
  std::vector<int64_t> bucket_first, bucket_last, distance;
  std::vector<double> bucket_loss, recall;  // seed means
};
struct GenPair {
  size_t a = 0, b = 0;
  std::vector<SeedInterval> seeds;  // b - a
  bool distinguishable = false;     // every seed's interval excludes 0, on one side
};
struct GenQuality {
  size_t reference = 0;
  int64_t windows = 0, window = 0;
  std::vector<GenVariant> variants;
  std::vector<GenPair> pairs;
};

struct Parsed {
  std::vector<Variant> variants;   // n_kv_head descending, then MLA's ranks descending
  int n_head = 0;                  // config.n_head, else the largest n_kv_head
  std::optional<Uptrain> uptrain;  // kvlab ablate --uptrain
  std::optional<GenQuality> gen;   // absent in results written before it was measured
  bool has_mla() const { return variants.back().mla(); }
  // The tables' first column header.
  std::string id_header() const { return has_mla() ? "n_kv_head / MLA rank" : "n_kv_head"; }
};

// Checks the document as compare_variants (report.h) describes; variants in Parsed's order.
Parsed parse(const json& results);

// One point of the memory-quality frontier: a variant's model read through one cache dtype
// (kv_quality: every seed's figures on the same validation windows), or with its matrices of
// one type (weight_quality, on the same windows).
struct QualityPoint {
  const Variant* v = nullptr;
  std::string dtype;
  double bytes = 0;  // per token of cache; of weights a decode step reads
  double loss = 0, loss_std = 0, delta = 0, delta_std = 0, kl = 0, kl_std = 0, top1 = 0;
  bool front = false;  // no other point holds fewer or equal bytes at a lower loss
  std::optional<double> vs_f32;  // a weight point's bytes over the f32 model's
};

// Every variant's kv_quality points, each marked whether it is on the frontier.
std::vector<QualityPoint> quality_points(const Parsed& p);
// Every variant's weight_quality points (none in results written before they were measured).
std::vector<QualityPoint> weight_points(const Parsed& p);

// The serving sweep of a variant: each rate's figures over its runs (empty without a sweep).
struct SweepPoint {
  double rate = 0;
  std::vector<double> served, ttft_p99;
};
std::vector<SweepPoint> sweep_of(const Variant& v);

std::vector<int> uptrain_kvs(const Uptrain& u);

// A JSON value as text: a string's own characters, anything else as JSON.
std::string text_of(const json& v);
// text_of(obj[key]); empty when the key is missing or null.
std::string text_field(const json& obj, const char* key);

// --- tables.cpp --------------------------------------------------------------------------

// printf of one number.
std::string fmt(const char* format, double v);

// Human units, one precision for each kind of figure (exact values stay in results.json and
// results.csv): bytes as B, KiB, MiB, GiB to three significant figures ("1.25 KiB", "256 KiB");
// counts with thousands separators ("32,768"); rates too, with a decimal under 100 ("41.5");
// milliseconds as ms below a second, else s ("0.495 ms", "871 ms", "1.49 s"). "-" for none.
std::string bytes(std::optional<double> b);
// The unit bytes() shows v in, and its size in bytes (a plot's axis takes its largest value's).
struct ByteUnit {
  const char* name;
  double scale;
};
ByteUnit byte_unit(double v);
std::string grouped(double v);
std::string count(std::optional<double> v);
std::string rate(std::optional<double> v);
std::string millis(std::optional<double> ms);
// Decode tokens/s with the KV cache over without it.
std::optional<double> speedup(const Variant& v);
std::string pm(double mean, double sd, const char* format);

struct Table {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
  std::string id;  // the HTML (and Markdown anchor) id the findings link to
};

// The multi-head variant (n_kv_head == n_head), or null where the sweep left it out.
const Variant* mha_of(const Parsed& p);

// Cells the findings quote: one function per figure, so a finding and its table show one value.
std::string loss_cell(const Variant& v);                          // val loss, mean ± std
std::string loss_delta_cell(const Parsed& p, const Variant& v);   // val loss minus MHA's
// A pair's per-seed paired differences: "+0.0186 [+0.0136, +0.0238]; ..." (b - a).
std::string seed_intervals(const GenPair& pair);
// A task's answer accuracy, mean ± std (none for a text sweep).
std::optional<std::string> accuracy_cell(const Variant& v);
std::string cache_cell(const Variant& v);       // measured cache bytes at full context
std::string vs_mha_cell(const Variant& v);      // those bytes over MHA's
std::string sequences_cell(const Variant& v);   // full-context sequences in the KV budget
std::string kv_memory_cell(const Variant& v);   // the serving workload's KV memory
std::string peak_paged_cell(const Variant& v);  // the paged cache's peak sequences in it
std::string quality_loss_cell(const QualityPoint& q);
std::string quality_delta_cell(const QualityPoint& q);  // loss minus f32's, mean ± std
std::string quality_kl_cell(const QualityPoint& q);     // mean KL against f32, mean ± std
std::string weight_bytes_cell(const QualityPoint& q);   // decode weight bytes
std::string vs_f32_cell(const QualityPoint& q);         // those bytes over the f32 model's

Table record_table(const Parsed& p);
Table detail_table(const Parsed& p);
std::optional<Table> memory_table(const Parsed& p);
std::optional<Table> serving_table(const Parsed& p);
std::optional<Table> mla_table(const Parsed& p);
std::optional<Table> quality_table(const Parsed& p);
std::optional<Table> weight_table(const Parsed& p);
Table uptrain_table(const Uptrain& u);
Table generation_table(const Parsed& p, const GenQuality& g);
Table paired_table(const Parsed& p, const GenQuality& g);

std::string md_escape(const std::string& s);
std::string render_markdown(const Table& t);
std::string render_html(const Table& t);

// --- verdicts.cpp ------------------------------------------------------------------------

// A variant's val loss, mean ± std.
std::string loss_pm(const Variant& v);
const Variant* nearest_in_bytes(const Parsed& p, const Variant& m);
std::vector<Verdict> verdicts(const Parsed& p);
std::vector<std::string> mla_findings(const Parsed& p);
std::vector<std::string> quality_findings(const Parsed& p);
std::vector<std::string> serving_findings(const Parsed& p);
std::vector<std::string> uptrain_findings(const Uptrain& u);
// The seed-spread verdict (compare_variants' rule) of variants a and b.
bool spread_distinguishable(const Variant& a, const Variant& b);
std::vector<std::string> generation_findings(const Parsed& p, const GenQuality& g);

// A sentence of the report's opening findings and the ids of the tables, verdicts or figures
// that show its figures.
struct Finding {
  std::string text;
  std::vector<std::string> links;
};
std::vector<Finding> findings(const Parsed& p);

// --- plots.cpp ---------------------------------------------------------------------------

// A plot of the report: its file name (without .svg), its SVG and a caption saying what to
// look at in it.
struct Figure {
  std::string name, svg, caption;
};
std::vector<Figure> figures(const Parsed& p, const json& results);

svg::Plot curves_plot(const Parsed& p);
// Each variant's mean curve minus MHA's over the second half of training (none without MHA).
std::optional<svg::Plot> curves_vs_mha_plot(const Parsed& p);
svg::Plot loss_vs_kv_plot(const Parsed& p);
svg::Plot cache_plot(const Parsed& p, const json& results);
svg::Plot speed_plot(const Parsed& p);
svg::Plot serving_plot(const Parsed& p, bool ttft);
svg::Plot quality_plot(const Parsed& p, bool kl);
svg::Plot uptrain_plot(const Uptrain& u, int kv);
svg::Plot position_plot(const Parsed& p, const GenQuality& g);
svg::Plot recall_plot(const Parsed& p, const GenQuality& g);

}  // namespace kvlab::report_detail
