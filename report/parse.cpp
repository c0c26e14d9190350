// Reading the results document: each variant checked up front, the uptrain section, and the
// figures the tables, verdicts and plots share (kv_quality's points, the serving sweep).
#include <algorithm>
#include <cmath>

#include "platform/error.h"
#include "report/report_parts.h"

namespace kvlab::report_detail {
namespace {

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

// A number array of obj[key], each element a number; "what" names it in the error.
std::vector<double> numbers(const json& obj, const char* key, const std::string& what) {
  const auto it = obj.find(key);
  KVLAB_CHECK(it != obj.end() && it->is_array(), "report: ", what, " has no array '", key, "'");
  std::vector<double> out;
  for (const json& x : *it) {
    KVLAB_CHECK(x.is_number(), "report: ", what, "'s '", key, "' holds ", x.dump());
    out.push_back(x.get<double>());
  }
  return out;
}

// The index of the variant ablate names "kv<n>" or "mla<rank>".
size_t variant_named(const Parsed& p, const std::string& name) {
  for (size_t i = 0; i < p.variants.size(); ++i) {
    const Variant& v = p.variants[i];
    if (name == (v.mla() ? "mla" + std::to_string(v.rank) : "kv" + std::to_string(v.n_kv))) return i;
  }
  throw Error(detail::cat("report: generation_quality names '", name, "', which is no variant"));
}

std::optional<GenQuality> parse_generation_quality(const json& results, const Parsed& p) {
  const auto it = results.find("generation_quality");
  if (it == results.end() || it->is_null()) return std::nullopt;
  const json& j = *it;
  KVLAB_CHECK(j.is_object() && j.contains("variants") && j["variants"].is_array() &&
                  j.contains("pairs") && j["pairs"].is_array(),
              "report: generation_quality needs 'variants' and 'pairs' arrays");
  GenQuality g;
  g.reference = variant_named(p, text_field(j, "reference"));
  g.windows = static_cast<int64_t>(number(j, "windows").value_or(0));
  g.window = static_cast<int64_t>(number(j, "window").value_or(0));
  for (const json& e : j["variants"]) {
    KVLAB_CHECK(e.is_object(), "report: generation_quality.variants holds ", e.dump());
    GenVariant v;
    const std::string name = text_field(e, "name");
    v.v = variant_named(p, name);
    v.loss = numbers(e, "loss", name);
    v.bpb = numbers(e, "bits_per_byte", name);
    v.icl = numbers(e, "icl_score", name);
    v.kl = numbers(e, "kl_vs_reference", name);
    v.top1 = numbers(e, "top1_vs_reference", name);
    if (e.contains("samples") && e["samples"].is_object()) {
      v.distinct2 = numbers(e["samples"], "distinct_2", name + "'s samples");
      v.repeated3 = numbers(e["samples"], "repeated_3grams", name + "'s samples");
    }
    for (const json& b : e.value("position_buckets", json::array())) {
      KVLAB_CHECK(b.is_object() && number(b, "first") && number(b, "last") && number(b, "loss"),
                  "report: ", name, "'s position bucket ", b.dump());
      v.bucket_first.push_back(static_cast<int64_t>(*number(b, "first")));
      v.bucket_last.push_back(static_cast<int64_t>(*number(b, "last")));
      v.bucket_loss.push_back(*number(b, "loss"));
    }
    for (const json& r : e.value("recall", json::array())) {
      KVLAB_CHECK(r.is_object() && number(r, "distance") && number(r, "accuracy"),
                  "report: ", name, "'s recall point ", r.dump());
      v.distance.push_back(static_cast<int64_t>(*number(r, "distance")));
      v.recall.push_back(*number(r, "accuracy"));
    }
    g.variants.push_back(std::move(v));
  }
  for (const json& e : j["pairs"]) {
    KVLAB_CHECK(e.is_object() && e.contains("seeds") && e["seeds"].is_array(),
                "report: generation_quality.pairs holds ", e.dump());
    GenPair pair;
    pair.a = variant_named(p, text_field(e, "a"));
    pair.b = variant_named(p, text_field(e, "b"));
    pair.distinguishable = e.value("distinguishable", false);
    for (const json& s : e["seeds"]) {
      KVLAB_CHECK(s.is_object() && number(s, "mean_diff") && s.contains("ci95") &&
                      s["ci95"].is_array() && s["ci95"].size() == 2 && s["ci95"][0].is_number() &&
                      s["ci95"][1].is_number(),
                  "report: a pair's seed holds ", s.dump());
      pair.seeds.push_back({*number(s, "mean_diff"), s["ci95"][0].get<double>(),
                            s["ci95"][1].get<double>()});
    }
    g.pairs.push_back(std::move(pair));
  }
  return g;
}

}  // namespace

std::optional<double> number(const json& obj, const char* key) {
  const auto it = obj.find(key);
  if (it == obj.end() || !it->is_number()) return std::nullopt;
  return it->get<double>();
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
  p.gen = parse_generation_quality(results, p);
  return p;
}

namespace {
// Every variant's entries of `key` (kv_quality or weight_quality), their bytes from
// `bytes_key`.
std::vector<QualityPoint> points_of(const Parsed& p, const char* key, const char* bytes_key) {
  std::vector<QualityPoint> out;
  for (const Variant& v : p.variants)
    for (const json& e : v.j->value(key, json::array())) {
      if (!e.is_object() || !number(e, bytes_key) || !number(e, "loss_mean")) continue;
      QualityPoint q;
      q.v = &v;
      q.dtype = text_field(e, "dtype");
      if (e.value("int8_products", false)) q.dtype += "+int8";  // DecodeStep::int8_products
      q.bytes = *number(e, bytes_key);
      q.loss = *number(e, "loss_mean");
      q.loss_std = number(e, "loss_std").value_or(0);
      q.delta = number(e, "delta_loss_mean").value_or(0);
      q.delta_std = number(e, "delta_loss_std").value_or(0);
      q.kl = number(e, "kl_mean").value_or(0);
      q.kl_std = number(e, "kl_std").value_or(0);
      q.top1 = number(e, "top1_mean").value_or(0);
      out.push_back(q);
    }
  return out;
}
}  // namespace

std::vector<QualityPoint> quality_points(const Parsed& p) {
  std::vector<QualityPoint> out = points_of(p, "kv_quality", "bytes_per_token");
  for (QualityPoint& q : out)
    q.front = std::none_of(out.begin(), out.end(), [&](const QualityPoint& o) {
      return (o.bytes <= q.bytes && o.loss < q.loss) || (o.bytes < q.bytes && o.loss <= q.loss);
    });
  return out;
}

std::vector<QualityPoint> weight_points(const Parsed& p) {
  std::vector<QualityPoint> out = points_of(p, "weight_quality", "decode_weight_bytes");
  for (QualityPoint& q : out) {
    const auto f32 = q.v->get("decode_weight_bytes_f32");
    if (f32 && *f32 > 0) q.vs_f32 = q.bytes / *f32;
  }
  return out;
}

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

// n_kv_head values of the uptrain entries, in the results' order, each once.
std::vector<int> uptrain_kvs(const Uptrain& u) {
  std::vector<int> kvs;
  for (const UptrainEntry& e : u.entries)
    if (std::find(kvs.begin(), kvs.end(), e.n_kv) == kvs.end()) kvs.push_back(e.n_kv);
  return kvs;
}

std::string text_of(const json& v) {
  return v.is_string() ? v.get<std::string>()
                       : v.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string text_field(const json& obj, const char* key) {
  const auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? std::string() : text_of(*it);
}

}  // namespace kvlab::report_detail
