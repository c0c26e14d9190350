#include "apps/report/report.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "apps/report/svg_plot.h"
#include "platform/error.h"

extern char** environ;

namespace kvlab {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

std::optional<double> number(const json& obj, const char* key) {
  const auto it = obj.find(key);
  if (it == obj.end() || !it->is_number()) return std::nullopt;
  return it->get<double>();
}

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

struct Parsed {
  std::vector<Variant> variants;  // n_kv_head descending, then MLA's ranks descending
  int n_head = 0;                 // config.n_head, else the largest n_kv_head
  std::optional<Uptrain> uptrain;  // kvlab ablate --uptrain
  bool has_mla() const { return variants.back().mla(); }
  // The tables' first column header.
  std::string id_header() const { return has_mla() ? "n_kv_head / MLA rank" : "n_kv_head"; }
};

// The uptrain section, entries without the figures the tables need left out.
std::optional<Uptrain> parse_uptrain(const json& results) {
  const auto it = results.find("uptrain");
  if (it == results.end() || !it->is_object()) return std::nullopt;
  Uptrain u;
  u.j = &*it;
  u.fraction = number(*it, "fraction").value_or(0);
  u.steps = static_cast<int64_t>(number(*it, "steps").value_or(0));
  const auto entries = it->find("entries");  // by reference: the entries keep pointers into it
  if (entries == it->end() || !entries->is_array()) return std::nullopt;
  for (const json& e : *entries) {
    if (!e.is_object()) continue;
    const auto kv = number(e, "n_kv_head"), conv = number(e, "val_loss_converted_mean"),
               up = number(e, "val_loss_uptrained_mean");
    const auto method = e.find("method");
    if (!kv || !conv || !up || method == e.end() || !method->is_string()) continue;
    UptrainEntry x;
    x.n_kv = static_cast<int>(*kv);
    x.method = method->get<std::string>();
    const auto runs = e.find("runs");
    x.seeds = runs != e.end() && runs->is_array() ? static_cast<int>(runs->size()) : 0;
    x.conv = *conv;
    x.conv_sd = number(e, "val_loss_converted_std").value_or(0);
    x.up = *up;
    x.up_sd = number(e, "val_loss_uptrained_std").value_or(0);
    x.scratch = number(e, "val_loss_scratch_mean");
    x.scratch_sd = number(e, "val_loss_scratch_std");
    x.j = &e;
    u.entries.push_back(std::move(x));
  }
  if (u.entries.empty()) return std::nullopt;
  return u;
}

Parsed parse(const json& results) {
  KVLAB_CHECK(results.is_object(), "report: results must be a JSON object, got ",
              results.type_name());
  const auto it = results.find("variants");
  KVLAB_CHECK(it != results.end() && it->is_array() && !it->empty(),
              "report: results have no non-empty 'variants' array");
  Parsed p;
  for (std::size_t i = 0; i < it->size(); ++i) {
    const json& v = (*it)[i];
    KVLAB_CHECK(v.is_object(), "report: variants[", i, "] is not an object");
    const auto whole = [](std::optional<double> x) {
      return x && *x >= 1 && *x <= 1 << 20 && *x == std::floor(*x);
    };
    const auto n_kv = number(v, "n_kv_head"), rank = number(v, "kv_lora_rank");
    KVLAB_CHECK(whole(n_kv) || whole(rank), "report: variants[", i,
                "] has no positive integer 'n_kv_head' (or MLA's 'kv_lora_rank')");
    Variant var;
    var.n_kv = whole(n_kv) ? static_cast<int>(*n_kv) : 0;
    var.rank = var.n_kv == 0 ? static_cast<int>(*rank) : 0;
    const auto mean = number(v, "val_loss_mean");
    KVLAB_CHECK(mean.has_value(), "report: variant ", var.label(),
                " has no number 'val_loss_mean'");
    const auto runs = v.find("runs");
    var.seeds = runs != v.end() && runs->is_array() ? static_cast<int>(runs->size()) : 0;
    var.mean = *mean;
    var.std = number(v, "val_loss_std").value_or(0.0);
    var.j = &v;
    for (const Variant& other : p.variants)
      KVLAB_CHECK(other.n_kv != var.n_kv || other.rank != var.rank, "report: two variants ",
                  var.label());
    p.variants.push_back(var);
  }
  std::sort(p.variants.begin(), p.variants.end(), [](const Variant& x, const Variant& y) {
    return x.mla() != y.mla() ? y.mla() : x.n_kv != y.n_kv ? x.n_kv > y.n_kv : x.rank > y.rank;
  });
  const json& config = results.value("config", json::object());
  const auto n_head = config.is_object() ? number(config, "n_head") : std::nullopt;
  p.n_head = n_head ? static_cast<int>(*n_head) : p.variants.front().n_kv;
  for (Variant& v : p.variants)
    v.kind = v.mla() ? "MLA" : v.n_kv == p.n_head ? "MHA" : v.n_kv == 1 ? "MQA" : "GQA";
  p.uptrain = parse_uptrain(results);
  return p;
}

std::string loss_pm(const Variant& v) { return fmt("%.4f", v.mean) + " ± " + fmt("%.4f", v.std); }

Verdict compare(const Variant& a, const Variant& b) {
  Verdict out{a.label(), b.label(), a.label() + " vs " + b.label() + ": ", false};
  const double diff = std::abs(a.mean - b.mean);
  if (std::min(a.seeds, b.seeds) < 2) {
    out.text += "no spread measured (1 seed): difference " + fmt("%.4f", diff) +
                " is not a ranking; " + fmt("%.4f", a.mean) + " vs " + fmt("%.4f", b.mean);
    return out;
  }
  const std::string figures = "; " + loss_pm(a) + " vs " + loss_pm(b);
  if (diff <= a.std + b.std) {
    out.text += "not distinguishable at this budget" + figures;
    return out;
  }
  out.distinguishable = true;
  const Variant& lower = a.mean < b.mean ? a : b;
  // Pooled over the two variants: with equal stds this is simply "how many stds apart".
  const double pooled = std::sqrt((a.std * a.std + b.std * b.std) / 2);
  out.text += lower.label() + " has the lower val loss, by " + fmt("%.4f", diff);
  if (pooled > 0) out.text += ", " + fmt("%.1f", diff / pooled) + " pooled std apart";
  out.text += figures;
  return out;
}

// The GQA variant (MHA to MQA) whose cache bytes per token are nearest MLA variant m's (the
// fewer bytes on a tie), or null without those figures.
const Variant* nearest_in_bytes(const Parsed& p, const Variant& m) {
  const auto mine = m.get("cache_bytes_per_token");
  const Variant* best = nullptr;
  double best_gap = 0, best_bytes = 0;
  for (const Variant& v : p.variants) {
    const auto b = v.get("cache_bytes_per_token");
    if (v.mla() || !mine || !b) continue;
    const double gap = std::abs(*b - *mine);
    if (!best || gap < best_gap || (gap == best_gap && *b < best_bytes))
      best = &v, best_gap = gap, best_bytes = *b;
  }
  return best;
}

// Among the GQA variants (n_kv_head descending): adjacent pairs, then each remaining one
// against MHA. Each MLA variant against the GQA variant nearest in cache bytes, and against
// MHA where that is another.
std::vector<Verdict> verdicts(const Parsed& p) {
  std::vector<const Variant*> vs;
  for (const Variant& v : p.variants)
    if (!v.mla()) vs.push_back(&v);
  std::vector<Verdict> out;
  for (std::size_t i = 0; i + 1 < vs.size(); ++i) out.push_back(compare(*vs[i], *vs[i + 1]));
  const auto mha =
      std::find_if(vs.begin(), vs.end(), [](const Variant* v) { return v->kind == "MHA"; });
  if (mha != vs.end()) {
    const std::size_t m = mha - vs.begin();
    for (std::size_t j = 0; j < vs.size(); ++j)
      if (j + 1 < m || j > m + 1)  // adjacent pairs are already compared
        out.push_back(compare(*vs[std::min(j, m)], *vs[std::max(j, m)]));
  }
  for (const Variant& v : p.variants) {
    if (!v.mla()) continue;
    const Variant* near = nearest_in_bytes(p, v);
    if (near) out.push_back(compare(v, *near));
    if (mha != vs.end() && *mha != near) out.push_back(compare(v, **mha));
  }
  return out;
}

// --- tables ------------------------------------------------------------------------------

enum class Bytes { human, exact };

std::string bytes(std::optional<double> b, Bytes style) {
  if (!b) return "-";
  if (style == Bytes::exact) return fmt("%.0f", *b);
  const double v = *b;
  if (v < 1024) return fmt("%.0f B", v);
  if (v < 1024.0 * 1024) return fmt("%.1f KiB", v / 1024);
  if (v < 1024.0 * 1024 * 1024) return fmt("%.1f MiB", v / (1024.0 * 1024));
  return fmt("%.2f GiB", v / (1024.0 * 1024 * 1024));
}

std::string figure(std::optional<double> v, const char* format) {
  return v ? fmt(format, *v) : "-";
}

std::string rate(std::optional<double> v) {
  return !v ? "-" : *v < 100 ? fmt("%.1f", *v) : fmt("%.0f", *v);
}

std::optional<double> speedup(const Variant& v) {
  const auto with = v.get("decode_tokens_per_s_cache");
  const auto without = v.get("decode_tokens_per_s_nocache");
  if (!with || !without || *without <= 0) return std::nullopt;
  return *with / *without;
}

struct Table {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
};

Table record_table(const Parsed& p, Bytes style) {
  Table t{{p.id_header(), "cache bytes (measured)", "formula", "vs MHA", "tokens/s", "val loss"},
          {}};
  for (const Variant& v : p.variants)
    t.rows.push_back({v.id(), bytes(v.get("cache_bytes_context_measured"), style),
                      bytes(v.get("cache_bytes_context_formula"), style),
                      figure(v.get("vs_mha"), "%.3fx"), rate(v.get("decode_tokens_per_s_cache")),
                      v.seeds >= 2 ? loss_pm(v) : fmt("%.4f", v.mean) + " (1 seed)"});
  return t;
}

Table detail_table(const Parsed& p, Bytes style) {
  Table t{{p.id_header(), "params", "bpc", "cache bytes/token", "sequences in budget",
           "tokens/s (no cache)", "cache speed-up", "TTFT ms", "TPOT ms"},
          {}};
  for (const Variant& v : p.variants)
    t.rows.push_back({v.id(), figure(v.get("params"), "%.0f"),
                      figure(v.get("bpc"), "%.4f"), bytes(v.get("cache_bytes_per_token"), style),
                      figure(v.get("sequences_in_budget"), "%.0f"),
                      rate(v.get("decode_tokens_per_s_nocache")), figure(speedup(v), "%.2fx"),
                      figure(v.get("ttft_ms"), "%.3f"), figure(v.get("tpot_ms"), "%.3f")});
  return t;
}

// Under the serving workload at one KV memory for every variant (results without it, from
// before it was measured, leave the table out).
std::optional<Table> memory_table(const Parsed& p, Bytes style) {
  if (!p.variants.front().get("kv_workload_peak_sequences_paged")) return std::nullopt;
  Table t{{p.id_header(), "KV memory", "peak sequences paged", "contiguous", "paged / contiguous",
           "utilisation paged", "contiguous", "steps paged", "contiguous"},
          {}};
  for (const Variant& v : p.variants) {
    const auto paged = v.get("kv_workload_peak_sequences_paged");
    const auto contiguous = v.get("kv_workload_peak_sequences_contiguous");
    t.rows.push_back(
        {v.id(), bytes(v.get("kv_workload_budget_bytes"), style),
         figure(paged, "%.0f"), figure(contiguous, "%.0f"),
         figure(paged && contiguous && *contiguous > 0
                    ? std::optional<double>(*paged / *contiguous)
                    : std::nullopt,
                "%.2fx"),
         figure(v.get("kv_workload_utilisation_paged"), "%.3f"),
         figure(v.get("kv_workload_utilisation_contiguous"), "%.3f"),
         figure(v.get("kv_workload_steps_paged"), "%.0f"),
         figure(v.get("kv_workload_steps_contiguous"), "%.0f")});
  }
  return t;
}

// Serving the workload with the trained model at that memory (results measured on a GPU, or
// before it was measured, leave the table out).
std::optional<Table> serving_table(const Parsed& p) {
  if (!p.variants.front().get("serve_requests_per_s_continuous")) return std::nullopt;
  Table t{{p.id_header(), "requests/s continuous", "static", "continuous / static",
           "peak sequences continuous", "static", "p99 TTFT ms continuous", "static",
           "sustained requests/s"},
          {}};
  for (const Variant& v : p.variants) {
    const auto c = v.get("serve_requests_per_s_continuous");
    const auto s = v.get("serve_requests_per_s_static");
    t.rows.push_back(
        {v.id(), figure(c, "%.1f"), figure(s, "%.1f"),
         figure(c && s && *s > 0 ? std::optional<double>(*c / *s) : std::nullopt, "%.2fx"),
         figure(v.get("serve_peak_sequences_continuous"), "%.0f"),
         figure(v.get("serve_peak_sequences_static"), "%.0f"),
         figure(v.get("serve_ttft_p99_ms_continuous"), "%.0f"),
         figure(v.get("serve_ttft_p99_ms_static"), "%.0f"),
         figure(v.get("serve_sustained_rate"), "%.2f")});
  }
  return t;
}

// Each MLA variant beside the n_kv_head variant nearest in cache bytes per token (results
// without MLA leave it out).
std::optional<Table> mla_table(const Parsed& p, Bytes style) {
  if (!p.has_mla()) return std::nullopt;
  Table t{{"MLA rank", "bytes/token", "nearest n_kv_head", "bytes/token", "MLA / it (bytes)",
           "val loss MLA", "val loss n_kv_head", "decode tokens/s MLA", "n_kv_head",
           "MLA / it (speed)"},
          {}};
  const auto ratio = [](std::optional<double> a, std::optional<double> b) {
    return a && b && *b > 0 ? std::optional<double>(*a / *b) : std::nullopt;
  };
  for (const Variant& m : p.variants) {
    const Variant* g = m.mla() ? nearest_in_bytes(p, m) : nullptr;
    if (g == nullptr) continue;
    const auto mb = m.get("cache_bytes_per_token"), gb = g->get("cache_bytes_per_token");
    const auto ms = m.get("decode_tokens_per_s_cache"), gs = g->get("decode_tokens_per_s_cache");
    t.rows.push_back({std::to_string(m.rank), bytes(mb, style), g->id() + " (" + g->kind + ")",
                      bytes(gb, style), figure(ratio(mb, gb), "%.2fx"),
                      m.seeds >= 2 ? loss_pm(m) : fmt("%.4f", m.mean) + " (1 seed)",
                      g->seeds >= 2 ? loss_pm(*g) : fmt("%.4f", g->mean) + " (1 seed)",
                      rate(ms), rate(gs), figure(ratio(ms, gs), "%.2fx")});
  }
  return t;
}

// The verdict at (nearly) equal cache bytes, per MLA variant, with the bytes it rests on.
std::vector<std::string> mla_findings(const Parsed& p) {
  std::vector<std::string> out;
  for (const Variant& m : p.variants) {
    const Variant* g = m.mla() ? nearest_in_bytes(p, m) : nullptr;
    if (g == nullptr) continue;
    const double mb = *m.get("cache_bytes_per_token"), gb = *g->get("cache_bytes_per_token");
    out.push_back("At " + fmt("%.0f", mb) + " against " + fmt("%.0f", gb) +
                  " cache bytes per token (" + fmt("%.2f", mb / gb) + "x): " +
                  compare(m, *g).text + ".");
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

std::string text_field(const json& obj, const char* key);

// One point of the memory-quality frontier: a variant's model read through one cache dtype
// (kv_quality: every seed's figures on the same validation windows).
struct QualityPoint {
  const Variant* v = nullptr;
  std::string dtype;
  double bytes = 0;  // per token
  double loss = 0, loss_std = 0, delta = 0, delta_std = 0, kl = 0, kl_std = 0, top1 = 0;
  bool front = false;  // no other point holds fewer or equal bytes at a lower loss
};

std::vector<QualityPoint> quality_points(const Parsed& p) {
  std::vector<QualityPoint> out;
  for (const Variant& v : p.variants)
    for (const json& e : v.j->value("kv_quality", json::array())) {
      if (!e.is_object() || !number(e, "bytes_per_token") || !number(e, "loss_mean")) continue;
      QualityPoint q;
      q.v = &v;
      q.dtype = text_field(e, "dtype");
      q.bytes = *number(e, "bytes_per_token");
      q.loss = *number(e, "loss_mean");
      q.loss_std = number(e, "loss_std").value_or(0);
      q.delta = number(e, "delta_loss_mean").value_or(0);
      q.delta_std = number(e, "delta_loss_std").value_or(0);
      q.kl = number(e, "kl_mean").value_or(0);
      q.kl_std = number(e, "kl_std").value_or(0);
      q.top1 = number(e, "top1_mean").value_or(0);
      out.push_back(q);
    }
  for (QualityPoint& q : out)
    q.front = std::none_of(out.begin(), out.end(), [&](const QualityPoint& o) {
      return (o.bytes <= q.bytes && o.loss < q.loss) || (o.bytes < q.bytes && o.loss <= q.loss);
    });
  return out;
}

// mean ± sd, the sd without a sign (a format's "+" flag is for the mean).
std::string pm(double mean, double sd, const char* format) {
  std::string sd_format = format;
  sd_format.erase(std::remove(sd_format.begin(), sd_format.end(), '+'), sd_format.end());
  return fmt(format, mean) + " ± " + fmt(sd_format.c_str(), sd);
}

// Every (n_kv_head, cache dtype) point (results without kv_quality leave it out).
std::optional<Table> quality_table(const Parsed& p) {
  const std::vector<QualityPoint> pts = quality_points(p);
  if (pts.empty()) return std::nullopt;
  Table t{{p.id_header(), "cache dtype", "bytes/token", "val loss", "Δ vs f32 cache", "mean KL",
           "top-1 agreement", "frontier"},
          {}};
  for (const QualityPoint& q : pts)
    t.rows.push_back({q.v->id(), q.dtype, fmt("%.0f", q.bytes),
                      pm(q.loss, q.loss_std, "%.4f"), pm(q.delta, q.delta_std, "%+.5f"),
                      pm(q.kl, q.kl_std, "%.2e"), fmt("%.4f", q.top1), q.front ? "yes" : ""});
  return t;
}

// The frontier in words: within each budget of bytes per token, which (n_kv_head, dtype) has
// the lowest val loss; then, per quantised dtype, whether fewer KV heads make it costlier (its
// loss delta and mean KL at the fewest KV heads against multi-head's, beyond the seeds' spread).
std::vector<std::string> quality_findings(const Parsed& p) {
  std::vector<QualityPoint> pts = quality_points(p);
  std::vector<std::string> out;
  if (pts.empty()) return out;
  std::sort(pts.begin(), pts.end(),
            [](const QualityPoint& a, const QualityPoint& b) { return a.bytes < b.bytes; });
  for (const QualityPoint& q : pts)
    if (q.front)
      out.push_back("Within " + fmt("%.0f", q.bytes) + " bytes per token the lowest val loss is " +
                    q.v->label() + " with " + q.dtype + " keys and values: " +
                    pm(q.loss, q.loss_std, "%.4f") + ".");
  // Per dtype, the GQA variants with the most and the fewest KV heads.
  const Variant& many = p.variants.front();
  const Variant& few = *std::find_if(p.variants.rbegin(), p.variants.rend(),
                                     [](const Variant& v) { return !v.mla(); });
  if (&many == &few) return out;
  for (const char* dtype : {"bf16", "fp8", "int8", "int4"}) {
    const auto at = [&](const Variant& v) {
      return std::find_if(pts.begin(), pts.end(), [&](const QualityPoint& q) {
        return q.v == &v && q.dtype == dtype;
      });
    };
    const auto a = at(many), b = at(few);
    if (a == pts.end() || b == pts.end()) continue;
    const bool one_seed = std::min(many.seeds, few.seeds) < 2;
    // "costlier by X" / "cheaper by X" / "no difference" for a figure at MHA (x) and at the
    // fewest KV heads (y), judged against the seeds' spread.
    auto judge = [&](double x, double sx, double y, double sy, const char* format) {
      if (one_seed) return std::string("1 seed, so no spread to judge by");
      if (std::abs(y - x) <= sx + sy) return std::string("no difference beyond the seeds' spread");
      return std::string(y > x ? "costlier" : "cheaper") + ", by " + fmt(format, std::abs(y - x)) +
             (x > 0 && y > 0 ? " (" + fmt("%.2f", y / x) + "x)" : "") +
             ", beyond the seeds' spread";
    };
    out.push_back(std::string(dtype) + " costs " + pm(a->delta, a->delta_std, "%+.5f") +
                  " nats at " + many.label() + " and " + pm(b->delta, b->delta_std, "%+.5f") +
                  " at " + few.label() + " (" +
                  judge(a->delta, a->delta_std, b->delta, b->delta_std, "%.5f") +
                  "); its mean KL " + pm(a->kl, a->kl_std, "%.2e") + " and " +
                  pm(b->kl, b->kl_std, "%.2e") + " (" +
                  judge(a->kl, a->kl_std, b->kl, b->kl_std, "%.2e") + ").");
  }
  return out;
}

constexpr const char* kQualityNote =
    "Each trained model (every seed) evaluated on the same fixed validation windows with its "
    "keys and values read through a cache of each dtype, exactly as a cached decoder reads "
    "them (kvlab bench kv-quality), against the f32 cache: mean ± std over seeds. Bytes per "
    "token: K and V of every layer, a quantised row's scales included. Frontier: no other "
    "point has as few bytes at a lower loss.";

// The serving sweep of a variant: each rate's figures over its runs (empty without a sweep).
struct SweepPoint {
  double rate = 0;
  std::vector<double> served, ttft_p99;
};
std::vector<SweepPoint> sweep_of(const Variant& v) {
  std::vector<SweepPoint> out;
  for (const json& pt : v.j->value("serve_sweep", json::array())) {
    if (!pt.is_object() || !number(pt, "rate")) continue;
    SweepPoint s{*number(pt, "rate"), {}, {}};
    for (const json& x : pt.value("requests_per_s", json::array()))
      if (x.is_number()) s.served.push_back(x.get<double>());
    for (const json& x : pt.value("ttft_p99_ms", json::array()))
      if (x.is_number()) s.ttft_p99.push_back(x.get<double>());
    if (!s.served.empty() && s.served.size() == s.ttft_p99.size()) out.push_back(std::move(s));
  }
  return out;
}

// What the sweep shows: each variant's sustained rate, and at the highest rate whether its
// requests/s differ from the multi-head model's beyond the spread of their runs (their ranges
// do not overlap).
std::vector<std::string> serving_findings(const Parsed& p) {
  std::vector<std::string> out;
  const auto mha = std::find_if(p.variants.begin(), p.variants.end(),
                                [&](const Variant& v) { return v.n_kv == p.n_head; });
  if (mha == p.variants.end() || sweep_of(*mha).empty()) return out;
  const SweepPoint top = sweep_of(*mha).back();
  const auto [mlo, mhi] = std::minmax_element(top.served.begin(), top.served.end());
  for (const Variant& v : p.variants) {
    const std::vector<SweepPoint> sw = sweep_of(v);
    if (sw.empty()) continue;
    std::string line = v.label() + " sustains " +
                       fmt("%.2f", v.get("serve_sustained_rate").value_or(0)) + " requests/s";
    if (&v != &*mha && sw.back().rate == top.rate) {
      const auto [lo, hi] = std::minmax_element(sw.back().served.begin(), sw.back().served.end());
      const bool apart = *lo > *mhi || *hi < *mlo;
      line += "; at " + fmt("%.2f", top.rate) + " requests/s offered it serves " +
              fmt("%.2f", *lo) + "-" + fmt("%.2f", *hi) + " against MHA's " + fmt("%.2f", *mlo) +
              "-" + fmt("%.2f", *mhi) + ": " +
              (apart ? "beyond the run-to-run spread" : "within the run-to-run spread");
    }
    out.push_back(line + ".");
  }
  return out;
}

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
  for (const auto& h : t.header) out += " " + md_escape(h) + " |";
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
  std::string out = "<table>\n<thead><tr>";
  for (const auto& h : t.header) out += "<th>" + svg::escape_xml(h) + "</th>";
  out += "</tr></thead>\n<tbody>\n";
  for (const auto& row : t.rows) {
    out += "<tr>";
    for (const auto& cell : row) out += "<td>" + svg::escape_xml(cell) + "</td>";
    out += "</tr>\n";
  }
  return out + "</tbody>\n</table>\n";
}

// --- CSV ---------------------------------------------------------------------------------

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
                                          "cache_bytes_per_token",
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

// --- uptraining (kvlab ablate --uptrain) --------------------------------------------------

// n_kv_head values of the uptrain entries, in the results' order, each once.
std::vector<int> uptrain_kvs(const Uptrain& u) {
  std::vector<int> kvs;
  for (const UptrainEntry& e : u.entries)
    if (std::find(kvs.begin(), kvs.end(), e.n_kv) == kvs.end()) kvs.push_back(e.n_kv);
  return kvs;
}

std::string steps_tokens(const json& e, const char* steps, const char* tokens) {
  const auto s = number(e, steps), t = number(e, tokens);
  if (!s) return "-";
  return fmt("%.0f", *s) + (t ? " (" + fmt("%.0f", *t) + " tokens)" : std::string());
}

// Per (n_kv_head, method): val loss right after the conversion, after uptraining, and the
// sweep's from-scratch model's, mean ± std over seeds, with the training each one took.
Table uptrain_table(const Uptrain& u) {
  Table t{{"n_kv_head", "method", "after conversion", "after uptraining", "from scratch",
           "gap to scratch", "steps (tokens) uptrained", "steps (tokens) from scratch"},
          {}};
  for (const UptrainEntry& e : u.entries)
    t.rows.push_back({std::to_string(e.n_kv), e.method, pm(e.conv, e.conv_sd, "%.4f"),
                      pm(e.up, e.up_sd, "%.4f"),
                      e.scratch ? pm(*e.scratch, e.scratch_sd.value_or(0), "%.4f") : "-",
                      e.scratch ? fmt("%+.4f", e.up - *e.scratch) : "-",
                      steps_tokens(*e.j, "uptrained_steps", "uptrained_tokens"),
                      steps_tokens(*e.j, "scratch_steps", "scratch_tokens")});
  return t;
}

// Where a converted model (the multi-head MLP, fewer KV heads) and the from-scratch one differ
// in size (a --param-matched sweep widens the latter's MLP), saying so: the gap then mixes the
// KV heads with the parameter count.
std::string size_note(const Uptrain& u) {
  std::string out;
  std::set<int> said;
  for (const UptrainEntry& e : u.entries) {
    const auto up = number(*e.j, "params_uptrained"), scratch = number(*e.j, "params_scratch");
    if (!up || !scratch || *up == *scratch || !said.insert(e.n_kv).second) continue;
    out += std::string(out.empty() ? "" : "; ") + "n_kv_head " + std::to_string(e.n_kv) + ": " +
           fmt("%.0f", *up) + " parameters converted, " + fmt("%.0f", *scratch) + " from scratch";
  }
  if (out.empty()) return out;
  return "The two sides differ in size (" + out +
         "): a converted model keeps the multi-head MLP while the from-scratch one was "
         "parameter-matched, so each gap to scratch mixes sharing KV heads with model size.";
}

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

// a against b (val losses, lower is better) in words, judged against the seeds' spread.
std::string versus(const std::string& a_name, double a, double sa, const std::string& b_name,
                   double b, double sb, bool one_seed) {
  const std::string figures = " (" + pm(a, sa, "%.4f") + " vs " + pm(b, sb, "%.4f") + ")";
  const std::string& lower = a < b ? a_name : b_name;
  const std::string& higher = a < b ? b_name : a_name;
  if (one_seed)
    return lower + " is lower than " + higher + " by " + fmt("%.4f", std::abs(a - b)) +
           figures + ", 1 seed, so no spread to judge by";
  if (std::abs(a - b) <= sa + sb)
    return a_name + " and " + b_name + " are within the seeds' spread of each other" + figures;
  return lower + " beats " + higher + " by " + fmt("%.4f", std::abs(a - b)) +
         ", beyond the seeds' spread" + figures;
}

// Per n_kv_head: whether mean beats first and random (after the conversion and after
// uptraining), then how close each method's uptraining gets to training from scratch.
std::vector<std::string> uptrain_findings(const Uptrain& u) {
  std::vector<std::string> out;
  for (const int kv : uptrain_kvs(u)) {
    std::vector<const UptrainEntry*> at;
    for (const UptrainEntry& e : u.entries)
      if (e.n_kv == kv) at.push_back(&e);
    const auto find = [&](const char* m) -> const UptrainEntry* {
      for (const UptrainEntry* e : at)
        if (e->method == m) return e;
      return nullptr;
    };
    const std::string where = "At n_kv_head=" + std::to_string(kv);
    if (const UptrainEntry* mean = find("mean")) {
      for (const char* other : {"first", "random"}) {
        const UptrainEntry* o = find(other);
        if (o == nullptr) continue;
        const bool one_seed = std::min(mean->seeds, o->seeds) < 2;
        out.push_back(where + ", right after conversion: " +
                      versus("mean", mean->conv, mean->conv_sd, other, o->conv, o->conv_sd,
                             one_seed) +
                      "; after uptraining: " +
                      versus("mean", mean->up, mean->up_sd, other, o->up, o->up_sd, one_seed) +
                      ".");
      }
    }
    std::string gaps;
    for (const UptrainEntry* e : at) {
      if (!e->scratch) continue;
      const double sd = e->scratch_sd.value_or(0), gap = e->up - *e->scratch;
      const bool one_seed = e->seeds < 2;
      gaps += (gaps.empty() ? "" : "; ") + e->method + " ends at " + pm(e->up, e->up_sd, "%.4f") +
              ", a gap of " + fmt("%+.4f", gap) +
              (one_seed ? std::string(" (1 seed, so no spread to judge by)")
               : std::abs(gap) <= e->up_sd + sd
                   ? std::string(" (within the seeds' spread: as good as from scratch)")
                   : std::string(gap > 0 ? " (above from scratch, beyond the seeds' spread)"
                                         : " (below from scratch, beyond the seeds' spread)"));
    }
    if (!gaps.empty()) {
      const UptrainEntry& e = *at.front();
      out.push_back(where + ", " + fmt("%g", u.fraction * 100) + "% uptraining (" +
                    fmt("%.0f", static_cast<double>(u.steps)) +
                    " steps) against training from scratch (" +
                    pm(*e.scratch, e.scratch_sd.value_or(0), "%.4f") + "): " + gaps + ".");
    }
  }
  if (std::string sizes = size_note(u); !sizes.empty()) out.push_back(std::move(sizes));
  return out;
}

// --- plots -------------------------------------------------------------------------------

// The report's plots, by file name; the serving plots where the results hold a sweep.
std::vector<std::string> plot_names(const Parsed& p) {
  std::vector<std::string> names = {"val_loss_curves", "val_loss_vs_kv", "cache_bytes_vs_kv",
                                    "tokens_per_s_vs_kv"};
  if (!sweep_of(p.variants.front()).empty()) {
    names.push_back("served_vs_rate");
    names.push_back("ttft_p99_vs_rate");
  }
  if (!quality_points(p).empty()) {
    names.push_back("val_loss_vs_cache_bytes");
    names.push_back("kl_vs_cache_bytes");
  }
  if (p.uptrain)
    for (const int kv : uptrain_kvs(*p.uptrain)) names.push_back("uptrain_kv" + std::to_string(kv));
  return names;
}

// Where a variant sits on the n_kv_head axis: its n_kv_head, or for MLA the KV heads whose
// cache takes its bytes (vs_mha * n_head; none without vs_mha).
double kv_position(const Parsed& p, const Variant& v) {
  if (!v.mla()) return v.n_kv;
  const auto r = v.get("vs_mha");
  return r ? *r * p.n_head : std::nan("");
}

std::vector<double> kv_axis(const Parsed& p) {
  std::vector<double> x;
  for (const Variant& v : p.variants)
    if (!v.mla()) x.push_back(v.n_kv);
  return x;
}

// One series of `base`'s style per kind present: the n_kv_head variants, then MLA's (dashed,
// "MLA" in the legend), with y = y_of(v) at kv_position; base.label names the first.
std::vector<svg::Series> kind_series(const Parsed& p, const svg::Series& base,
                                     const std::function<double(const Variant&)>& y_of) {
  std::vector<svg::Series> out;
  for (const bool mla : {false, true}) {
    svg::Series s = base;
    if (mla) {
      if (!p.has_mla()) break;
      s.dashed = true;
      s.label = base.label.empty() ? "MLA (at its cache's KV heads)" : base.label + ", MLA";
    }
    for (const Variant& v : p.variants) {
      if (v.mla() != mla) continue;
      s.x.push_back(kv_position(p, v));
      s.y.push_back(y_of(v));
    }
    out.push_back(std::move(s));
  }
  if (p.has_mla() && out.front().label.empty()) out.front().label = "n_kv_head";
  return out;
}

const char* kv_axis_label(const Parsed& p) {
  return p.has_mla() ? "n_kv_head; MLA at the KV heads of its cache bytes (log2 axis)"
                     : "n_kv_head (log2 axis)";
}

svg::Plot curves_plot(const Parsed& p) {
  svg::Plot plot;
  plot.title = "Validation loss during training";
  plot.note = "thin: each seed; bold: mean across seeds";
  plot.x_label = "step";
  plot.y_label = "val loss (nats/token)";
  std::vector<svg::Series> means;
  for (std::size_t i = 0; i < p.variants.size(); ++i) {
    const Variant& v = p.variants[i];
    std::map<double, std::pair<double, int>> by_step;  // step -> (sum, seeds reporting it)
    int curves = 0;
    for (const json& run : v.j->value("runs", json::array())) {
      const json curve = run.is_object() ? run.value("curve", json::array()) : json::array();
      if (!curve.is_array() || curve.empty()) continue;
      svg::Series s;
      s.color = svg::palette(i);
      s.line_width = 1.0;
      s.opacity = 0.45;
      s.css_class = "seed";
      for (const json& pt : curve) {
        const auto step = pt.is_object() ? number(pt, "step") : std::nullopt;
        const auto loss = pt.is_object() ? number(pt, "val_loss") : std::nullopt;
        if (!step || !loss) continue;
        s.x.push_back(*step);
        s.y.push_back(*loss);
        by_step[*step].first += *loss;
        by_step[*step].second += 1;
      }
      plot.series.push_back(std::move(s));
      ++curves;
    }
    svg::Series mean;
    mean.label = v.label();
    mean.color = svg::palette(i);
    mean.line_width = 2.5;
    mean.css_class = "mean";
    // Only steps every seed reported, so the mean never mixes different sets of seeds.
    for (const auto& [step, acc] : by_step)
      if (acc.second == curves) mean.x.push_back(step), mean.y.push_back(acc.first / curves);
    means.push_back(std::move(mean));
  }
  for (auto& m : means) plot.series.push_back(std::move(m));  // drawn last, on top
  return plot;
}

svg::Plot loss_vs_kv_plot(const Parsed& p) {
  svg::Plot plot;
  plot.title = "Validation loss vs n_kv_head";
  const int min_seeds =
      std::min_element(p.variants.begin(), p.variants.end(),
                       [](const Variant& a, const Variant& b) { return a.seeds < b.seeds; })
          ->seeds;
  plot.note = min_seeds >= 2 ? "mean ± std over seeds" : "1 seed: no spread measured";
  plot.x_label = kv_axis_label(p);
  plot.y_label = "val loss (nats/token)";
  plot.x_ticks = kv_axis(p);
  plot.x_log2 = true;
  svg::Series base;
  base.line_width = 1.5;
  base.markers = true;
  std::vector<svg::Series> series = kind_series(p, base, [](const Variant& v) { return v.mean; });
  for (std::size_t i = 0; i < series.size(); ++i) {  // 0: n_kv_head's, 1: MLA's
    for (const Variant& v : p.variants)
      if (v.mla() == (i == 1)) series[i].y_err.push_back(v.seeds >= 2 ? v.std : 0.0);
    plot.series.push_back(std::move(series[i]));
  }
  return plot;
}

svg::Plot cache_plot(const Parsed& p, const json& results) {
  double top = 0;
  for (const Variant& v : p.variants)
    top = std::max({top, v.get("cache_bytes_context_measured").value_or(0),
                    v.get("cache_bytes_context_formula").value_or(0)});
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (u < 3 && top >= 1024 * std::pow(1024.0, u)) ++u;
  const double scale = std::pow(1024.0, u);
  svg::Plot plot;
  plot.title = "KV-cache bytes per sequence at full context";
  const json& config = results.value("config", json::object());
  if (config.is_object() && number(config, "block_size"))
    plot.note = "context = block_size = " + fmt("%.0f", *number(config, "block_size")) + " tokens";
  plot.x_label = kv_axis_label(p);
  plot.y_label = std::string("KV cache (") + units[u] + ")";
  plot.x_ticks = kv_axis(p);
  plot.x_log2 = true;
  plot.y_from_zero = true;
  // The formula is drawn dashed on top: where it matches the measurement, both stay visible.
  const char* keys[] = {"cache_bytes_context_measured", "cache_bytes_context_formula"};
  for (int k = 0; k < 2; ++k) {
    svg::Series s;
    s.label = k ? "formula" : "measured";
    s.color = svg::palette(k ? 3 : 0);
    s.dashed = k == 1;
    s.markers = k == 0;
    s.line_width = k ? 2.0 : 3.0;
    for (const Variant& v : p.variants) {
      if (v.mla()) continue;
      s.x.push_back(v.n_kv);
      s.y.push_back(v.get(keys[k]).value_or(std::nan("")) / scale);
    }
    plot.series.push_back(std::move(s));
  }
  if (p.has_mla()) {  // measured only: the formula is the same bytes
    svg::Series s;
    s.label = "MLA, measured";
    s.color = svg::palette(2);
    s.markers = true;
    s.line_width = 0;
    for (const Variant& v : p.variants)
      if (v.mla()) {
        s.x.push_back(kv_position(p, v));
        s.y.push_back(v.get(keys[0]).value_or(std::nan("")) / scale);
      }
    plot.series.push_back(std::move(s));
  }
  return plot;
}

svg::Plot speed_plot(const Parsed& p) {
  svg::Plot plot;
  plot.title = "Decode speed vs n_kv_head";
  plot.x_label = kv_axis_label(p);
  plot.y_label = "decode tokens/s";
  plot.x_ticks = kv_axis(p);
  plot.x_log2 = true;
  plot.y_from_zero = true;
  const char* keys[] = {"decode_tokens_per_s_cache", "decode_tokens_per_s_nocache"};
  for (int k = 0; k < 2; ++k) {
    svg::Series base;
    base.label = k ? "without KV cache" : "with KV cache";
    base.color = svg::palette(k ? 1 : 0);
    base.markers = true;
    for (svg::Series& s : kind_series(
             p, base, [&](const Variant& v) { return v.get(keys[k]).value_or(std::nan("")); }))
      plot.series.push_back(std::move(s));
  }
  return plot;
}

// Served requests/s (rate_plot) or p99 TTFT against the offered rate, a line per variant,
// error bars spanning the runs.
svg::Plot serving_plot(const Parsed& p, bool ttft) {
  svg::Plot plot;
  plot.title = ttft ? "p99 time to first token vs request rate" : "Requests served vs request rate";
  plot.note = "continuous batching over the paged cache, one KV memory for all; bars: the runs' range";
  plot.x_label = "offered requests/s (Poisson arrivals)";
  plot.y_label = ttft ? "p99 TTFT (ms)" : "served requests/s";
  plot.y_from_zero = true;
  for (std::size_t i = 0; i < p.variants.size(); ++i) {
    if (sweep_of(p.variants[i]).empty()) continue;
    svg::Series s;
    s.label = p.variants[i].label();
    s.color = svg::palette(i);
    s.markers = true;
    for (const SweepPoint& pt : sweep_of(p.variants[i])) {
      const std::vector<double>& y = ttft ? pt.ttft_p99 : pt.served;
      const auto [lo, hi] = std::minmax_element(y.begin(), y.end());
      s.x.push_back(pt.rate);
      s.y.push_back((*lo + *hi) / 2);
      s.y_err.push_back((*hi - *lo) / 2);
    }
    plot.series.push_back(std::move(s));
  }
  if (!ttft) {  // served = offered: what keeping up looks like
    svg::Series diag;
    diag.label = "offered";
    diag.color = "#999999";
    diag.dashed = true;
    diag.line_width = 1.0;
    for (const SweepPoint& pt : sweep_of(p.variants.front())) {
      diag.x.push_back(pt.rate);
      diag.y.push_back(pt.rate);
    }
    plot.series.push_back(std::move(diag));
  }
  return plot;
}

// Val loss (or log10 of the mean KL) against cache bytes per token: a line per variant through
// its cache dtypes, bars the seeds' std, and the frontier dashed.
svg::Plot quality_plot(const Parsed& p, bool kl) {
  const std::vector<QualityPoint> pts = quality_points(p);
  svg::Plot plot;
  plot.title = kl ? "KL divergence from the f32 cache vs cache bytes per token"
                  : "Validation loss vs KV-cache bytes per token";
  plot.note = kl ? "a line per variant: int4, fp8, int8, bf16 (f32's KL is 0); bars: seed std"
                 : "a line per variant: int4, fp8, int8, bf16, f32; bars: seed std; dashed: frontier";
  plot.x_label = "KV-cache bytes per token (log2 axis)";
  plot.y_label = kl ? "log10 mean KL (nats)" : "val loss (nats/token)";
  plot.x_log2 = true;
  auto y_of = [&](const QualityPoint& q) { return kl ? std::log10(q.kl) : q.loss; };
  for (std::size_t i = 0; i < p.variants.size(); ++i) {
    std::vector<QualityPoint> mine;
    for (const QualityPoint& q : pts)
      if (q.v == &p.variants[i]) mine.push_back(q);
    if (mine.empty()) continue;
    std::sort(mine.begin(), mine.end(),
              [](const QualityPoint& a, const QualityPoint& b) { return a.bytes < b.bytes; });
    svg::Series s;
    s.label = p.variants[i].label();
    s.color = svg::palette(i);
    s.markers = true;
    s.line_width = 1.5;
    for (const QualityPoint& q : mine) {
      s.x.push_back(q.bytes);
      s.y.push_back(y_of(q));
      // On a log axis a std is a ratio: the bar spans log10(kl +- std) around the point.
      s.y_err.push_back(kl ? (q.kl > q.kl_std ? std::log10(q.kl) - std::log10(q.kl - q.kl_std)
                                              : 0.0)
                           : q.loss_std);
    }
    plot.series.push_back(std::move(s));
  }
  if (!kl) {
    std::vector<QualityPoint> front;
    for (const QualityPoint& q : pts)
      if (q.front) front.push_back(q);
    std::sort(front.begin(), front.end(),
              [](const QualityPoint& a, const QualityPoint& b) { return a.bytes < b.bytes; });
    svg::Series f;
    f.label = "frontier";
    f.color = "#999999";
    f.dashed = true;
    f.line_width = 1.0;
    for (const QualityPoint& q : front) {
      f.x.push_back(q.bytes);
      f.y.push_back(q.loss);
    }
    plot.series.push_back(std::move(f));
  }
  return plot;
}

// Val loss against uptraining steps at one n_kv_head: a line per method (the seeds' mean,
// bars their std), from-scratch's level and the multi-head source's as dashed lines.
svg::Plot uptrain_plot(const Uptrain& u, int kv) {
  svg::Plot plot;
  plot.title = "Uptraining converted MHA checkpoints to n_kv_head=" + std::to_string(kv);
  plot.note = "a line per conversion method: mean over seeds, bars their std; dashed: reference levels";
  plot.x_label = "uptraining step";
  plot.y_label = "val loss (nats/token)";
  std::optional<double> scratch;
  std::size_t colour = 0;
  for (const UptrainEntry& e : u.entries) {
    if (e.n_kv != kv) continue;
    if (e.scratch) scratch = e.scratch;
    std::map<double, std::vector<double>> by_step;
    for (const json& run : e.j->value("runs", json::array()))
      for (const json& pt : run.is_object() ? run.value("curve", json::array()) : json::array()) {
        const auto step = pt.is_object() ? number(pt, "step") : std::nullopt;
        const auto loss = pt.is_object() ? number(pt, "val_loss") : std::nullopt;
        if (step && loss) by_step[*step].push_back(*loss);
      }
    svg::Series s;
    s.label = e.method;
    s.color = svg::palette(colour++);
    s.markers = true;
    for (const auto& [step, losses] : by_step) {
      if (static_cast<int>(losses.size()) != e.seeds) continue;  // every seed, or none
      double sum = 0, sum2 = 0;
      for (double l : losses) sum += l, sum2 += l * l;
      const double n = static_cast<double>(losses.size()), mean = sum / n;
      s.x.push_back(step);
      s.y.push_back(mean);
      s.y_err.push_back(n > 1 ? std::sqrt(std::max(0.0, (sum2 - n * mean * mean) / (n - 1))) : 0.0);
    }
    plot.series.push_back(std::move(s));
  }
  const double end = static_cast<double>(std::max<int64_t>(1, u.steps));
  const auto level = [&](const std::string& label, double y, const std::string& color) {
    svg::Series r;
    r.label = label;
    r.color = color;
    r.dashed = true;
    r.line_width = 1.5;
    r.x = {0, end};
    r.y = {y, y};
    plot.series.push_back(std::move(r));
  };
  if (scratch) level("from scratch", *scratch, "#555555");
  const json& src = u.j->value("source_val_loss", json::object());
  if (const auto m = src.is_object() ? number(src, "mean") : std::nullopt)
    level("MHA source", *m, "#bbbbbb");
  return plot;
}

std::string text_of(const json& v) {
  return v.is_string() ? v.get<std::string>()
                       : v.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string text_field(const json& obj, const char* key) {
  const auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? std::string() : text_of(*it);
}

// --- samples -----------------------------------------------------------------------------

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

// --- documents ---------------------------------------------------------------------------

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
    md << "\n## MLA against GQA at equal cache bytes\n\n" << render_markdown(*t) << '\n'
       << kMlaNote << '\n';
    for (const std::string& f : mla_findings(p)) md << "\n- " << md_escape(f);
    md << '\n';
  }
  if (const auto m = memory_table(p, Bytes::exact))
    md << "\n## KV memory under a serving workload\n\n" << render_markdown(*m) << '\n'
       << kMemoryNote << '\n';
  if (const auto t = serving_table(p)) {
    md << "\n## Serving it\n\n" << render_markdown(*t) << '\n' << kServingNote << '\n';
    for (const std::string& f : serving_findings(p)) md << "\n- " << md_escape(f);
    md << '\n';
  }
  if (const auto t = quality_table(p)) {
    md << "\n## What each cache dtype costs: the memory-quality frontier\n\n"
       << render_markdown(*t) << '\n' << kQualityNote << '\n';
    for (const std::string& f : quality_findings(p)) md << "\n- " << md_escape(f);
    md << '\n';
  }
  if (p.uptrain) {
    md << "\n## Uptraining converted checkpoints (the GQA paper's recipe)\n\n"
       << render_markdown(uptrain_table(*p.uptrain)) << '\n' << md_escape(uptrain_note(*p.uptrain))
       << '\n';
    for (const std::string& f : uptrain_findings(*p.uptrain)) md << "\n- " << md_escape(f);
    md << '\n';
  }
  md << "\n## Verdicts (val loss, mean ± std over seeds)\n\n";
  for (const Verdict& v : vs) md << "- " << md_escape(v.text) << '\n';
  md << "\n## Plots\n\n";
  for (const std::string& name : plot_names(p)) {
    md << "![" << name << name << "](" << name << ".svg)\n\n[" << name << ".svg](" << name << ".svg)";
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
    h << "<h2>MLA against GQA at equal cache bytes</h2>\n" << render_html(*t) << "<p>"
      << kMlaNote << "</p>\n<ul>\n";
    for (const std::string& f : mla_findings(p)) h << "<li>" << e(f) << "</li>\n";
    h << "</ul>\n";
  }
  if (const auto m = memory_table(p, Bytes::exact))
    h << "<h2>KV memory under a serving workload</h2>\n" << render_html(*m) << "<p>" << kMemoryNote
      << "</p>\n";
  if (const auto t = serving_table(p)) {
    h << "<h2>Serving it</h2>\n" << render_html(*t) << "<p>" << kServingNote << "</p>\n<ul>\n";
    for (const std::string& f : serving_findings(p)) h << "<li>" << e(f) << "</li>\n";
    h << "</ul>\n";
  }
  if (const auto t = quality_table(p)) {
    h << "<h2>What each cache dtype costs: the memory-quality frontier</h2>\n" << render_html(*t)
      << "<p>" << kQualityNote << "</p>\n<ul>\n";
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

// --- files -------------------------------------------------------------------------------

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

std::vector<Verdict> compare_variants(const nlohmann::json& results) {
  return verdicts(parse(results));
}

std::string format_table(const nlohmann::json& results) {
  const Parsed p = parse(results);
  std::string out = render_text(record_table(p, Bytes::human)) + '\n' +
                    render_text(detail_table(p, Bytes::human));
  if (const auto t = mla_table(p, Bytes::human)) {
    out += "\nMLA against GQA at equal cache bytes:\n" + render_text(*t);
    for (const std::string& f : mla_findings(p)) out += "  " + f + "\n";
  }
  if (const auto m = memory_table(p, Bytes::human))
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
  if (p.uptrain) {
    out += "\nuptraining converted MHA checkpoints (" + fmt("%g", p.uptrain->fraction * 100) +
           "% of the steps; val loss, mean ± std over seeds):\n" +
           render_text(uptrain_table(*p.uptrain));
    for (const std::string& f : uptrain_findings(*p.uptrain)) out += "  " + f + "\n";
  }
  out += "\nverdicts (val loss, mean ± std over seeds):\n";
  for (const Verdict& v : verdicts(p)) out += "  " + v.text + '\n';
  return out;
}

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
  std::vector<std::string> svgs = {
      svg::render(curves_plot(p)), svg::render(loss_vs_kv_plot(p)),
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
    for (const int kv : uptrain_kvs(*p.uptrain)) svgs.push_back(svg::render(uptrain_plot(*p.uptrain, kv)));
  for (std::size_t i = 0; i < svgs.size(); ++i)
    write_file_atomic(out_dir / (names[i] + ".svg"), svgs[i]);
  write_file_atomic(out_dir / "report.md", make_markdown(results, p, vs, rsvg.has_value()));
  write_file_atomic(out_dir / "report.html", make_html(results, p, vs, svgs));
  if (rsvg)
    for (const std::string& name : names)
      svg_to_png(*rsvg, out_dir / (name + ".svg"), out_dir / (name + ".png"));
}

void write_file_atomic(const fs::path& path, const std::string& content) {
  fs::path tmp = path;
  tmp += ".tmp";
  std::error_code ec;
  {
    std::ofstream os(tmp, std::ios::binary | std::ios::trunc);
    KVLAB_CHECK(os.is_open(), "cannot write ", path.string(), ": ", std::strerror(errno));
    os << content;
    os.flush();
    if (!os.good()) {
      const int err = errno;
      os.close();
      fs::remove(tmp, ec);
      KVLAB_CHECK(false, "error writing ", path.string(), ": ", std::strerror(err));
    }
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    KVLAB_CHECK(false, "cannot rename ", tmp.string(), " to ", path.string(), ": ", ec.message());
  }
}

}  // namespace kvlab
