#pragma once
// One variant of the sweep measured after its runs trained (run_ablation calls it per variant).
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/ablate/ablate.h"

namespace kvlab {

// One variant's figures: its runs' validation curves and losses, then, from its first seed's
// final checkpoint, parameters, cache bytes, the serving workload, decode speed and sample
// continuations, and from every seed's, the cost of each cache dtype and of each matrix type.
// serve_rates: the serving sweep's arrival rates, set by the first variant measured.
nlohmann::json measure_variant(const AblateConfig& cfg, const AblateVariant& var,
                               int64_t prompt_len, double tokens_per_byte,
                               std::vector<double>& serve_rates);

// The mean training tokens/s of a run, from its log.jsonl.
double mean_train_tokens_per_s(const std::filesystem::path& dir);

}  // namespace kvlab
