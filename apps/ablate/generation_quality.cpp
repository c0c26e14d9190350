#include "apps/ablate/generation_quality.h"

#include <algorithm>
#include <cstdio>

#include "checkpoints/model_io.h"
#include "infer/measure/model_eval.h"

namespace kvlab {

using nlohmann::json;

namespace {

// The sweep's variants with the reference first.
std::vector<AblateVariant> reference_first(const AblateConfig& cfg) {
  std::vector<AblateVariant> vars = ablation_variants(cfg);
  const auto mha = std::find_if(vars.begin(), vars.end(), [&](const AblateVariant& v) {
    return v.mla_rank == 0 && v.n_kv_head == cfg.base.model.n_head;
  });
  if (mha != vars.end()) std::rotate(vars.begin(), mha, mha + 1);
  return vars;
}

// One seed's variants scored together on the same windows.
EvalResult evaluate_seed(const AblateConfig& cfg, const std::vector<AblateVariant>& vars,
                         int seed, const Corpus& corpus) {
  std::vector<LoadedModel> loaded;
  std::vector<GPT*> models;
  std::vector<std::string> names;
  for (const AblateVariant& var : vars) {
    loaded.push_back(load_model(ablation_run_dir(cfg, var, seed) / "final.h5"));
    models.push_back(loaded.back().model.get());
    names.push_back(var.name());
  }
  EvalOptions o;
  o.windows = cfg.quality_windows;
  o.window = cfg.base.model.block_size;
  o.samples = 8;
  o.sampling.max_new_tokens = cfg.sample_tokens;
  // A task's sweep is scored on its answers, whole examples a window.
  if (!corpus.val_targets.empty()) o.targets = &corpus.val_targets;
  o.period = corpus.example_tokens;
  return evaluate_models(models, names, corpus.val, loaded.front().tokenizer, o);
}

json interval_json(const PairedInterval& d) {
  return {{"mean_diff", d.mean}, {"ci95", {d.lo, d.hi}}};
}

// Every seed's interval excludes 0, and on the same side.
bool seeds_agree(const std::vector<PairedInterval>& seeds) {
  return std::all_of(seeds.begin(), seeds.end(),
                     [&](const PairedInterval& d) {
                       return d.excludes_zero() && (d.mean > 0) == (seeds.front().mean > 0);
                     });
}

// A variant's figures, each per seed, and its loss by position and recall as seed means.
json variant_json(const std::vector<EvalResult>& seeds, size_t i) {
  json v{{"name", seeds[0].models[i].name}};
  for (const auto& [key, field] : {std::pair{"loss", &ModelQuality::loss},
                                   std::pair{"bits_per_byte", &ModelQuality::bits_per_byte},
                                   std::pair{"icl_score", &ModelQuality::icl},
                                   std::pair{"kl_vs_reference", &ModelQuality::kl},
                                   std::pair{"top1_vs_reference", &ModelQuality::top1}}) {
    std::vector<double> per_seed;
    for (const EvalResult& r : seeds) per_seed.push_back(r.models[i].*field);
    v[key] = per_seed;
  }
  for (const auto& [key, field] : {std::pair{"distinct_1", 0}, std::pair{"distinct_2", 1},
                                   std::pair{"distinct_3", 2}}) {
    std::vector<double> per_seed;
    for (const EvalResult& r : seeds) per_seed.push_back(r.models[i].samples->distinct[field]);
    v["samples"][key] = per_seed;
  }
  for (const auto& [key, field] : {std::pair{"repeated_3grams", &SampleStats::repeated3},
                                   std::pair{"mean_bytes", &SampleStats::mean_bytes},
                                   std::pair{"stopped", &SampleStats::stopped}}) {
    std::vector<double> per_seed;
    for (const EvalResult& r : seeds) per_seed.push_back(*r.models[i].samples.*field);
    v["samples"][key] = per_seed;
  }
  const double n = static_cast<double>(seeds.size());
  for (size_t k = 0; k < seeds[0].models[i].buckets.size(); ++k) {
    double loss = 0;
    for (const EvalResult& r : seeds) loss += r.models[i].buckets[k].loss / n;
    v["position_buckets"].push_back({{"first", seeds[0].models[i].buckets[k].first},
                                     {"last", seeds[0].models[i].buckets[k].last},
                                     {"loss", loss}});
  }
  for (size_t k = 0; k < seeds[0].models[i].recall.size(); ++k) {
    double loss = 0, accuracy = 0;
    for (const EvalResult& r : seeds) {
      loss += r.models[i].recall[k].loss / n;
      accuracy += r.models[i].recall[k].accuracy / n;
    }
    v["recall"].push_back({{"distance", seeds[0].models[i].recall[k].distance},
                           {"loss", loss},
                           {"accuracy", accuracy}});
  }
  return v;
}

}  // namespace

json record_generation_quality(const AblateConfig& cfg) {
  const std::vector<AblateVariant> vars = reference_first(cfg);
  const Corpus corpus = load_run_corpus(cfg.base);
  std::vector<EvalResult> seeds;
  for (int s = 0; s < cfg.seeds; ++s) {
    std::fprintf(stderr, "seed %d: generation quality of %zu variants on %d windows\n", s,
                 vars.size(), cfg.quality_windows);
    seeds.push_back(evaluate_seed(cfg, vars, s, corpus));
  }
  json out{{"reference", vars.front().name()},
           {"windows", seeds[0].windows},
           {"window", seeds[0].window},
           {"predictions", seeds[0].predictions}};
  out["variants"] = json::array();
  for (size_t i = 0; i < vars.size(); ++i) out["variants"].push_back(variant_json(seeds, i));
  out["pairs"] = json::array();
  for (size_t p = 0; p < seeds[0].pairs.size(); ++p) {
    std::vector<PairedInterval> per_seed;
    json intervals = json::array();
    for (const EvalResult& r : seeds) {
      per_seed.push_back(r.pairs[p].diff);
      intervals.push_back(interval_json(r.pairs[p].diff));
    }
    out["pairs"].push_back({{"a", vars[seeds[0].pairs[p].a].name()},
                            {"b", vars[seeds[0].pairs[p].b].name()},
                            {"seeds", intervals},
                            {"distinguishable", seeds_agree(per_seed)}});
  }
  return out;
}

}  // namespace kvlab
