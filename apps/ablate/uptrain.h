#pragma once
// The GQA paper's conversion experiment behind `kvlab ablate --uptrain F` (Ainslie et al.
// 2023): each seed's multi-head run of the sweep, converted to every smaller n_kv_head of the
// sweep by each KVHeadInit (nn/kv_convert.h), evaluated at once and then trained a further
// round(F * iters) steps, against the sweep's from-scratch run at that n_kv_head.
#include <cstdint>
#include <filesystem>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/ablate/ablate.h"

namespace kvlab {

// round(fraction * iters): the steps every converted model is uptrained for.
int64_t uptrain_steps(double fraction, int64_t iters);

// What is wrong with uptraining `fraction` of `iters` steps over the sweep's kv_heads for
// n_head heads, or "" when nothing is: fraction in (0, 1], n_head in the sweep (the source),
// some smaller n_kv_head to convert to, and at least one step.
std::string uptrain_problem(double fraction, int64_t iters, const std::vector<int64_t>& kv_heads,
                            int64_t n_head);

// The run that uptrains `mha_run`'s final checkpoint converted to n_kv_head `kv`: the source
// run's config with the converted model, iters = uptrain_steps, warmup scaled by the fraction
// (the sweep's warmup + cosine schedule squeezed into the new steps; a new AdamW), an
// evaluation every max(1, steps / 5) steps on the sweep's validation windows, in `out_dir`.
TrainConfig uptrain_run_config(const TrainConfig& mha_run, int64_t kv, double fraction,
                               const std::filesystem::path& out_dir);

// Converts and uptrains (or reuses / resumes) every (n_kv_head, method, seed) of cfg, after
// the sweep's runs are trained, and returns results.json's "uptrain" section; `variants` are
// the sweep's measured variants (the from-scratch figures). Progress goes to stderr; throws
// Interrupted on Ctrl-C with the finished runs kept.
nlohmann::json run_uptrain(const AblateConfig& cfg, const std::vector<TrainConfig>& runs,
                           const nlohmann::json& variants, AblateStats& stats);

}  // namespace kvlab
