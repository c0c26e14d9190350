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

#include "platform/atomic_file.h"
#include "platform/error.h"
#include "report/report_parts.h"

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
    "verdict here: by the paired bootstrap where the pair was scored on shared windows, beside "
    "the seeds' spread (mean ± std intervals that overlap are within it). At equal "
    "bytes every MLA query head scores and sums the whole latent row, where a GQA head reads "
    "its narrower key and value: more arithmetic per token, which its decode speed shows.";

constexpr const char* kQualityNote =
    "Each trained model (every seed) evaluated on the same fixed validation windows with its "
    "keys and values read through a cache of each dtype, exactly as a cached decoder reads "
    "them (kvlab bench kv-quality), against the f32 cache: mean ± std over seeds. Bytes per "
    "token: K and V of every layer, a quantised row's scales included. Frontier: no other "
    "point has as few bytes at a lower loss.";

constexpr const char* kWeightNote =
    "Each trained model (every seed) evaluated on the same validation windows as the cache "
    "dtypes, its matrices (attention, MLP and LM head) rounded as --weight-dtype rounds them "
    "(kvlab bench weight-quality; q8_0 and q4_0 are ggml's blocks of 32, with q4_0 the LM head "
    "q8_0, and a matrix whose rows are not whole blocks bf16), against its f32 matrices, "
    "both through an f32 cache: mean ± std over seeds. Decode weight bytes: what a fused CPU "
    "decode step reads of the weights, each matrix in the fewest bytes that hold its values.";

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
    "per-token loss difference (resampling windows) excludes 0 on the same side; the findings "
    "and verdicts use it, with the seed-spread verdict (mean ± std intervals that do not "
    "overlap) beside it.";

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
    facts.emplace_back("KV budget", fmt("%.0f", *b) + " bytes (" + bytes(b) + ")");
  if (const auto d = number(r, "dtype_bytes"))
    facts.emplace_back("cache element size", fmt("%.0f", *d) + " bytes");
  if (r.contains("weight_dtype") && r["weight_dtype"].is_string())
    facts.emplace_back("matrices served and benchmarked",
                       r["weight_dtype"].get<std::string>() + " (--weight-dtype)" +
                           (r.value("int8_products", false) ? ", in integer products (--int8-products)"
                                                            : ""));
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

// The report's body as one outline that the Markdown and HTML pages both render, so the two
// keep one order: sections of tables, each followed by the figures that illustrate it, notes
// and finding lists. Tables and figures are numbered in that order.
struct Item {
  enum Kind { paragraph, table, figure, bullets, subheading } kind;
  std::string text;  // a paragraph, a table's caption, a subheading; a figure's name
  Table t;
  std::vector<std::string> list;
  std::string id;  // a subheading's anchor
};

struct Section {
  std::string id, heading;
  std::vector<Item> items;
  void para(std::string s) { items.push_back({Item::paragraph, std::move(s), {}, {}, {}}); }
  void table(Table t, std::string caption) {
    items.push_back({Item::table, std::move(caption), std::move(t), {}, {}});
  }
  void figure(const std::vector<Figure>& figs, const std::string& name) {
    for (const Figure& f : figs)
      if (f.name == name) items.push_back({Item::figure, name, {}, {}, {}});
  }
  void bullets(std::vector<std::string> l) {
    if (!l.empty()) items.push_back({Item::bullets, {}, {}, std::move(l), {}});
  }
  void subheading(std::string s, std::string id) {
    items.push_back({Item::subheading, std::move(s), {}, {}, std::move(id)});
  }
};

std::vector<Section> outline(const Parsed& p, const std::vector<Verdict>& vs,
                             const std::vector<Figure>& figs) {
  std::vector<Section> out;
  // The frontier first: every variant at every cache dtype by its bytes per token, the answer
  // to what a cache of a given size costs.
  if (auto t = quality_table(p)) {
    Section s{"quality", "What each cache dtype costs: the memory-quality frontier", {}};
    s.table(std::move(*t), "Every variant read through every cache dtype, against its f32 cache.");
    s.para(kQualityNote);
    s.figure(figs, "val_loss_vs_cache_bytes");
    s.figure(figs, "kl_vs_cache_bytes");
    s.bullets(quality_findings(p));
    out.push_back(std::move(s));
  }
  {
    Section s{"results", "Loss, cache and speed", {}};
    s.table(record_table(p),
            "Each variant's KV cache at full context (measured and by the formula), decode "
            "speed with the cache, and final validation loss (mean ± std over seeds).");
    for (const char* f : {"val_loss_curves", "val_loss_curves_vs_mha", "val_loss_vs_kv",
                          "cache_bytes_vs_kv"})
      s.figure(figs, f);
    s.subheading("Verdicts (paired on shared windows where measured; val loss, mean ± std)",
                 "verdicts");
    std::vector<std::string> lines;
    for (const Verdict& v : vs) lines.push_back(v.text);
    s.bullets(std::move(lines));
    s.table(detail_table(p),
            "Parameters, bits per token and byte, cache bytes per token and per byte of text, "
            "full-context sequences in the KV budget, and decode latency.");
    s.figure(figs, "tokens_per_s_vs_kv");
    out.push_back(std::move(s));
  }
  if (auto t = mla_table(p)) {
    Section s{"mla", "MLA against GQA at equal cache bytes", {}};
    s.table(std::move(*t), "Each MLA rank beside the n_kv_head variant nearest in bytes.");
    s.para(kMlaNote);
    s.bullets(mla_findings(p));
    out.push_back(std::move(s));
  }
  if (auto t = memory_table(p)) {
    Section s{"memory", "KV memory under a serving workload", {}};
    s.table(std::move(*t), "Sequences held at one KV memory, paged against contiguous caches.");
    s.para(kMemoryNote);
    out.push_back(std::move(s));
  }
  if (auto t = serving_table(p)) {
    Section s{"serving", "Serving it", {}};
    s.table(std::move(*t), "Serving the workload: continuous against static batching.");
    s.para(kServingNote);
    s.figure(figs, "served_vs_rate");
    s.figure(figs, "ttft_p99_vs_rate");
    s.bullets(serving_findings(p));
    out.push_back(std::move(s));
  }
  if (auto t = weight_table(p)) {
    Section s{"weights", "What each weight dtype costs", {}};
    s.table(std::move(*t), "Every variant with its matrices of every type, against its f32 ones.");
    s.para(kWeightNote);
    out.push_back(std::move(s));
  }
  if (p.uptrain) {
    Section s{"uptrain", "Uptraining converted checkpoints (the GQA paper's recipe)", {}};
    s.table(uptrain_table(*p.uptrain), "Converted and uptrained against trained from scratch.");
    s.para(uptrain_note(*p.uptrain));
    for (const int kv : uptrain_kvs(*p.uptrain)) s.figure(figs, "uptrain_kv" + std::to_string(kv));
    s.bullets(uptrain_findings(*p.uptrain));
    out.push_back(std::move(s));
  }
  if (p.gen) {
    Section s{"generation", "Generation quality: paired on shared windows", {}};
    s.table(generation_table(p, *p.gen), "Every variant scored on the same windows.");
    s.para(kGenerationNote);
    s.figure(figs, "loss_by_position");
    s.figure(figs, "recall_by_distance");
    s.table(paired_table(p, *p.gen), "Each pair's paired loss difference and both verdicts.");
    s.bullets(generation_findings(p, *p.gen));
    out.push_back(std::move(s));
  }
  return out;
}

// "Table 2", "Figure 3", "the verdicts" by the id a finding links to.
std::map<std::string, std::string> labels(const std::vector<Section>& sections) {
  std::map<std::string, std::string> out;
  int tables = 0, figures = 0;
  for (const Section& s : sections)
    for (const Item& it : s.items) {
      if (it.kind == Item::table) out[it.t.id] = "Table " + std::to_string(++tables);
      if (it.kind == Item::figure) out["fig-" + it.text] = "Figure " + std::to_string(++figures);
      if (it.kind == Item::subheading) out[it.id] = "verdicts";
    }
  return out;
}

const Figure& figure_named(const std::vector<Figure>& figs, const std::string& name) {
  return *std::find_if(figs.begin(), figs.end(), [&](const Figure& f) { return f.name == name; });
}

// Plot titles carry no markup: the first <text> of the SVG is its title.
std::string plot_title(const Figure& f) {
  const auto open = f.svg.find('>', f.svg.find("<text"));
  const auto close = f.svg.find("</text>", open);
  return open == std::string::npos || close == std::string::npos ? f.name
                                                                  : f.svg.substr(open + 1, close - open - 1);
}

std::string make_markdown(const json& r, const Parsed& p, const std::vector<Verdict>& vs,
                          const std::vector<Figure>& figs, bool with_png) {
  const std::vector<Section> sections = outline(p, vs, figs);
  const std::map<std::string, std::string> label = labels(sections);
  std::ostringstream md;
  md << "# kvlab ablate: " << title(p) << "\n\n";
  if (r.contains("command")) md << "Command: " << md_escape(text_of(r["command"])) << "\n\n";
  md << "<a id=\"findings\"></a>\n\n## Findings\n\n";
  for (const Finding& f : findings(p)) {
    md << "- " << md_escape(f.text) << " (";
    for (std::size_t i = 0; i < f.links.size(); ++i)
      md << (i ? ", " : "") << "[" << label.at(f.links[i]) << "](#" << f.links[i] << ")";
    md << ")\n";
  }
  md << "\n## The run\n\n";
  for (const auto& [k, v] : run_facts(r)) md << "- " << k << ": " << md_escape(v) << '\n';
  for (const Section& s : sections) {
    md << "\n<a id=\"" << s.id << "\"></a>\n\n## " << md_escape(s.heading) << "\n";
    for (const Item& it : s.items) {
      switch (it.kind) {
        case Item::paragraph: md << '\n' << md_escape(it.text) << '\n'; break;
        case Item::subheading:
          md << "\n<a id=\"" << it.id << "\"></a>\n\n### " << md_escape(it.text) << '\n';
          break;
        case Item::bullets:
          md << '\n';
          for (const std::string& b : it.list) md << "- " << md_escape(b) << '\n';
          break;
        case Item::table:
          md << "\n<a id=\"" << it.t.id << "\"></a>\n\n**" << label.at(it.t.id) << ".** "
             << md_escape(it.text) << "\n\n"
             << render_markdown(it.t);
          break;
        case Item::figure: {
          const Figure& f = figure_named(figs, it.text);
          md << "\n<a id=\"fig-" << f.name << "\"></a>\n\n![" << md_escape(plot_title(f)) << "]("
             << f.name << ".svg)\n\n*" << label.at("fig-" + f.name) << ".* " << md_escape(f.caption)
             << " ([" << f.name << ".svg](" << f.name << ".svg)";
          if (with_png) md << " · [" << f.name << ".png](" << f.name << ".png)";
          md << ")\n";
          break;
        }
      }
    }
  }
  md << "\n## Samples\n";
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
  if (has_config(r)) {
    md << "\n## Configuration\n\n| key | value |\n|---|---|\n";
    for (const auto& [k, v] : r["config"].items())
      md << "| " << md_escape(k) << " | " << md_escape(text_of(v)) << " |\n";
  }
  md << "\nAlso: results.json (everything, exact values), results.csv (one row per variant), "
        "report.html.\n";
  return md.str();
}

const char* kCss =
    R"(body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;max-width:1200px;
margin:1.2em auto;padding:0 1em;color:#222;line-height:1.4}
h1{font-size:1.6em;margin:.2em 0 .3em}h2{margin-top:1.6em;border-bottom:1px solid #ddd}
code,pre{font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:.9em}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f6f6;padding:.6em;margin:.2em 0 .8em}
.findings{background:#f4f8fc;border:1px solid #c9dcef;padding:.2em 1.2em .4em;margin:.6em 0}
.findings h2{margin-top:.4em;border:0}.findings li{margin:.35em 0}
.table-wrap{overflow-x:auto;margin:.8em 0}.tcap{margin:.8em 0 .2em}
table{border-collapse:collapse;font-variant-numeric:tabular-nums;font-size:.9em}
th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right}td{white-space:nowrap}
th{background:#f0f0f0}td.key,th.key{text-align:left;white-space:normal}
.plots{display:flex;flex-wrap:wrap;gap:1em}figure{margin:.5em 0;max-width:760px}
.plots figure{flex:1 1 520px;max-width:590px}
figure svg{max-width:100%;height:auto}figcaption{font-size:.92em;color:#333}
.samples{display:grid;gap:1em}.samples h4{margin:.2em 0}.kind{color:#666;font-size:.85em}
dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dt{font-weight:bold}dd{margin:0}
@media print{body{max-width:none;margin:0;padding:0;font-size:10pt}
.table-wrap{overflow:visible}table,figure,.findings,pre,.tcap{break-inside:avoid;page-break-inside:avoid}
h2,h3,.tcap{break-after:avoid;page-break-after:avoid}.plots{display:block}
a{color:inherit;text-decoration:none}.samples{display:block}}
)";

std::string make_html(const json& r, const Parsed& p, const std::vector<Verdict>& vs,
                      const std::vector<Figure>& figs) {
  auto e = [](const std::string& s) { return svg::escape_xml(s); };
  const std::vector<Section> sections = outline(p, vs, figs);
  const std::map<std::string, std::string> label = labels(sections);
  std::ostringstream h;
  h << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
    << "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
    << "<title>kvlab ablate report</title>\n<style>\n"
    << kCss << "</style>\n</head>\n<body>\n"
    << "<h1>kvlab ablate: " << title(p) << "</h1>\n";
  if (r.contains("command")) h << "<p><code>" << e(text_of(r["command"])) << "</code></p>\n";
  h << "<section id=\"findings\" class=\"findings\">\n<h2>Findings</h2>\n<ul>\n";
  for (const Finding& f : findings(p)) {
    h << "<li>" << e(f.text) << " (";
    for (std::size_t i = 0; i < f.links.size(); ++i)
      h << (i ? ", " : "") << "<a href=\"#" << f.links[i] << "\">" << label.at(f.links[i])
        << "</a>";
    h << ")</li>\n";
  }
  h << "</ul>\n</section>\n<h2>The run</h2>\n<dl>\n";
  for (const auto& [k, v] : run_facts(r)) h << "<dt>" << e(k) << "</dt><dd>" << e(v) << "</dd>\n";
  h << "</dl>\n";
  for (const Section& s : sections) {
    h << "<section id=\"" << s.id << "\">\n<h2>" << e(s.heading) << "</h2>\n";
    bool in_plots = false;  // adjacent figures share one row
    for (const Item& it : s.items) {
      if (in_plots && it.kind != Item::figure) h << "</div>\n", in_plots = false;
      switch (it.kind) {
        case Item::paragraph: h << "<p>" << e(it.text) << "</p>\n"; break;
        case Item::subheading: h << "<h3 id=\"" << it.id << "\">" << e(it.text) << "</h3>\n"; break;
        case Item::bullets:
          h << "<ul>\n";
          for (const std::string& b : it.list) h << "<li>" << e(b) << "</li>\n";
          h << "</ul>\n";
          break;
        case Item::table:
          h << "<div class=\"table-wrap\">\n<p class=\"tcap\"><b>" << label.at(it.t.id) << ".</b> "
            << e(it.text) << "</p>\n"
            << render_html(it.t) << "</div>\n";
          break;
        case Item::figure: {
          if (!in_plots) h << "<div class=\"plots\">\n", in_plots = true;
          const Figure& f = figure_named(figs, it.text);
          h << "<figure id=\"fig-" << f.name << "\">\n"
            << f.svg << "<figcaption><b>" << label.at("fig-" + f.name) << ".</b> " << e(f.caption)
            << "</figcaption>\n</figure>\n";
          break;
        }
      }
    }
    if (in_plots) h << "</div>\n";
    h << "</section>\n";
  }
  h << "<section id=\"samples\">\n<h2>Samples</h2>\n";
  for (const auto& [prompt, cells] : samples_by_prompt(p)) {
    h << "<h3>Prompt: <code>" << e(prompt) << "</code></h3>\n<div class=\"samples\" "
      << "style=\"grid-template-columns:repeat(" << cells.size() << ",minmax(0,1fr))\">\n";
    for (std::size_t i = 0; i < cells.size(); ++i)
      h << "<div><h4>" << e(p.variants[i].label()) << "</h4>\n<div class=\"kind\">greedy</div>"
        << "<pre>" << e(cells[i].greedy) << "</pre>\n<div class=\"kind\">"
        << e(sampled_label(cells[i])) << "</div><pre>" << e(cells[i].sampled) << "</pre></div>\n";
    h << "</div>\n";
  }
  h << "</section>\n";
  if (has_config(r)) {
    h << "<section id=\"configuration\">\n<h2>Configuration</h2>\n<table>\n";
    for (const auto& [k, v] : r["config"].items())
      h << "<tr><td class=\"key\">" << e(k) << "</td><td class=\"key\">" << e(text_of(v))
        << "</td></tr>\n";
    h << "</table>\n</section>\n";
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
  const std::vector<Figure> figs = figures(p, results);
  for (const Figure& f : figs) write_file_atomic(out_dir / (f.name + ".svg"), f.svg);
  write_file_atomic(out_dir / "report.md", make_markdown(results, p, vs, figs, rsvg.has_value()));
  write_file_atomic(out_dir / "report.html", make_html(results, p, vs, figs));
  if (rsvg)
    for (const Figure& f : figs)
      svg_to_png(*rsvg, out_dir / (f.name + ".svg"), out_dir / (f.name + ".png"));
}

}  // namespace kvlab
