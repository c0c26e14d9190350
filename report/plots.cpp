// The report's plots, as svg::Plot descriptions: training curves, loss, cache bytes and speed
// against n_kv_head, the serving sweep, the memory-quality frontier and uptraining.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>

#include "report/report_parts.h"

namespace kvlab::report_detail {
namespace {

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

// A variant's mean validation curve: step -> mean over the seeds, at the steps every seed
// reported (so the mean never mixes different sets of seeds).
std::map<double, double> mean_curve(const Variant& v) {
  std::map<double, std::pair<double, int>> by_step;  // step -> (sum, seeds reporting it)
  int curves = 0;
  for (const json& run : v.j->value("runs", json::array())) {
    const json curve = run.is_object() ? run.value("curve", json::array()) : json::array();
    if (!curve.is_array() || curve.empty()) continue;
    ++curves;
    for (const json& pt : curve) {
      const auto step = pt.is_object() ? number(pt, "step") : std::nullopt;
      const auto loss = pt.is_object() ? number(pt, "val_loss") : std::nullopt;
      if (step && loss) by_step[*step].first += *loss, by_step[*step].second += 1;
    }
  }
  std::map<double, double> out;
  for (const auto& [step, acc] : by_step)
    if (acc.second == curves) out[step] = acc.first / curves;
  return out;
}

}  // namespace

svg::Plot curves_plot(const Parsed& p) {
  svg::Plot plot;
  plot.title = "Validation loss during training";
  plot.note = "thin: each seed; bold: mean across seeds";
  plot.x_label = "step";
  plot.y_label = "val loss (nats/token)";
  std::vector<svg::Series> means;
  for (std::size_t i = 0; i < p.variants.size(); ++i) {
    const Variant& v = p.variants[i];
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
      }
      plot.series.push_back(std::move(s));
    }
    svg::Series mean;
    mean.label = v.label();
    mean.color = svg::palette(i);
    mean.line_width = 2.5;
    mean.css_class = "mean";
    for (const auto& [step, loss] : mean_curve(v)) mean.x.push_back(step), mean.y.push_back(loss);
    means.push_back(std::move(mean));
  }
  for (auto& m : means) plot.series.push_back(std::move(m));  // drawn last, on top
  return plot;
}

// The second half of training, each variant's mean curve minus MHA's at the same steps: on the
// full curves the variants' differences are a few pixels under the early drop.
std::optional<svg::Plot> curves_vs_mha_plot(const Parsed& p) {
  const Variant* mha = mha_of(p);
  if (mha == nullptr || p.variants.size() < 2) return std::nullopt;
  const std::map<double, double> ref = mean_curve(*mha);
  if (ref.size() < 2) return std::nullopt;
  const double from = ref.rbegin()->first / 2;
  svg::Plot plot;
  plot.title = "Validation loss minus MHA's, second half of training";
  plot.note = "mean across seeds; above 0: worse than MHA";
  plot.x_label = "step";
  plot.y_label = "val loss - MHA's (nats/token)";
  plot.y_from_zero = true;
  svg::Series zero;
  zero.label = mha->label();
  zero.color = "#999999";
  zero.dashed = true;
  zero.line_width = 1.0;
  zero.x = {from, ref.rbegin()->first};
  zero.y = {0, 0};
  plot.series.push_back(std::move(zero));
  for (std::size_t i = 0; i < p.variants.size(); ++i) {
    if (&p.variants[i] == mha) continue;
    svg::Series s;
    s.label = p.variants[i].label();
    s.color = svg::palette(i);
    s.markers = true;
    s.line_width = 2.0;
    for (const auto& [step, loss] : mean_curve(p.variants[i])) {
      const auto at = ref.find(step);
      if (step < from || at == ref.end()) continue;
      s.x.push_back(step);
      s.y.push_back(loss - at->second);
    }
    plot.series.push_back(std::move(s));
  }
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
  const ByteUnit unit = byte_unit(top);
  const double scale = unit.scale;
  svg::Plot plot;
  plot.title = "KV-cache bytes per sequence at full context";
  const json& config = results.value("config", json::object());
  if (config.is_object() && number(config, "block_size"))
    plot.note = "context = block_size = " + fmt("%.0f", *number(config, "block_size")) + " tokens";
  plot.x_label = kv_axis_label(p);
  plot.y_label = std::string("KV cache (") + unit.name + ")";
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
  plot.note =
      "continuous batching over the paged cache, one KV memory for all; bars: the runs' range";
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
  plot.note =
      kl ? "a line per variant: int4, fp8, int8, bf16 (f32's KL is 0); bars: seed std"
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
      s.y_err.push_back(
          kl ? (q.kl > q.kl_std ? std::log10(q.kl) - std::log10(q.kl - q.kl_std) : 0.0)
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
  plot.note =
      "a line per conversion method: mean over seeds, bars their std; dashed: reference levels";
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

// A line per variant of the paired evaluation, its points from points(v, x, y).
static svg::Plot variant_lines(const Parsed& p, const GenQuality& g, svg::Plot plot,
                               const std::function<void(const GenVariant&, std::vector<double>&,
                                                        std::vector<double>&)>& points) {
  plot.x_log2 = true;
  for (size_t i = 0; i < g.variants.size(); ++i) {
    svg::Series s;
    s.label = p.variants[g.variants[i].v].label();
    s.color = svg::palette(i);
    s.markers = true;
    s.line_width = 1.5;
    points(g.variants[i], s.x, s.y);
    plot.series.push_back(std::move(s));
  }
  return plot;
}

// Each variant over its log-spaced position buckets (each at its geometric middle).
svg::Plot position_plot(const Parsed& p, const GenQuality& g) {
  svg::Plot plot;
  plot.title = "Loss by position in the context";
  plot.note = "mean over " + std::to_string(g.windows) + " shared validation windows and the seeds";
  plot.x_label = "position (log2 axis)";
  plot.y_label = "loss (nats/token)";
  return variant_lines(p, g, plot, [](const GenVariant& v, auto& x, auto& y) {
    for (size_t k = 0; k < v.bucket_loss.size(); ++k) {
      x.push_back(std::sqrt(static_cast<double>(v.bucket_first[k] * v.bucket_last[k])));
      y.push_back(v.bucket_loss[k]);
    }
  });
}

svg::Plot recall_plot(const Parsed& p, const GenQuality& g) {
  svg::Plot plot;
  plot.title = "In-context recall by distance";
  plot.note = "random tokens repeated once: top-1 accuracy on the second copy, mean over seeds";
  plot.x_label = "distance between the copies (tokens, log2 axis)";
  plot.y_label = "top-1 accuracy";
  plot.y_from_zero = true;
  return variant_lines(p, g, plot, [](const GenVariant& v, auto& x, auto& y) {
    for (size_t k = 0; k < v.recall.size(); ++k) {
      x.push_back(static_cast<double>(v.distance[k]));
      y.push_back(v.recall[k]);
    }
  });
}

// Every plot of the results, rendered, with what to look at in it; in the order the report
// shows them.
std::vector<Figure> figures(const Parsed& p, const json& results) {
  std::vector<Figure> out;
  const auto add = [&](std::string name, const svg::Plot& plot, std::string caption) {
    out.push_back({std::move(name), svg::render(plot), std::move(caption)});
  };
  add("val_loss_curves", curves_plot(p),
      "Validation loss over training, thin lines each seed, bold their mean. Look at whether the "
      "bold lines part by the end, and by more than the thin lines of one variant spread.");
  if (const auto diff = curves_vs_mha_plot(p))
    add("val_loss_curves_vs_mha", *diff,
        "The same means over the second half of training, minus MHA's at each step (above 0: "
        "worse than MHA). Look at the last steps: whether a gap holds steady or closes as "
        "training goes on; its end is near the Δ val loss column.");
  add("val_loss_vs_kv", loss_vs_kv_plot(p),
      "Final val loss against n_kv_head, bars one std over seeds. Where bars overlap, the seeds "
      "do not rank the variants.");
  add("cache_bytes_vs_kv", cache_plot(p, results),
      "KV-cache bytes of one full-context sequence, measured (solid) and by the formula "
      "(dashed). Look at the slope: bytes scale with n_kv_head, and the dashed line on the "
      "solid one means the cache holds exactly the formula's bytes.");
  add("tokens_per_s_vs_kv", speed_plot(p),
      "Decode tokens/s with and without the KV cache (the median of the timed runs, on a "
      "shared host). Look at the gap between the two lines: what the cache buys.");
  if (!sweep_of(p.variants.front()).empty()) {
    add("served_vs_rate", serving_plot(p, false),
        "Requests served against requests offered at one KV memory; dashed: served = offered. "
        "Look at where each variant leaves the diagonal: its capacity.");
    add("ttft_p99_vs_rate", serving_plot(p, true),
        "p99 time to first token against the offered rate. Look at the rate where a line "
        "climbs: requests start to queue there.");
  }
  if (!quality_points(p).empty()) {
    add("val_loss_vs_cache_bytes", quality_plot(p, false),
        "Each variant through its cache dtypes (int4, fp8, int8, bf16, f32 from left to right); "
        "lower left is better. The dashed frontier is the lowest loss within each byte budget.");
    add("kl_vs_cache_bytes", quality_plot(p, true),
        "How far each dtype moves the predictions from the f32 cache's (log scale). Look at "
        "whether variants with fewer KV heads sit higher at the same dtype.");
  }
  if (p.uptrain)
    for (const int kv : uptrain_kvs(*p.uptrain))
      add("uptrain_kv" + std::to_string(kv), uptrain_plot(*p.uptrain, kv),
          "Val loss while uptraining converted checkpoints; dashed: the from-scratch model and "
          "the MHA source. Look at how near each method ends to the from-scratch line.");
  if (p.gen) {
    add("loss_by_position", position_plot(p, *p.gen),
        "Loss by position in the context. Look for positions where a variant's gap to the "
        "reference widens: where it uses the context less.");
    add("recall_by_distance", recall_plot(p, *p.gen),
        "Top-1 recall of a repeated random token by the distance between its copies. Look "
        "for variants that fall off with distance.");
  }
  return out;
}

}  // namespace kvlab::report_detail
