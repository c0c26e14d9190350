#pragma once
// The sweep's generation quality (kvlab eval's measurements, infer/measure/model_eval.h):
// each seed's final models of every variant scored on the same validation windows, so that
// each variant's difference from the reference is paired, with a bootstrap interval per seed.
#include <nlohmann/json.hpp>

#include "apps/ablate/ablate.h"

namespace kvlab {

// results.json's generation_quality. The reference is the MHA variant (n_kv_head = n_head)
// where the sweep has one, else its first variant. A pair is "distinguishable" when every
// seed's 95% interval excludes 0 and the seeds' differences share a sign.
nlohmann::json record_generation_quality(const AblateConfig& cfg);

}  // namespace kvlab
