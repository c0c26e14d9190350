// The report's tables: each figure formatted, each table built from the parsed results, and
// rendered as terminal text, Markdown or HTML.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string_view>

#include "report/report_parts.h"

namespace kvlab::report_detail {
namespace {

std::string figure(std::optional<double> v, const char* format) {
  return v ? fmt(format, *v) : "-";
}


// Terminal columns count code points, not bytes ("±" is two bytes).
std::size_t display_width(const std::string& s) {
  return std::count_if(s.begin(), s.end(),
                       [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
}

std::string render_text(const Table& t) {
  std::vector<std::size_t> w(t.header.size());
  for (std::size_t c = 0; c < w.size(); ++c) {
    w[c] = display_width(t.header[c]);
    for (const auto& row : t.rows) w[c] = std::max(w[c], display_width(row[c]));
  }
  std::string out;
  auto line = [&](const std::vector<std::string>& cells) {
    for (std::size_t c = 0; c < cells.size(); ++c) {
      if (c) out += " | ";
      out += std::string(w[c] - display_width(cells[c]), ' ') + cells[c];
    }
    out += '\n';
  };
  line(t.header);
  for (std::size_t c = 0; c < w.size(); ++c) out += (c ? "-+-" : "") + std::string(w[c], '-');
  out += '\n';
  for (const auto& row : t.rows) line(row);
  return out;
}

std::string steps_tokens(const json& e, const char* steps, const char* tokens) {
  const auto s = number(e, steps), t = number(e, tokens);
  if (!s) return "-";
  return grouped(*s) + (t ? " (" + grouped(*t) + " tokens)" : std::string());
}

}  // namespace

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

namespace {
// Three significant figures ("0.495", "1.25", "32.0", "256"): one precision for every unit.
std::string three_figures(double v) {
  const double a = std::abs(v);
  return fmt(a < 0.9995 ? "%.3f" : a < 9.995 ? "%.2f" : a < 99.95 ? "%.1f" : "%.0f", v);
}
}  // namespace

ByteUnit byte_unit(double v) {
  static const char* const names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  if (v < 1024) return {names[0], 1};
  double scale = 1024;
  int u = 1;
  // 1023.9 KiB would print as "1024 KiB": the next unit once three figures round up to it.
  while (u < 4 && v / scale >= 1023.5) scale *= 1024, ++u;
  return {names[u], scale};
}

std::string bytes(std::optional<double> b) {
  if (!b) return "-";
  const ByteUnit u = byte_unit(*b);
  return (u.scale == 1 ? fmt("%.0f", *b) : three_figures(*b / u.scale)) + " " + u.name;
}

std::string grouped(double v) {
  const std::string digits = fmt("%.0f", std::abs(v));
  // Appended a digit at a time (GCC 12's -Wrestrict misreads string::insert here).
  std::string out = v < 0 && digits != "0" ? "-" : "";
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string rate(std::optional<double> v) {
  return !v ? "-" : std::abs(*v) < 100 ? fmt("%.1f", *v) : grouped(*v);
}

std::string millis(std::optional<double> ms) {
  if (!ms) return "-";
  return *ms < 999.5 ? three_figures(*ms) + " ms" : three_figures(*ms / 1000) + " s";
}

std::string count(std::optional<double> v) { return v ? grouped(*v) : "-"; }

std::optional<double> speedup(const Variant& v) {
  const auto with = v.get("decode_tokens_per_s_cache");
  const auto without = v.get("decode_tokens_per_s_nocache");
  if (!with || !without || *without <= 0) return std::nullopt;
  return *with / *without;
}

const Variant* mha_of(const Parsed& p) {
  for (const Variant& v : p.variants)
    if (!v.mla() && v.n_kv == p.n_head) return &v;
  return nullptr;
}

std::string loss_cell(const Variant& v) {
  return v.seeds >= 2 ? loss_pm(v) : fmt("%.4f", v.mean) + " (1 seed)";
}

std::string loss_delta_cell(const Parsed& p, const Variant& v) {
  const Variant* m = mha_of(p);
  return m == nullptr ? "-" : fmt("%+.4f", v.mean - m->mean);
}

std::optional<std::string> accuracy_cell(const Variant& v) {
  const auto mean = v.get("val_accuracy_mean");
  if (!mean) return std::nullopt;
  const double sd = v.get("val_accuracy_std").value_or(0);
  return v.seeds >= 2 ? pm(*mean, sd, "%.3f") : fmt("%.3f", *mean) + " (1 seed)";
}

std::string cache_cell(const Variant& v) { return bytes(v.get("cache_bytes_context_measured")); }
std::string vs_mha_cell(const Variant& v) { return figure(v.get("vs_mha"), "%.3fx"); }
std::string sequences_cell(const Variant& v) { return count(v.get("sequences_in_budget")); }
std::string kv_memory_cell(const Variant& v) { return bytes(v.get("kv_workload_budget_bytes")); }
std::string peak_paged_cell(const Variant& v) {
  return count(v.get("kv_workload_peak_sequences_paged"));
}

Table record_table(const Parsed& p) {
  Table t{{p.id_header(), "cache bytes (measured)", "formula", "vs MHA", "tokens/s", "val loss",
           "Δ val loss vs MHA", "bits/byte"},
          {},
          "table-results"};
  for (const Variant& v : p.variants)
    t.rows.push_back({v.id(), cache_cell(v), bytes(v.get("cache_bytes_context_formula")),
                      vs_mha_cell(v), rate(v.get("decode_tokens_per_s_cache")), loss_cell(v),
                      loss_delta_cell(p, v), figure(v.get("val_bpb_mean"), "%.4f")});
  // A task's sweep (--task mqar): the share of answers each variant recalls.
  if (accuracy_cell(p.variants.front())) {
    t.header.push_back("answer accuracy");
    for (size_t i = 0; i < p.variants.size(); ++i)
      t.rows[i].push_back(accuracy_cell(p.variants[i]).value_or("-"));
  }
  return t;
}

Table detail_table(const Parsed& p) {
  Table t{{p.id_header(), "params", "bits/token", "cache bytes/token", "cache bytes/byte",
           "sequences in budget", "tokens/s (no cache)", "cache speed-up", "TTFT", "TPOT"},
          {},
          "table-details"};
  for (const Variant& v : p.variants)
    t.rows.push_back({v.id(), count(v.get("params")), figure(v.get("bpc"), "%.4f"),
                      bytes(v.get("cache_bytes_per_token")),
                      figure(v.get("cache_bytes_per_byte"), "%.1f"), sequences_cell(v),
                      rate(v.get("decode_tokens_per_s_nocache")), figure(speedup(v), "%.2fx"),
                      millis(v.get("ttft_ms")), millis(v.get("tpot_ms"))});
  return t;
}

// Under the serving workload at one KV memory for every variant (results without it, from
// before it was measured, leave the table out).
std::optional<Table> memory_table(const Parsed& p) {
  if (!p.variants.front().get("kv_workload_peak_sequences_paged")) return std::nullopt;
  Table t{{p.id_header(), "KV memory", "peak sequences paged", "contiguous", "paged / contiguous",
           "utilisation paged", "contiguous", "steps paged", "contiguous"},
          {},
          "table-memory"};
  for (const Variant& v : p.variants) {
    const auto paged = v.get("kv_workload_peak_sequences_paged");
    const auto contiguous = v.get("kv_workload_peak_sequences_contiguous");
    t.rows.push_back(
        {v.id(), kv_memory_cell(v), peak_paged_cell(v), count(contiguous),
         figure(paged && contiguous && *contiguous > 0 ? std::optional<double>(*paged / *contiguous)
                                                       : std::nullopt,
                "%.2fx"),
         figure(v.get("kv_workload_utilisation_paged"), "%.3f"),
         figure(v.get("kv_workload_utilisation_contiguous"), "%.3f"),
         count(v.get("kv_workload_steps_paged")), count(v.get("kv_workload_steps_contiguous"))});
  }
  return t;
}

// Serving the workload with the trained model at that memory (results measured on a GPU, or
// before it was measured, leave the table out).
std::optional<Table> serving_table(const Parsed& p) {
  if (!p.variants.front().get("serve_requests_per_s_continuous")) return std::nullopt;
  Table t{{p.id_header(), "requests/s continuous", "static", "continuous / static",
           "peak sequences continuous", "static", "p99 TTFT continuous", "static",
           "sustained requests/s"},
          {},
          "table-serving"};
  for (const Variant& v : p.variants) {
    const auto c = v.get("serve_requests_per_s_continuous");
    const auto s = v.get("serve_requests_per_s_static");
    t.rows.push_back(
        {v.id(), rate(c), rate(s),
         figure(c && s && *s > 0 ? std::optional<double>(*c / *s) : std::nullopt, "%.2fx"),
         count(v.get("serve_peak_sequences_continuous")),
         count(v.get("serve_peak_sequences_static")), millis(v.get("serve_ttft_p99_ms_continuous")),
         millis(v.get("serve_ttft_p99_ms_static")),
         figure(v.get("serve_sustained_rate"), "%.2f")});
  }
  return t;
}

// Each MLA variant beside the n_kv_head variant nearest in cache bytes per token (results
// without MLA leave it out).
std::optional<Table> mla_table(const Parsed& p) {
  if (!p.has_mla()) return std::nullopt;
  Table t{{"MLA rank", "bytes/token", "nearest n_kv_head", "bytes/token", "MLA / it (bytes)",
           "val loss MLA", "val loss n_kv_head", "decode tokens/s MLA", "n_kv_head",
           "MLA / it (speed)"},
          {},
          "table-mla"};
  const auto ratio = [](std::optional<double> a, std::optional<double> b) {
    return a && b && *b > 0 ? std::optional<double>(*a / *b) : std::nullopt;
  };
  for (const Variant& m : p.variants) {
    const Variant* g = m.mla() ? nearest_in_bytes(p, m) : nullptr;
    if (g == nullptr) continue;
    const auto mb = m.get("cache_bytes_per_token"), gb = g->get("cache_bytes_per_token");
    const auto ms = m.get("decode_tokens_per_s_cache"), gs = g->get("decode_tokens_per_s_cache");
    t.rows.push_back({std::to_string(m.rank), bytes(mb), g->id() + " (" + g->kind + ")",
                      bytes(gb), figure(ratio(mb, gb), "%.2fx"),
                      loss_cell(m), loss_cell(*g), rate(ms),
                      rate(gs), figure(ratio(ms, gs), "%.2fx")});
  }
  return t;
}

// mean ± sd, the sd without a sign (a format's "+" flag is for the mean).
std::string pm(double mean, double sd, const char* format) {
  std::string sd_format = format;
  sd_format.erase(std::remove(sd_format.begin(), sd_format.end(), '+'), sd_format.end());
  return fmt(format, mean) + " ± " + fmt(sd_format.c_str(), sd);
}

std::string quality_loss_cell(const QualityPoint& q) { return pm(q.loss, q.loss_std, "%.4f"); }
std::string quality_delta_cell(const QualityPoint& q) { return pm(q.delta, q.delta_std, "%+.5f"); }
std::string quality_kl_cell(const QualityPoint& q) { return pm(q.kl, q.kl_std, "%.2e"); }
std::string weight_bytes_cell(const QualityPoint& q) { return bytes(q.bytes); }
std::string vs_f32_cell(const QualityPoint& q) { return figure(q.vs_f32, "%.3fx"); }

// Every (n_kv_head, cache dtype) point (results without kv_quality leave it out).
std::optional<Table> quality_table(const Parsed& p) {
  const std::vector<QualityPoint> pts = quality_points(p);
  if (pts.empty()) return std::nullopt;
  Table t{{p.id_header(), "cache dtype", "bytes/token", "val loss", "Δ vs f32 cache", "mean KL",
           "top-1 agreement", "frontier"},
          {},
          "table-quality"};
  for (const QualityPoint& q : pts)
    t.rows.push_back({q.v->id(), q.dtype, bytes(q.bytes), quality_loss_cell(q),
                      quality_delta_cell(q), quality_kl_cell(q), fmt("%.4f", q.top1),
                      q.front ? "yes" : ""});
  return t;
}

// Every (variant, matrix type) point (results without weight_quality leave it out).
std::optional<Table> weight_table(const Parsed& p) {
  const std::vector<QualityPoint> pts = weight_points(p);
  if (pts.empty()) return std::nullopt;
  Table t{{p.id_header(), "weight dtype", "decode weight bytes", "vs f32", "val loss",
           "Δ vs f32 weights", "mean KL", "top-1 agreement"},
          {},
          "table-weights"};
  for (const QualityPoint& q : pts)
    t.rows.push_back({q.v->id(), q.dtype, weight_bytes_cell(q), vs_f32_cell(q),
                      quality_loss_cell(q), quality_delta_cell(q), quality_kl_cell(q),
                      fmt("%.4f", q.top1)});
  return t;
}

namespace {
// Mean ± sample std of per-seed figures (± 0 for one seed).
std::string seeds_pm(const std::vector<double>& xs, const char* format) {
  double mean = 0, var = 0;
  for (double x : xs) mean += x / static_cast<double>(xs.size());
  for (double x : xs) var += (x - mean) * (x - mean);
  return pm(mean, xs.size() > 1 ? std::sqrt(var / static_cast<double>(xs.size() - 1)) : 0.0,
            format);
}
}  // namespace

// Every variant's paired figures: loss and bits per byte on the shared windows, the ICL score,
// KL and top-1 agreement against the reference, and recall at the longest distance probed.
Table generation_table(const Parsed& p, const GenQuality& g) {
  const std::string ref = p.variants[g.reference].id();
  const int64_t far = g.variants.front().distance.empty() ? 0 : g.variants.front().distance.back();
  Table t{{p.id_header(), "loss", "bits/byte", "ICL score", "KL vs " + ref, "top-1 vs " + ref,
           "recall at " + std::to_string(far), "samples: distinct-2", "repeated 3-grams"},
          {},
          "table-generation"};
  for (const GenVariant& v : g.variants)
    t.rows.push_back({p.variants[v.v].id(), seeds_pm(v.loss, "%.4f"), seeds_pm(v.bpb, "%.4f"),
                      seeds_pm(v.icl, "%+.4f"), seeds_pm(v.kl, "%.2e"), seeds_pm(v.top1, "%.4f"),
                      v.recall.empty() ? "-" : fmt("%.3f", v.recall.back()),
                      v.distinct2.empty() ? "-" : seeds_pm(v.distinct2, "%.3f"),
                      v.repeated3.empty() ? "-" : seeds_pm(v.repeated3, "%.3f")});
  return t;
}

std::string seed_intervals(const GenPair& pair) {
  std::string out;
  for (const SeedInterval& s : pair.seeds)
    out += (out.empty() ? "" : "; ") + fmt("%+.4f", s.mean) + " [" + fmt("%+.4f", s.lo) + ", " +
           fmt("%+.4f", s.hi) + "]";
  return out;
}

// Every pair: each seed's paired loss difference with its 95% interval, and the two verdicts.
Table paired_table(const Parsed& p, const GenQuality& g) {
  Table t{{"pair (b - a)", "Δ loss per seed [95% interval]", "paired verdict", "seed-spread verdict"},
          {},
          "table-paired"};
  for (const GenPair& pair : g.pairs) {
    const std::string per_seed = seed_intervals(pair);
    const Variant &a = p.variants[pair.a], &b = p.variants[pair.b];
    t.rows.push_back({b.id() + " - " + a.id(), per_seed,
                      pair.distinguishable ? "distinguishable" : "not distinguishable",
                      spread_distinguishable(a, b) ? "distinguishable" : "not distinguishable"});
  }
  return t;
}

// Markdown-safe cell text: HTML-escaped, markdown punctuation backslashed, newlines as <br>.
// The '#' of a character reference (an apostrophe's &#39;) stays: backslashed, it would break
// the reference and the page would show it.
std::string md_escape(const std::string& s) {
  std::string out;
  for (char c : svg::escape_xml(s)) {
    if (c == '\n') {
      out += "<br>";
      continue;
    }
    if (c == '\r') continue;
    // '_' stays: GFM ignores intraword underscores, and n_kv_head reads better unescaped.
    const bool reference = c == '#' && !out.empty() && out.back() == '&';
    if (!reference && std::string_view("\\`*[]|~#").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

std::string render_markdown(const Table& t) {
  std::string out = "|";
  for (const auto& h : t.header) {  // appended piecewise, as the cells below (GCC 12 -Wrestrict)
    out += ' ';
    out += md_escape(h);
    out += " |";
  }
  out += "\n|";
  for (std::size_t c = 0; c < t.header.size(); ++c) out += "---:|";
  out += '\n';
  for (const auto& row : t.rows) {
    out += "|";
    for (const auto& cell : row) {
      out += ' ';
      out += md_escape(cell);
      out += " |";
    }
    out += '\n';
  }
  return out;
}

std::string render_html(const Table& t) {
  std::string out = t.id.empty() ? "<table>" : "<table id=\"" + t.id + "\">";
  out += "\n<thead><tr>";
  for (const auto& h : t.header) out += "<th>" + svg::escape_xml(h) + "</th>";
  out += "</tr></thead>\n<tbody>\n";
  for (const auto& row : t.rows) {
    out += "<tr>";
    for (const auto& cell : row) out += "<td>" + svg::escape_xml(cell) + "</td>";
    out += "</tr>\n";
  }
  return out + "</tbody>\n</table>\n";
}

// Per (n_kv_head, method): val loss right after the conversion, after uptraining, and the
// sweep's from-scratch model's, mean ± std over seeds, with the training each one took.
Table uptrain_table(const Uptrain& u) {
  Table t{{"n_kv_head", "method", "after conversion", "after uptraining", "from scratch",
           "gap to scratch", "steps (tokens) uptrained", "steps (tokens) from scratch"},
          {},
          "table-uptrain"};
  for (const UptrainEntry& e : u.entries)
    t.rows.push_back({std::to_string(e.n_kv), e.method, pm(e.conv, e.conv_sd, "%.4f"),
                      pm(e.up, e.up_sd, "%.4f"),
                      e.scratch ? pm(*e.scratch, e.scratch_sd.value_or(0), "%.4f") : "-",
                      e.scratch ? fmt("%+.4f", e.up - *e.scratch) : "-",
                      steps_tokens(*e.j, "uptrained_steps", "uptrained_tokens"),
                      steps_tokens(*e.j, "scratch_steps", "scratch_tokens")});
  return t;
}

}  // namespace kvlab::report_detail

namespace kvlab {

using namespace report_detail;

std::string format_table(const nlohmann::json& results) {
  const Parsed p = parse(results);
  std::string out = render_text(record_table(p)) + '\n' +
                    render_text(detail_table(p));
  if (const auto t = mla_table(p)) {
    out += "\nMLA against GQA at equal cache bytes:\n" + render_text(*t);
    for (const std::string& f : mla_findings(p)) out += "  " + f + "\n";
  }
  if (const auto m = memory_table(p))
    out += "\nKV memory under a serving workload:\n" + render_text(*m);
  if (const auto t = serving_table(p)) {
    out += "\nserving it:\n" + render_text(*t);
    for (const std::string& f : serving_findings(p)) out += "  " + f + "\n";
  }
  if (const auto t = quality_table(p)) {
    out += "\nwhat each cache dtype costs (against the f32 cache, mean ± std over seeds):\n" +
           render_text(*t);
    for (const std::string& f : quality_findings(p)) out += "  " + f + "\n";
  }
  if (const auto t = weight_table(p))
    out += "\nwhat each weight dtype costs (against the f32 matrices, mean ± std over seeds):\n" +
           render_text(*t);
  if (p.uptrain) {
    out += "\nuptraining converted MHA checkpoints (" + fmt("%g", p.uptrain->fraction * 100) +
           "% of the steps; val loss, mean ± std over seeds):\n" +
           render_text(uptrain_table(*p.uptrain));
    for (const std::string& f : uptrain_findings(*p.uptrain)) out += "  " + f + "\n";
  }
  out += "\nverdicts (paired on shared windows where measured; val loss, mean ± std over seeds):\n";
  for (const Verdict& v : verdicts(p)) out += "  " + v.text + '\n';
  return out;
}

}  // namespace kvlab
