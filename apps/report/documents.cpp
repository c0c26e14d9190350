// The report folder: results.json and .csv, report.md and report.html assembled from the
// tables, verdicts and plots, each plot as SVG (and PNG through rsvg-convert), each file
// written to a temporary name and renamed into place.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "apps/report/report_parts.h"
#include "platform/atomic_file.h"
#include "platform/error.h"

extern char** environ;

namespace kvlab::report_detail {

namespace fs = std::filesystem;

namespace {

std::string csv_field(const json& v) {
  if (v.is_null()) return "";
  // Whole doubles print as integers ("262144", not "262144.0"); others round-trip exactly.
  if (v.is_number_float() && std::abs(v.get<double>()) < 1e15 &&
      v.get<double>() == std::floor(v.get<double>()))
    return fmt("%.0f", v.get<double>());
  if (!v.is_string()) return v.dump();
  const std::string s = v.get<std::string>();
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string make_csv(const Parsed& p) {
  // Known figures first in a fixed order, derived ones next, then any other scalar keys.
  const std::vector<std::string> known = {"n_kv_head",
                                          "params",
                                          "val_loss_mean",
                                          "val_loss_std",
                                          "bpc",
                                          "val_bpb_mean",
                                          "val_bpb_std",
                                          "val_tokens_per_byte",
                                          "cache_bytes_per_token",
                                          "cache_bytes_per_byte",
                                          "cache_bytes_context_measured",
                                          "cache_bytes_context_formula",
                                          "vs_mha",
                                          "sequences_in_budget",
                                          "decode_tokens_per_s_cache",
                                          "decode_tokens_per_s_nocache",
                                          "ttft_ms",
                                          "tpot_ms"};
  const std::vector<std::string> derived = {"attention", "seeds", "cache_speedup",
                                            "train_tokens_per_s_mean"};
  std::set<std::string> extra;
  for (const Variant& v : p.variants)
    for (const auto& [key, value] : v.j->items())
      if (value.is_primitive() && !value.is_null() &&
          std::find(known.begin(), known.end(), key) == known.end())
        extra.insert(key);
  std::vector<std::string> columns = known;
  columns.insert(columns.end(), derived.begin(), derived.end());
  columns.insert(columns.end(), extra.begin(), extra.end());

  std::string out;
  for (std::size_t c = 0; c < columns.size(); ++c) out += (c ? "," : "") + columns[c];
  out += '\n';
  for (const Variant& v : p.variants) {
    double train_sum = 0;
    int train_n = 0;
    for (const json& run : v.j->value("runs", json::array()))
      if (const auto t = run.is_object() ? number(run, "train_tokens_per_s") : std::nullopt)
        train_sum += *t, ++train_n;
    const auto sp = speedup(v);
    const std::map<std::string, json> derived_values = {
        {"attention", v.kind},
        {"seeds", v.seeds},
        {"cache_speedup", sp ? json(*sp) : json()},
        {"train_tokens_per_s_mean", train_n ? json(train_sum / train_n) : json()}};
    for (std::size_t c = 0; c < columns.size(); ++c) {
      const auto d = derived_values.find(columns[c]);
      const json& value = d != derived_values.end() ? d->second : v.j->value(columns[c], json());
      if (c) out += ',';
      if (value.is_primitive()) out += csv_field(value);
    }
    out += '\n';
  }
  return out;
}

constexpr const char* kMlaNote =
    "Each MLA variant (a latent of the given rank and one rotary key shared by every head, "
    "cached in latent form) against the n_kv_head variant whose cache takes the nearest bytes "
    "per token, both trained the same way with the same seeds. The verdict is judged as every "
    "verdict here: mean ± std intervals that overlap are within the seeds' spread. At equal "
    "bytes every MLA query head scores and sums the whole latent row, where a GQA head reads "
    "its narrower key and value: more arithmetic per token, which its decode speed shows.";

constexpr const char* kQualityNote =
    "Each trained model (every seed) evaluated on the same fixed validation windows with its "
    "keys and values read through a cache of each dtype, exactly as a cached decoder reads "
    "them (kvlab bench kv-quality), against the f32 cache: mean ± std over seeds. Bytes per "
    "token: K and V of every layer, a quantised row's scales included. Frontier: no other "
    "point has as few bytes at a lower loss.";

constexpr const char* kGenerationNote =
    "Every variant's final model of each seed scored on the same validation windows (kvlab "
    "eval's measurements), mean ± std over seeds. Bits per byte: the loss over the bytes of text "
    "the predicted tokens spell, comparable across tokenizers. ICL score: loss over the last "
    "tenth of the context minus loss near a tenth of it (Olsson et al. 2022): negative when "
    "later tokens gain from the context. KL and top-1: against the reference's predictions. "
    "Recall: random tokens repeated once, top-1 accuracy on the second copy. Samples: 8 "
    "continuations at temperature 0.8 (the same prompts and seed for every model), their "
    "distinct bigrams over all bigrams and the share of 3-grams repeated within a sample. A pair is "
    "distinguishable by the paired bootstrap when every seed's 95% interval for the mean "
    "per-token loss difference (resampling windows) excludes 0 on the same side; the seed-spread "
    "verdict is the one below (mean ± std intervals that do not overlap).";

constexpr const char* kServingNote =
    "The workload's 256 requests, all at once, served with the trained model at the same "
    "KV memory by continuous batching over the paged cache and by static batching over "
    "contiguous caches (kvlab bench serve), one run each: its rates move with the host, its "
    "peak sequences do not. Then continuous batching alone at Poisson arrival rates (multiples "
    "of the first variant's all-at-once throughput), two runs each: a rate is sustained when "
    "the requests/s served reach 90% of it and the p99 TTFT stays within 1 s (means of the "
    "runs).";

// What the memory table's figures are, in a sentence for every format.
constexpr const char* kMemoryNote =
    "Serving workload: 256 requests with log-normal prompt and output lengths scaled to the "
    "context, at one KV memory for every n_kv_head (16 full-context multi-head sequences), "
    "through the paged cache's allocator (blocks of at most 16 positions and a sixteenth of "
    "the context) and through contiguous max-length slots. Utilisation: positions stored / "
    "positions the held memory holds, mean over steps.";

std::string uptrain_note(const Uptrain& u) {
  std::string lr = u.j->value("lr_schedule", std::string());
  return "Each seed's multi-head run (n_kv_head " +
         fmt("%.0f", number(*u.j, "source_n_kv_head").value_or(0)) +
         ") converted to fewer KV heads: mean pools each group's key and value heads (the GQA "
         "paper's choice), first keeps the group's first head, random draws new heads. Val loss "
         "on the sweep's fixed validation windows right after the conversion and after " +
         fmt("%.0f", static_cast<double>(u.steps)) + " steps of uptraining (" +
         fmt("%g", u.fraction * 100) + "% of the sweep's steps" + (lr.empty() ? "" : "; " + lr) +
         "), against the sweep's model trained from scratch at that n_kv_head: mean ± std over "
         "seeds. Uptrained steps and tokens count the multi-head run's and the uptraining's.";
}

struct SampleCell {
  std::string greedy, sampled;
  std::optional<double> seed;
};

// Prompts in order of first appearance; for each, every variant's sample (empty if none).
std::vector<std::pair<std::string, std::vector<SampleCell>>> samples_by_prompt(const Parsed& p) {
  std::vector<std::pair<std::string, std::vector<SampleCell>>> out;
  for (std::size_t i = 0; i < p.variants.size(); ++i) {
    for (const json& s : p.variants[i].j->value("samples", json::array())) {
      if (!s.is_object()) continue;
      const std::string prompt = text_field(s, "prompt");
      auto it =
          std::find_if(out.begin(), out.end(), [&](const auto& e) { return e.first == prompt; });
      if (it == out.end()) {
        out.emplace_back(prompt, std::vector<SampleCell>(p.variants.size()));
        it = out.end() - 1;
      }
      it->second[i] = {text_field(s, "greedy"), text_field(s, "sampled"), number(s, "seed")};
    }
  }
  return out;
}

std::string sampled_label(const SampleCell& c) {
  return c.seed ? "sampled (seed " + fmt("%.0f", *c.seed) + ")" : std::string("sampled");
}

std::string duration(double s) {
  std::string out = fmt("%.1f s", s);
  if (s >= 60)
    out += " (" + fmt("%.0f", std::floor(s / 60)) + " min " + fmt("%.0f", std::fmod(s, 60)) + " s)";
  return out;
}

// "key: value" lines describing the run, shared by the Markdown and HTML pages.
std::vector<std::pair<std::string, std::string>> run_facts(const json& r) {
  std::vector<std::pair<std::string, std::string>> facts;
  if (r.contains("started")) facts.emplace_back("started", text_of(r["started"]));
  if (const auto w = number(r, "wall_s")) facts.emplace_back("wall time", duration(*w));
  const json& sweep = r.value("sweep", json::object());
  if (const auto ranks = number(sweep, "ranks")) {
    const auto per_run = number(sweep, "ranks_per_run");
    facts.emplace_back("trained by", fmt("%.0f MPI ranks", *ranks) +
                                         (per_run && *per_run > 1 ? fmt(", %.0f per run", *per_run)
                                                                  : std::string()));
  }
  for (const char* group : {"machine", "versions"}) {
    const json& g = r.value(group, json::object());
    if (!g.is_object() || g.empty()) continue;
    std::string line;
    for (const auto& [k, v] : g.items()) line += (line.empty() ? "" : ", ") + k + " " + text_of(v);
    facts.emplace_back(group, line);
  }
  if (const auto b = number(r, "kv_budget_bytes"))
    facts.emplace_back("KV budget", fmt("%.0f", *b) + " bytes (" + bytes(b, Bytes::human) + ")");
  if (const auto d = number(r, "dtype_bytes"))
    facts.emplace_back("cache element size", fmt("%.0f", *d) + " bytes");
  if (r.contains("param_matched"))
    facts.emplace_back(
        "parameter-matched",
        r["param_matched"] == true
            ? "yes"
            : "no: K/V projections shrink with n_kv_head, and the parameter count with them");
  return facts;
}

std::string title(const Parsed& p) {
  return p.has_mla() ? "MHA vs GQA vs MQA vs MLA" : "MHA vs GQA vs MQA";
}

bool has_config(const json& r) { return r.value("config", json()).is_object(); }

std::string make_markdown(const json& r, const Parsed& p, const std::vector<Verdict>& vs,
                          bool with_png) {
  std::ostringstream md;
  md << "# kvlab ablate: " << title(p) << "\n\n";
  if (r.contains("command")) md << "Command: " << md_escape(text_of(r["command"])) << "\n\n";
  for (const auto& [k, v] : run_facts(r)) md << "- " << k << ": " << md_escape(v) << '\n';
  if (has_config(r)) {
    md << "\n## Configuration\n\n| key | value |\n|---|---|\n";
    for (const auto& [k, v] : r["config"].items())
      md << "| " << md_escape(k) << " | " << md_escape(text_of(v)) << " |\n";
  }
  md << "\n## Results\n\n"
     << render_markdown(record_table(p, Bytes::exact)) << '\n'
     << render_markdown(detail_table(p, Bytes::exact)) << "\nCache bytes are exact bytes.\n";
  if (const auto t = mla_table(p, Bytes::exact)) {
    md << "\n## MLA against GQA at equal cache bytes\n\n"
       << render_markdown(*t) << '\n'
       << kMlaNote << '\n';
    for (const std::string& f : mla_findings(p)) md << "\n- " << md_escape(f);
    md << '\n';
  }
  if (const auto m = memory_table(p, Bytes::exact))
    md << "\n## KV memory under a serving workload\n\n"
       << render_markdown(*m) << '\n'
       << kMemoryNote << '\n';
  if (const auto t = serving_table(p)) {
    md << "\n## Serving it\n\n" << render_markdown(*t) << '\n' << kServingNote << '\n';
    for (const std::string& f : serving_findings(p)) md << "\n- " << md_escape(f);
    md << '\n';
  }
  if (const auto t = quality_table(p)) {
    md << "\n## What each cache dtype costs: the memory-quality frontier\n\n"
       << render_markdown(*t) << '\n'
       << kQualityNote << '\n';
    for (const std::string& f : quality_findings(p)) md << "\n- " << md_escape(f);
    md << '\n';
  }
  if (p.uptrain) {
    md << "\n## Uptraining converted checkpoints (the GQA paper's recipe)\n\n"
       << render_markdown(uptrain_table(*p.uptrain)) << '\n'
       << md_escape(uptrain_note(*p.uptrain)) << '\n';
    for (const std::string& f : uptrain_findings(*p.uptrain)) md << "\n- " << md_escape(f);
    md << '\n';
  }
  if (p.gen) {
    md << "\n## Generation quality: paired on shared windows\n\n"
       << render_markdown(generation_table(p, *p.gen)) << '\n'
       << kGenerationNote << "\n\n"
       << render_markdown(paired_table(p, *p.gen)) << '\n';
    for (const std::string& f : generation_findings(p, *p.gen)) md << "\n- " << md_escape(f);
    md << '\n';
  }
  md << "\n## Verdicts (val loss, mean ± std over seeds)\n\n";
  for (const Verdict& v : vs) md << "- " << md_escape(v.text) << '\n';
  md << "\n## Plots\n\n";
  for (const std::string& name : plot_names(p)) {
    md << "![" << name << name << "](" << name << ".svg)\n\n[" << name << ".svg](" << name
       << ".svg)";
    if (with_png) md << " · [" << name << ".png](" << name << ".png)";
    md << "\n\n";
  }
  md << "## Samples\n";
  for (const auto& [prompt, cells] : samples_by_prompt(p)) {
    md << "\n### Prompt: " << md_escape(prompt) << "\n\n|  |";
    for (const Variant& v : p.variants) md << ' ' << md_escape(v.label()) << " |";
    md << "\n|---|";
    for (std::size_t i = 0; i < p.variants.size(); ++i) md << "---|";
    md << "\n| greedy |";
    for (const SampleCell& c : cells) md << ' ' << md_escape(c.greedy) << " |";
    md << "\n| sampled |";
    for (const SampleCell& c : cells)
      md << ' ' << (c.seed ? "*seed " + fmt("%.0f", *c.seed) + ":* " : "") << md_escape(c.sampled)
         << " |";
    md << '\n';
  }
  md << "\nAlso: results.json (everything), results.csv (one row per variant), report.html.\n";
  return md.str();
}

const char* kCss =
    R"(body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;max-width:1200px;
margin:2em auto;padding:0 1em;color:#222;line-height:1.4}
h1{font-size:1.6em}h2{margin-top:1.6em;border-bottom:1px solid #ddd}
code,pre{font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:.9em}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f6f6;padding:.6em;margin:.2em 0 .8em}
table{border-collapse:collapse;margin:.8em 0}
th,td{border:1px solid #ccc;padding:.3em .7em;text-align:right}
th{background:#f0f0f0}td.key,th.key{text-align:left}
.plots{display:flex;flex-wrap:wrap;gap:1em}.plots svg{max-width:100%;height:auto}
.samples{display:grid;gap:1em}.samples h4{margin:.2em 0}.kind{color:#666;font-size:.85em}
dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dt{font-weight:bold}dd{margin:0}
)";

std::string make_html(const json& r, const Parsed& p, const std::vector<Verdict>& vs,
                      const std::vector<std::string>& svgs) {
  auto e = [](const std::string& s) { return svg::escape_xml(s); };
  std::ostringstream h;
  h << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
    << "<title>kvlab ablate report</title>\n<style>\n"
    << kCss << "</style>\n</head>\n<body>\n"
    << "<h1>kvlab ablate: " << title(p) << "</h1>\n";
  if (r.contains("command")) h << "<p><code>" << e(text_of(r["command"])) << "</code></p>\n";
  h << "<dl>\n";
  for (const auto& [k, v] : run_facts(r)) h << "<dt>" << e(k) << "</dt><dd>" << e(v) << "</dd>\n";
  h << "</dl>\n<h2>Results</h2>\n"
    << render_html(record_table(p, Bytes::exact)) << render_html(detail_table(p, Bytes::exact))
    << "<p>Cache bytes are exact bytes.</p>\n";
  if (const auto t = mla_table(p, Bytes::exact)) {
    h << "<h2>MLA against GQA at equal cache bytes</h2>\n"
      << render_html(*t) << "<p>" << kMlaNote << "</p>\n<ul>\n";
    for (const std::string& f : mla_findings(p)) h << "<li>" << e(f) << "</li>\n";
    h << "</ul>\n";
  }
  if (const auto m = memory_table(p, Bytes::exact))
    h << "<h2>KV memory under a serving workload</h2>\n"
      << render_html(*m) << "<p>" << kMemoryNote << "</p>\n";
  if (const auto t = serving_table(p)) {
    h << "<h2>Serving it</h2>\n" << render_html(*t) << "<p>" << kServingNote << "</p>\n<ul>\n";
    for (const std::string& f : serving_findings(p)) h << "<li>" << e(f) << "</li>\n";
    h << "</ul>\n";
  }
  if (const auto t = quality_table(p)) {
    h << "<h2>What each cache dtype costs: the memory-quality frontier</h2>\n"
      << render_html(*t) << "<p>" << kQualityNote << "</p>\n<ul>\n";
    for (const std::string& f : quality_findings(p)) h << "<li>" << e(f) << "</li>\n";
    h << "</ul>\n";
  }
  if (p.uptrain) {
    h << "<h2>Uptraining converted checkpoints (the GQA paper's recipe)</h2>\n"
      << render_html(uptrain_table(*p.uptrain)) << "<p>" << e(uptrain_note(*p.uptrain))
      << "</p>\n<ul>\n";
    for (const std::string& f : uptrain_findings(*p.uptrain)) h << "<li>" << e(f) << "</li>\n";
    h << "</ul>\n";
  }
  if (p.gen) {
    h << "<h2>Generation quality: paired on shared windows</h2>\n"
      << render_html(generation_table(p, *p.gen)) << "<p>" << kGenerationNote << "</p>\n"
      << render_html(paired_table(p, *p.gen)) << "<ul>\n";
    for (const std::string& f : generation_findings(p, *p.gen)) h << "<li>" << e(f) << "</li>\n";
    h << "</ul>\n";
  }
  h << "<h2>Verdicts</h2>\n<p>Val loss, mean ± std over seeds.</p>\n<ul>\n";
  for (const Verdict& v : vs) h << "<li>" << e(v.text) << "</li>\n";
  h << "</ul>\n<h2>Plots</h2>\n<div class=\"plots\">\n";
  for (const std::string& s : svgs) h << "<figure>\n" << s << "</figure>\n";
  h << "</div>\n<h2>Samples</h2>\n";
  for (const auto& [prompt, cells] : samples_by_prompt(p)) {
    h << "<h3>Prompt: <code>" << e(prompt) << "</code></h3>\n<div class=\"samples\" "
      << "style=\"grid-template-columns:repeat(" << cells.size() << ",minmax(0,1fr))\">\n";
    for (std::size_t i = 0; i < cells.size(); ++i)
      h << "<div><h4>" << e(p.variants[i].label()) << "</h4>\n<div class=\"kind\">greedy</div>"
        << "<pre>" << e(cells[i].greedy) << "</pre>\n<div class=\"kind\">"
        << e(sampled_label(cells[i])) << "</div><pre>" << e(cells[i].sampled) << "</pre></div>\n";
    h << "</div>\n";
  }
  if (has_config(r)) {
    h << "<h2>Configuration</h2>\n<table>\n";
    for (const auto& [k, v] : r["config"].items())
      h << "<tr><td class=\"key\">" << e(k) << "</td><td class=\"key\">" << e(text_of(v))
        << "</td></tr>\n";
    h << "</table>\n";
  }
  h << "</body>\n</html>\n";
  return h.str();
}

std::optional<fs::path> find_on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (dir.empty()) continue;
    const fs::path candidate = fs::path(dir) / program;
    std::error_code ec;
    if (fs::is_regular_file(candidate, ec) && ::access(candidate.c_str(), X_OK) == 0)
      return candidate;
  }
  return std::nullopt;
}

// Runs rsvg-convert directly (no shell, so paths need no quoting).
void svg_to_png(const fs::path& rsvg, const fs::path& svg_file, const fs::path& png_file) {
  std::vector<std::string> args = {rsvg.string(),    "-f", "png", "-o", png_file.string(),
                                   svg_file.string()};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawn(&pid, rsvg.c_str(), nullptr, nullptr, argv.data(), environ);
  KVLAB_CHECK(rc == 0, "report: cannot run ", rsvg.string(), " for ", svg_file.string());
  int status = 0;
  ::waitpid(pid, &status, 0);
  KVLAB_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "report: ", rsvg.string(),
              " failed converting ", svg_file.string(), " (status ", status,
              "); every other report file is written");
}

}  // namespace

}  // namespace kvlab::report_detail

namespace kvlab {

using namespace report_detail;

void write_report(const nlohmann::json& results, const std::filesystem::path& out_dir) {
  const Parsed p = parse(results);  // a bad document writes nothing
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  KVLAB_CHECK(!ec && fs::is_directory(out_dir), "report: cannot create output folder ",
              out_dir.string(), ec ? ": " + ec.message() : std::string(": not a directory"));
  const std::vector<Verdict> vs = verdicts(p);
  const std::optional<fs::path> rsvg = find_on_path("rsvg-convert");

  // Generated text may hold invalid UTF-8 (byte-level sampling): replace it, don't throw.
  write_file_atomic(out_dir / "results.json",
                    results.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
  write_file_atomic(out_dir / "results.csv", make_csv(p));
  const std::vector<std::string> names = plot_names(p);
  std::vector<std::string> svgs = {svg::render(curves_plot(p)), svg::render(loss_vs_kv_plot(p)),
                                   svg::render(cache_plot(p, results)), svg::render(speed_plot(p))};
  if (!sweep_of(p.variants.front()).empty()) {
    svgs.push_back(svg::render(serving_plot(p, false)));
    svgs.push_back(svg::render(serving_plot(p, true)));
  }
  if (!quality_points(p).empty()) {
    svgs.push_back(svg::render(quality_plot(p, false)));
    svgs.push_back(svg::render(quality_plot(p, true)));
  }
  if (p.uptrain)
    for (const int kv : uptrain_kvs(*p.uptrain))
      svgs.push_back(svg::render(uptrain_plot(*p.uptrain, kv)));
  if (p.gen) {
    svgs.push_back(svg::render(position_plot(p, *p.gen)));
    svgs.push_back(svg::render(recall_plot(p, *p.gen)));
  }
  for (std::size_t i = 0; i < svgs.size(); ++i)
    write_file_atomic(out_dir / (names[i] + ".svg"), svgs[i]);
  write_file_atomic(out_dir / "report.md", make_markdown(results, p, vs, rsvg.has_value()));
  write_file_atomic(out_dir / "report.html", make_html(results, p, vs, svgs));
  if (rsvg)
    for (const std::string& name : names)
      svg_to_png(*rsvg, out_dir / (name + ".svg"), out_dir / (name + ".png"));
}

}  // namespace kvlab
