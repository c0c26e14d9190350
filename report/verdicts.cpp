// What the figures say, in words: the validation-loss verdicts between variants, and the
// findings of the MLA, serving, cache-dtype and uptraining tables.
#include <algorithm>
#include <cmath>
#include <set>

#include "platform/formats.h"
#include "report/report_parts.h"

namespace kvlab::report_detail {
namespace {

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

// The verdict's wording without its "a vs b: " prefix.
std::string verdict_wording(const Verdict& v) {
  const std::string prefix = v.a + " vs " + v.b + ": ";
  return v.text.rfind(prefix, 0) == 0 ? v.text.substr(prefix.size()) : v.text;
}

// The pair the paired evaluation measured for variants a and b (either order), or null.
const GenPair* pair_of(const Parsed& p, const Variant& a, const Variant& b) {
  if (!p.gen) return nullptr;
  const size_t ia = &a - p.variants.data(), ib = &b - p.variants.data();
  for (const GenPair& pair : p.gen->pairs)
    if ((pair.a == ia && pair.b == ib) || (pair.a == ib && pair.b == ia)) return &pair;
  return nullptr;
}

// The paired bootstrap's verdict in words: which side has the lower loss on the shared
// windows (the seeds' mean of the per-token difference) when every seed's interval excludes 0
// on one side, else that it does not tell them apart; each seed's interval as the figures.
std::string paired_wording(const Parsed& p, const GenPair& pair) {
  double mean = 0;
  for (const SeedInterval& s : pair.seeds) mean += s.mean / static_cast<double>(pair.seeds.size());
  const Variant &a = p.variants[pair.a], &b = p.variants[pair.b];
  const std::string on = "paired on " + std::to_string(p.gen->windows) + " shared windows, ";
  const std::string figures =
      " (" + b.label() + " - " + a.label() + " per seed: " + seed_intervals(pair) + ")";
  if (!pair.distinguishable) {
    const bool holds_zero =
        std::any_of(pair.seeds.begin(), pair.seeds.end(),
                    [](const SeedInterval& s) { return s.lo <= 0 && s.hi >= 0; });
    return on + "not distinguishable: " +
           (holds_zero ? "a seed's 95% interval holds 0"
                       : "the seeds' intervals fall on both sides of 0") +
           figures;
  }
  const Variant& lower = mean < 0 ? b : a;
  return on + lower.label() + " has the lower loss, by " + fmt("%.4f", std::abs(mean)) +
         " per token, every seed's 95% interval excluding 0" + figures;
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

// a against b (val losses, lower is better) in words, judged against the seeds' spread.
std::string versus(const std::string& a_name, double a, double sa, const std::string& b_name,
                   double b, double sb, bool one_seed) {
  const std::string figures = " (" + pm(a, sa, "%.4f") + " vs " + pm(b, sb, "%.4f") + ")";
  const std::string& lower = a < b ? a_name : b_name;
  const std::string& higher = a < b ? b_name : a_name;
  if (one_seed)
    return lower + " is lower than " + higher + " by " + fmt("%.4f", std::abs(a - b)) + figures +
           ", 1 seed, so no spread to judge by";
  if (std::abs(a - b) <= sa + sb)
    return a_name + " and " + b_name + " are within the seeds' spread of each other" + figures;
  return lower + " beats " + higher + " by " + fmt("%.4f", std::abs(a - b)) +
         ", beyond the seeds' spread" + figures;
}

// A task's answer accuracy of v against MHA's (higher is better), judged by the seeds' spread.
std::string accuracy_versus(const Variant& v, const Variant& mha) {
  const double a = *v.get("val_accuracy_mean"), m = mha.get("val_accuracy_mean").value_or(0);
  const double sa = v.get("val_accuracy_std").value_or(0);
  const double sm = mha.get("val_accuracy_std").value_or(0);
  const bool one_seed = std::min(v.seeds, mha.seeds) < 2;
  const std::string mine = one_seed ? fmt("%.3f", a) : pm(a, sa, "%.3f");
  const std::string theirs = one_seed ? fmt("%.3f", m) : pm(m, sm, "%.3f");
  const std::string figures = mine + " of the answers against MHA's " + theirs;
  if (one_seed) return "It recalls " + figures + " (1 seed, so no spread to judge by)";
  if (std::abs(a - m) <= sa + sm) return "It recalls " + figures + ", within the seeds' spread";
  return "It recalls " + figures + ": " + (a > m ? "more" : "fewer") +
         " than MHA, beyond the seeds' spread";
}

}  // namespace

std::string loss_pm(const Variant& v) { return fmt("%.4f", v.mean) + " ± " + fmt("%.4f", v.std); }

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
bool spread_distinguishable(const Variant& a, const Variant& b) {
  return compare(a, b).distinguishable;
}

// How many pairs each method tells apart, and what loss by position and recall add.
std::vector<std::string> generation_findings(const Parsed& p, const GenQuality& g) {
  int paired = 0, spread = 0;
  for (const GenPair& pair : g.pairs) {
    paired += pair.distinguishable ? 1 : 0;
    spread += spread_distinguishable(p.variants[pair.a], p.variants[pair.b]) ? 1 : 0;
  }
  const size_t seeds = g.variants.front().loss.size();
  std::vector<std::string> out{
      "On " + std::to_string(g.windows) + " shared windows of " + std::to_string(g.window) +
      " tokens, the paired bootstrap tells " + std::to_string(paired) + " of " +
      std::to_string(g.pairs.size()) + " pairs apart (" +
      (seeds > 1 ? "every seed's 95% interval excluding 0, on one side"
                 : "1 seed: its 95% interval excluding 0") +
      "); the seed spread of the val loss tells " + std::to_string(spread) + " apart."};
  // Where the reference's lead is largest along the context.
  const GenVariant& ref = g.variants.front();
  for (const GenVariant& v : g.variants) {
    if (v.v == ref.v || v.bucket_loss.size() != ref.bucket_loss.size() || v.bucket_loss.empty())
      continue;
    size_t worst = 0;
    for (size_t k = 0; k < v.bucket_loss.size(); ++k)
      if (v.bucket_loss[k] - ref.bucket_loss[k] > v.bucket_loss[worst] - ref.bucket_loss[worst])
        worst = k;
    out.push_back(p.variants[v.v].label() + " against " + p.variants[ref.v].label() +
                  ": the largest loss gap by position is " +
                  fmt("%+.4f", v.bucket_loss[worst] - ref.bucket_loss[worst]) + " at positions " +
                  std::to_string(v.bucket_first[worst]) + "-" + std::to_string(v.bucket_last[worst]) +
                  (v.recall.empty() || ref.recall.empty()
                       ? ""
                       : "; recall at distance " + std::to_string(v.distance.back()) + ": " +
                             fmt("%.3f", v.recall.back()) + " against " +
                             fmt("%.3f", ref.recall.back())) +
                  ".");
  }
  return out;
}

// a against b: the paired verdict where the results hold one (it decides `distinguishable`),
// the seed-spread verdict beside it; else the seed-spread verdict alone.
namespace {
Verdict judge(const Parsed& p, const Variant& a, const Variant& b) {
  Verdict spread = compare(a, b);
  const GenPair* pair = pair_of(p, a, b);
  if (pair == nullptr) return spread;
  Verdict out{spread.a, spread.b, spread.a + " vs " + spread.b + ": ", pair->distinguishable};
  out.text += paired_wording(p, *pair) + "; by the seeds' spread of the val loss, " +
              verdict_wording(spread);
  return out;
}
}  // namespace

std::vector<Verdict> verdicts(const Parsed& p) {
  std::vector<const Variant*> vs;
  for (const Variant& v : p.variants)
    if (!v.mla()) vs.push_back(&v);
  std::vector<Verdict> out;
  for (std::size_t i = 0; i + 1 < vs.size(); ++i) out.push_back(judge(p, *vs[i], *vs[i + 1]));
  const auto mha =
      std::find_if(vs.begin(), vs.end(), [](const Variant* v) { return v->kind == "MHA"; });
  if (mha != vs.end()) {
    const std::size_t m = mha - vs.begin();
    for (std::size_t j = 0; j < vs.size(); ++j)
      if (j + 1 < m || j > m + 1)  // adjacent pairs are already compared
        out.push_back(judge(p, *vs[std::min(j, m)], *vs[std::max(j, m)]));
  }
  for (const Variant& v : p.variants) {
    if (!v.mla()) continue;
    const Variant* near = nearest_in_bytes(p, v);
    if (near) out.push_back(judge(p, v, *near));
    if (mha != vs.end() && *mha != near) out.push_back(judge(p, v, **mha));
  }
  return out;
}

// The verdict at (nearly) equal cache bytes, per MLA variant, with the bytes it rests on.
std::vector<std::string> mla_findings(const Parsed& p) {
  std::vector<std::string> out;
  for (const Variant& m : p.variants) {
    const Variant* g = m.mla() ? nearest_in_bytes(p, m) : nullptr;
    if (g == nullptr) continue;
    const double mb = *m.get("cache_bytes_per_token"), gb = *g->get("cache_bytes_per_token");
    out.push_back("At " + fmt("%.0f", mb) + " against " + fmt("%.0f", gb) +
                  " cache bytes per token (" + fmt("%.2f", mb / gb) + "x): " + judge(p, m, *g).text +
                  ".");
  }
  return out;
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
                    q.v->label() + " with " + q.dtype +
                    " keys and values: " + pm(q.loss, q.loss_std, "%.4f") + ".");
  // Per dtype, the GQA variants with the most and the fewest KV heads.
  const Variant& many = p.variants.front();
  const Variant& few = *std::find_if(p.variants.rbegin(), p.variants.rend(),
                                     [](const Variant& v) { return !v.mla(); });
  if (&many == &few) return out;
  for (const Format& cache_format : formats()) {
    if (!cache_format.holds(kKVEntries) || cache_format.id == Fmt::F32) continue;
    const std::string dtype = cache_format.name;
    const auto at = [&](const Variant& v) {
      return std::find_if(pts.begin(), pts.end(),
                          [&](const QualityPoint& q) { return q.v == &v && q.dtype == dtype; });
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
    out.push_back(
        std::string(dtype) + " costs " + pm(a->delta, a->delta_std, "%+.5f") + " nats at " +
        many.label() + " and " + pm(b->delta, b->delta_std, "%+.5f") + " at " + few.label() + " (" +
        judge(a->delta, a->delta_std, b->delta, b->delta_std, "%.5f") + "); its mean KL " +
        pm(a->kl, a->kl_std, "%.2e") + " and " + pm(b->kl, b->kl_std, "%.2e") + " (" +
        judge(a->kl, a->kl_std, b->kl, b->kl_std, "%.2e") + ").");
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
              (!apart          ? "within the run-to-run spread"
               : *lo > *mhi    ? "more than MHA, beyond the run-to-run spread"
                               : "fewer than MHA, beyond the run-to-run spread");
    }
    out.push_back(line + ".");
  }
  return out;
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
        out.push_back(
            where + ", right after conversion: " +
            versus("mean", mean->conv, mean->conv_sd, other, o->conv, o->conv_sd, one_seed) +
            "; after uptraining: " +
            versus("mean", mean->up, mean->up_sd, other, o->up, o->up_sd, one_seed) + ".");
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

// The frontier's answer in one sentence: of every variant with every cache dtype measured
// (kv_quality's points), the fewest cache bytes per token whose val loss stays within one per
// cent of MHA's with the f32 cache (on the same windows); none without those points.
namespace {
std::optional<Finding> cheapest_within_mha(const Parsed& p, const std::vector<QualityPoint>& pts) {
  const Variant* mha = mha_of(p);
  const auto ref = std::find_if(pts.begin(), pts.end(), [&](const QualityPoint& q) {
    return q.v == mha && q.dtype == "f32";
  });
  if (mha == nullptr || ref == pts.end()) return std::nullopt;
  const QualityPoint* best = nullptr;
  for (const QualityPoint& q : pts)
    if (q.loss <= ref->loss * 1.01 &&
        (best == nullptr || q.bytes < best->bytes || (q.bytes == best->bytes && q.loss < best->loss)))
      best = &q;
  return Finding{"The cheapest KV cache within one per cent of MHA's val loss is " +
                     best->v->label() + " with " + best->dtype + " keys and values: " +
                     bytes(best->bytes) + " per token against MHA's " + bytes(ref->bytes) +
                     " with f32, at " + quality_loss_cell(*best) + " against " +
                     quality_loss_cell(*ref) + ".",
                 {"table-quality", "fig-val_loss_vs_cache_bytes"}};
}
}  // namespace

// Per variant against MHA: the loss it costs with the verdict's wording, the cache it saves,
// and the sequences the paged cache holds at the serving workload's KV memory (else the full
// context sequences in the KV budget). Then the best cache dtype per byte budget: at each
// variant's bf16 bytes per token, the frontier's lowest val loss within them, and what q8_0
// matrices cost the multi-head (else first) variant for their bytes. Every figure is
// a cell function's (tables.cpp), so a finding shows what its table shows.
std::vector<Finding> findings(const Parsed& p) {
  std::vector<Finding> out;
  if (auto f = cheapest_within_mha(p, quality_points(p))) out.push_back(std::move(*f));
  const Variant* mha = mha_of(p);
  if (mha != nullptr) {
    const bool workload = mha->get("kv_workload_peak_sequences_paged").has_value();
    for (const Variant& v : p.variants) {
      if (&v == mha) continue;
      Finding f;
      f.text = v.label() + ": val loss " + loss_delta_cell(p, v) + " against MHA (" +
               verdict_wording(judge(p, *mha, v)) + "). Its cache takes " + vs_mha_cell(v) +
               " MHA's bytes, " + cache_cell(v) + " against " + cache_cell(*mha) +
               " a full-context sequence";
      f.links = {"table-results", "verdicts"};
      if (accuracy_cell(v)) f.text += ". " + accuracy_versus(v, *mha);
      if (workload) {
        f.text += "; at " + kv_memory_cell(v) + " of KV memory the paged cache holds " +
                  peak_paged_cell(v) + " sequences at peak against MHA's " +
                  peak_paged_cell(*mha) + ".";
        f.links.push_back("table-memory");
      } else if (v.get("sequences_in_budget")) {
        f.text += "; the KV budget holds " + sequences_cell(v) +
                  " full-context sequences against MHA's " + sequences_cell(*mha) + ".";
        f.links.push_back("table-details");
      } else {
        f.text += ".";
      }
      out.push_back(std::move(f));
    }
  }
  const std::vector<QualityPoint> pts = quality_points(p);
  std::vector<double> budgets;
  for (const QualityPoint& q : pts)
    if (q.dtype == "bf16") budgets.push_back(q.bytes);
  const bool at_bf16 = !budgets.empty();
  if (!at_bf16)
    for (const QualityPoint& q : pts)
      if (q.front) budgets.push_back(q.bytes);
  std::sort(budgets.begin(), budgets.end());
  budgets.erase(std::unique(budgets.begin(), budgets.end()), budgets.end());
  std::string best;
  for (const double budget : budgets) {
    const QualityPoint* pick = nullptr;
    for (const QualityPoint& q : pts)
      if (q.bytes <= budget && (pick == nullptr || q.loss < pick->loss)) pick = &q;
    if (pick == nullptr) continue;
    best += (best.empty() ? "" : "; ") + std::string("within ") + bytes(budget) + ", " +
            pick->v->label() + " with " + pick->dtype + " (" + bytes(pick->bytes) + ", " +
            quality_loss_cell(*pick) + ")";
  }
  if (!best.empty())
    out.push_back({std::string("Lowest val loss per byte budget of cache per token (") +
                       (at_bf16 ? "each variant's bf16 bytes" : "the frontier's points") +
                       "): " + best + ".",
                   {"table-quality", "fig-val_loss_vs_cache_bytes"}});
  // What q8_0 matrices cost the first variant (MHA where the sweep has it) for their bytes
  // (in integer products where the sweep measured them so: "q8_0+int8").
  const Variant* first = mha != nullptr ? mha : &p.variants.front();
  for (const QualityPoint& q : weight_points(p))
    if (q.v == first && q.dtype.starts_with("q8_0") && q.vs_f32)
      out.push_back({q.dtype + " matrices cost " + first->label() + " " + quality_delta_cell(q) +
                         " nats of val loss (mean KL " + quality_kl_cell(q) + ") for " +
                         vs_f32_cell(q) + " the decode weight bytes of f32 matrices (" +
                         weight_bytes_cell(q) + ").",
                     {"table-weights"}});
  return out;
}

}  // namespace kvlab::report_detail

namespace kvlab {

using namespace report_detail;

std::vector<Verdict> compare_variants(const nlohmann::json& results) {
  return verdicts(parse(results));
}

}  // namespace kvlab
